"""Reference GPT decoder (``model.arch: gpt2``; pre-LN, causal or bidirectional attention, GELU MLP,
tied or untied LM head).

This file is the single-process dense reference every layout is tested against; the
strategies do not change it: the engine builds its stages and converts them (2D layers
``from_dense``, :mod:`.tp2d`; ring attention as a block's ``attention_fn``).

Shapes (dense): tokens ``[b, s]`` → hidden ``[b, s, h]`` → logits ``[b, s, V]``.
The model is also a flat list of *stages* (``embed, block_0..block_{L-1}, head``, see
:mod:`parallel4d.models.stages`) that pipeline partitioning cuts into chunks; ``model(tokens)``
just runs them in order.
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
from parallel4d.models.stages import DenseModel, cached_attention, dense_attention, seeded_stage

if TYPE_CHECKING:
    from parallel4d.config.schema import ModelConfig


@dataclass(frozen=True)
class GPTShape:
    """The architecture numbers the layers need (a subset of ``config.ModelConfig``)."""

    arch: ClassVar[str] = "gpt2"  # the family (not a field: the class says it)
    vocab_size: int = 256
    seq_len: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    causal: bool = True  # False: bidirectional attention (``sequence.causal`` of a job, see engine.model_shape)
    activation: str = "gelu"  # or "gelu_tanh", the approximation GPT-2 checkpoints were trained with
    max_positions: int | None = None  # the position table's rows (≥ seq_len; a checkpoint's n_positions); None: seq_len
    dropout: float = 0.0  # resid_pdrop: each residual branch's output (models/dropout.py)
    attention_dropout: float = 0.0  # attn_pdrop: the attention probabilities
    embedding_dropout: float = 0.0  # embd_pdrop: token + position embedding

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def positions(self) -> int:
        """The rows of the position table: ``max_positions``, else ``seq_len``."""
        return self.max_positions or self.seq_len


class Embedding(ReadsContext):
    """Token + learned position embedding, then its dropout: tokens ``[b, s]`` → ``[b, s, h]``. The
    position table has ``shape.positions ≥ s`` rows; training at ``seq_len`` reads the first ``seq_len``
    (the others get no gradient and stay as they were loaded). ``positions``: ``[s]`` (default
    ``0..s-1``); a packed forward's per-sample positions in each document replace them."""

    def __init__(self, shape: GPTShape):
        super().__init__()
        self.tok = nn.Embedding(shape.vocab_size, shape.hidden)
        self.pos = nn.Embedding(shape.positions, shape.hidden)
        self.drop = Site(shape.embedding_dropout, 0, "embedding")

    def forward(self, tokens, positions=None):
        return self.drop(self.tok(tokens) + self.pos(token_positions(self, tokens, positions)))


def token_positions(module: ReadsContext, tokens, positions=None) -> torch.Tensor:
    """What a learned position table reads for ``tokens`` ``[b, s]``: a packed forward's per-document
    positions ``[b, s]``, else ``positions`` ``[s]`` (default ``0..s-1``)."""
    packed = module.packed()
    if packed is not None:
        return packed.positions
    return torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions


