"""Hugging Face weights into this rank's model (``model.pretrained``): only its own slices read."""

from __future__ import annotations

import importlib

import torch.nn as nn

from parallel4d.config.errors import ConfigError


def load_pretrained(model: nn.Module, layouts: dict, model_cfg) -> int:
    """Fill ``model``'s parameters (this rank's pieces, ``layouts``:
    :func:`~parallel4d.engine.state.dense_layouts`) from the Hugging Face checkpoint
    ``model.pretrained``, reading only those slices; the bytes read."""
    pieces: dict[str, list] = {}
    for name, p in model.named_parameters():  # a shared (tied) Parameter once
        dense, _, cut = layouts[name]
        pieces.setdefault(dense, []).extend(cut(p.data))
    return pretrained_checkpoint(model_cfg, lambda hf: hf.load_pieces(pieces, model_cfg.pretrained, model_cfg))


def pretrained_checkpoint(model_cfg, use):
    """``use(parallel4d.models.hf)`` on ``model.pretrained``; ConfigError naming the directory for a
    missing hf extra, file or tensor, or a tensor of the wrong shape."""
    try:
        hf = importlib.import_module("parallel4d.models.hf")  # safetensors: the optional hf extra
    except ImportError as e:
        raise ConfigError(f"model.pretrained needs the hf extra ({e.name} is missing): "
                          "pip install 'parallel4d[hf]' (make installs it)") from None
    try:
        return use(hf)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model.pretrained={model_cfg.pretrained!r}: {e}") from None
