"""Ulysses and hybrid sequence parallelism: all-to-all over heads, optionally around the ring.

The ``N`` sp ranks are ``R = N/U`` ring positions × ``U`` Ulysses positions, Ulysses innermost (the
all-to-all between neighbouring ranks): sp rank ``i`` is ring rank ``i // U`` in the ring of the ranks
sharing its Ulysses index ``i % U``, and member ``i % U`` of the Ulysses group of the ranks sharing its
ring index. ``U = N`` is pure Ulysses, ``U = 1`` the ring alone.

Layout (:func:`hybrid_positions`): the sequence is first cut over the ``R`` ring ranks in the ring's
layout (contiguous or zigzag), then each ring shard, in its local order, into ``U`` consecutive slices
of ``s/N`` tokens, one per member of its Ulysses group. Attention of one layer on ``q [b, h, s/N, d]``,
``k, v [b, h_kv, s/N, d]``:

1. all-to-all in the Ulysses group: heads scattered, sequence gathered → ``q [b, h/U, s/R, d]``,
   ``k, v [b, h_kv/U, s/R, d]``: each member holds the whole ring shard for ``1/U`` of the heads
   (query head ``i`` still reads key/value head ``i // (h/h_kv)``: both split into ``U`` contiguous
   groups, so ``h_kv % U == 0`` keeps each query group with its key/value head);
2. :func:`~.ring.ring_attention` over the ring (``R`` ranks, the ring's layout) — for ``R = 1`` the
   whole sequence is local (pure Ulysses);
3. the inverse all-to-all → ``[b, h, s/N, d]``.

Backward: each all-to-all's gradient is the inverse all-to-all. Bytes per rank and layer (sent =
received, ``e`` the element size): forward ``(U-1)/U · (2·b·h·(s/N)·d + 2·b·h_kv·(s/N)·d) · e`` over the
Ulysses group (q and out, k and v), the same again in backward, plus the ring's bytes at ``R`` with
``h_kv/U`` heads and ``s/R`` local tokens (:func:`~.ring.ring_bytes`).
"""

from __future__ import annotations

import dataclasses

import torch

from parallel4d.distributed import comm
from parallel4d.sequence.layout import check_seq_len, local_positions, rank_positions
from parallel4d.sequence.ring import ring_attention, ring_bytes

A2A = "ulysses.all_to_all"


