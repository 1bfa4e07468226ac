"""``train.fused``: the optimizer and norm kernels a job runs (``off``, ``torch``, ``apex``; ``auto`` is
apex when importable, else torch — :func:`parallel4d.config.rules.training.resolve_fused`).

* ``off``: torch's plain AdamW / Adam and the models' own norms (the exactness references).
* ``torch``: ``torch.optim.AdamW(fused=True)`` and ``F.rms_norm`` (LayerNorm is torch's fused
  kernel already).
* ``apex``: ``apex.optimizers.FusedAdam`` and apex's fused LayerNorm / RMSNorm functions.

Norms inside 2D tensor-parallel layers reduce their statistics over the grid and stay as they are.
Which dense modules are RMSNorms is the model family's to say (``models.build.Family.rms_norms``):
this module sits below the models and never imports one.
"""

from __future__ import annotations

import importlib
from typing import Iterable, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.config.rules.training import resolve_fused


class RMSNormLike(Protocol):
    """A dense RMSNorm: ``forward(x) = weight · x / sqrt(mean(x²) + eps)`` over the last dimension."""

    weight: nn.Parameter
    eps: float


def make_optimizer(groups: list[dict], opt_cfg, fused: str) -> torch.optim.Optimizer:
    """AdamW / Adam over parameter ``groups`` with ``train.fused``'s kernel."""
    kind = resolve_fused(fused)
    common = dict(lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps)
    if kind == "apex":
        fused_adam = importlib.import_module("apex.optimizers").FusedAdam
        return fused_adam(groups, adam_w_mode=opt_cfg.name == "adamw", **common)
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[opt_cfg.name]
    return cls(groups, fused=True, **common) if kind == "torch" else cls(groups, **common)


def _apex_rms(norm: RMSNormLike):
    fn = importlib.import_module("apex.normalization.fused_layer_norm").fused_rms_norm_affine
    return lambda x: fn(x, norm.weight, norm.weight.shape, norm.eps)


def _apex_layer_norm(norm: nn.LayerNorm):
    fn = importlib.import_module("apex.normalization.fused_layer_norm").fused_layer_norm_affine
    return lambda x: fn(x, norm.weight, norm.bias, norm.normalized_shape, norm.eps)


def _torch_rms(norm: RMSNormLike):
    return lambda x: F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def use_fused_norms(modules: Iterable[nn.Module], fused: str, rms_norms: tuple[type, ...]) -> None:
    """Point the dense norms inside ``modules`` at ``train.fused``'s kernels (their parameters stay):
    ``nn.LayerNorm`` and the classes ``rms_norms`` (each :class:`RMSNormLike`, the model family's)."""
    kind = resolve_fused(fused)
    if kind == "off":
        return
    for module in modules:
        for m in module.modules():
            if isinstance(m, rms_norms):
                m.forward = (_apex_rms if kind == "apex" else _torch_rms)(m)
            elif isinstance(m, nn.LayerNorm) and kind == "apex":
                m.forward = _apex_layer_norm(m)
