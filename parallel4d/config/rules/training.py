"""The training step's rules (``train:``, ``optimizer:``): the dtypes, the optional fused kernels
(whether apex is installed is looked up here, never imported), TensorBoard, and the learning-rate
schedule."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config, OptimizerConfig


def dtype_problems(cfg: Config) -> list[str]:
    """``train.dtype`` (a preset) against ``param_dtype`` and ``autocast_dtype`` given beside it, and
    autocast over float64 parameters."""
    t, out = cfg.train, []
    preset = {"float32": ("float32", "none"), "float64": ("float64", "none"), "bfloat16": ("float32", "bfloat16"),
              "float16": ("float32", "float16")}[t.dtype]
    for field, given, implied in (("param_dtype", t.param_dtype, preset[0]),
                                  ("autocast_dtype", t.autocast_dtype, preset[1])):
        if given is not None and given != implied and "dtype" in t.model_fields_set:
            out.append(f"train.{field}={given} but train.dtype={t.dtype} means {field}={implied}; give one of them "
                       f"(train.dtype is a preset for param_dtype and autocast_dtype)")
    if t.parameters == "float64" and t.autocast != "none":
        out.append(f"train.autocast_dtype={t.autocast} with float64 parameters: autocast computes float32 "
                   "matmuls in half precision only; use param_dtype=float32")
    return out


APEX_INSTALL = ("pip install -v --no-build-isolation --config-settings '--build-option=--cpp_ext' "
                "--config-settings '--build-option=--cuda_ext' git+https://github.com/NVIDIA/apex")


def apex_available() -> bool:
    """Whether NVIDIA apex is importable here (looked up, not imported)."""
    return importlib.util.find_spec("apex") is not None


def resolve_fused(choice: str) -> str:
    """``train.fused`` as it runs: ``auto`` is apex when importable, else torch's fused kernels."""
    if choice == "auto":
        return "apex" if apex_available() else "torch"
    return choice


def fused_problem(choice: str) -> Optional[str]:
    """``train.fused=apex`` where apex is not installed: how to install it, or what to use instead."""
    if choice == "apex" and not apex_available():
        return ("train.fused=apex needs NVIDIA apex, which is not installed here (it is not on the package "
                f"index; it builds against CUDA): {APEX_INSTALL} — or use train.fused=torch (torch's fused "
                "AdamW and RMSNorm) or auto (apex when present, else torch)")
    return None


def tensorboard_problems(cfg: Config) -> list[str]:
    """``train.tensorboard=true`` where the tensorboard package is not installed (looked up)."""
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return ["train.tensorboard=true needs the tensorboard package: pip install 'parallel4d[viz]' (make "
                "installs it), or set train.tensorboard=false (metrics.jsonl is written either way)"]
    return []


def lr_schedule_problems(o: OptimizerConfig, steps: int) -> list[str]:
    """The learning-rate schedule's fields: those of a decay under a constant schedule, a decay that
    ends above ``lr`` or before the warm-up does (``steps``: ``train.steps``)."""
    out = []
    if o.schedule == "constant":
        given = [f"optimizer.{f}={v}" for f, v in (("min_lr", o.min_lr), ("decay_steps", o.decay_steps)) if v]
        if given:
            out.append(f"{given[0]} applies to a decaying schedule but optimizer.schedule=constant; "
                       "set optimizer.schedule=cosine or linear, or remove it")
        return out
    if o.min_lr > o.lr:
        out.append(f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}; the decay ends at min_lr, so set "
                   "min_lr ≤ lr")
    end = o.decay_steps or steps
    if end <= o.warmup_steps:
        field = f"optimizer.decay_steps={o.decay_steps}" if o.decay_steps else f"train.steps={steps}"
        out.append(f"{field} ends the {o.schedule} decay before optimizer.warmup_steps={o.warmup_steps} ends the "
                   f"warm-up; set it above {o.warmup_steps} or shorten the warm-up")
    return out
