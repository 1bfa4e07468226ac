"""Chunk-based heterogeneous memory (PatrickStar-style) with ZeRO over the ``dp`` axis.

Engine-facing API::

    from parallel4d.hetero import state_dict, load_state_dict
    from parallel4d.hetero import wrap

    model, opt = wrap(model, cfg.optimizer, cfg.hetero, mesh=None | mesh)
    loss = loss_fn(model(x), y)      # per-rank MEAN over this rank's slice of the batch
    loss.backward()                  # gradients go into chunks; p.grad stays None
    opt.clip_grad_norm_(max_norm)    # optional; global norm (over dp too), applied in step()
    opt.param_groups[0]["lr"] = lr   # optional learning-rate schedule
    opt.step()                       # chunk-wise Adam/AdamW; consumes the gradients
    opt.zero_grad()                  # frees any gradient left (no-op after step())
    opt.stats()                      # {"model_data_bytes", "device_budget_bytes",
                                     #  "peak_resident_bytes", "bytes_moved", ...}
    sd = state_dict(model, opt)      # {"model": {fqn: full tensor}, "optim": {...}}: DCP-ready,
    load_state_dict(model, opt, sd)  # layout-independent (save at dp=2, load at dp=1)

* ``wrap`` accepts the pydantic sections (:class:`~parallel4d.config.OptimizerConfig`,
  :class:`~parallel4d.config.HeteroConfig`) or dicts of their fields.
* With ``mesh`` and ``mesh.size("dp") > 1`` hetero does the data-parallel reduction
  itself (ZeRO): gradients are **averaged** over dp (sum / dp), exactly like DDP, so
  each rank's loss must be the mean over its own slice of the global batch — do not
  scale by ``1/dp`` and do not all-reduce gradients elsewhere. Every dp rank must run
  the same loop (same micro-batch count) with the same budget and policy.
* ``model.state_dict()`` returns full parameter values under the original keys (tied
  parameters under every alias); ``model.load_state_dict`` writes into the chunks.
  Both are collective under ZeRO.
* ``opt.stats()["bytes_moved"]`` is the cumulative host↔device bytes (loads +
  write-backs); ``stats()["last_iteration"]`` has the per-iteration counters (loads,
  write-backs, zero-fills, drops, all-gather / reduce-scatter bytes).
* ``wrap(..., compute_dtype=torch.bfloat16)`` (the engine passes it under ``train.dtype:
  bfloat16``): the device chunks hold that 16-bit compute copy and its gradients; the master
  parameters and Adam moments, in the parameters' dtype (:mod:`.master`), live on the device for as
  many rows as the budget leaves after the compute chunks (all without a budget) and are updated there;
  the other rows' on the host, updated by a worker thread in forward order beside the next forward
  (``opt.update_in_backward()``: from the backward on, when nothing scales the gradients after it);
  ``state_dict`` gives the master.
* On CUDA: host backings are one page-locked buffer (``cudaHostRegister``), fills and
  write-backs run on one side stream per direction with per-chunk ready events, the next chunks of the
  replayed trace are prefetched, ZeRO all-gathers included (``model._hetero_runtime.mgr.prefetch_depth``,
  2), reduce-scatters run asynchronously, and rows that are
  not fully resident at ``step()`` are updated on the host with torch's fused CPU AdamW
  (``model._hetero_runtime.host_optimizer``: "fused" | "exact" | "off"). On the CPU compute device
  both are off by default (nothing to overlap) and switched on by the tests.
* Frozen parameters (``requires_grad`` False: a LoRA base) get rows of their own with no gradient, Adam
  or ZeRO-reduction chunks and, under 16-bit chunks, no master: their chunks in the compute dtype are their
  only copy (2 host bytes a parameter in bfloat16). They stream like every chunk, forward and backward (a
  module's frozen parameters are released once its inputs' gradients are computed).
* Limits: every parameter must be a direct parameter of a module whose ``forward``
  uses it (module hooks drive residency); activation checkpointing must use
  ``use_reentrant=False``; all parameters share one floating dtype; do not move the
  model (``.to``/``.cuda``) after ``wrap``. ``hetero.enabled`` is the engine's switch:
  ``wrap`` always wraps. The slot arena is preallocated, so on CUDA the dynamic budget
  governs residency and traffic but empty slots are not lent to activations.
"""

from parallel4d.config.schema import HeteroConfig, OptimizerConfig
from parallel4d.hetero.chunk import InvalidTransition, TensorState, TRANSITIONS, search_chunk_elems
from parallel4d.hetero.manager import BudgetError, ChunkManager
from parallel4d.hetero.optim import HeteroOptimizer, adam_update
from parallel4d.hetero.tracer import AccessTrace, opt_loads, opt_traffic, opt_traffic_of
from parallel4d.hetero.transfers import MoveStats
from parallel4d.hetero.wrap import HeteroRuntime, wrap


def state_dict(model, opt) -> dict:
    """``{"model": {fqn: tensor}, "optim": opt.state_dict()}`` with full (unsharded) tensors."""
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def load_state_dict(model, opt, sd: dict, *, frozen_may_be_missing: bool = False) -> None:
    """Inverse of :func:`state_dict`; works for any dp layout of the saved job. With
    ``frozen_may_be_missing`` (a LoRA checkpoint: adapters only) a frozen parameter absent from
    ``sd["model"]`` keeps its chunks' values; a trained one absent is still an error."""
    loaded = model.load_state_dict(sd["model"], strict=not frozen_may_be_missing)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(loaded.missing_keys) & trained) + list(loaded.unexpected_keys)
    if missing:
        raise RuntimeError(f"hetero state dict: trained parameters missing or unknown keys: {missing}")
    opt.load_state_dict(sd["optim"])


__all__ = ["wrap", "state_dict", "load_state_dict", "HeteroConfig", "OptimizerConfig", "HeteroOptimizer",
           "HeteroRuntime", "ChunkManager", "MoveStats", "BudgetError", "InvalidTransition", "TensorState",
           "TRANSITIONS", "AccessTrace", "opt_loads", "opt_traffic", "opt_traffic_of", "adam_update",
           "search_chunk_elems"]
