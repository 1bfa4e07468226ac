"""``model.pretrained``: a Hugging Face checkpoint, read through :mod:`parallel4d.models.hf` (the
optional hf extra, imported on use). Torch-free itself, so that the launcher's pre-flight checks
import it at module top; reading the files' headers imports the extra (and torch)."""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

from parallel4d.config.errors import ConfigError


def pretrained_checkpoint(model_cfg, use: Callable[[Any], Any]) -> Any:
    """``use(parallel4d.models.hf)`` on ``model.pretrained``; ConfigError naming the directory for a
    missing hf extra, file or tensor, or a tensor of the wrong shape."""
    return _with_hf("model.pretrained", model_cfg.pretrained, use)


def _with_hf(field: str, value, use: Callable[[Any], Any]) -> Any:
    """``use(parallel4d.models.hf)``; a missing hf extra, or a ValueError / OSError of ``use`` (a file or
    tensor missing or of the wrong shape), as a ConfigError naming ``field`` and its ``value``."""
    try:
        hf = importlib.import_module("parallel4d.models.hf")  # safetensors: the optional hf extra
    except ImportError as e:
        raise ConfigError(f"{field} needs the hf extra ({e.name} is missing): "
                          "pip install 'parallel4d[hf]' (make installs it)") from None
    try:
        return use(hf)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{field}={value!r}: {e}") from None


def check_pretrained(model_cfg) -> None:
    """Every weight file of ``model.pretrained`` there and of the model's shape, from the files'
    headers alone (no tensor read); ConfigError naming the directory otherwise."""
    pretrained_checkpoint(model_cfg, lambda hf: hf.check_checkpoint(model_cfg.pretrained, model_cfg))


def check_adapter(model_cfg) -> None:
    """``model.lora.adapter``'s weights hold exactly the model's adapters, each of its shape, from the file's
    header alone (:func:`parallel4d.models.hf.check_adapter`); ConfigError naming the field and tensor."""
    where = model_cfg.lora.adapter
    _with_hf("model.lora.adapter", where, lambda hf: hf.check_adapter(os.path.expanduser(where), model_cfg))
