"""The dense single-process reference models, one module per family (``model.arch``).

``gpt.py`` (``gpt2``: LayerNorm, learned positions, GELU MLP) and ``llama.py`` (``llama``:
RMSNorm, rotary, SwiGLU, grouped-query attention). Both are a flat list of stages
``embed, block_0..block_{L-1}, head`` built one at a time from ``(seed, stage)``; the
functions here pick the family from the shape.
"""

from __future__ import annotations

import torch.nn as nn

from parallel4d.models import gpt
from parallel4d.models import llama
from parallel4d.models.gpt import GPT, GPTShape, cross_entropy, stage_names
from parallel4d.models.llama import Llama, LlamaShape

Shape = GPTShape | LlamaShape


def shape_from_config(model_cfg, causal: bool = True) -> Shape:
    """The shape of ``config.ModelConfig`` for its ``arch`` (``causal``: ``sequence.causal``)."""
    m = model_cfg
    if m.arch == "llama":
        return LlamaShape(vocab_size=m.vocab_size, seq_len=m.seq_len, hidden=m.hidden, heads=m.heads,
                          kv_heads=m.kv_heads_or_heads, layers=m.layers, intermediate_size=m.mlp_width,
                          tie_embeddings=m.tie_embeddings, norm_eps=m.norm_eps, init_std=m.init_std,
                          rope_theta=m.rope_theta, qkv_bias=m.qkv_bias, causal=causal)
    fields = GPTShape.__dataclass_fields__
    return GPTShape(**{**{k: getattr(m, k) for k in fields if hasattr(m, k)}, "causal": causal})


def build_stage(shape: Shape, index: int, seed: int = 0, tied_weight: nn.Parameter | None = None,
                meta: bool = False) -> nn.Module:
    """Stage ``index`` of the family of ``shape`` (see :func:`.gpt.build_stage`)."""
    family = llama if isinstance(shape, LlamaShape) else gpt
    return family.build_stage(shape, index, seed, tied_weight=tied_weight, meta=meta)


def build_dense(shape: Shape, seed: int = 0) -> GPT:
    """The whole dense reference model of ``shape``'s family, from ``seed``."""
    return (Llama if isinstance(shape, LlamaShape) else GPT)(shape, seed)


__all__ = ["GPT", "GPTShape", "Llama", "LlamaShape", "Shape", "shape_from_config", "build_stage", "build_dense",
           "cross_entropy", "stage_names"]
