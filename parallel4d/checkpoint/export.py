"""``parallel4d export CKPT OUT_DIR``: a checkpoint of any layout → a Hugging Face model directory.

The checkpoint's dense tensors are gathered (:func:`.gather.gather`, one tensor at a time into a
mapped file), then written as ``config.json`` + safetensors (:func:`.models.hf.save_hf`, sharded
above ``max_shard_bytes``) that ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)``
loads. The architecture is the ``model:`` section of the config saved with the checkpoint. A job
with ``model.pretrained`` gets back that directory's config.json (what training changed, merged),
tokenizer and generation files, which its checkpoints carry (:mod:`.hf_source`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.checkpoint.resume import saved_config
from parallel4d.checkpoint.gather import gather, resolve_checkpoint, with_tied_head
from parallel4d.checkpoint.files import default_mode
from parallel4d.checkpoint.hf_source import carry_source


def export(ckpt: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> Path:
    """Write checkpoint ``ckpt`` (a ``step_*`` directory or a checkpoint root) to ``out_dir``."""
    path, out_dir = resolve_checkpoint(ckpt), Path(out_dir)
    model_cfg = make_config(saved_config(path)).model
    try:
        hf = importlib.import_module("parallel4d.models.hf")  # safetensors: the optional hf extra
    except ImportError as e:
        raise ConfigError(f"parallel4d export needs the hf extra ({e.name} is missing): "
                          "pip install 'parallel4d[hf]'") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    dense = out_dir / ".parallel4d-gather.pt"
    try:
        gather(path, dense)
        state = with_tied_head(torch.load(dense, mmap=True, weights_only=True)["model"], model_cfg.tie_embeddings)
        hf.save_hf(state, model_cfg, out_dir, max_shard_bytes=max_shard_bytes)
        dtype = state["embed.tok.weight"].dtype
        carried = carry_source(path, out_dir, model_cfg, lambda m: hf.hf_config(m, dtype))
        default_mode([*out_dir.glob("*.safetensors"), *out_dir.glob("*.json"), *carried])  # readable by others
    finally:
        dense.unlink(missing_ok=True)
    return out_dir
