"""All ranks' ring-attention block work on one device, without communication.

Runs exactly the per-step plans, kernel calls and merges that each of the ``N`` ring
ranks performs (:mod:`.kernels`, :func:`.layout.step_plan`), rank after rank, on full
``[b, h, s, d]`` tensors. Used to measure the local-compute cost of a ring against one
monolithic attention call (``benchmarks/sequence.py``) and to check the fused kernels
against a reference on one device. Results come back in global token order.
"""

from __future__ import annotations

import torch

from parallel4d.sequence.kernels import (QueryRows, acc_dtype, add_kv_grads_, backward_step, default_scale,
                                         first_step_forward, forward_step, merge_, resolve_backend)
from parallel4d.sequence.layout import check_seq_len, rank_positions, step_plan
from parallel4d.sequence.ring import StepMasks


def shard_index(seq_len: int, n: int, layout: str, device=None) -> list[torch.Tensor]:
    """Per rank, the global positions of its tokens (int64 index tensors)."""
    check_seq_len(seq_len, n, layout)
    return [rank_positions(seq_len, r, n, layout, device) for r in range(n)]


def shard(x: torch.Tensor, n: int, layout: str) -> list[torch.Tensor]:
    """``[b, h, s, d]`` → per-rank contiguous ``[b, h, s/N, d]`` shards."""
    return [x.index_select(2, i).contiguous() for i in shard_index(x.shape[2], n, layout, x.device)]


def unshard(parts: list[torch.Tensor], layout: str) -> torch.Tensor:
    """Inverse of :func:`shard`."""
    n = len(parts)
    full = torch.empty(*parts[0].shape[:2], parts[0].shape[2] * n, *parts[0].shape[3:],
                       dtype=parts[0].dtype, device=parts[0].device)
    for p, i in zip(parts, shard_index(full.shape[2], n, layout, full.device)):
        full.index_copy_(2, i, p)
    return full


def ring_work(n: int, layout: str, causal: bool, L: int, documents=None) -> int:
    """Query×key elements of the block calls all ``n`` ranks of a ring run in a forward over shards of ``L``
    tokens (with ``documents``: the pairs that share one; whole pairs are skipped, partial ones masked)."""
    like = torch.empty(0) if documents is None else documents.ids
    total = 0
    for r in range(n):
        masks = StepMasks(r, n, layout, causal, L, like, None, documents)
        for t in range(n):
            total += sum((c.q_hi - c.q_lo) * (c.k_hi - c.k_lo) for c in masks.step(t)[0])
    return total


def ring_forward(qs, ks, vs, layout: str, causal: bool, scale=None, backend: str = "auto", merge=merge_,
                 documents=None):
    """Forward of every rank: lists of shards in → ``(outs, lses)`` per rank
    (``outs`` in the input dtype, ``lses`` in the accumulation dtype). ``merge``: the LSE merge (the ring's
    by default; the benchmark times :func:`.kernels.fused_merge` too). ``documents``: packed
    :class:`~.documents.Documents` (the ring's calls and masks, ``math`` kernel)."""
    n = len(qs)
    backend = "math" if documents is not None else resolve_backend(backend, qs[0])
    scale = default_scale(qs[0].shape[-1]) if scale is None else scale
    L = qs[0].shape[2]
    outs, lses = [], []
    for r in range(n):
        out = lse = None
        masks = StepMasks(r, n, layout, causal, L, qs[r], None, documents)
        rows = QueryRows(qs[r])
        for t in range(n):
            src = (r - t) % n
            calls, _, allowed = masks.step(t)
            if t == 0:
                out, lse = first_step_forward(rows, ks[src], vs[src], calls, scale, backend, allowed=allowed, merge=merge)
            else:
                forward_step(rows, ks[src], vs[src], calls, out, lse, scale, backend, merge=merge, allowed=allowed)
        outs.append(out.to(qs[r].dtype))
        lses.append(lse)
    return outs, lses


def ring_backward(douts, qs, ks, vs, outs, lses, layout: str, causal: bool, scale=None, backend: str = "auto"):
    """Backward of every rank; returns per-rank ``(dqs, dks, dvs)`` in the input dtype.

    dK/dV of each block are summed in the accumulation dtype, as the travelling
    accumulator of the real ring does.
    """
    n = len(qs)
    backend = resolve_backend(backend, qs[0])
    scale = default_scale(qs[0].shape[-1]) if scale is None else scale
    L = qs[0].shape[2]
    ad = acc_dtype(qs[0].dtype)
    dkvs = [torch.zeros(2, *ks[0].shape, dtype=ad, device=ks[0].device) for _ in range(n)]
    dqs = []
    for r in range(n):
        dq = torch.zeros(qs[r].shape, dtype=ad, device=qs[r].device)
        rows = QueryRows(douts[r], qs[r], outs[r], lses[r].to(ad))
        for t in range(n):
            src = (r - t) % n
            calls = step_plan(r, src, n, layout, causal, L)
            grads = backward_step(rows, ks[src], vs[src], calls, dq, scale, backend)
            add_kv_grads_(dkvs[src], grads)
        dqs.append(dq.to(qs[r].dtype))
    return dqs, [d[0].to(ks[0].dtype) for d in dkvs], [d[1].to(vs[0].dtype) for d in dkvs]
