"""2D versions of the GPT stages: embedding, pre-LN transformer block, head.

Each mirrors the dense reference module attribute by attribute (duck-typed; this
package never imports the model) and takes/returns the 2D activation layout
``[b/q, s, h/q]`` (tokens ``[b/q, s]`` for the embedding, logits ``[b/q, s, V/q]``
from the head).

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

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.tensor2d.checks import check_heads
from parallel4d.tensor2d.layers import (DenseLayout, Embedding2D, LayerNorm2D, Linear2D, LMHead2D, VocabParallelCrossEntropy2D,
                     VocabParallelEmbedding2D)


def sdpa_attention(q, k, v, causal: bool = True):
    """Default local attention core on ``[b/q, heads/q, s, d]``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def qkv_permutation(hidden: int, q: int) -> list[int]:
    """Index ``perm`` with ``W_2d = W_dense[perm]`` for the ``[3h, h]`` qkv weight (see module doc)."""
    w = hidden // q
    return [part * hidden + j * w + r for j in range(q) for part in range(3) for r in range(w)]


def _prefixed(prefix: str, d: dict) -> dict:
    return {f"{prefix}{k}": v for k, v in d.items()}


class _Composite(nn.Module):
    """Gathers ``dense_state_dict`` / ``dense_grads`` of its named 2D parts."""

    def _parts(self):
        raise TypeError(f"{type(self).__name__} must list its parts")

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for prefix, layer in self._parts():
            out.update(_prefixed(prefix, layer.dense_state_dict()))
        return out

    def dense_grads(self) -> dict[str, torch.Tensor]:
        out = {}
        for prefix, layer in self._parts():
            out.update(_prefixed(prefix, layer.dense_grads()))
        return out

    def dense_layout(self) -> dict[str, tuple[str, DenseLayout]]:
        """``{local parameter name: (dense name, (dense shape, pieces))}`` (no communication)."""
        local = {id(m): n for n, m in self.named_modules()}
        out = {}
        for prefix, layer in self._layout_parts():
            for key, layout in layer.dense_layout().items():
                out[f"{local[id(layer)]}.{key}"] = (f"{prefix}{key}", layout)
        return out

    def _layout_parts(self):
        return self._parts()

    def to_dense(self, dense_module: nn.Module) -> nn.Module:
        """Load the gathered parameters into ``dense_module`` (same structure as the source)."""
        missing, unexpected = dense_module.load_state_dict(self.dense_state_dict(), strict=False)
        if unexpected or [k for k in missing if not self._tied_key(k)]:
            raise ValueError(f"to_dense: state dict mismatch (missing {missing}, unexpected {unexpected})")
        return dense_module

    def _tied_key(self, key: str) -> bool:
        return False


class Block2D(_Composite):
    """Pre-LN block ``x + proj(attn(qkv(ln1 x)))``, then ``x + fc2(gelu(fc1(ln2 x)))`` on
    ``[b/q, s, h/q]``. 4 SUMMA AB forward, 4 ABᵀ + 4 AᵀB backward; the attention core
    ``attention_fn(q, k, v, causal=self.causal)`` sees local ``[b/q, heads/q, s_local, d]``.
    ``approximate``: ``F.gelu``'s (``"tanh"`` for GPT-2 checkpoints), the dense MLP's."""

    def __init__(self, ln1, qkv, proj, ln2, fc1, fc2, heads: int, attention_fn=None, causal: bool = True,
                 approximate: str = "none"):
        super().__init__()
        self.causal, self.approximate = causal, approximate
        self.ln1, self.qkv, self.proj, self.ln2, self.fc1, self.fc2 = ln1, qkv, proj, ln2, fc1, fc2
        self.heads = heads
        self.local_heads = heads // qkv.grid.q
        self.attention_fn = attention_fn or sdpa_attention

    @classmethod
    def from_dense(cls, block: nn.Module, mesh, attention_fn=None, *, name: str = "block",
                   overlap: bool = True) -> "Block2D":
        """From a dense block with ``ln1, attn.qkv, attn.proj, attn.heads, ln2, mlp.fc1, mlp.fc2``.
        Checks divisibility (``ValueError``) before any collective."""
        hidden = block.attn.qkv.weight.shape[1]
        heads = block.attn.heads
        q = mesh.q
        check_heads(heads, hidden, q, heads_field=f"{name}.attn.heads", hidden_field=f"{name}.hidden")
        perm = qkv_permutation(hidden, q)
        return cls(
            LayerNorm2D.from_dense(block.ln1, mesh, name=f"{name}.ln1"),
            Linear2D.from_dense(block.attn.qkv, mesh, name=f"{name}.attn.qkv", out_perm=perm, overlap=overlap),
            Linear2D.from_dense(block.attn.proj, mesh, name=f"{name}.attn.proj", overlap=overlap),
            LayerNorm2D.from_dense(block.ln2, mesh, name=f"{name}.ln2"),
            Linear2D.from_dense(block.mlp.fc1, mesh, name=f"{name}.mlp.fc1", overlap=overlap),
            Linear2D.from_dense(block.mlp.fc2, mesh, name=f"{name}.mlp.fc2", overlap=overlap),
            heads, attention_fn, causal=getattr(block.attn, "causal", True),
            approximate=getattr(block.mlp, "approximate", "none"),
        )

    def _parts(self):
        return [("ln1.", self.ln1), ("attn.qkv.", self.qkv), ("attn.proj.", self.proj), ("ln2.", self.ln2),
                ("mlp.fc1.", self.fc1), ("mlp.fc2.", self.fc2)]

    def attention(self, x):
        """``[b/q, s, h/q]`` → ``[b/q, s, h/q]`` (my heads only; no communication in the core)."""
        bq, s, hq = x.shape
        qkv = self.qkv(x).view(bq, s, 3, self.local_heads, hq // self.local_heads).permute(2, 0, 3, 1, 4)
        y = self.attention_fn(qkv[0], qkv[1], qkv[2], causal=self.causal)  # [b/q, a/q, s, d]
        return self.proj(y.transpose(1, 2).reshape(bq, s, hq))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approximate))


