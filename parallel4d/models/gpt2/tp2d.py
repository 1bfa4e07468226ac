"""The 2D twin of the GPT's stages (``model.arch: gpt2``): embedding, pre-LN transformer block, head.

Each mirrors the dense module of :mod:`.model` attribute by attribute and takes/returns the 2D
activation layout ``[b/q, s, h/q]`` (tokens ``[b/q, s]`` for the embedding, logits ``[b/q, s, V/q]``
from the head); the layers are :mod:`parallel4d.tensor2d`'s.

Heads are split over grid columns: column j owns heads ``j·a/q … (j+1)·a/q − 1``.
The dense ``qkv`` output features are ordered ``[q | k | v]``, each ``h = a·d`` wide
with heads contiguous, so a plain column split would give column 0 all of q and
part of k. :func:`qkv_permutation` reorders the output features to
``[q_0 k_0 v_0 | q_1 k_1 v_1 | …]`` where ``q_j`` is the ``h/q`` features of the heads
of column j; the local ``[b/q, s, 3h/q]`` output is then ``[.., 3, a/q, d]``, exactly the
dense view restricted to my heads. ``to_dense`` undoes the permutation. The output
projection needs no permutation: the attention output of my heads is hidden block j.
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from parallel4d.models.context import ReadsContext
from parallel4d.models.dropout import Site, attend
from parallel4d.models.gpt2.model import Block, Embedding, Head, token_positions
from parallel4d.models.stages import dense_attention
from parallel4d.tensor2d.checks import check_heads
from parallel4d.tensor2d.composite import Composite2D, Head2D
from parallel4d.tensor2d.layers import Embedding2D, LayerNorm2D, Linear2D, VocabParallelEmbedding2D


def qkv_permutation(hidden: int, q: int) -> list[int]:
    """Index ``perm`` with ``W_2d = W_dense[perm]`` for the ``[3h, h]`` qkv weight (see module doc)."""
    w = hidden // q
    return [part * hidden + j * w + r for j in range(q) for part in range(3) for r in range(w)]


class Block2D(Composite2D, ReadsContext):
    """Pre-LN block ``x + proj(attn(qkv(ln1 x)))``, then ``x + fc2(gelu(fc1(ln2 x)))`` on
    ``[b/q, s, h/q]``. 4 SUMMA AB forward, 4 ABᵀ + 4 AᵀB backward; the attention core
    ``attention_fn(q, k, v, causal=self.causal)`` sees local ``[b/q, heads/q, s_local, d]``.
    ``approximate``: ``F.gelu``'s (``"tanh"`` for GPT-2 checkpoints), the dense MLP's. ``drops``: the
    dense block's dropout sites (attention probabilities, attention output, MLP output) for this grid
    column's heads and hidden block (None: no dropout)."""

    def __init__(self, ln1, qkv, proj, ln2, fc1, fc2, heads: int, attention_fn=None, causal: bool = True,
                 approximate: str = "none", drops: tuple[Site, Site, Site] | None = None):
        super().__init__()
        drops = drops or tuple(Site(0.0, 1, kind) for kind in ("attention", "attention_output", "mlp_output"))
        self.attn_drop, self.attn_out_drop, self.mlp_drop = drops
        self.causal, self.approximate = causal, approximate
        self.ln1, self.qkv, self.proj, self.ln2, self.fc1, self.fc2 = ln1, qkv, proj, ln2, fc1, fc2
        self.heads = heads
        self.local_heads = heads // qkv.grid.q
        self.attention_fn = attention_fn or dense_attention

    @classmethod
    def from_dense(cls, block: Block, mesh, attention_fn=None, *, name: str = "block",
                   overlap: bool = True) -> "Block2D":
        """From a dense block with ``ln1, attn.qkv, attn.proj, attn.heads, ln2, mlp.fc1, mlp.fc2``.
        Checks divisibility (``ValueError``) before any collective."""
        hidden = block.attn.qkv.weight.shape[1]
        heads = block.attn.heads
        q = mesh.q
        check_heads(heads, hidden, q, heads_field=f"{name}.attn.heads", hidden_field=f"{name}.hidden")
        perm = qkv_permutation(hidden, q)
        j = mesh.rank("tp_col")  # this column's heads and hidden block
        drops = (block.attn.attn_drop.shifted(j * heads // q), block.attn.resid_drop.shifted(j * hidden // q),
                 block.mlp.drop.shifted(j * hidden // q))
        return cls(
            LayerNorm2D.from_dense(block.ln1, mesh, name=f"{name}.ln1"),
            Linear2D.from_dense(block.attn.qkv, mesh, name=f"{name}.attn.qkv", out_perm=perm, overlap=overlap),
            Linear2D.from_dense(block.attn.proj, mesh, name=f"{name}.attn.proj", overlap=overlap),
            LayerNorm2D.from_dense(block.ln2, mesh, name=f"{name}.ln2"),
            Linear2D.from_dense(block.mlp.fc1, mesh, name=f"{name}.mlp.fc1", overlap=overlap),
            Linear2D.from_dense(block.mlp.fc2, mesh, name=f"{name}.mlp.fc2", overlap=overlap),
            heads, attention_fn, causal=block.attn.causal, approximate=block.mlp.approximate, drops=drops,
        )

    def _parts(self):
        return [("ln1.", self.ln1), ("attn.qkv.", self.qkv), ("attn.proj.", self.proj), ("ln2.", self.ln2),
                ("mlp.fc1.", self.fc1), ("mlp.fc2.", self.fc2)]

    def attention(self, x):
        """``[b/q, s, h/q]`` → ``[b/q, s, h/q]`` (my heads only; no communication in the core)."""
        bq, s, hq = x.shape
        qkv = self.qkv(x).view(bq, s, 3, self.local_heads, hq // self.local_heads).permute(2, 0, 3, 1, 4)
        mask = self.attn_drop.attention(bq, self.local_heads, x.device)
        y = attend(self.attention_fn, qkv[0], qkv[1], qkv[2], self.causal, mask, self.documents())  # [b/q, a/q, s, d]
        return self.attn_out_drop(self.proj(y.transpose(1, 2).reshape(bq, s, hq)))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.mlp_drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approximate)))


class TokenPositionEmbedding2D(Composite2D, ReadsContext):
    """Mirrors the dense ``Embedding``: ``tok`` (vocab-parallel) + learned ``pos``.

    tokens ``[b/q, s]`` (batch block i) and optional positions (``[s]`` or ``[b/q, s]``,
    default ``arange(s)``; pass the original positions when the sequence is sharded
    or permuted) → ``[b/q, s, h/q]``, then the dense embedding's dropout ``drop`` on hidden block j."""

    def __init__(self, tok: VocabParallelEmbedding2D, pos: Embedding2D, drop: Site | None = None):
        super().__init__()
        self.tok, self.pos = tok, pos
        self.drop = drop or Site(0.0, 0, "embedding")

    @classmethod
    def from_dense(cls, embed: Embedding, mesh, *, name: str = "embed") -> "TokenPositionEmbedding2D":
        hidden = embed.tok.weight.shape[1]
        return cls(VocabParallelEmbedding2D.from_dense(embed.tok, mesh, name=f"{name}.tok"),
                   Embedding2D.from_dense(embed.pos, mesh, name=f"{name}.pos"),
                   embed.drop.shifted(mesh.rank("tp_col") * hidden // mesh.q))

    def _parts(self):
        return [("tok.", self.tok), ("pos.", self.pos)]

    def forward(self, tokens, positions=None):
        return self.drop(self.tok(tokens) + self.pos(token_positions(self, tokens, positions)))


def from_dense_stage(stage: nn.Module, mesh, *, embedding=None, attention_fn=None, name: str = "",
                     overlap: bool = True) -> nn.Module:
    """Convert one dense GPT stage by its type: embedding, block or head (pass the converted
    ``embedding`` so a tied head shares its Parameter)."""
    if isinstance(stage, Embedding):
        return TokenPositionEmbedding2D.from_dense(stage, mesh, name=name or "embed")
    if isinstance(stage, Block):
        return Block2D.from_dense(stage, mesh, attention_fn, name=name or "block", overlap=overlap)
    if isinstance(stage, Head):
        return Head2D.from_dense(stage, mesh, embedding, name=name or "head", overlap=overlap)
    raise ValueError(f"from_dense_stage: don't know how to convert {type(stage).__name__} "
                     "(expected a GPT Embedding, Block or Head)")
