"""FP8 training rules (``train.fp8``): the precision it cannot start from, and the layouts it does not run
in yet (issue 50 builds it in steps: the data, sequence and pipeline axes and hetero run; 2D tp, experts,
LoRA and DeepSpeed not yet; compiled blocks run, and are what makes FP8 fast on a GPU).

Torch-free; ``config/checks.py`` lists :func:`problems` among the cross-field rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config


def precision_problems(cfg: Config) -> list[str]:
    """float64 parameters: FP8 products would throw away everything a float64 run is for."""
    if cfg.train.parameters != "float64":
        return []
    field = "train.param_dtype=float64" if cfg.train.param_dtype == "float64" else f"train.dtype={cfg.train.dtype}"
    return [f"train.fp8={cfg.train.fp8} with {field}: FP8 products never run in a float64 job (it is the exact "
            "reference); use train.dtype=bfloat16 or float32, or train.fp8=none"]


def layout_problems(cfg: Config) -> list[str]:
    """What FP8 linears do not run beside yet: expert parallelism, a deepspeed: section, LoRA adapters,
    MoE layers; each named with the field to change. (dp, sp — ring and Ulysses —, pp, 2D tp, hetero and
    ``train.compile: blocks`` run: their FP8 products equal one process's, each amax reduced over the ranks
    that hold the rest of its contracted dimension: the grid's rows or columns, the data replicas for the
    tokens.)"""
    p, m, not_yet = cfg.parallel, cfg.model, []
    if p.ep > 1:
        not_yet.append(f"parallel.ep={p.ep}; set parallel.ep=1")
    if cfg.deepspeed is not None:
        not_yet.append("a deepspeed: section; remove it")
    if m.lora is not None:
        not_yet.append("model.lora (the adapted linears); remove model.lora")
    if m.num_experts:
        not_yet.append(f"model.num_experts={m.num_experts} (MoE layers); set model.num_experts=0")
    return [f"train.fp8={cfg.train.fp8} runs on a dense model only for now, not with {what} or train.fp8=none"
            for what in not_yet]


def problems(cfg: Config) -> list[str]:
    """``train.fp8``'s rules (none with ``train.fp8: none``)."""
    if cfg.train.fp8 == "none":
        return []
    return precision_problems(cfg) + layout_problems(cfg)
