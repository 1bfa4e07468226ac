"""Ring Self-Attention: K/V blocks travel a ring of ``N`` ranks, results merge by log-sum-exp.

Every rank holds ``q [b, h, L, d]`` and ``k, v [b, h_kv, L, d]`` for its ``L = s/N``
tokens (layout: :mod:`.layout`). Ring neighbours are the group-local ranks
``r+1`` (next) and ``r-1`` (prev), resolved to global ranks with
``dist.get_global_rank(group, i)``.

Forward, steps ``t = 0..N-1``: the rank holds the K/V block of ``src = r - t`` (own
block at ``t = 0``). At the start of step ``t < N-1`` it posts ``send(block → next)`` and
``recv(block ← prev)`` (one packed ``[2, b, h_kv, L, d]`` buffer), *then* computes this
step's block pairs (:func:`.layout.step_plan`: causal pairs skipped / full / diagonal by
global position) and merges them into ``(out, lse)`` (:func:`.kernels.merge_`), then waits.
No score tensor larger than one block pair ``[b, h, L, L]`` is ever formed.

Backward: K/V travel the same ring again, and with them a dK/dV accumulator of the
visiting block. At step ``t`` the rank adds its contribution to the accumulator of
block ``src``, which it received from ``prev`` (rank ``r-1`` handled that block at step
``t-1``), and sends it on to ``next``; after the last step one more hop delivers every
accumulator to its owner (``src`` of rank ``r`` at step ``N-1`` is ``r+1``). The sum of
all ``N`` contributions arrives exactly once at the owner: no all-reduce, no ``1/N``.
The accumulator transfer of step ``t`` overlaps the compute of step ``t+1``
(the rank adds its contribution once that compute is done). dQ stays local.

Bytes per rank (sent = received), ``e`` = element size of the inputs, ``e_acc`` of the
accumulation dtype (4 for fp16/bf16, else ``e``), ``L = s/N``, for ``N > 1`` (0 for ``N = 1``):

* forward: ``(N-1) · 2·b·h_kv·L·d · e``                          (label ``ring_attention.fwd.kv``)
* backward: ``(N-1) · 2·b·h_kv·L·d · e``                         (``ring_attention.bwd.kv``)
  ``+ N · 2·b·h_kv·L·d · e_acc``                                  (``ring_attention.bwd.dkv``)

:func:`ring_bytes` evaluates these; the tests compare them with the ``CommStats`` counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel4d.distributed import comm

from parallel4d.sequence.kernels import (QueryRows, acc_dtype, add_kv_grads_, backward_step, default_scale,
                                         first_step_forward, forward_step, resolve_backend)
from parallel4d.config.rules.sequence import check_layout
from parallel4d.sequence.layout import global_position, rank_positions, step_plan

FWD_KV = "ring_attention.fwd.kv"
BWD_KV = "ring_attention.bwd.kv"
BWD_DKV = "ring_attention.bwd.dkv"


def ring_bytes(n: int, b: int, kv_heads: int, local_len: int, d: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes each rank sends (and receives) per label, from the formulas in the module docstring."""
    if n == 1:
        return {FWD_KV: 0, BWD_KV: 0, BWD_DKV: 0}
    block = 2 * b * kv_heads * local_len * d
    e = torch.empty((), dtype=dtype).element_size()
    e_acc = torch.empty((), dtype=acc_dtype(dtype)).element_size()
    return {FWD_KV: (n - 1) * block * e, BWD_KV: (n - 1) * block * e, BWD_DKV: n * block * e_acc}


