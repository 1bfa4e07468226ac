"""The ``optimizer`` section as torch objects: parameter groups and the learning-rate schedule.

Both are functions of the dense model's parameter names and the step alone, so every layout
(pp×dp×sp×tp, hetero or not) trains with the same groups and learning rates as one process.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn

from parallel4d.optim.fused import make_optimizer


def decays(dense_name: str, ndim: int, opt_cfg) -> bool:
    """Whether weight decay applies to a parameter: the usual groups leave out norm gains and
    biases (``ndim < 2``) and the token / position tables (``embed.*``; a tied LM head is the
    token table) unless ``decay_norms_and_biases`` / ``decay_embeddings`` say otherwise."""
    if dense_name.startswith("embed."):
        return opt_cfg.decay_embeddings
    if ndim < 2:
        return opt_cfg.decay_norms_and_biases
    return True


def param_groups(named: Iterable[tuple[str, nn.Parameter]], opt_cfg) -> list[dict]:
    """``[{"params": [...], "weight_decay": wd}, {"params": [...], "weight_decay": 0.0}]`` (empty
    groups left out) from ``(dense name, parameter)`` pairs, each parameter once; one empty group where
    nothing is trained (a LoRA pipeline rank holding only the embedding or the head: it still steps with
    the others, on nothing)."""
    with_decay, without, seen = [], [], set()
    for name, p in named:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (with_decay if decays(name, p.dim(), opt_cfg) else without).append(p)
    groups = [{"params": with_decay, "weight_decay": float(opt_cfg.weight_decay)},
              {"params": without, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]] or groups[1:]


def build_optimizer(named: Iterable[tuple[str, nn.Parameter]], opt_cfg, fused: str = "off") -> torch.optim.Optimizer:
    """AdamW / Adam from the ``optimizer`` section over :func:`param_groups`, with ``train.fused``'s
    kernel (:func:`.fused.make_optimizer`; ``off``: torch's plain one)."""
    return make_optimizer(param_groups(named, opt_cfg), opt_cfg, fused)


def lr_at(step: int, opt_cfg, total_steps: int) -> float:
    """The learning rate of 0-based ``step``: linear warm-up ``lr·(step+1)/warmup_steps``, then
    ``lr`` (constant) or a cosine / linear decay from ``lr`` to ``min_lr`` over the steps from
    ``warmup_steps`` to ``decay_steps`` (default ``total_steps``), ``min_lr`` after."""
    o = opt_cfg
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    end = o.decay_steps or total_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, end - o.warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1.0 - progress
    return o.min_lr + (o.lr - o.min_lr) * shape


def lr_lambda(cfg):
    """``lr_at`` as a factor of ``optimizer.lr``, for ``torch.optim.lr_scheduler.LambdaLR``."""
    return lambda step: lr_at(step, cfg.optimizer, cfg.train.steps) / cfg.optimizer.lr
