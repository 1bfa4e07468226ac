"""Sequence layouts over the ring: which global tokens each rank holds.

The sequence of length ``s`` is cut into equal *pieces*; each rank holds some of
them, concatenated in increasing global order (so local token order is global
order, which keeps a standard causal mask valid inside one rank's shard).

* ``contiguous``: ``N`` pieces of ``s/N`` tokens; rank ``r`` holds piece ``r``.
* ``zigzag``: ``2N`` pieces of ``s/2N`` tokens; rank ``r`` holds pieces ``r`` and
  ``2N-1-r``. Under a causal mask every rank then does the same work.

``split_sequence`` / ``gather_sequence`` move between the full tensor (same on
every rank) and the local shard; ``positions_for`` gives the global position ids
of the local tokens (needed by learned position embeddings / RoPE).
The causal *plan* of one ring step (which query/key piece pairs are computed,
and whether with a diagonal causal mask) lives here too, as pure functions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel4d.distributed import comm
from parallel4d.config.rules.sequence import check_layout, num_pieces, seq_len_problem


def pieces_of(rank: int, n: int, layout: str) -> tuple[int, ...]:
    """Global piece indices held by ``rank`` (group-local index), in local order."""
    check_layout(layout)
    return (rank,) if layout == "contiguous" else (rank, 2 * n - 1 - rank)


def check_seq_len(seq_len: int, n: int, layout: str, field: str = "seq_len") -> None:
    """``ValueError`` unless ``seq_len`` splits into this layout's pieces."""
    problem = seq_len_problem(seq_len, n, layout, field)
    if problem:
        raise ValueError(problem)


def local_positions(seq_len: int, rank: int, n: int, layout: str) -> list[int]:
    """Global positions of ``rank``'s tokens, in local order (pure function)."""
    check_seq_len(seq_len, n, layout)
    p = seq_len // num_pieces(n, layout)
    return [i for piece in pieces_of(rank, n, layout) for i in range(piece * p, (piece + 1) * p)]