class TokenPositionEmbedding2D(_Composite):
    """Mirrors the dense ``Embedding``: ``tok`` (vocab-parallel) + learned ``pos``.

    tokens ``[b/q, s]`` (batch block i) and optional positions (``[s]`` or ``[b/q, s]``,
    default ``arange(s)``; pass the original positions when the sequence is sharded
    or permuted) → ``[b/q, s, h/q]``."""

    def __init__(self, tok: VocabParallelEmbedding2D, pos: Embedding2D):
        super().__init__()
        self.tok, self.pos = tok, pos

    @classmethod
    def from_dense(cls, embed: nn.Module, mesh, *, name: str = "embed") -> "TokenPositionEmbedding2D":
        return cls(VocabParallelEmbedding2D.from_dense(embed.tok, mesh, name=f"{name}.tok"),
                   Embedding2D.from_dense(embed.pos, mesh, name=f"{name}.pos"))

    def _parts(self):
        return [("tok.", self.tok), ("pos.", self.pos)]

    def forward(self, tokens, positions=None):
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class Head2D(_Composite):
    """Mirrors the dense ``Head``: ``ln_f`` then the LM head, ``[b/q, s, h/q]`` → logits
    ``[b/q, s, V/q]`` (vocab block j). Tied: ``lm_head.weight`` is the embedding's Parameter."""

    norm_prefix = "ln_f."  # the final norm's dense name

    def __init__(self, ln_f: nn.Module, lm_head: LMHead2D, tied: bool):
        super().__init__()
        self.ln_f, self.lm_head, self.tied = ln_f, lm_head, tied

    @classmethod
    def from_dense(cls, head: nn.Module, mesh, embedding=None, *, name: str = "head",
                   overlap: bool = True, norm: nn.Module | None = None) -> "Head2D":
        """``embedding``: the converted :class:`TokenPositionEmbedding2D` (or its ``tok``).
        If the dense head's weight is the dense token table that embedding came from, the
        2D head shares the embedding's Parameter. Without ``embedding`` (e.g. head and
        embedding on different pipeline stages) the head gets its own copy of the table,
        and keeping the two copies equal (summing their gradients) is the caller's job."""
        tok = getattr(embedding, "tok", embedding)
        tied = tok is not None and tok.converted_from(head.weight)
        return cls(norm or LayerNorm2D.from_dense(head.ln_f, mesh, name=f"{name}.ln_f"),
                   LMHead2D.from_dense(head, mesh, name=f"{name}.lm_head", tied=tok if tied else None,
                                       overlap=overlap),
                   tied)

    def _parts(self):
        parts = [(self.norm_prefix, self.ln_f)]
        if not self.tied:  # a tied weight belongs to the embedding's state dict
            parts.append(("", self.lm_head))
        return parts

    def _layout_parts(self):  # a tied weight is listed too: its dense name says where it lives
        return [(self.norm_prefix, self.ln_f), ("", self.lm_head)]

    def _tied_key(self, key: str) -> bool:
        return self.tied and key == "weight"

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def from_dense_stage(stage: nn.Module, mesh, *, embedding=None, attention_fn=None, name: str = "",
                     overlap: bool = True) -> nn.Module:
    """Convert one dense GPT stage by duck typing: ``tok``+``pos`` → embedding,
    ``ln1``+``attn`` → block, ``ln_f`` → head (pass the converted ``embedding`` so a
    tied head shares its Parameter)."""
    if hasattr(stage, "tok") and hasattr(stage, "pos"):
        return TokenPositionEmbedding2D.from_dense(stage, mesh, name=name or "embed")
    if hasattr(stage, "ln1") and hasattr(stage, "attn"):
        return Block2D.from_dense(stage, mesh, attention_fn, name=name or "block", overlap=overlap)
    if hasattr(stage, "ln_f"):
        return Head2D.from_dense(stage, mesh, embedding, name=name or "head", overlap=overlap)
    raise ValueError(f"from_dense_stage: don't know how to convert {type(stage).__name__} "
                     "(expected tok+pos, ln1+attn, or ln_f attributes)")


def loss_2d(mesh, ignore_index: int = -100) -> VocabParallelCrossEntropy2D:
    """The 2D twin of the dense ``cross_entropy(logits, targets)`` (token mean)."""
    return VocabParallelCrossEntropy2D(mesh, ignore_index=ignore_index)
