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
A LoRA job's checkpoint (``model.lora``: the adapters only, its base named in ``lora_base.json``) is written
merged — the base read from the directory it names (checked by fingerprint; ``--base DIR`` where it moved) a
block of rows at a time, ``scaling · B·A`` added to each adapted weight (:class:`.adapters.MergedSource`) —
or, with ``--adapter``, as peft's adapter directory (:func:`.adapters.write_adapter`).
OUT_DIR follows :mod:`.outputs`' rules: never the checkpoint or inside it, and written as a whole —
the files go in a temporary directory, moved into OUT_DIR once all are complete.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path

import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.checkpoint.adapters import MergedSource, peft_problem, write_adapter
from parallel4d.checkpoint.gather import resolve_checkpoint, verified
from parallel4d.checkpoint.resume import saved_config
from parallel4d.checkpoint.files import default_mode
from parallel4d.checkpoint.hf_source import carry_source
from parallel4d.checkpoint.lora_base import BASE_FILE, base_problem, fingerprint, saved_base
from parallel4d.checkpoint.outputs import check_output, new_directory, user_path
from parallel4d.checkpoint.rows import CheckpointTensors
from parallel4d.models.build import build_dense, shape_from_config
from parallel4d.models.lora import adapter_names


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


def export(ckpt: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 << 30, adapter: bool = False,
           base: str | Path | None = None) -> Path:
    """Write checkpoint ``ckpt`` (a ``step_*`` directory or a checkpoint root) to ``out_dir``; returns
    ``out_dir`` (``~`` expanded). ``ConfigError`` for an ``out_dir`` :func:`.outputs.check_output` refuses.

    A LoRA job's checkpoint (``model.lora``): the merged model, or with ``adapter``
    the adapters alone in peft's format (:func:`_write_lora`); ``base``: the base's directory where it is no longer where the
    checkpoint names it (checked by fingerprint, :mod:`.lora_base`)."""
    path = resolve_checkpoint(ckpt)
    out_dir = check_output(out_dir, "OUT_DIR", [(path, "the checkpoint it reads")], kind="directory")
    model_cfg = make_config(saved_config(path)).model
    if adapter and model_cfg.lora is None:
        raise ConfigError(f"parallel4d export --adapter: {path} is not a LoRA job's checkpoint (its config has no "
                          "model.lora); export it without --adapter")
    try:
        hf = importlib.import_module("parallel4d.models.hf")  # safetensors: the optional hf extra
    except ImportError as e:
        raise ConfigError(f"parallel4d export needs the hf extra ({e.name} is missing): "
                          "pip install 'parallel4d[hf]'") from None
    _refusals(hf, path, model_cfg, adapter)
    verified(path)  # after the cheap refusals: it reads every byte of the checkpoint
    with new_directory(out_dir, "OUT_DIR") as tmp:
        if model_cfg.lora is None:
            _write_hf(hf, path, model_cfg, tmp, max_shard_bytes)
        else:
            _write_lora(hf, path, model_cfg, tmp, max_shard_bytes, adapter, base)
        written = [p.name for p in tmp.iterdir()]
    hf.remove_stale_weights(out_dir, written)  # an earlier export's shards, where it is written over
    return out_dir


def checkpoint_adapters(path: Path, model_cfg) -> dict[str, torch.Tensor]:
    """``{dense adapter name: tensor}`` of a LoRA job's checkpoint ``path`` (small: ``r·(in + out)`` each, the
    routed experts' stacked ``[E, …]``)."""
    names = adapter_names(model_cfg)
    with CheckpointTensors(path) as tensors:
        missing = [n for n in names if f"model.{n}" not in tensors.shapes]
        if missing:
            raise ConfigError(f"parallel4d export: {path} has no adapter tensor {missing[0]!r} ({len(missing)} "
                              f"missing) although its config has model.lora.targets={model_cfg.lora.targets}")
        return {n: tensors.read(f"model.{n}") for n in names}


