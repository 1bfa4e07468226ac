"""Reference GPT decoder (pre-LN, causal or bidirectional attention, GELU MLP, tied or untied LM head).

This file is the single-process dense reference every layout is tested against; the
strategies do not change it: the engine builds its stages and converts them (2D layers
``from_dense``, ring attention as a block's ``attention_fn``).

Shapes (dense): tokens ``[b, s]`` → hidden ``[b, s, h]`` → logits ``[b, s, V]``.
The model is also a flat list of *stages* (``embed, block_0..block_{L-1}, head``)
that pipeline partitioning cuts into chunks; ``model(tokens)`` just runs them in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTShape:
    """The architecture numbers the layers need (a subset of ``config.ModelConfig``)."""

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

    @classmethod
    def from_config(cls, model_cfg) -> "GPTShape":
        fields = cls.__dataclass_fields__
        return cls(**{k: getattr(model_cfg, k) for k in fields if hasattr(model_cfg, k)})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def dense_attention(q, k, v, causal: bool = True):
    """Softmax attention on ``[b, heads, s, d]``; the single-process reference."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class Embedding(nn.Module):
    """Token + learned position embedding: tokens ``[b, s]`` → ``[b, s, h]``."""

    def __init__(self, shape: GPTShape):
        super().__init__()
        self.tok = nn.Embedding(shape.vocab_size, shape.hidden)
        self.pos = nn.Embedding(shape.seq_len, shape.hidden)

    def forward(self, tokens, positions=None):
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class Attention(nn.Module):
    """Multi-head self-attention ``[b, s, h]`` → ``[b, s, h]`` with a pluggable core,
    called as ``attention_fn(q, k, v, causal=self.causal)`` on ``[b, heads, s, d]``."""

    def __init__(self, shape: GPTShape, attention_fn=dense_attention):
        super().__init__()
        self.heads = shape.heads
        self.causal = shape.causal
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.proj = nn.Linear(shape.hidden, shape.hidden)
        self.attention_fn = attention_fn

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention_fn(q, k, v, causal=self.causal)  # [b, heads, s, d]
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.fc1 = nn.Linear(shape.hidden, shape.mlp_ratio * shape.hidden)
        self.fc2 = nn.Linear(shape.mlp_ratio * shape.hidden, shape.hidden)
        self.approximate = "tanh" if shape.activation == "gelu_tanh" else "none"

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, shape: GPTShape, attention_fn=dense_attention):
        super().__init__()
        self.ln1 = nn.LayerNorm(shape.hidden, eps=shape.norm_eps)
        self.attn = Attention(shape, attention_fn)
        self.ln2 = nn.LayerNorm(shape.hidden, eps=shape.norm_eps)
        self.mlp = MLP(shape)

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


def cross_entropy(logits, targets, ignore_index: int = -100):
    """Mean token cross entropy of ``[b, s, V]`` logits against ``[b, s]`` targets."""
    if logits.dtype in (torch.float16, torch.bfloat16):  # the softmax wants ≥ fp32 accuracy
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)


class _SkipRandomInit(torch.overrides.TorchFunctionMode):
    """Meta stages carry shapes only, so their random init is skipped: the meta kernel of
    ``normal_`` is a Python reference that imports ``torch._dynamo`` (~2 s of CPU), which
    every rank of a job would pay just to measure its stages' sizes."""

    _INIT = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_,
                       nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
                       nn.init.xavier_uniform_, nn.init.xavier_normal_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._INIT:  # nn.init passes its tensor by keyword
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def stage_names(shape: GPTShape) -> list[str]:
    """``["embed", "blocks.0", ..., "head"]``: stage ``i`` of :meth:`GPT.stages`."""
    return ["embed", *(f"blocks.{i}" for i in range(shape.layers)), "head"]


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
        return Block(shape)
    return Head(shape, tied_weight)


def seeded_stage(shape, index: int, seed: int, tied_weight, meta: bool, make, init) -> nn.Module:
    """``make(shape, index, tied_weight)`` then ``init(module, shape, skip)`` under the RNG seeded
    from ``(seed, index)`` (any model family); ``meta``: shapes only."""
    last = shape.layers + 1
    if not 0 <= index <= last:
        raise ValueError(f"stage index {index} out of range 0..{last}")
    if meta:
        with torch.device("meta"), _SkipRandomInit():
            return make(shape, index, tied_weight)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + index)
        module = make(shape, index, tied_weight)
        init(module, shape, skip=() if tied_weight is None else (tied_weight,))
    return module


class GPT(nn.Module):
    """Stages ``embed → blocks → head``; ``forward(tokens, targets=None)`` → logits or loss."""

    def __init__(self, shape: GPTShape, seed: int = 0):
        super().__init__()
        build = type(self).build_stage  # the family's stages (models/llama.py's Llama sets its own)
        self.shape = shape
        self.embed = build(shape, 0, seed)
        self.blocks = nn.ModuleList(build(shape, i + 1, seed) for i in range(shape.layers))
        tied = self.embed.tok.weight if shape.tie_embeddings else None
        self.head = build(shape, shape.layers + 1, seed, tied_weight=tied)

    def stages(self) -> list[nn.Module]:
        """The model as a flat list a pipeline cuts into contiguous chunks."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, tokens, targets=None):
        x = tokens
        for stage in self.stages():
            x = stage(x)
        return x if targets is None else cross_entropy(x, targets)


GPT.build_stage = staticmethod(build_stage)


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
