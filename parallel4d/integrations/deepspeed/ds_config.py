"""The ``deepspeed:`` section checked against DeepSpeed, and the ds_config parallel4d hands it.

:func:`resolve` runs before any process starts (``launch`` and ``parallel4d validate`` call it):
the keys DeepSpeed would ignore or refuse (:mod:`.ds_keys`), what this device cannot run, then the
section completed from parallel4d's fields (config.py has checked that they agree).
"""

from __future__ import annotations

import copy
from typing import Any

from ...config import Config, ConfigError, deepspeed_batch
from .ds_keys import key_problems

#: DeepSpeed optimizer types that run on torch's code when ``torch_adam`` is set (no compiled op)
TORCH_OPTIMIZERS = ("adam", "adamw")


def resolve(cfg: Config, device_type: str) -> dict[str, Any]:
    """The ds_config for ``deepspeed.initialize``: ``cfg.deepspeed`` checked (ConfigError naming
    each key and the fix), with the batch sizes, clipping and bf16 filled from parallel4d's fields."""
    section = dict(cfg.deepspeed or {})
    problems = key_problems(section) + _device_problems(section, device_type)
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    ds = copy.deepcopy(section)
    ds.update(deepspeed_batch(cfg))  # config.py checked that any given value equals these
    if cfg.train.grad_clip and "gradient_clipping" not in ds:
        ds["gradient_clipping"] = cfg.train.grad_clip
    if cfg.train.autocast == "bfloat16":
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