class Attention(ReadsContext):
    """Multi-head self-attention ``[b, s, h]`` → ``[b, s, h]`` with a pluggable core,
    called as ``attention_fn(q, k, v, causal=self.causal)`` on ``[b, heads, s, d]`` (with
    ``dropout=`` the probabilities' mask when one is drawn); the output's dropout after ``proj``."""

    def __init__(self, shape: GPTShape, attention_fn=dense_attention, stage: int = 1):
        super().__init__()
        self.heads = shape.heads
        self.causal = shape.causal
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.proj = nn.Linear(shape.hidden, shape.hidden)
        self.attention_fn = attention_fn
        self.attn_drop = Site(shape.attention_dropout, stage, "attention")
        self.resid_drop = Site(shape.dropout, stage, "attention_output")

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        mask = self.attn_drop.attention(b, self.heads, x.device)
        y = attend(self.attention_fn, q, k, v, self.causal, mask, self.documents())  # [b, heads, s, d]
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, s, h)))


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))``, then its dropout."""

    def __init__(self, shape: GPTShape, stage: int = 1):
        super().__init__()
        self.fc1 = nn.Linear(shape.hidden, shape.mlp_ratio * shape.hidden)
        self.fc2 = nn.Linear(shape.mlp_ratio * shape.hidden, shape.hidden)
        self.approximate = "tanh" if shape.activation == "gelu_tanh" else "none"
        self.drop = Site(shape.dropout, stage, "mlp_output")

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(x), approximate=self.approximate)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; ``stage``: its
    index in the model (1…L), its dropout sites' key."""

    def __init__(self, shape: GPTShape, attention_fn=dense_attention, stage: int = 1):
        super().__init__()
        self.ln1 = nn.LayerNorm(shape.hidden, eps=shape.norm_eps)
        self.attn = Attention(shape, attention_fn, stage)
        self.ln2 = nn.LayerNorm(shape.hidden, eps=shape.norm_eps)
        self.mlp = MLP(shape, stage)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm + LM head: ``[b, s, h]`` → logits ``[b, s, V]``.

    With tied embeddings the head has no weight of its own: it uses the token
    embedding's (``tied_weight``), which may be set after construction.
    """

    def __init__(self, shape: GPTShape, tied_weight: nn.Parameter | None = None):
        super().__init__()
        self.ln_f = nn.LayerNorm(shape.hidden, eps=shape.norm_eps)
        if tied_weight is None:
            self.weight = nn.Parameter(torch.empty(shape.vocab_size, shape.hidden))
        else:
            self.weight = tied_weight  # same Parameter object as the embedding's

    def forward(self, x):
        return F.linear(self.ln_f(x), self.weight)


def build_stage(shape: GPTShape, index: int, seed: int = 0, tied_weight: nn.Parameter | None = None,
                meta: bool = False) -> nn.Module:
    """Stage ``index`` (0 = embedding, 1..L = blocks, L+1 = head), initialised from
    ``(seed, index)`` alone, so a rank can build just its own stages and get exactly
    the values of the whole reference model. ``tied_weight``: the token table a tied
    head shares (left as it is). ``meta``: shapes only, no memory, no init (for costs).
    Built on the CPU (its RNG is the same everywhere); move it afterwards.
    """
    return seeded_stage(shape, index, seed, tied_weight, meta, make_stage, init_weights)


def make_stage(shape: GPTShape, index: int, tied_weight: nn.Parameter | None = None) -> nn.Module:
    """Stage ``index`` (0 = embedding, 1..L = blocks, L+1 = head), uninitialised."""
    if index == 0:
        return Embedding(shape)
    if index <= shape.layers:
        return Block(shape, stage=index)
    return Head(shape, tied_weight)


class GPT(DenseModel):
    """Stages ``embed → blocks → head`` (:class:`~parallel4d.models.stages.DenseModel`) of the GPT."""

    build_stage = staticmethod(build_stage)


def init_weights(model: nn.Module, shape: GPTShape, skip=()) -> None:
    """GPT-2 style init: N(0, 0.02) matrices, output projections scaled by 1/sqrt(2L),
    zero biases, unit LayerNorm gains. Parameters in ``skip`` are left as they are."""
    skip_ids = {id(p) for p in skip}
    for name, p in model.named_parameters():
        if id(p) in skip_ids:
            continue
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() == 1:  # LayerNorm gain
            nn.init.ones_(p)
        else:
            scaled = name.endswith("proj.weight") or name.endswith("fc2.weight")
            nn.init.normal_(p, 0.0, shape.init_std / (math.sqrt(2 * shape.layers) if scaled else 1.0))


def build_gpt(shape: GPTShape, seed: int = 0) -> GPT:
    """Build the dense reference deterministically from ``seed`` (stage by stage)."""
    return GPT(shape, seed)


def shape_from_config(m: ModelConfig, causal: bool = True) -> GPTShape:
    """The shape of a job's ``model:`` section (``causal``: ``sequence.causal``)."""
    return GPTShape(vocab_size=m.vocab_size, seq_len=m.seq_len, hidden=m.hidden, heads=m.heads, layers=m.layers,
                    mlp_ratio=m.mlp_ratio, tie_embeddings=m.tie_embeddings, norm_eps=m.norm_eps, init_std=m.init_std,
                    causal=causal, activation=m.activation, max_positions=m.positions, dropout=m.dropout,
                    attention_dropout=m.attention_p, embedding_dropout=m.embedding_p)


# --- decoding with a KV cache (parallel4d generate): the dense modules' own projections, one new token at a time

def decode_embed(embed: Embedding, tokens, start: int):
    """``tokens`` ``[b, t]`` at positions ``start..start+t-1`` → ``[b, t, h]``."""
    return embed(tokens, torch.arange(start, start + tokens.shape[1], device=tokens.device))


def decode_block(block: Block, x, kv, start: int):
    """``(block output [b, t, h], (k, v) extended by the t new tokens)``; ``kv``: the cache (None: empty)."""
    b, t, h = x.shape
    attn = block.attn
    q, k, v = attn.qkv(block.ln1(x)).view(b, t, 3, attn.heads, h // attn.heads).permute(2, 0, 3, 1, 4)
    if kv is not None:
        k, v = torch.cat((kv[0], k), 2), torch.cat((kv[1], v), 2)
    y = cached_attention(q, k, v, start)
    x = x + attn.proj(y.transpose(1, 2).reshape(b, t, h))
    return x + block.mlp(block.ln2(x)), (k, v)
