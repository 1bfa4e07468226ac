"""The ``deepspeed:`` section checked against DeepSpeed itself, and the ds_config parallel4d hands it.

DeepSpeed ignores a top-level key it does not read (``"gradient_cliping": 1.0`` trains unclipped,
silently). Which keys it reads is found by asking it: the section is given to DeepSpeed's own
``DeepSpeedConfig`` inside a dict that records every key looked up; any key of the section that
was never looked up is one DeepSpeed would ignore. The same call runs DeepSpeed's models of the
sub-sections (``zero_optimization``, ``bf16``, …), which refuse unknown keys themselves; their
errors are reported under the section's names. Both happen before any process starts
(``launch`` and ``parallel4d validate`` call :func:`resolve`).
"""

from __future__ import annotations

import copy
from typing import Any

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from pydantic import ValidationError

from ...config import Config, ConfigError, deepspeed_batch
from ...rules import did_you_mean

#: keys DeepSpeed reads that parallel4d's own fields already decide
TAKEN = {"tensor_parallel": "parallel.tp (parallel4d's 2D tensor parallelism replaces DeepSpeed's AutoTP)",
         "pipeline": "parallel.pp and the pipeline: section (parallel4d's executor runs the schedule)"}
#: DeepSpeed optimizer types that run on torch's code when ``torch_adam`` is set (no compiled op)
TORCH_OPTIMIZERS = ("adam", "adamw")


class _Recording(dict):
    """A dict that notes every key looked up (``get``, ``[]``, ``in``, ``in .keys()``)."""

    def __init__(self, data: dict):
        super().__init__(data)
        self.read: set = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        return _RecordingKeys(self)


class _RecordingKeys:
    def __init__(self, owner: _Recording):
        self.owner = owner

    def __contains__(self, key):
        return key in self.owner

    def __iter__(self):
        return iter(dict.keys(self.owner))

    def __len__(self):
        return len(self.owner)


class _OneReplica:
    """An mpu of one data replica, so the probe's batch sizes fit with or without a process group."""

    def get_data_parallel_world_size(self) -> int:
        return 1


def deepspeed_problems(section: dict) -> list[str]:
    """Keys DeepSpeed would ignore or refuse, and keys parallel4d decides; one message each."""
    # batch sizes of one process: the real ones are checked against parallel4d's fields in config.py
    probe = {**copy.deepcopy(section), "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
             "gradient_accumulation_steps": 1}
    recording = _Recording(probe)
    try:
        DeepSpeedConfig(recording, mpu=_OneReplica())
    except ValidationError as err:
        return _located(err)
    # DeepSpeedConfigError: a removed feature (amp, elasticity, ...); AttributeError: a section that is not a
    # mapping where DeepSpeed calls .get/.keys on it ("optimizer: adam", "checkpoint: 3")
    except (ValueError, AssertionError, TypeError, KeyError, AttributeError, DeepSpeedConfigError) as err:
        return [f"deepspeed: DeepSpeed refuses the section: {err}"]
    out = []
    for key in section:
        if key in TAKEN:
            out.append(f"deepspeed.{key}: set by {TAKEN[key]}; remove it")
        elif key not in recording.read:
            out.append(f"deepspeed.{key}: DeepSpeed {deepspeed.__version__} does not read this key and would ignore it; "
                       f"{did_you_mean(key, sorted(recording.read - set(TAKEN)), 'deepspeed.')}"
                       "see https://www.deepspeed.ai/docs/config-json/")
    return out


def _located(err: ValidationError) -> list[str]:
    """DeepSpeed's sub-section errors, named as in the job file (``deepspeed.<section>.<key>``)."""
    model = err.title  # e.g. DeepSpeedZeroConfig: which sub-section is not said by the error itself
    out = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "DeepSpeed does not know this key; remove it or check its spelling"
        out.append(f"deepspeed (DeepSpeed's {model}): {where}: {msg}")
    return out


def resolve(cfg: Config, device_type: str) -> dict[str, Any]:
    """The ds_config for ``deepspeed.initialize``: ``cfg.deepspeed`` checked (ConfigError naming
    each key and the fix), with the batch sizes, clipping and bf16 filled from parallel4d's fields."""
    section = dict(cfg.deepspeed or {})
    problems = deepspeed_problems(section) + _device_problems(section, device_type)
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    ds = copy.deepcopy(section)
    ds.update(deepspeed_batch(cfg))  # config.py checked that any given value equals these
    if cfg.train.grad_clip and "gradient_clipping" not in ds:
        ds["gradient_clipping"] = cfg.train.grad_clip
    if cfg.train.dtype == "bfloat16":
        ds.setdefault("bf16", {})["enabled"] = True
    if "optimizer" in ds:  # DeepSpeed's optimizer: torch's Adam code rather than a JIT-built fused kernel
        if str(ds["optimizer"].get("type", "")).lower() in TORCH_OPTIMIZERS and device_type == "cpu":
            ds["optimizer"].setdefault("params", {}).setdefault("torch_adam", True)
    else:  # parallel4d's torch optimizer, also on offloaded states (DeepSpeedCPUAdam would be JIT-built)
        ds.setdefault("zero_force_ds_cpu_optimizer", False)
    if cfg.parallel.pp > 1:
        ds["managed_gradient_accumulation"] = False  # the executor accumulates (engines.DeepSpeedPipeline)
    return ds


def _device_problems(section: dict, device_type: str) -> list[str]:
    if device_type != "cpu":
        return []
    out = []
    if isinstance(section.get("fp16"), dict) and section["fp16"].get("enabled") is True:
        out.append("deepspeed.fp16.enabled: DeepSpeed has no fp16 on CPU; use deepspeed.bf16.enabled=true, or "
                   "float32 (no fp16/bf16 section)")
    kind = section.get("optimizer", {}).get("type") if isinstance(section.get("optimizer"), dict) else None
    if kind is not None and str(kind).lower() not in TORCH_OPTIMIZERS:
        out.append(f"deepspeed.optimizer.type={kind!r} needs an op DeepSpeed compiles at run time on CPU; use "
                   "type Adam or AdamW (run on torch's code), or remove deepspeed.optimizer to use parallel4d's "
                   "optimizer: section")
    return out
