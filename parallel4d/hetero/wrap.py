"""``wrap(model, optimizer_config, hetero_config, mesh=None)``: hand a model's data to chunks.

The sections are validated here (pydantic sections or dicts of their fields); the work is
:class:`~parallel4d.hetero.runtime.HeteroRuntime`'s, the training-loop surface
:class:`~parallel4d.hetero.optim.HeteroOptimizer`'s.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from pydantic import ValidationError

from parallel4d.config.messages import format_validation_error
from parallel4d.config.schema import HeteroConfig, OptimizerConfig
from parallel4d.hetero.budget import resolve_device
from parallel4d.hetero.optim import HeteroOptimizer
from parallel4d.hetero.runtime import HeteroRuntime

__all__ = ["wrap", "HeteroRuntime", "resolve_device"]


def _validate(cfg, cls, field_name: str):
    """``cfg`` as a ``cls`` section; a dict is validated as the job file's ``field_name`` would be."""
    if cfg is None:
        return cls()
    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, dict):
        try:
            return cls.model_validate(cfg)
        except ValidationError as e:
            raise ValueError(f"invalid {field_name} section:\n" + format_validation_error(e, (field_name,))) from None
    raise ValueError(f"{field_name} must be a {cls.__name__} or a dict of its fields, got {type(cfg).__name__}")


def wrap(model: nn.Module, optimizer_config=None, hetero_config=None, mesh=None, param_groups=None,
         compute_dtype: torch.dtype | None = None, partial_replicas=None, zero_grad_steps=()):
    """Move ``model``'s parameters, gradients and Adam states into chunks.

    ``optimizer_config``: :class:`~parallel4d.config.OptimizerConfig` or a dict of its
    fields; ``hetero_config``: :class:`~parallel4d.config.HeteroConfig` or a dict;
    ``mesh``: a :class:`~parallel4d.mesh.Mesh` whose ``dp`` axis (if > 1) shards the
    chunks ZeRO-style; ``param_groups``: torch-style groups of ``model``'s trainable parameters
    (each once; e.g. ``weight_decay: 0.0`` for norms and biases), default one group of all of
    them; ``compute_dtype``: the device chunks' dtype when narrower than the parameters' (16-bit
    chunks: the parameters compute in it, their master copy and the Adam moments stay in the
    parameters' dtype on the host), None for one copy; ``partial_replicas``: ``(params, group)``, parameters
    of ``model`` that only the data replicas of the process ``group`` hold (the same values on its ranks;
    other groups hold other values: expert parallelism's expert slices) — ZeRO shards their rows over
    ``group`` and sums their gradients there, divided by the whole dp as every gradient; ``zero_grad_steps``:
    parameters of ``model`` each step updates with a zero gradient when none arrived (torch's AdamW skips a
    parameter without one): experts held one module each, which no token chose, as rows of a stacked
    tensor they would step with zeros. Returns ``(model, optimizer)``: the same module object (hooks
    installed, ``state_dict`` gives full values under the original keys) and a
    :class:`~parallel4d.hetero.optim.HeteroOptimizer`.
    """
    opt_cfg = _validate(optimizer_config, OptimizerConfig, "optimizer")
    cfg = _validate(hetero_config, HeteroConfig, "hetero")
    if getattr(model, "_hetero_runtime", None) is not None:
        raise ValueError("hetero.wrap: this model is already wrapped")
    rt = HeteroRuntime(model, opt_cfg, cfg, mesh, compute_dtype, partial_replicas, zero_grad_steps)
    model._hetero_runtime = rt
    return model, HeteroOptimizer(rt, opt_cfg, param_groups)
