"""Gradients across the mesh: averaged over the data replicas (``dp × sp``) — during the
backward in buckets (:func:`gradient_buckets`), or in one all-reduce after it
(:func:`average_gradients`, the reference for dense parameters) — and the whole model's gradient
norm with each dense element counted once, whatever the layout. Under expert parallelism an
expert's gradient is summed over the ranks holding that expert instead, and its squared norm over
the ranks that split the experts (:mod:`.experts`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel4d.config.schema import Config
from parallel4d.distributed import comm
from parallel4d.distributed.ddp import GradBuckets
from parallel4d.distributed.mesh import Mesh
from parallel4d.engine.experts import ExpertShards
from parallel4d.engine.model import TORCH_DTYPES
from parallel4d.optim.norms import weighted_sq_norm


def average_gradients(params: list[nn.Parameter], mesh: Mesh, timeout_s: float,
                      experts: ExpertShards | None = None) -> None:
    """Average grads over the data-like axes ``dp`` and ``sp`` (every dense parameter is replicated over
    both; each rank's loss is the mean over its own tokens) in one all-reduce after the backward. The
    engine overlaps the same sums with the backward (:class:`~parallel4d.ddp.GradBuckets`); this is the
    reference they are tested against. ``experts``: under expert parallelism this rank's expert slices,
    summed over the ranks holding the same experts instead (their gradient already holds the ep group's
    tokens: :mod:`.experts`) and divided by ``dp·sp`` all the same."""
    replicas = mesh.size("dp") * mesh.size("sp")
    if replicas == 1:
        return
    split = {id(p) for p in experts.params} if experts is not None else set()
    _sum_and_divide([p.grad for p in params if p.grad is not None and id(p) not in split], mesh,
                    mesh.group_over("dp", "sp"), "dp_grad", replicas, timeout_s,
                    "gradient all-reduce over the data replicas (dp·sp)")
    if experts is not None:
        _sum_and_divide([p.grad for p in experts.params if p.grad is not None], mesh, experts.replicas, "ep_grad",
                        replicas, timeout_s, "expert gradient all-reduce over the expert replicas")


def _sum_and_divide(grads: list[torch.Tensor], mesh: Mesh, group, label: str, divisor: int, timeout_s: float,
                    what: str) -> None:
    """``grads`` summed over ``group`` in one all-reduce (counted under ``label``; ``what`` names it in a
    timeout), divided by ``divisor``."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = comm.all_reduce(flat, group, stats=mesh.comm_stats, label=label, async_op=True)
    comm.wait(work, timeout_s, what, mesh.deadlines)
    flat /= divisor
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def norm_weight(p: nn.Parameter, q: int, tied_copies: set[int]) -> float:
    """How much of ``p``'s squared gradient norm this rank contributes to the whole model's, so
    that summing over tp and pp counts each dense element once: 1/q for each grid axis a parameter
    is replicated over (``tensor2d_replicated_over``: the rows, or rows and columns), 1/2 for a tied
    copy held on two pp ranks (``tied_copies``: ids), else 1."""
    w = 1.0
    for _ in getattr(p, "tensor2d_replicated_over", ()):
        w /= q
    if id(p) in tied_copies:
        w /= 2
    return w


def sum_over_model_axes(sq: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """``sq`` summed over the axes that hold different parameters (tp_row, tp_col, pp), in place."""
    for axis in ("tp_row", "tp_col", "pp"):
        comm.all_reduce(sq, mesh.group(axis), stats=mesh.comm_stats, label="grad_norm")
    return sq


def global_grad_norm(params: list[nn.Parameter], mesh: Mesh, tied_copies: set[int] = frozenset(),
                     experts: ExpertShards | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each distinct dense element counted once
    (:func:`norm_weight`), shards on different tp/pp ranks summed — and ``experts``' slices (expert
    parallelism) summed over their ep group —; float64 ``[]``. A constant number of kernels whatever the
    number of parameters (:func:`~parallel4d.optim.norms.weighted_sq_norm`)."""
    q = mesh.size("tp_row")
    split = {id(p) for p in experts.params} if experts is not None else set()
    with_grad = [p for p in params if p.grad is not None and id(p) not in split]
    sq = weighted_sq_norm([p.grad.detach() for p in with_grad], [norm_weight(p, q, tied_copies) for p in with_grad],
                          mesh.device)
    if experts is not None:  # each rank of an ep group holds other experts: their squares add up
        mine = [p for p in experts.params if p.grad is not None]  # (under tp on every grid rank: 1/q² each)
        expert_sq = weighted_sq_norm([p.grad.detach() for p in mine], [norm_weight(p, q, tied_copies) for p in mine],
                                     mesh.device)
        comm.all_reduce(expert_sq, experts.ep, stats=mesh.comm_stats, label="grad_norm")
        sq = sq + expert_sq
    return sum_over_model_axes(sq, mesh).sqrt()


def accumulations(params: list[nn.Parameter], executor, microbatches: int) -> dict[int, int]:
    """``{id(param): gradient accumulations per step}``: one per micro-batch, and under the
    pipeline (``executor``) one per micro-batch for each of this rank's chunks holding the parameter."""
    if executor is None:
        return {id(p): microbatches for p in params}
    counts: dict[int, int] = {}
    for chunk in executor.chunks.values():
        for p in chunk.parameters():
            counts[id(p)] = counts.get(id(p), 0) + microbatches
    return counts


def gradient_buckets(params: list[nn.Parameter], mesh: Mesh, cfg: Config, executor,
                     deferred: list[nn.Parameter], experts: ExpertShards | None = None) -> GradBuckets | None:
    """Bucketed all-reduces over ``dp·sp`` posted during the backward (:class:`GradBuckets`);
    None with one replica. ``deferred``: parameters whose reduction waits for the step's end (a
    tied table's copies, summed between two pp ranks first). ``experts``: this rank's expert slices,
    summed over their replicas instead (``ep_grad``) and divided by ``dp·sp`` all the same."""
    if mesh.size("dp") * mesh.size("sp") == 1:
        return None
    sum_over = (experts.replicas, "ep_grad", experts.params) if experts is not None else None
    return GradBuckets(params, mesh, bucket_bytes=cfg.train.dp_bucket_mb * 2**20, timeout_s=cfg.train.timeout_s,
                       expected=accumulations(params, executor, cfg.pipeline.microbatches), deferred=deferred,
                       reduce_dtype=TORCH_DTYPES[cfg.train.grad_reduce], sum_over=sum_over)
