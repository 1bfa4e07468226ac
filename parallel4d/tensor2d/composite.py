"""What every family's 2D twin is made of, besides the layers: a composite of 2D parts, the
default attention core, the final norm + LM head, the loss.

A 2D stage mirrors its dense module attribute by attribute (the model packages build them,
``models/<family>/tp2d.py``) on the 2D activation layout ``[b/q, s, h/q]`` (logits
``[b/q, s, V/q]``). :class:`Composite2D` gathers the dense state dict, gradients and layout of its
named parts; :class:`Head2D` is the final norm and the (possibly tied) LM head.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.tensor2d.layers import DenseLayout, LayerNorm2D, LMHead2D, VocabParallelCrossEntropy2D


def sdpa_attention(q, k, v, causal: bool = True, dropout=None):
    """Default local attention core on ``[b/q, heads/q, s, d]``. ``dropout``: the block's mask of the
    attention probabilities (an object with ``attend(q, k, v, causal)``, the model's own plain-operations
    attention: a fused kernel cannot take the mask), given only when one is drawn."""
    if dropout is not None:
        return dropout.attend(q, k, v, causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _prefixed(prefix: str, d: dict) -> dict:
    return {f"{prefix}{k}": v for k, v in d.items()}


class Composite2D(nn.Module):
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

    def dense_parts(self) -> dict[str, nn.Module]:
        """``{dense module name: 2D part}`` relative to this stage (``self_attn.q_proj`` → its
        :class:`~.layers.Linear2D`): where a dense module's twin is, for whoever adds to a converted stage."""
        return {prefix.rstrip("."): layer for prefix, layer in self._layout_parts() if prefix}

    def to_dense(self, dense_module: nn.Module) -> nn.Module:
        """Load the gathered parameters into ``dense_module`` (same structure as the source)."""
        missing, unexpected = dense_module.load_state_dict(self.dense_state_dict(), strict=False)
        if unexpected or [k for k in missing if not self._tied_key(k)]:
            raise ValueError(f"to_dense: state dict mismatch (missing {missing}, unexpected {unexpected})")
        return dense_module

    def _tied_key(self, key: str) -> bool:
        return False


class Head2D(Composite2D):
    """Mirrors a dense head: final norm ``ln_f`` then the LM head, ``[b/q, s, h/q]`` → logits
    ``[b/q, s, Vp/q]`` (vocab block j of the vocabulary padded to the grid: :class:`LMHead2D`). Tied: ``lm_head.weight`` is the embedding's Parameter.
    ``norm_prefix``: the final norm's dense name (a family's subclass sets its own)."""

    norm_prefix = "ln_f."  # the final norm's dense name

    def __init__(self, ln_f: nn.Module, lm_head: LMHead2D, tied: bool):
        super().__init__()
        self.ln_f, self.lm_head, self.tied = ln_f, lm_head, tied

    @classmethod
    def from_dense(cls, head: nn.Module, mesh, embedding=None, *, name: str = "head",
                   overlap: bool = True, norm: nn.Module | None = None) -> "Head2D":
        """``embedding``: the converted embedding stage (its ``tok``), or that ``tok``.
        If the dense head's weight is the dense token table that embedding came from, the
        2D head shares the embedding's Parameter. Without ``embedding`` (e.g. head and
        embedding on different pipeline stages) the head gets its own copy of the table,
        and keeping the two copies equal (summing their gradients) is the caller's job. ``norm``:
        the converted final norm (default: a :class:`LayerNorm2D` of ``head.ln_f``)."""
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


def loss_2d(mesh, ignore_index: int = -100, vocab: int | None = None) -> VocabParallelCrossEntropy2D:
    """The 2D twin of the dense ``cross_entropy(logits, targets)`` (token mean); ``vocab``: the model's
    vocabulary, when the head pads it to the grid (the padded logits are left out of the softmax)."""
    return VocabParallelCrossEntropy2D(mesh, ignore_index=ignore_index, vocab=vocab)