def ulysses_bytes(n: int, ulysses: int, b: int, heads: int, kv_heads: int, seq_len: int, d: int,
                  dtype: torch.dtype) -> dict[str, int]:
    """Bytes each rank sends (and receives) per label for one layer's attention, forward and backward,
    from the formulas in the module docstring (labels with 0 bytes left out)."""
    e, local = torch.empty((), dtype=dtype).element_size(), seq_len // n
    a2a = 2 * (ulysses - 1) * (2 * b * heads * local * d + 2 * b * kv_heads * local * d) * e // ulysses
    ring = ring_bytes(n // ulysses, b, kv_heads // ulysses, seq_len * ulysses // n, d, dtype)
    return {label: v for label, v in ((A2A, a2a), *ring.items()) if v}


def check_hybrid(seq_len: int, n: int, ulysses: int, layout: str) -> None:
    """``ValueError`` unless ``seq_len`` splits over the ring of ``n/ulysses`` in ``layout`` and into ``n`` parts."""
    check_seq_len(seq_len, n // ulysses, layout)
    if seq_len % n:
        raise ValueError(f"seq_len={seq_len} must be a multiple of sp={n} for Ulysses groups of {ulysses}")


def hybrid_positions(seq_len: int, rank: int, n: int, ulysses: int, layout: str) -> list[int]:
    """Global positions of sp rank ``rank``'s tokens (local order) for ``n`` sp ranks of which ``ulysses``
    per Ulysses group (pure function)."""
    check_hybrid(seq_len, n, ulysses, layout)
    shard, part = local_positions(seq_len, rank // ulysses, n // ulysses, layout), seq_len // n
    j = rank % ulysses
    return shard[j * part:(j + 1) * part]


def hybrid_position_tensor(seq_len: int, rank: int, n: int, ulysses: int, layout: str, device=None) -> torch.Tensor:
    """:func:`hybrid_positions` as an int64 tensor built on ``device`` (no host→device copy)."""
    check_hybrid(seq_len, n, ulysses, layout)
    part, j = seq_len // n, rank % ulysses
    return rank_positions(seq_len, rank // ulysses, n // ulysses, layout, device)[j * part:(j + 1) * part]


def make_ulysses_attention_fn(ulysses_group, ring_group, layout: str = "zigzag", stats=None, *,
                              timeout_s: float | None = None, deadlines=None):
    """A drop-in ``attention_fn(q, k, v, causal=True, dropout=None, documents=None)`` running
    :func:`ulysses_attention` (the model's attention core under ``sequence.ulysses > 1``)."""
    def attention_fn(q, k, v, causal: bool = True, dropout=None, documents=None):
        return ulysses_attention(q, k, v, ulysses_group, ring_group, causal=causal, layout=layout, stats=stats,
                                 timeout_s=timeout_s, deadlines=deadlines, dropout=dropout, documents=documents)

    attention_fn.layout = layout
    return attention_fn


class _AllToAll(torch.autograd.Function):
    """:func:`comm.all_to_all` whose gradient is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, stats):
        ctx.cfg = (group, scatter_dim, gather_dim, stats)
        return comm.all_to_all(x, group, scatter_dim=scatter_dim, gather_dim=gather_dim, stats=stats, label=A2A)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim, stats = ctx.cfg
        back = comm.all_to_all(grad.contiguous(), group, scatter_dim=gather_dim, gather_dim=scatter_dim,
                               stats=stats, label=A2A)
        return back, None, None, None, None


def _heads_out(x, group, stats):
    """``[b, heads, s/N, d]`` → ``[b, heads/U, s/R, d]`` (heads scattered, sequence gathered)."""
    return _AllToAll.apply(x, group, 1, 2, stats)


def _heads_in(x, group, stats):
    """The inverse: ``[b, heads/U, s/R, d]`` → ``[b, heads, s/N, d]``."""
    return _AllToAll.apply(x, group, 2, 1, stats)


def _local_dropout(dropout, ulysses_rank: int, u: int, heads: int):
    """Attention dropout's mask for this member's heads after the all-to-all (the ring draws the keys'
    and queries' positions itself, by the ring's layout)."""
    if dropout is None:
        return None
    per = heads // u
    return dataclasses.replace(dropout, heads=dropout.heads[ulysses_rank * per:(ulysses_rank + 1) * per])


@comm.eager
def ulysses_attention(q, k, v, ulysses_group, ring_group, causal: bool = False, layout: str = "contiguous",
                      scale=None, stats: comm.CommStats | None = None, timeout_s: float | None = None,
                      backend: str = "auto", deadlines: comm.DeadlineLedger | None = None, dropout=None,
                      documents=None):
    """Exact softmax attention over a sequence held in the hybrid layout (module docstring): ``q
    [b, h, s/N, d]``, ``k, v [b, h_kv, s/N, d]`` → ``[b, h, s/N, d]``; ``ulysses_group``: this rank's
    ``U`` members (heads exchanged), ``ring_group``: its ``R`` ring members (None or a group of one:
    pure Ulysses). The other arguments are :func:`~.ring.ring_attention`'s (``documents`` indexes global
    positions, which the ring's shard after the all-to-all holds in the ring's layout)."""
    u = comm.group_size(ulysses_group)
    h, hkv = q.shape[1], k.shape[1]
    if h % u or hkv % u:
        raise ValueError(f"ulysses_attention: query heads {h} and key/value heads {hkv} must both be multiples "
                         f"of the Ulysses group's {u} members; use a sequence.ulysses that divides both")
    mask = _local_dropout(dropout, comm.group_rank(ulysses_group), u, h)
    ql, kl, vl = (_heads_out(x.contiguous(), ulysses_group, stats) for x in (q, k, v))
    out = ring_attention(ql, kl, vl, ring_group, causal=causal, layout=layout, scale=scale, stats=stats,
                         timeout_s=timeout_s, backend=backend, deadlines=deadlines, dropout=mask, documents=documents)
    return _heads_in(out, ulysses_group, stats)
