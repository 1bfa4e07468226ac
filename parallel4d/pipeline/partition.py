"""Cut a flat list of stage modules into contiguous, balanced model chunks.

The model is ``[embed, block_0, ..., block_{L-1}, head]``; a contiguous cut
keeps the embedding in chunk 0 and the LM head (the executor adds the loss
after it) in the last chunk. Costs are per stage, whatever the caller balances:
the engine gives each stage's training FLOPs per token (its compute:
:func:`parallel4d.engine.compose.pipeline_cut`); :func:`parameter_costs` (memory)
and :func:`timed_costs` (measured forward times) are the other choices.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn as nn


def partition(costs: Sequence[float], num_chunks: int) -> list[range]:
    """Contiguous cut of ``len(costs)`` stages into ``num_chunks`` non-empty ranges
    minimising the largest chunk cost; among those cuts, the most even one
    (smallest sum of squared chunk costs). Deterministic; O(n²·k)."""
    n = len(costs)
    if int(num_chunks) != num_chunks or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be an integer ≥ 1")
    if num_chunks > n:
        raise ValueError(f"cannot cut {n} stages into num_chunks={num_chunks} non-empty chunks; "
                         f"use num_chunks≤{n} or a model with ≥{num_chunks} stages (model.layers≥{num_chunks - 2})")
    if any(c < 0 for c in costs):
        raise ValueError("stage costs must be ≥ 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    k = int(num_chunks)
    inf = float("inf")

    def seg(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    # Pass 1: the smallest achievable maximum chunk cost.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, n - (k - c) + 1):
            best[c][j] = min(max(best[c - 1][i], seg(i, j)) for i in range(c - 1, j))
    limit = best[k][n] * (1 + 1e-12) + 1e-12
    # Pass 2: among cuts whose chunks all stay within that maximum, the most even.
    sq = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[-1] * (n + 1) for _ in range(k + 1)]
    sq[0][0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, n - (k - c) + 1):
            for i in range(c - 1, j):
                s = seg(i, j)
                if s <= limit and sq[c - 1][i] + s * s < sq[c][j]:
                    sq[c][j], arg[c][j] = sq[c - 1][i] + s * s, i
    cuts, j = [], n
    for c in range(k, 0, -1):
        i = arg[c][j]
        cuts.append(range(i, j))
        j = i
    return cuts[::-1]


def parameter_costs(stages: Sequence[nn.Module]) -> list[float]:
    """Parameter count per stage; a parameter shared by two stages (a tied
    embedding / LM head) counts in both, since both use it in compute."""
    return [float(sum(p.numel() for p in s.parameters())) for s in stages]


@torch.no_grad()
def timed_costs(stages: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Measured forward seconds per stage (best of ``repeats``), feeding each
    stage the previous stage's output for ``sample`` (e.g. a token micro-batch)."""
    costs, x = [], sample
    for s in stages:
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            y = s(x)
            if y.is_cuda:
                torch.cuda.synchronize(y.device)
            best = min(best, time.perf_counter() - t0)
        costs.append(best)
        x = y
    return costs


def build_chunks(stages: Sequence[nn.Module], ranges: Sequence[range], chunk_ids,
                 activation_dtype: torch.dtype | None = None) -> dict[int, nn.Module]:
    """``{chunk id: nn.Sequential(stages in its range)}`` for the given chunk ids
    (this rank's ``schedule.placement[pp_rank]``). Shares the stage modules.
    ``activation_dtype``: activations cross chunks in this dtype (:class:`CastChunk`); None: in
    whatever dtype the stages give them."""
    if activation_dtype is None:
        return {c: nn.Sequential(*[stages[i] for i in ranges[c]]) for c in chunk_ids}
    last = len(ranges) - 1
    return {c: CastChunk(activation_dtype, c < last, *[stages[i] for i in ranges[c]]) for c in chunk_ids}


class CastChunk(nn.Sequential):
    """A chunk whose activations cross to the next chunk in ``dtype`` (e.g. bf16 between float32
    stages under bf16 autocast: half the bytes) while its stages compute as they would unpipelined:
    a floating input is cast to the chunk's parameters' dtype on the way in, the output to ``dtype``
    on the way out (``cast_out``: all but the last chunk, whose output goes to the loss). Both casts
    are differentiable, so the input-gradient handed back is in ``dtype`` as well and the
    output-gradient received is cast back by autograd. Casts to the dtype a tensor has are free."""

    def __init__(self, dtype: torch.dtype, cast_out: bool, *stages: nn.Module):
        super().__init__(*stages)
        self.activation_dtype, self.cast_out = dtype, cast_out

    def forward(self, x):
        if x.is_floating_point():  # chunk 0 takes token ids
            x = x.to(next((p.dtype for p in self.parameters() if p.is_floating_point()), x.dtype))
        y = super().forward(x)
        return y.to(self.activation_dtype) if self.cast_out and y.is_floating_point() else y