@contextmanager
def lora_base(hf, path: Path, model_cfg, base: str | Path | None):
    """The frozen base of LoRA checkpoint ``path`` as a dense source: the pretrained directory its
    ``lora_base.json`` names (or ``base``, a copy of it: the same fingerprint), or the random base of the
    train.seed it records; ConfigError naming both when it is not the base the adapters were trained on."""
    record = saved_base(path)
    if record is None:
        raise ConfigError(f"{path} holds LoRA adapters but no {BASE_FILE} naming their base; resume the run with "
                          "this parallel4d for a step to save a checkpoint that names it")
    if base is None and record.get("pretrained") is None:
        dense = build_dense(shape_from_config(model_cfg), seed=record["seed"]).state_dict()
        yield hf.tensor_source(dense)
        return
    where = user_path(base) if base is not None else Path(record["pretrained"])
    if not where.is_dir():
        raise ConfigError(f"{path} holds LoRA adapters trained on model.pretrained={str(where)!r}, which is not "
                          "there now; give its directory (a copy of it) with --base DIR")
    problem = base_problem(record, {"pretrained": str(where), "fingerprint": fingerprint(where)}, path)
    if problem:
        raise ConfigError(f"parallel4d: {problem}; give the base they were trained on with --base DIR")
    try:
        with hf.PretrainedSource(where, model_cfg) as source:
            yield source
    except (ValueError, OSError) as e:
        raise ConfigError(f"the base {where}: {e}") from None


def _write_lora(hf, path: Path, model_cfg, out: Path, max_shard_bytes: int, adapter: bool,
                base: str | Path | None) -> None:
    """LoRA checkpoint ``path`` into ``out``: the adapters in peft's format (``adapter``), else the merged
    model as a Hugging Face directory (with the base's carried files)."""
    adapters = checkpoint_adapters(path, model_cfg)
    record = saved_base(path) or {}
    if adapter:
        write_adapter(out, adapters, model_cfg, record.get("pretrained"))
    else:
        with lora_base(hf, path, model_cfg, base) as source:
            merged = MergedSource(source, adapters, model_cfg)
            hf.save_hf(merged, model_cfg, out, max_shard_bytes=max_shard_bytes)
        dtype = merged.shapes["embed.tok.weight"][1]
        carry_source(path, out, model_cfg, lambda m: hf.hf_config(m, dtype))
    default_mode(list(out.iterdir()))  # readable by others (safetensors' writer leaves 0600)


def _refusals(hf, path: Path, model_cfg, adapter: bool = False) -> None:
    """What the export cannot write, from the checkpoint's metadata alone: a model no transformers model type
    holds (say q/k norms with a shared expert), tensors that are not the model's (experts saved otherwise
    than as the dense ``[num_experts, ...]`` tensors every layout saves), an ``adapter`` peft would load
    otherwise (:func:`.adapters.peft_problem`)."""
    try:
        model_type = hf.hf_config(model_cfg, torch.float32)["model_type"]
    except ValueError as e:
        raise ConfigError(f"parallel4d export: {path}: {e}") from None
    problem = peft_problem(model_cfg, model_type) if adapter else None
    if problem:
        raise ConfigError(f"parallel4d export --adapter: {path}: {problem}")
    if model_cfg.lora is not None:  # the adapters only: checkpoint_adapters checks them, the base its own way
        return
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


def merged_state_dict(path: Path, model_cfg, base: str | Path | None = None) -> dict[str, torch.Tensor]:
    """LoRA checkpoint ``path``'s merged model as one dense state dict (whole tensors in memory: for
    ``parallel4d generate``, which runs the model in one process anyway)."""
    hf = importlib.import_module("parallel4d.models.hf")
    adapters = checkpoint_adapters(path, model_cfg)
    with lora_base(hf, path, model_cfg, base) as source:
        merged = MergedSource(source, adapters, model_cfg)
        return {name: merged.read(name, 0, shape[0] if len(shape) else 1)
                for name, (shape, _) in merged.shapes.items()}