def _check_inputs(q, k, v, group, causal, layout, scale):
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"ring_attention: {name} must be a 4-D tensor [b, heads, s/N, d], "
                             f"got {getattr(t, 'shape', type(t))}")
    if k.shape != v.shape:
        raise ValueError(f"ring_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    b, h, L, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, L, d):
        raise ValueError(f"ring_attention: k/v {tuple(k.shape)} must match q {tuple(q.shape)} in batch, "
                         "local sequence length and head dim")
    if h % k.shape[1]:
        ok = [x for x in range(1, h + 1) if h % x == 0]
        raise ValueError(f"ring_attention: query heads {h} must be a multiple of k/v heads {k.shape[1]} (GQA); "
                         f"valid k/v head counts: {ok}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("ring_attention: q, k, v must share dtype and device, got "
                         f"{q.dtype}/{k.dtype}/{v.dtype} on {q.device}/{k.device}/{v.device}")
    if L < 1:
        raise ValueError("ring_attention: the local sequence shard is empty")
    if layout == "zigzag" and L % 2:
        raise ValueError(f"ring_attention: layout='zigzag' needs an even local length (seq % 2N == 0), "
                         f"got s/N={L}; use a sequence length that is a multiple of 2N, or layout='contiguous'")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"ring_attention: scale must be a positive number or None (1/sqrt(d)), got {scale!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"ring_attention: causal must be True or False, got {causal!r}")


class _Ring:
    """Group-local position and global ranks of the neighbours."""

    def __init__(self, group):
        self.group = group
        if group is None and not dist.is_initialized():  # single process: a ring of one
            self.rank, self.n, self.next, self.prev = 0, 1, 0, 0
            return
        self.rank = dist.get_rank(group)
        self.n = dist.get_world_size(group)
        peer = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
        self.next = peer((self.rank + 1) % self.n)
        self.prev = peer((self.rank - 1) % self.n)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, stats, label):
        """Post send(→ next) and recv(← prev) together; returns the works."""
        return comm.p2p([("send", send, self.next), ("recv", recv, self.prev)], self.group,
                        stats=stats, label=label)


class StepMasks:
    """One rank's per-step masks in one forward or backward of an ``n``-rank ring: attention dropout's
    scales and packed documents' pairs by global positions (each rank's ``[L]`` built once on the device,
    only when either is set), and the calls documents let run (decided on the host from piece arithmetic:
    no device read). Also what :mod:`.emulate` replays."""

    def __init__(self, rank: int, n: int, layout: str, causal: bool, L: int, like: torch.Tensor, dropout, documents):
        self.rank, self.n, self.layout, self.causal, self.L = rank, n, layout, causal, L
        self.dropout, self.documents = dropout, documents
        self.ad = acc_dtype(like.dtype)
        self.positions = ([rank_positions(L * n, r, n, layout, like.device) for r in range(n)]
                          if dropout is not None or documents is not None else None)

    def step(self, t: int):
        """``(calls, keep, allowed)`` of step ``t``: the block calls to run, ``call → [b, h, lq, lk]``
        dropout scales and ``call → [b, lq, lk]`` document pairs (None when not set)."""
        me, src, L = self.rank, (self.rank - t) % self.n, self.L
        calls = step_plan(me, src, self.n, self.layout, self.causal, L)
        keep = allowed = None
        if self.positions is not None:
            mine, theirs = self.positions[me], self.positions[src]
        if self.dropout is not None:
            keep = lambda c: self.dropout.keep(mine[c.q_lo:c.q_hi], theirs[c.k_lo:c.k_hi], self.ad)  # noqa: E731
        if self.documents is not None:
            calls = [c for c in calls if c.causal or self.documents.meet(
                self._span(me, c.q_lo, c.q_hi), self._span(src, c.k_lo, c.k_hi))]
            allowed = lambda c: self.documents.pairs(mine[c.q_lo:c.q_hi], theirs[c.k_lo:c.k_hi])  # noqa: E731
        return calls, keep, allowed

    def _span(self, rank: int, lo: int, hi: int) -> tuple[int, int]:
        """Global positions ``[first, last + 1)`` of ``rank``'s local tokens ``lo … hi-1`` (a call's run)."""
        n, L = self.n, self.L
        return (global_position(lo, rank, n, self.layout, L), global_position(hi - 1, rank, n, self.layout, L) + 1)


