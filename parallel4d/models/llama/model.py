"""Reference Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention.

The single-process dense reference of ``model.arch: llama`` (Llama, Mistral without a sliding
window, Qwen2 with ``qkv_bias``; Qwen3-MoE, Qwen2-MoE and Mixtral with :mod:`parallel4d.models.moe`'s
layers in place of the MLP where ``shape.moe`` selects them: :func:`block_mlp`). Module and parameter names inside a block are Hugging Face's
(``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, …), so a ``transformers``
checkpoint maps onto it name by name (:mod:`.spec`'s ``hf_names``).

Shapes (dense): tokens ``[b, s]`` → hidden ``[b, s, h]`` → logits ``[b, s, V]``; q
``[b, heads, s, d]``, k and v ``[b, kv_heads, s, d]`` with ``d = head_dim`` (``h / heads``
unless set: Qwen3's is wider). Qwen3 (``qk_norm``) normalises each head's q and k (RMSNorm over
``d``, ``q_norm`` / ``k_norm``) before the rotary. Rotary embeddings (:mod:`.rotary`, scaled or not)
rotate q and k by their token's *global* position (``Attention.positions``; the engine sets a
sequence shard's, and ``Attention.length``, the whole sequence's), so a shard of the sequence
rotates as in the whole.
Stages: ``embed, block_0..block_{L-1}, head`` (:mod:`parallel4d.models.stages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.models.context import ReadsContext
from parallel4d.models.dropout import Site, attend
from parallel4d.models.llama.rotary import Rotary, Scaling, rotate
from parallel4d.models.moe.balance import auxiliary_loss
from parallel4d.models.moe.layer import SparseMoE
from parallel4d.models.moe.spec import MoeShape
from parallel4d.models.stages import DenseModel, cached_attention, dense_attention, seeded_stage

if TYPE_CHECKING:
    from parallel4d.config.schema import ModelConfig


@dataclass(frozen=True)
class LlamaShape:
    """The architecture numbers of a Llama-family model (from ``config.ModelConfig``)."""

    arch: ClassVar[str] = "llama"  # the family (not a field: the class says it)

    vocab_size: int = 256
    seq_len: int = 64
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 4
    layers: int = 2
    intermediate_size: int = 172
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    init_std: float = 0.02
    rope_theta: float = 10000.0
    qkv_bias: bool = False  # Qwen2's q, k, v projections have biases
    causal: bool = True
    head_width: int | None = None  # model.head_dim (None: hidden / heads)
    qk_norm: bool = False  # Qwen3's RMSNorm of each head's q and k
    max_positions: int | None = None  # model.max_positions (None: seq_len), what rotary scaling reads
    rope_scaling: Scaling | None = None
    attention_dropout: float = 0.0  # on the attention probabilities (models/dropout.py); no other dropout
    moe: MoeShape | None = None  # mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral); None: dense MLPs

    @property
    def head_dim(self) -> int:
        return self.head_width or self.hidden // self.heads

    @property
    def rotary(self) -> Rotary:
        return Rotary(self.head_dim, self.rope_theta, self.rope_scaling, self.max_positions or self.seq_len)


class RMSNorm(nn.Module):
    """``x / rms(x) · weight`` over the last dimension, computed in float32 (or wider)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Embedding(nn.Module):
    """Token embedding (positions enter through the rotary attention): ``[b, s]`` → ``[b, s, h]``."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.tok = nn.Embedding(shape.vocab_size, shape.hidden)

    def forward(self, tokens):
        return self.tok(tokens)


class Attention(ReadsContext):
    """Grouped-query self-attention with rotary q, k: ``[b, s, h]`` → ``[b, s, h]``; the core is
    ``attention_fn(q, k, v, causal=...)``. ``positions`` ``[s]``: the tokens' global positions
    (None: ``0..s-1``) in a sequence of ``length`` tokens (None: ``s``; dynamic rotary reads it); a
    packed forward rotates by each token's position in its document instead."""

    def __init__(self, shape: LlamaShape, attention_fn=dense_attention, stage: int = 1):
        super().__init__()
        d = shape.head_dim
        self.heads, self.kv_heads, self.causal = shape.heads, shape.kv_heads, shape.causal
        self.rotary = shape.rotary  # the 2D block and decoding rotate with it too
        self.q_proj = nn.Linear(shape.hidden, shape.heads * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(shape.hidden, shape.kv_heads * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(shape.hidden, shape.kv_heads * d, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.heads * d, shape.hidden, bias=False)
        if shape.qk_norm:  # one gain per head dimension, shared by the heads
            self.q_norm, self.k_norm = RMSNorm(d, shape.norm_eps), RMSNorm(d, shape.norm_eps)
        self.qk_norm = shape.qk_norm
        self.attention_fn = attention_fn
        self.positions: torch.Tensor | None = None
        self.length: int | None = None
        self.attn_drop = Site(shape.attention_dropout, stage, "attention")

    def heads_of(self, x, t: int):
        """q ``[b, heads, t, d]``, k and v ``[b, kv_heads, t, d]`` of ``x`` ``[b, t, h]`` (q and k
        normalised per head under ``qk_norm``; not yet rotated)."""
        b = x.shape[0]
        q = self.q_proj(x).view(b, t, self.heads, -1)
        k = self.k_proj(x).view(b, t, self.kv_heads, -1)
        v = self.v_proj(x).view(b, t, self.kv_heads, -1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.heads_of(x, s)
        cos, sin = self.rotary.table(rotary_positions(self, s, x.device), self.length or s, q.dtype)
        mask = self.attn_drop.attention(b, self.heads, x.device)
        y = attend(self.attention_fn, rotate(q, cos, sin), rotate(k, cos, sin), v, self.causal, mask,
                   self.documents())  # [b, heads, s, d]
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


def rotary_positions(attn, s: int, device) -> torch.Tensor:
    """What an attention (dense or 2D: a :class:`~parallel4d.models.context.ReadsContext` with
    ``positions``) rotates its ``s`` local tokens by: a packed forward's positions in each document
    ``[b, s]``, else the tokens' global positions ``[s]`` (default ``0..s-1``)."""
    packed = attn.packed()
    if packed is not None:
        return packed.positions
    return attn.positions if attn.positions is not None else torch.arange(s, device=device)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))``, ``width`` wide (None: ``intermediate_size``; Qwen2-MoE's
    shared expert has its own)."""

    def __init__(self, shape: LlamaShape, width: int | None = None):
        super().__init__()
        width = width or shape.intermediate_size
        self.gate_proj = nn.Linear(shape.hidden, width, bias=False)
        self.up_proj = nn.Linear(shape.hidden, width, bias=False)
        self.down_proj = nn.Linear(width, shape.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def block_mlp(shape: LlamaShape, layer: int) -> nn.Module:
    """Layer ``layer``'s (from 0) MLP: a mixture of experts where ``shape.moe`` selects it (with Qwen2-MoE's
    shared expert when it has a width), else the dense SwiGLU."""
    moe = shape.moe
    if moe is None or not moe.is_sparse(layer):
        return MLP(shape)
    shared = MLP(shape, moe.shared_width) if moe.shared_width else None
    return SparseMoE(moe, shape.hidden, layer, shared)


class Block(nn.Module):
    """Pre-norm block: ``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``
    (``mlp``: :func:`block_mlp`, dense or a mixture of experts)."""

    def __init__(self, shape: LlamaShape, attention_fn=dense_attention, stage: int = 1):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.norm_eps)
        self.self_attn = Attention(shape, attention_fn, stage)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.norm_eps)
        self.mlp = block_mlp(shape, stage - 1)

    @property
    def attn(self) -> Attention:  # the name the engine sets attention_fn through, as on the GPT block
        return self.self_attn

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Head(nn.Module):
    """Final RMSNorm + LM head: ``[b, s, h]`` → logits ``[b, s, V]`` (``tied_weight``: the token table)."""

    def __init__(self, shape: LlamaShape, tied_weight: nn.Parameter | None = None):
        super().__init__()
        self.norm = RMSNorm(shape.hidden, shape.norm_eps)
        self.weight = tied_weight if tied_weight is not None else nn.Parameter(torch.empty(shape.vocab_size,
                                                                                           shape.hidden))

    def forward(self, x):
        return F.linear(self.norm(x), self.weight)


def make_stage(shape: LlamaShape, index: int, tied_weight: nn.Parameter | None = None) -> nn.Module:
    """Stage ``index`` (0 = embedding, 1..L = blocks, L+1 = head), uninitialised."""
    if index == 0:
        return Embedding(shape)
    if index <= shape.layers:
        return Block(shape, stage=index)
    return Head(shape, tied_weight)


def init_weights(module: nn.Module, shape: LlamaShape, skip=()) -> None:
    """N(0, init_std) matrices (output projections scaled by 1/sqrt(2L), the stacked experts' too), zero
    biases, unit norms."""
    skip_ids = {id(p) for p in skip}
    for name, p in module.named_parameters():
        if id(p) in skip_ids:
            continue
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() == 1:
            nn.init.ones_(p)
        else:
            scaled = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
            nn.init.normal_(p, 0.0, shape.init_std / (math.sqrt(2 * shape.layers) if scaled else 1.0))


def build_stage(shape: LlamaShape, index: int, seed: int = 0, tied_weight: nn.Parameter | None = None,
                meta: bool = False) -> nn.Module:
    """Stage ``index`` (0 = embedding, 1..L = blocks, L+1 = head) initialised from ``(seed, index)``
    alone (:func:`~parallel4d.models.stages.seeded_stage`); ``meta``: shapes only."""
    return seeded_stage(shape, index, seed, tied_weight, meta, make_stage, init_weights)


def moe_auxiliary_loss(shape: LlamaShape, state, sum_over_ranks=None) -> torch.Tensor | None:
    """The load-balancing loss term of one forward (:func:`~parallel4d.models.moe.balance.auxiliary_loss`
    over what its MoE layers recorded in ``state``; ``sum_over_ranks``: its statistics summed over the ranks
    sharing the batch); None for a dense model."""
    return auxiliary_loss(shape.moe, state.routing, sum_over_ranks)


class Llama(DenseModel):
    """Stages ``embed → blocks → head`` (:class:`~parallel4d.models.stages.DenseModel`) of the Llama family."""

    build_stage = staticmethod(build_stage)
    auxiliary_loss = staticmethod(moe_auxiliary_loss)


def shape_from_config(m: ModelConfig, causal: bool = True) -> LlamaShape:
    """The shape of a job's ``model:`` section (``causal``: ``sequence.causal``)."""
    return LlamaShape(vocab_size=m.vocab_size, seq_len=m.seq_len, hidden=m.hidden, heads=m.heads,
                      kv_heads=m.kv_heads_or_heads, layers=m.layers, intermediate_size=m.mlp_width,
                      tie_embeddings=m.tie_embeddings, norm_eps=m.norm_eps, init_std=m.init_std,
                      rope_theta=m.rope_theta, qkv_bias=m.qkv_bias, causal=causal, head_width=m.head_dim,
                      qk_norm=m.qk_norm, max_positions=m.positions, rope_scaling=Scaling.of(m.rope_scaling),
                      attention_dropout=m.attention_p, moe=MoeShape.of(m))


# --- decoding with a KV cache (parallel4d generate): the dense modules' own projections, one new token at a time

def decode_embed(embed: Embedding, tokens, start: int):
    """``tokens`` ``[b, t]`` → ``[b, t, h]`` (positions enter in the attention)."""
    return embed(tokens)


def decode_block(block: Block, x, kv, start: int):
    """``(block output [b, t, h], (k, v) extended by the t new tokens)``, q and k rotated by their
    positions ``start..start+t-1`` in a sequence of ``start + t`` tokens so far (dynamic rotary: the
    new tokens' frequencies are those of that length, the cached keys keep theirs, as in
    transformers' ``generate``); ``kv``: the cache (None: empty)."""
    b, t, _ = x.shape
    attn = block.self_attn
    q, k, v = attn.heads_of(block.input_layernorm(x), t)
    cos, sin = attn.rotary.table(torch.arange(start, start + t, device=x.device), start + t, q.dtype)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if kv is not None:
        k, v = torch.cat((kv[0], k), 2), torch.cat((kv[1], v), 2)
    y = cached_attention(q, k, v, start)
    x = x + attn.o_proj(y.transpose(1, 2).reshape(b, t, -1))
    return x + block.mlp(block.post_attention_layernorm(x)), (k, v)
