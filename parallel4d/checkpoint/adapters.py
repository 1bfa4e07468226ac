"""LoRA adapters in and out in ``peft``'s format, and the merged model (``model.lora``; the hf extra).

* :func:`load_adapter`: ``model.lora.adapter``'s ``adapter_model.safetensors`` into this rank's adapters,
  each rank reading only its pieces (``get_slice``), as ``model.pretrained`` is read.
* :func:`write_adapter`: the adapters as ``PeftModel.save_pretrained`` writes them (``adapter_config.json``
  + ``adapter_model.safetensors``, names ``base_model.model.<module>.lora_A.weight``), which
  ``PeftModel.from_pretrained(base, DIR)`` loads onto the original base (``parallel4d export --adapter``).
* :class:`MergedSource`: base + adapters as the dense tensors of a plain model — each targeted weight
  ``W + scaling · B·A`` (``W`` ``[out, in]``, the dense layout; GPT-2's Conv1D is transposed on writing as
  every GPT-2 weight is, so its merged ``[in, out]`` is ``Wᵀ + scaling·(B·A)ᵀ``, peft's ``fan_in_fan_out``
  merge) — read a block of rows at a time, which :func:`~parallel4d.models.hf.save_hf` writes
  (``parallel4d export``) and ``parallel4d generate`` runs.

The adapters' tensors in peft's file are ours as they are: ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``
for every family (:mod:`parallel4d.models.lora`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallel4d.checkpoint.pretrained import check_adapter
from parallel4d.config.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config
from parallel4d.models.lora import LoraShape, adapted_modules, is_adapter, peft_names


def adapter_pieces(model, layouts: dict) -> dict[str, tuple[tuple, list]]:
    """``{dense adapter name: (dense shape, [(offsets, view)])}``: this rank's pieces of every adapter of
    ``model`` (``layouts``: :func:`~parallel4d.engine.state.dense_layouts`)."""
    pieces: dict[str, tuple[tuple, list]] = {}
    for name, p in model.named_parameters():
        dense, shape, cut = layouts[name]
        if is_adapter(dense):
            pieces.setdefault(dense, (tuple(shape), []))[1].extend(cut(p.data))
    return pieces


def load_adapter(pieces: dict[str, tuple[tuple, list]], model_cfg) -> int:
    """Fill ``pieces`` (:func:`adapter_pieces`) from peft's ``adapter_model.safetensors`` in ``model.lora.adapter``,
    reading only those slices; the bytes read. ``ConfigError`` naming the file and tensor for a tensor
    missing, of another shape, or one the model has no adapter for (:func:`check_adapter`)."""
    from safetensors import safe_open  # the hf extra

    check_adapter(model_cfg)
    names = peft_names(adapted_modules(model_cfg))
    read = 0
    with safe_open(str(Path(model_cfg.lora.adapter).expanduser() / ADAPTER_WEIGHTS), framework="pt") as f:
        for dense, (_, boxes) in pieces.items():
            part = f.get_slice(names[dense])
            for offsets, view in boxes:
                t = part[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))]
                read += t.numel() * t.element_size()
                with torch.no_grad():
                    view.copy_(t)
    return read


def write_adapter(out: Path, adapters: dict[str, torch.Tensor], model_cfg, base_name: str | None) -> None:
    """``adapters`` (``{dense adapter name: whole tensor}``) as peft's adapter directory in ``out``."""
    from safetensors.torch import save_file  # the hf extra

    names = peft_names(adapted_modules(model_cfg))
    tensors = {names[dense]: t.detach().cpu().contiguous() for dense, t in adapters.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(model_cfg.lora, base_name, fan_in_fan_out=model_cfg.arch == "gpt2")
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


class MergedSource:
    """The merged model's dense tensors (a :class:`~parallel4d.models.hf.DenseSource`): ``base``'s, each
    adapted weight plus ``scaling · B·A`` (in float64, cast to the base's dtype). ``adapters``: ``{dense
    adapter name: whole tensor}`` (small: ``r·(in + out)`` per module)."""

    def __init__(self, base, adapters: dict[str, torch.Tensor], model_cfg):
        self.base, self.scaling = base, LoraShape.of(model_cfg.lora).scaling
        self.pairs = {f"{m}.weight": (adapters[f"{m}.lora_A"], adapters[f"{m}.lora_B"])
                      for m in adapted_modules(model_cfg)}
        self.shapes = {k: v for k, v in base.shapes.items() if not is_adapter(k)}

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        rows = self.base.read(name, start, stop)
        if name not in self.pairs:
            return rows
        a, b = self.pairs[name]
        delta = b[start:stop].double() @ a.double() * self.scaling
        return (rows.double() + delta).to(rows.dtype)