def _group_coords(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def global_position(index: int, rank: int, n: int, layout: str, local_len: int) -> int:
    """The global position of ``rank``'s local token ``index`` (``local_positions(...)[index]``, by
    arithmetic: no list of the shard)."""
    pieces = pieces_of(rank, n, layout)
    p = local_len // len(pieces)
    return pieces[index // p] * p + index % p


def rank_positions(seq_len: int, rank: int, n: int, layout: str, device=None) -> torch.Tensor:
    """:func:`local_positions` as an int64 tensor ``[s/N]`` built on ``device`` (ranges filled there: no
    host→device copy, which would make the host wait for a GPU)."""
    check_seq_len(seq_len, n, layout)
    p = seq_len // num_pieces(n, layout)
    return torch.cat([torch.arange(piece * p, (piece + 1) * p, dtype=torch.long, device=device)
                      for piece in pieces_of(rank, n, layout)])


def positions_for(seq_len: int, group, layout: str, device=None) -> torch.Tensor:
    """Global position ids ``[s/N]`` (int64) of this rank's tokens along ``group``."""
    rank, n = _group_coords(group)
    return rank_positions(seq_len, rank, n, layout, device)


def split_sequence(x: torch.Tensor, group, dim: int, layout: str) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` (identical on every rank) along ``dim``.

    ``[..., s, ...]`` → ``[..., s/N, ...]`` (a new contiguous tensor). No communication.
    """
    rank, n = _group_coords(group)
    dim = dim % x.dim()
    check_seq_len(x.shape[dim], n, layout, field=f"x.shape[{dim}]")
    p = x.shape[dim] // num_pieces(n, layout)
    parts = [x.narrow(dim, piece * p, p) for piece in pieces_of(rank, n, layout)]
    return torch.cat(parts, dim=dim).contiguous()


def gather_sequence(x: torch.Tensor, group, dim: int, layout: str, *, stats=None) -> torch.Tensor:
    """Inverse of :func:`split_sequence`: ``[..., s/N, ...]`` shards → the full ``[..., s, ...]``.

    One all-gather over ``group`` (not differentiable; for tests, evaluation, checkpoints).
    """
    rank, n = _group_coords(group)
    dim = dim % x.dim()
    per = len(pieces_of(0, n, layout))
    if x.shape[dim] % per:
        raise ValueError(f"gather_sequence: local length x.shape[{dim}]={x.shape[dim]} must be a multiple "
                         f"of {per} for layout={layout!r}")
    shards = comm.all_gather(x.contiguous(), group, dim=dim, stats=stats, label="gather_sequence")
    if n == 1:
        return shards
    local = x.shape[dim]
    p = local // per
    by_piece: dict[int, torch.Tensor] = {}
    for r in range(n):
        shard = shards.narrow(dim, r * local, local)
        for i, piece in enumerate(pieces_of(r, n, layout)):
            by_piece[piece] = shard.narrow(dim, i * p, p)
    return torch.cat([by_piece[i] for i in range(num_pieces(n, layout))], dim=dim)


# --------------------------------------------------------------------------- causal plan


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of a ring step, in local token offsets of the two shards.

    Queries ``[q_lo, q_hi)`` of this rank against keys ``[k_lo, k_hi)`` of the
    visiting block. ``causal`` means the top-left aligned triangular mask, used only
    when both ranges cover the same global positions (the diagonal).
    """

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool

    def area(self) -> int:
        """Number of (query, key) token pairs this call attends."""
        lq, lk = self.q_hi - self.q_lo, self.k_hi - self.k_lo
        return lq * (lq + 1) // 2 if self.causal else lq * lk


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``[lo, hi)`` of a sorted index list."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def step_plan(rank: int, src: int, n: int, layout: str, causal: bool, local_len: int) -> list[BlockCall]:
    """Kernel calls for queries of ``rank`` against the K/V block owned by ``src`` (:func:`_step_plan`, kept
    per arguments: every forward and backward of every layer asks again)."""
    return list(_step_plan(rank, src, n, layout, causal, local_len))


@functools.lru_cache(maxsize=4096)
def _step_plan(rank: int, src: int, n: int, layout: str, causal: bool, local_len: int) -> tuple[BlockCall, ...]:
    """Kernel calls for queries of ``rank`` against the K/V block owned by ``src``.

    Piece pairs are classified by global position: key piece after query piece →
    skipped; before → fully visible; the same piece → diagonal. Query pieces with
    the same visible key pieces share one call (for zigzag every step is one call:
    ``src < rank``: all queries × first key piece; ``src > rank``: second query piece ×
    all keys; ``src == rank``: one causal call over the whole shard, valid because
    local order is global order).
    """
    if not causal:
        return (BlockCall(0, local_len, 0, local_len, False),)
    if src == rank:
        return (BlockCall(0, local_len, 0, local_len, True),)
    qp, kp = pieces_of(rank, n, layout), pieces_of(src, n, layout)
    p = local_len // len(qp)
    visible = [tuple(j for j, gk in enumerate(kp) if gk < gq) for gq in qp]
    calls: list[BlockCall] = []
    i = 0
    while i < len(qp):
        j = i
        while j + 1 < len(qp) and visible[j + 1] == visible[i]:
            j += 1
        for lo, hi in _runs(list(visible[i])):
            calls.append(BlockCall(i * p, (j + 1) * p, lo * p, hi * p, False))
        i = j + 1
    return tuple(calls)


@dataclass(frozen=True)
class CausalBalance:
    """Per-rank causal attention work of a whole ring pass (forward) for one layout.

    ``work[r]``: area rank ``r`` computes in units of one half-block pair ``(s/2N)²``
    (a diagonal triangle counts half its square); ``pairs[r]``: exact visible (query, key)
    token pairs; ``calls[r]``: kernel calls. ``imbalance`` = max/mean work (1.0 = balanced);
    the slowest rank sets the step time, so ``imbalance`` is the slowdown versus a balanced ring.
    """

    layout: str
    n: int
    seq_len: int
    work: tuple[float, ...]
    pairs: tuple[int, ...]
    calls: tuple[int, ...]
    imbalance: float


def causal_balance(n: int, layout: str, seq_len: int | None = None) -> CausalBalance:
    """Work per rank for causal ring attention (pure; no process group needed)."""
    seq_len = 2 * n if seq_len is None else seq_len
    check_seq_len(seq_len, n, layout)
    local = seq_len // n
    half = seq_len / (2 * n)
    work, pairs, calls = [], [], []
    for r in range(n):
        plan = [c for t in range(n) for c in step_plan(r, (r - t) % n, n, layout, True, local)]
        area = sum((c.q_hi - c.q_lo) ** 2 / 2 if c.causal else (c.q_hi - c.q_lo) * (c.k_hi - c.k_lo)
                   for c in plan)
        work.append(area / (half * half))
        pairs.append(sum(c.area() for c in plan))
        calls.append(len(plan))
    mean = sum(work) / n
    return CausalBalance(layout, n, seq_len, tuple(work), tuple(pairs), tuple(calls), max(work) / mean)
