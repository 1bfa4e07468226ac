"""The ``deepspeed:`` section checked against DeepSpeed, and the ds_config parallel4d hands it.

:func:`resolve` runs before any process starts (``launch`` and ``parallel4d validate`` call it):
the keys DeepSpeed would ignore or refuse (:mod:`.ds_keys`), what this device cannot run, then the
section completed from parallel4d's fields (the config has checked that they agree). The rules that
need no DeepSpeed live in :mod:`parallel4d.config.rules.deepspeed`.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

from parallel4d.config.errors import ConfigError
from parallel4d.config.rules.common import did_you_mean
from parallel4d.config.rules.deepspeed import DOCS, TORCH_OPTIMIZERS, deepspeed_batch, device_problems
from parallel4d.config.schema import Config
from parallel4d.integrations.deepspeed.ds_keys import key_problems


def resolve(cfg: Config, device_type: str) -> dict[str, Any]:
    """The ds_config for ``deepspeed.initialize``: ``cfg.deepspeed`` checked (ConfigError naming
    each key and the fix), with the batch sizes, clipping and bf16 filled from parallel4d's fields."""
    section = dict(cfg.deepspeed or {})
    problems = (key_problems(section) + _type_problems(section)
                + device_problems(section, device_type, _known_optimizer))
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    ds = copy.deepcopy(section)
    ds.update(deepspeed_batch(cfg))  # the config checked that any given value equals these
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


def _type_problems(section: dict) -> list[str]:
    """An optimizer or scheduler type DeepSpeed would not find when it builds the engine (in a worker,
    as an AssertionError), looked up where DeepSpeed looks: its own names, then torch's; a scheduler's
    params checked against its constructor."""
    out = []
    optimizer = section.get("optimizer")
    kind = optimizer.get("type") if isinstance(optimizer, dict) else None
    known = sorted(set(DEEPSPEED_OPTIMIZERS) | {n for n, c in vars(torch.optim).items() if isinstance(c, type)
                                                and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer})
    if kind is not None and not _known_optimizer(kind):
        out.append(f"deepspeed.optimizer.type={kind!r} is not an optimizer DeepSpeed knows; {did_you_mean(str(kind), known)}"
                   f"use one of {', '.join(known)} ({DOCS})")
    scheduler = section.get("scheduler")
    kind = scheduler.get("type") if isinstance(scheduler, dict) else None
    if kind is None:
        return out
    cls = (getattr(lr_schedules, kind, None) or getattr(torch.optim.lr_scheduler, kind, None)) \
        if isinstance(kind, str) else None
    if not isinstance(cls, type):
        known = sorted(lr_schedules.VALID_LR_SCHEDULES)
        return out + [f"deepspeed.scheduler.type={kind!r} is not a scheduler DeepSpeed knows; "
                      f"{did_you_mean(str(kind), known)}use one of {', '.join(known)} or a torch.optim.lr_scheduler "
                      f"class name ({DOCS})"]
    params = scheduler.get("params") or {}
    try:
        inspect.signature(cls).bind(None, **params) if isinstance(params, dict) else None
    except TypeError as e:
        out.append(f"deepspeed.scheduler.params: {kind} does not take them ({e}); give the arguments of {kind} "
                   f"({DOCS})")
    return out


def _known_optimizer(kind: Any) -> bool:
    """Whether DeepSpeed finds optimizer ``kind``: one of its own names (any case), else torch.optim's."""
    return isinstance(kind, str) and (kind.lower() in DEEPSPEED_OPTIMIZERS or isinstance(getattr(torch.optim, kind, None), type))
