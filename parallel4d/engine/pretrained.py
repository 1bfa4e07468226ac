"""Hugging Face weights into this rank's model (``model.pretrained``): only its own slices read."""

from __future__ import annotations

import torch.nn as nn

from parallel4d.checkpoint.pretrained import pretrained_checkpoint


def load_pretrained(model: nn.Module, layouts: dict, model_cfg) -> int:
    """Fill ``model``'s parameters (this rank's pieces, ``layouts``:
    :func:`~parallel4d.engine.state.dense_layouts`) from the Hugging Face checkpoint
    ``model.pretrained``, reading only those slices; the bytes read."""
    pieces: dict[str, list] = {}
    for name, p in model.named_parameters():  # a shared (tied) Parameter once
        dense, _, cut = layouts[name]
        pieces.setdefault(dense, []).extend(cut(p.data))
    return pretrained_checkpoint(model_cfg, lambda hf: hf.load_pieces(pieces, model_cfg.pretrained, model_cfg))
