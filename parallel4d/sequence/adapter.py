"""Plug ring attention into a model whose attention core is ``attention_fn(q, k, v, causal=True)``.

The reference GPT's ``Attention`` calls its core with ``[b, heads, s_local, d]`` tensors;
with sequence parallelism each rank feeds only its own tokens (``split_sequence`` of the
token ids, in the chosen layout) and the learned position embedding must receive the
*global* positions of those tokens (:func:`positions_for`).
"""

from __future__ import annotations

from typing import Callable

import torch

from parallel4d.config.rules.sequence import check_layout
from parallel4d.sequence.ring import ring_attention


def make_ring_attention_fn(group, layout: str = "zigzag", stats=None, *, backend: str = "auto",
                           timeout_s: float | None = None, scale: float | None = None, deadlines=None) -> Callable:
    """A drop-in ``attention_fn(q, k, v, causal=True, dropout=None, documents=None) -> [b, heads, s/N, d]``
    running :func:`ring_attention` over ``group`` (the sequence-parallel axis, e.g. ``mesh.group("sp")``;
    ``deadlines``: ``mesh.deadlines``)."""
    check_layout(layout)

    def attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                     dropout=None, documents=None) -> torch.Tensor:
        return ring_attention(q, k, v, group, causal=causal, layout=layout, scale=scale, stats=stats,
                              timeout_s=timeout_s, backend=backend, deadlines=deadlines, dropout=dropout,
                              documents=documents)

    attention_fn.layout = layout
    attention_fn.group = group
    return attention_fn
