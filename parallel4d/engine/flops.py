"""Model FLOPs per trained token, for ``summary.json``'s ``model_flops_per_second`` and MFU."""

from __future__ import annotations

from parallel4d.config.schema import Config
from parallel4d.models.registry import spec


def flops_per_token(cfg: Config) -> float:
    """The family's training FLOPs per token (forward and backward of every matrix product, the LM
    head included, and the attention's scores): see ``models/<family>/spec.py``."""
    return spec(cfg.model.arch).flops_per_token(cfg.model)


def stage_flops(cfg: Config) -> list[float]:
    """The same per pipeline stage ``[embedding, blocks…, LM head]`` (they sum to it): what the
    pipeline's cut balances (:func:`~parallel4d.engine.compose.build_pipeline`)."""
    return spec(cfg.model.arch).stage_flops(cfg.model)
