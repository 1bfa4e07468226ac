"""The torch side of the model families: shapes, stages and dense models of any ``model.arch``.

Each family's spec (:mod:`.registry`, torch-free) names its torch module
(``models/<family>/family.py``), which holds a :class:`Family`: the dense model's shape and
builders, its 2D twin's stage classes, where positions enter, the norms a fused kernel may replace
and the KV-cache decoding steps. :func:`family` imports that module on first use (a module of the
family's own package, below this one: no cycle).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Protocol

import torch.nn as nn

from parallel4d.models.registry import spec
from parallel4d.models.spec import ModelSpec
from parallel4d.models.stages import DenseModel

if TYPE_CHECKING:
    from parallel4d.config.schema import ModelConfig


class Shape(Protocol):
    """What the engine reads of any family's shape (a frozen dataclass of the family's model.py)."""

    arch: str  # the family (a ClassVar of the shape class)
    vocab_size: int
    seq_len: int
    hidden: int
    heads: int
    layers: int
    tie_embeddings: bool
    causal: bool


@dataclass(frozen=True)
class Family:
    """One model family's torch side. ``embed_2d``, ``block_2d``, ``head_2d``: the 2D twin's stage
    classes, each ``from_dense(dense stage, mesh, ...)`` (a block's with ``attention_fn``, ``name``,
    ``overlap``; a head's with ``embedding`` to share a tied table)."""

    spec: ModelSpec
    model_type: type[DenseModel]
    shape_from_config: Callable[[ModelConfig, bool], Shape]  # (model: section, sequence.causal)
    build_stage: Callable[..., nn.Module]  # (shape, index, seed, tied_weight=None, meta=False)
    embed_2d: type
    block_2d: type
    head_2d: type
    # where a sequence shard's global positions enter: the embedding's table ("embedding": the engine
    # feeds them to stage 0) or the attention's rotation ("attention": set as each block's ``positions``)
    positions: Literal["embedding", "attention"]
    rms_norms: tuple[type, ...]  # dense norm classes computing weight·x/rms(x) (attributes weight, eps)
    decode_embed: Callable  # (embed stage, tokens [b, t], start) → [b, t, h]
    decode_block: Callable  # (block, x [b, t, h], kv cache or None, start) → (x, (k, v))


def family(arch: str) -> Family:
    """The torch side of ``model.arch`` ``arch`` (also ``shape.arch``)."""
    found = importlib.import_module(spec(arch).torch_module).FAMILY
    if found.spec.name != arch:
        raise TypeError(f"{spec(arch).torch_module}.FAMILY is family {found.spec.name!r}, not {arch!r}")
    return found


def shape_from_config(model_cfg: ModelConfig, causal: bool = True) -> Shape:
    """The shape of ``config.ModelConfig`` for its ``arch`` (``causal``: ``sequence.causal``)."""
    return family(model_cfg.arch).shape_from_config(model_cfg, causal)


def build_stage(shape: Shape, index: int, seed: int = 0, tied_weight: nn.Parameter | None = None,
                meta: bool = False) -> nn.Module:
    """Stage ``index`` (0 = embedding, 1..L = blocks, L+1 = head) of ``shape``'s family, initialised
    from ``(seed, index)`` alone (:func:`~parallel4d.models.stages.seeded_stage`); ``meta``: shapes only."""
    return family(shape.arch).build_stage(shape, index, seed, tied_weight=tied_weight, meta=meta)


def build_dense(shape: Shape, seed: int = 0) -> DenseModel:
    """The whole dense reference model of ``shape``'s family, from ``seed``."""
    return family(shape.arch).model_type(shape, seed)