class RingAttention(torch.autograd.Function):
    """Autograd function behind :func:`ring_attention` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, stats, timeout_s, backend, deadlines, dropout,
                documents):
        ring = _Ring(group)
        n = ring.n
        masks = StepMasks(ring.rank, ring.n, layout, causal, q.shape[2], q, dropout, documents)
        kv = torch.stack([k, v])  # [2, b, h_kv, L, d]: one message per step
        buf = torch.empty_like(kv) if n > 1 else None
        works = None
        out_acc = lse_acc = None
        rows = QueryRows(q)
        for t in range(n):
            if works is not None:
                comm.wait(works, timeout_s, f"ring_attention forward: K/V block of step {t}", deadlines)
                kv, buf = buf, kv
                works = None
            if t + 1 < n:  # the next block's transfer runs while this block computes
                works = ring.shift(kv, buf, stats, FWD_KV)
            calls, mask, allowed = masks.step(t)
            if t == 0:
                out_acc, lse_acc = first_step_forward(rows, kv[0], kv[1], calls, scale, backend, mask, allowed)
            else:
                forward_step(rows, kv[0], kv[1], calls, out_acc, lse_acc, scale, backend, mask=mask, allowed=allowed)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.cfg = (ring, causal, layout, scale, stats, timeout_s, backend, deadlines, dropout, documents)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, layout, scale, stats, timeout_s, backend, deadlines, dropout, documents = ctx.cfg
        n = ring.n
        masks = StepMasks(ring.rank, ring.n, layout, causal, q.shape[2], q, dropout, documents)
        ad = acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=ad, device=q.device)
        rows = QueryRows(dout, q, out, lse)
        kv = torch.stack([k, v])  # K/V travel again; never reuse blocks held since forward
        kv_buf = torch.empty_like(kv) if n > 1 else None
        dkv = torch.zeros(kv.shape, dtype=ad, device=q.device)
        dkv_buf = torch.empty_like(dkv) if n > 1 else None
        kv_works = dkv_works = None
        for t in range(n):
            if kv_works is not None:
                comm.wait(kv_works, timeout_s, f"ring_attention backward: K/V block of step {t}", deadlines)
                kv, kv_buf = kv_buf, kv
                kv_works = None
            if t + 1 < n:
                kv_works = ring.shift(kv, kv_buf, stats, BWD_KV)
            calls, mask, allowed = masks.step(t)
            grads = backward_step(rows, kv[0], kv[1], calls, dq, scale, backend, mask, allowed)
            if dkv_works is not None:  # the accumulator of this step's block, from prev
                comm.wait(dkv_works, timeout_s, f"ring_attention backward: dK/dV of step {t}", deadlines)
                dkv, dkv_buf = dkv_buf, dkv
            add_kv_grads_(dkv, grads)
            if n > 1:  # pass it on; after the last step this is the hop home to its owner
                dkv_works = ring.shift(dkv, dkv_buf, stats, BWD_DKV)
        if dkv_works is not None:
            comm.wait(dkv_works, timeout_s, "ring_attention backward: own dK/dV", deadlines)
            dkv = dkv_buf
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None, None, None, None, None, None)


@comm.eager
def ring_attention(q, k, v, group=None, causal: bool = False, layout: str = "contiguous", scale=None,
                   stats: comm.CommStats | None = None, timeout_s: float | None = None,
                   backend: str = "auto", deadlines: comm.DeadlineLedger | None = None, dropout=None,
                   documents=None) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded along ``group`` (the ring).

    ``q [b, h, s/N, d]``, ``k, v [b, h_kv, s/N, d]`` (``h % h_kv == 0``): this rank's tokens in
    ``layout`` order (:func:`split_sequence`). Returns ``[b, h, s/N, d]`` for the same tokens.
    ``scale`` defaults to ``1/sqrt(d)``; ``stats`` counts bytes; ``timeout_s`` bounds each
    wait (``CommTimeout``; left to ``deadlines`` where waits are stream-ordered: :func:`comm.wait`);
    ``backend`` picks the block kernel (:mod:`.kernels`). ``dropout``: attention dropout's mask, an object
    whose ``keep(query_positions, key_positions, dtype)`` gives ``[b, h, lq, lk]`` scales (0 or ``1/(1-p)``)
    for the global positions of a block pair (the model's
    :class:`~parallel4d.models.dropout.AttentionMask`); only the ``math`` kernel takes it, which
    ``auto`` then picks (a fused backend named explicitly is refused). ``documents``: packed documents
    (:class:`~.documents.Documents`, the whole sequence's): each query attends its own document's keys
    only, and block pairs with no such pair are not computed (``math`` kernel, as for dropout).
    Every rank of ``group`` must call it with the same shapes and arguments.
    """
    _check_inputs(q, k, v, group, causal, layout, scale)
    masked = dropout is not None or documents is not None
    if masked and backend not in ("auto", "math"):
        raise ValueError(f"ring_attention: backend={backend!r} cannot apply attention dropout or packed documents "
                         "(fused kernels take no mask of ours); use backend='auto' or 'math'")
    backend = "math" if masked else resolve_backend(backend, q)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return RingAttention.apply(q, k, v, group, causal, layout, scale, stats, timeout_s, backend, deadlines, dropout,
                               documents)
