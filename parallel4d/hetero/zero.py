"""ZeRO over the ``dp`` group at chunk granularity (shard within chunk, Gemini-style).

Every chunk of ``C`` elements is split into ``dp`` equal shards of ``S = C/dp``;
dp rank ``r`` owns elements ``[r·S, (r+1)·S)`` of every row's parameter, gradient,
exp_avg and exp_avg_sq chunks (host backing of ``S`` elements each). Parameters are
all-gathered into a full device slot before use; gradient chunks are reduce-scattered
(summed, then divided by dp — the per-rank loss is the mean over that rank's slice,
like DDP) as soon as all their tensors' gradients are written, and each rank updates
only its shard.

All dp ranks run the same program on the same budget and policy, so their chunk
accesses and eviction decisions are identical and every collective is matched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .chunk import TensorInfo


def window(rank: int, shard: int) -> tuple[int, int]:
    """Element range ``[lo, hi)`` of a chunk owned by dp ``rank``."""
    return rank * shard, (rank + 1) * shard


def segment(t: TensorInfo, lo: int, hi: int) -> tuple[int, int] | None:
    """``t``'s elements inside ``[lo, hi)`` as chunk offsets, or ``None``."""
    a, b = max(t.offset, lo), min(t.end, hi)
    return (a, b) if a < b else None


def all_gather_into(full: torch.Tensor, local: torch.Tensor, group) -> None:
    """``full[C]`` ← concatenation of every rank's ``local[S]`` (rank order of ``group``)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with comm.named("hetero ZeRO parameter all-gather", group):
        fn(full, local.contiguous(), group=group)


def reduce_scatter_mean(full: torch.Tensor, group, dp: int) -> torch.Tensor:
    """Sum ``full[C]`` over the group and return this rank's ``[S]`` shard divided by ``dp``."""
    out = torch.empty(full.numel() // dp, dtype=full.dtype, device=full.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with comm.named("hetero ZeRO gradient reduce-scatter", group):
        fn(out, full, op=dist.ReduceOp.SUM, group=group)
    return out.div_(dp)
