"""Sequence parallelism over the ``sp`` axis of the mesh: Ring Self-Attention, and Ulysses around it.

Public API::

    ring_attention(q, k, v, group, causal=False, layout="contiguous", scale=None,
                   stats=None, timeout_s=None, backend="auto") -> out       # [b, h, s/N, d]
    split_sequence(x, group, dim, layout) -> shard                           # [.., s, ..] -> [.., s/N, ..]
    gather_sequence(x, group, dim, layout) -> full                           # inverse (one all-gather)
    positions_for(seq_len, group, layout, device=None) -> LongTensor [s/N]   # global ids of my tokens
    make_ring_attention_fn(group, layout="zigzag", stats=None) -> attention_fn(q, k, v, causal=True)
    causal_balance(n, layout, seq_len=None) -> CausalBalance                 # per-rank causal work
    ring_bytes(n, b, kv_heads, local_len, d, dtype) -> {label: bytes}        # per-rank traffic formula
    ulysses_attention(q, k, v, ulysses_group, ring_group, ...) -> out        # all-to-all over heads × ring
    hybrid_positions(seq_len, rank, n, ulysses, layout) -> [int]             # the hybrid layout's positions

Using it in the reference GPT (what the engine does for ``parallel.sp = N``)::

    sp = mesh.group("sp")
    attn = make_ring_attention_fn(sp, layout=cfg.sequence.layout, stats=mesh.comm_stats, deadlines=mesh.deadlines)
    for block in model.blocks:
        block.attn.attention_fn = attn               # or build Blocks with attention_fn=attn
    tokens_l  = split_sequence(tokens,  sp, dim=1, layout=layout)   # [b, s/N]
    targets_l = split_sequence(targets, sp, dim=1, layout=layout)   # same permutation as inputs
    pos_l     = positions_for(s, sp, layout, device)                # [s/N] global positions
    x = model.embed(tokens_l, pos_l)                                 # position embedding by global id
    for block in model.blocks: x = block(x)
    loss_l = cross_entropy(model.head(x), targets_l)                 # mean over my s/N tokens

Everything but attention is token-local, so each rank runs it on its own tokens. The
global mean loss is the mean of the ``N`` local means (every rank has ``b·s/N`` tokens;
with ignored tokens weight by counts). Parameter gradients of the replicated weights are
partial sums over the ranks' tokens: all-reduce them over ``sp`` (sum, when each rank's loss is
``loss_l / N``; or average when each uses its own mean) — the same as data parallelism.
Block kernels (``backend=``): ``auto`` picks cuDNN SDPA (fp16/bf16 CUDA, d ≤ 128), else
FlashAttention-2, else the plain ``math`` path (CPU, fp32/fp64); ``cpu_flash`` is ATen's fused
CPU kernel. Merges and gradient sums run in fp32 for half inputs. ``benchmarks/sequence.py``
measures the ring's local compute against one monolithic SDPA call (``--quick`` on CPU).

Sequence length must be divisible by ``N`` (``2N`` for ``zigzag``). Use ``zigzag`` for causal
models (balanced work, :func:`causal_balance`); ``contiguous`` is fine when not causal.
"""

from parallel4d.config.rules.sequence import LAYOUTS
from parallel4d.sequence.adapter import make_ring_attention_fn
from parallel4d.sequence.kernels import BACKENDS, acc_dtype, merge_
from parallel4d.sequence.layout import (BlockCall, CausalBalance, causal_balance, check_seq_len, gather_sequence,
                     local_positions, positions_for, split_sequence, step_plan)
from parallel4d.sequence.ring import RingAttention, ring_attention, ring_bytes
from parallel4d.sequence.ulysses import hybrid_positions, make_ulysses_attention_fn, ulysses_attention

__all__ = [
    "ring_attention", "RingAttention", "ring_bytes", "split_sequence", "gather_sequence", "positions_for",
    "local_positions", "make_ring_attention_fn", "causal_balance", "CausalBalance", "step_plan", "BlockCall",
    "check_seq_len", "LAYOUTS", "BACKENDS", "acc_dtype", "merge_", "ulysses_attention", "hybrid_positions",
    "make_ulysses_attention_fn",
]
