"""``parallel4d export CKPT OUT_DIR``: a checkpoint of any layout → a Hugging Face model directory.

The checkpoint's dense tensors are read a block of rows at a time (:class:`.rows.CheckpointTensors`)
straight into ``config.json`` + safetensors (:func:`.models.hf.save_hf`, sharded above
``max_shard_bytes``), which ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads:
no dense copy of the model is made, in memory or on disk, so the memory used does not grow with the
model (``benchmarks/export.py``). A mixture of experts is written as transformers' ``save_pretrained`` writes
it — Qwen3-MoE, Qwen2-MoE or Mixtral (:func:`.models.hf.hf_config` picks the type), one tensor per expert
and projection, each read whole (one expert's ``[I, h]``: the most held at once where it exceeds a block).
The architecture is the ``model:`` section of the config saved with the checkpoint. A job with
``model.pretrained`` gets back that directory's config.json (what training changed, merged), tokenizer and
generation files, which its checkpoints carry (:mod:`.hf_source`).
OUT_DIR follows :mod:`.outputs`' rules: never the checkpoint or inside it, and written as a whole —
the files go in a temporary directory, moved into OUT_DIR once all are complete.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.checkpoint.gather import resolve_checkpoint, verified
from parallel4d.checkpoint.resume import saved_config
from parallel4d.checkpoint.files import default_mode
from parallel4d.checkpoint.hf_source import carry_source
from parallel4d.checkpoint.outputs import check_output, new_directory
from parallel4d.checkpoint.rows import CheckpointTensors


class ModelTensors:
    """The checkpoint's ``model.*`` tensors under the dense model's names (``models.hf.DenseSource``):
    with tied embeddings ``head.weight`` is the token table, as the dense ``state_dict()`` lists it."""

    def __init__(self, tensors: CheckpointTensors, tied: bool):
        self.tensors = tensors
        self.keys = {k[len("model."):]: k for k in tensors.shapes if k.startswith("model.")}
        if tied and "head.weight" not in self.keys:
            self.keys["head.weight"] = self.keys["embed.tok.weight"]
        self.shapes = {name: tensors.shapes[key] for name, key in self.keys.items()}

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors.read(self.keys[name], start, stop)


def export(ckpt: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> Path:
    """Write checkpoint ``ckpt`` (a ``step_*`` directory or a checkpoint root) to ``out_dir``; returns
    ``out_dir`` (``~`` expanded). ``ConfigError`` for an ``out_dir`` :func:`.outputs.check_output` refuses."""
    path = resolve_checkpoint(ckpt)
    out_dir = check_output(out_dir, "OUT_DIR", [(path, "the checkpoint it reads")], kind="directory")
    model_cfg = make_config(saved_config(path)).model
    try:
        hf = importlib.import_module("parallel4d.models.hf")  # safetensors: the optional hf extra
    except ImportError as e:
        raise ConfigError(f"parallel4d export needs the hf extra ({e.name} is missing): "
                          "pip install 'parallel4d[hf]'") from None
    _refusals(hf, path, model_cfg)
    verified(path)  # after the cheap refusals: it reads every byte of the checkpoint
    with new_directory(out_dir, "OUT_DIR") as tmp:
        _write_hf(hf, path, model_cfg, tmp, max_shard_bytes)
        written = [p.name for p in tmp.iterdir()]
    hf.remove_stale_weights(out_dir, written)  # an earlier export's shards, where it is written over
    return out_dir


def _refusals(hf, path: Path, model_cfg) -> None:
    """What the export cannot write, from the checkpoint's metadata alone: a model no transformers model type
    holds (say q/k norms with a shared expert), tensors that are not the model's (experts saved otherwise
    than as the dense ``[num_experts, ...]`` tensors every layout saves)."""
    try:
        hf.hf_config(model_cfg, torch.float32)
    except ValueError as e:
        raise ConfigError(f"parallel4d export: {path}: {e}") from None
    with CheckpointTensors(path) as tensors:
        shapes = {k: shape for k, (shape, _) in ModelTensors(tensors, model_cfg.tie_embeddings).shapes.items()}
    problem = hf.fit_problem(shapes, model_cfg)
    if problem:
        raise ConfigError(f"parallel4d export: {path} does not hold the model its saved config describes: tensor "
                          f"{problem}; export reads the dense tensors every parallel4d layout saves (experts "
                          "stacked [num_experts, ...]): resume the run with this parallel4d and export the "
                          "checkpoint it saves")


def _write_hf(hf, path: Path, model_cfg, out: Path, max_shard_bytes: int) -> None:
    """Checkpoint ``path``'s model as a Hugging Face directory in the (new, empty) ``out``."""
    with CheckpointTensors(path) as tensors:
        source = ModelTensors(tensors, model_cfg.tie_embeddings)
        hf.save_hf(source, model_cfg, out, max_shard_bytes=max_shard_bytes)
    dtype = source.shapes["embed.tok.weight"][1]
    carry_source(path, out, model_cfg, lambda m: hf.hf_config(m, dtype))
    default_mode(list(out.iterdir()))  # readable by others (safetensors' writer leaves 0600)
