"""Hugging Face ``transformers`` checkpoints ↔ parallel4d's dense models (any ``model.arch``).

* :func:`model_fields_from_hf`: a ``config.json`` dict → the ``model:`` fields of a job
  (:mod:`parallel4d.config.hf_fields`; each family's spec maps its own ``model_type`` values).
* :func:`p4d_to_hf` / :func:`hf_to_p4d`: the tensor name map (the family spec's ``hf_names``),
  with the transform each name needs.
* :func:`load_hf_state_dict`: ``*.safetensors`` of a directory → the dense model's state dict;
  :class:`HFCheckpoint` underneath keeps the files open and reads a tensor, or a slice of one,
  by its Hugging Face name.
* :func:`save_hf`: a dense state dict → ``config.json`` + ``model.safetensors`` (or shards and
  ``model.safetensors.index.json``) that ``AutoModelForCausalLM.from_pretrained`` loads; a mixture of
  experts as Qwen3-MoE, Qwen2-MoE or Mixtral, one tensor per expert and projection (:func:`stored_tensors`).

Transforms (a dense tensor from the Hugging Face one): ``copy``; ``t``: GPT-2's ``Conv1D`` keeps
its weight ``[in, out]``, ``nn.Linear`` ``[out, in]``; mixtures of experts (:mod:`parallel4d.models.moe.spec`):
``experts``, one checkpoint tensor per expert (``{e}`` in its name), stacked, both ways; loading only,
transformers 5's fused experts, ``gate_half`` / ``up_half`` of ``gate_up_proj``. Every tensor keeps its shape
both ways (GPT-2's position table all its ``n_positions = model.max_positions`` rows, whatever ``seq_len``). With tied
embeddings the dense state dict holds the token table twice (``embed.tok.weight`` and
``head.weight``, one tensor); a checkpoint holds it once. This module needs ``safetensors``
(the ``hf`` extra), never ``transformers``; nothing else in parallel4d imports it.
"""

from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from parallel4d.config.hf_fields import mismatches, model_fields_from_hf
from parallel4d.config.peft_adapter import ADAPTER_WEIGHTS
from parallel4d.models.build import build_stage, shape_from_config
from parallel4d.config.rules.lora import EXPERT_ADAPTERS
from parallel4d.models.lora import ADAPTER_PARTS, adapted_experts, adapted_modules, expert_peft_names, peft_names
from parallel4d.models.moe.spec import alternatives
from parallel4d.models.registry import spec
from parallel4d.models.stages import stage_names

INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- the name map

def p4d_to_hf(model_cfg) -> dict[str, tuple[str, str]]:
    """Dense name → ``(Hugging Face name, transform)`` for ``config.ModelConfig``, in the dense
    model's order (the family's names, then ``lm_head.weight``: with tied embeddings the dense
    ``head.weight`` is absent, it is ``embed.tok.weight``)."""
    out = spec(model_cfg.arch).hf_names(model_cfg)
    if not model_cfg.tie_embeddings:
        out["head.weight"] = ("lm_head.weight", "copy")
    return out


def hf_to_p4d(model_cfg) -> dict[str, tuple[str, str]]:
    """Hugging Face name → ``(dense name, transform)``: :func:`p4d_to_hf` reversed (the transform
    is its own inverse: ``t`` transposes back)."""
    return {hf: (p4d, t) for p4d, (hf, t) in p4d_to_hf(model_cfg).items()}


def dense_shapes(model_cfg) -> dict[str, torch.Size]:
    """Dense state-dict name → shape for ``config.ModelConfig`` (built on the meta device; with
    tied embeddings ``head.weight`` is listed, as ``state_dict()`` lists it)."""
    shape, stages, out = shape_from_config(model_cfg), [], {}
    for i, name in enumerate(stage_names(shape)):
        tied = stages[0].tok.weight if name == "head" and shape.tie_embeddings else None
        stages.append(build_stage(shape, i, tied_weight=tied, meta=True))
        out.update({f"{name}.{k}": v.shape for k, v in stages[-1].state_dict().items()})
    return out


# ----------------------------------------------------------------------------- reading

class HFCheckpoint:
    """The ``*.safetensors`` of a directory, open for reading by Hugging Face tensor name.

    One ``model.safetensors``, shards listed by ``model.safetensors.index.json``, or (without an
    index) every ``*.safetensors`` there. ``read_tensor(name, slices)`` reads only ``slices`` (a
    tuple of ``slice``, one per leading dimension) through ``get_slice``. ``OSError`` naming the
    file for a missing, truncated or unreadable one. Use as a context manager (closes the files).
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        self._stack, self._open, self.file_of = ExitStack(), {}, {}
        index = self.directory / INDEX
        self.index = index if index.is_file() else None
        if self.index:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise OSError(f"{index}: not a safetensors index ({err})") from None
            files = sorted(set(weight_map.values()))
        else:
            weight_map, files = None, sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise OSError(f"{self.directory}: no *.safetensors file (nor {INDEX})")
        self.files = files
        for file in files:
            for name in self._file(file).keys():
                if name in self.file_of and self.file_of[name] != file:
                    raise ValueError(f"{self.directory}: tensor {name!r} is in both {self.file_of[name]} and {file}")
                if weight_map is None or weight_map.get(name) == file:
                    self.file_of[name] = file
        missing = sorted(set(weight_map or ()) - set(self.file_of))
        if missing:
            raise ValueError(f"{index}: tensor {missing[0]!r} is listed in {weight_map[missing[0]]} but that file "
                             f"does not hold it ({len(missing)} such tensors)")

    def _file(self, file: str):
        if file not in self._open:
            path = self.directory / file
            if not path.is_file():
                raise OSError(f"{path}: no such safetensors file")
            try:
                self._open[file] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as err:  # safetensors' own error (truncated, bad header) is a plain Exception
                raise OSError(f"{path}: not a readable safetensors file ({err})") from None
        return self._open[file]

    def path(self, name: str) -> Path:
        return self.directory / self.file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(self.file_of[name]).get_slice(name).get_shape())

    def read_tensor(self, name: str, slices: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name`` (in its saved dtype), or only ``slices`` of it."""
        f = self._file(self.file_of[name])
        return f.get_tensor(name) if slices is None else f.get_slice(name)[slices]

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_config(directory: Path, model_cfg) -> None:
    """``directory/config.json`` (when there) must describe ``model_cfg``'s architecture: a wrong
    ``rope_theta`` or ``norm_eps`` would load without a shape error and compute something else."""
    path = directory / "config.json"
    if not path.is_file():
        return
    hf = json.loads(path.read_text())
    ours = {**model_cfg.model_dump(), "kv_heads": model_cfg.kv_heads_or_heads, "intermediate_size": model_cfg.mlp_width,
            "max_positions": model_cfg.positions}
    wrong = [f"{k}={v!r} (the checkpoint's {theirs!r})" for k, v, theirs in mismatches(model_fields_from_hf(hf), ours)]
    if wrong:
        raise ValueError(f"{path} does not describe model: " + ", ".join(f"model.{w}" for w in wrong))


def load_hf_state_dict(directory, model_cfg) -> dict[str, torch.Tensor]:
    """The dense state dict (``load_state_dict(strict=True)``-ready) of ``config.ModelConfig``
    ``model_cfg`` from the Hugging Face safetensors checkpoint in ``directory``.

    Tensors keep their saved dtype (the caller casts). ``ValueError`` naming the file and tensor
    for a missing tensor, one of the wrong shape (vs. ``model_cfg``), an unexpected one (say a
    layer more), or a ``config.json`` that disagrees with ``model_cfg``; ``OSError`` for a
    missing or truncated file.
    """
    directory = Path(directory)
    _check_config(directory, model_cfg)
    out = {}
    with HFCheckpoint(directory) as ckpt:
        shapes = dense_shapes(model_cfg)
        for p4d, (hf, how) in _checked_names(ckpt, model_cfg).items():
            out[p4d] = _read(ckpt, hf, how, tuple(slice(0, n) for n in shapes[p4d]), shapes[p4d]).contiguous()
    if model_cfg.tie_embeddings:
        out["head.weight"] = out["embed.tok.weight"]
    return out


def _checked_names(ckpt: HFCheckpoint, model_cfg) -> dict[str, tuple[str, str]]:
    """Dense name → ``(the checkpoint's name, transform)``, every tensor there and of
    the model's shape, none left over (``ValueError`` naming the file and tensor otherwise)."""
    shapes, names, out = dense_shapes(model_cfg), set(ckpt.file_of), {}
    family = spec(model_cfg.arch)
    prefix = family.hf_prefix  # which some checkpoints of the family leave out (GPT2Model's, the hub's gpt2)
    strip = bool(prefix) and not any(n.startswith(prefix) for n in names)
    where = ckpt.index or ", ".join(str(ckpt.directory / f) for f in ckpt.files)
    for p4d, (hf, how) in p4d_to_hf(model_cfg).items():
        hf = hf.removeprefix(prefix) if strip else hf
        if hf.format(e=0) not in names:  # MoE layers: the other expert layouts (fused, Mixtral's names)
            hf, how = next(((a, t) for a, t in alternatives(hf, how) if a.format(e=0) in names), (hf, how))
        want = shapes[p4d]
        for name, expect in _stored(hf, how, want):
            if name not in names:
                raise ValueError(f"tensor {name!r} (for {p4d}) is missing from {where}")
            if ckpt.shape(name) != expect:
                raise ValueError(f"{ckpt.path(name)}: tensor {name!r} has shape {list(ckpt.shape(name))}, model "
                                 f"expects {list(expect)} (for {p4d})")
        out[p4d] = (hf, how)
    used = {name for p4d, (hf, how) in out.items() for name, _ in _stored(hf, how, shapes[p4d])}
    extra = sorted(n for n in names - used if not n.endswith(family.hf_ignored)
                   and not (model_cfg.tie_embeddings and n == "lm_head.weight"))
    if extra:
        raise ValueError(f"{ckpt.path(extra[0])}: unexpected tensor {extra[0]!r} for model (layers="
                         f"{model_cfg.layers}, {len(extra)} such tensors)")
    return out


class PretrainedSource:
    """A Hugging Face directory's tensors as a :class:`DenseSource` (dense names, a block of rows read at a
    time): what a LoRA export merges its adapters into. Checked as :func:`load_hf_state_dict` checks it;
    use as a context manager."""

    def __init__(self, directory, model_cfg):
        directory = Path(directory)
        _check_config(directory, model_cfg)
        self.ckpt = HFCheckpoint(directory)
        self.names, dense = _checked_names(self.ckpt, model_cfg), dense_shapes(model_cfg)
        if model_cfg.tie_embeddings:  # the dense head is the token table
            self.names["head.weight"] = self.names["embed.tok.weight"]
        dtypes = {p4d: self.ckpt.read_tensor(_stored(hf, how, dense[p4d])[0][0], (slice(0, 1),)).dtype
                  for p4d, (hf, how) in self.names.items()}
        self.shapes = {p4d: (dense[p4d], dtypes[p4d]) for p4d in self.names}

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        shape = self.shapes[name][0]
        hf, how = self.names[name]
        if not shape:
            return self.ckpt.read_tensor(hf)
        box = (slice(start, stop), *(slice(0, n) for n in shape[1:]))
        return _read(self.ckpt, hf, how, box, shape)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.ckpt.close()


def adapter_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """peft's adapter tensor name → shape for ``model.lora`` on ``model_cfg``: ``lora_A`` ``[r, in]``,
    ``lora_B`` ``[out, r]`` of each adapted linear (its dense weight ``[out, in]``); an MoE layer's experts'
    ``[E·R, in]`` and ``[out, R·E]`` per fused parameter (:func:`~parallel4d.models.lora.expert_tensor_to_peft`)."""
    shapes, r, modules = dense_shapes(model_cfg), model_cfg.lora.rank, adapted_modules(model_cfg)
    names = peft_names(modules)
    out = {}
    for m in modules:
        rows, cols = shapes[f"{m}.weight"]
        out.update({names[f"{m}.{part}"]: shape for part, shape in zip(ADAPTER_PARTS, ((r, cols), (rows, r)))})
    experts = expert_peft_names(model_cfg)  # peft's [E·R, in] and [out, R·E] (R = 2r for the fused gate_up_proj)
    for module, (_, fused) in adapted_experts(model_cfg).items():
        for which in fused:
            e, rows, cols = shapes[f"{module}.{'down_proj' if which == 'down_proj' else 'gate_proj'}"]
            wide = len(EXPERT_ADAPTERS[which])
            rank, rows = r * wide, rows * wide
            out.update({experts[f"{module}.adapters.{which}.{part}"]: shape
                        for part, shape in zip(ADAPTER_PARTS, ((e * rank, cols), (rows, rank * e)))})
    return out


def check_adapter(directory, model_cfg) -> None:
    """peft's ``adapter_model.safetensors`` in ``directory`` holds exactly ``model.lora``'s adapters, each of
    its shape (from the header alone); ``ValueError`` naming the file and tensor, ``OSError`` for no file."""
    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise OSError(f"{path} is not there; save the adapter with peft's save_pretrained (safetensors)")
    want = adapter_shapes(model_cfg)
    with safe_open(str(path), framework="pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    extra, missing = sorted(set(stored) - set(want)), [n for n in want if n not in stored]
    wrong = [n for n in want if n in stored and stored[n] != want[n]]
    if extra:
        raise ValueError(f"{path} holds {extra[0]!r} ({len(extra)} such tensors), which no adapter of "
                         f"model.lora.targets={model_cfg.lora.targets} on this model is; the adapter was made for "
                         "another model")
    if missing:
        raise ValueError(f"{path} has no tensor {missing[0]!r} ({len(missing)} missing); the adapter was made for "
                         "another model")
    if wrong:
        raise ValueError(f"{path}: tensor {wrong[0]!r} is {list(stored[wrong[0]])}, this model's is "
                         f"{list(want[wrong[0]])}; the adapter was made for another model")


def check_checkpoint(directory, model_cfg) -> None:
    """What :func:`load_pieces` would refuse, from the files' headers alone (no tensor read)."""
    directory = Path(directory)
    _check_config(directory, model_cfg)
    with HFCheckpoint(directory) as ckpt:
        _checked_names(ckpt, model_cfg)


def load_pieces(pieces: dict[str, list], directory, model_cfg) -> int:
    """Fill this rank's pieces of the dense tensors from the checkpoint in ``directory``, reading
    only those slices (``get_slice``), never a whole tensor another rank holds part of.

    ``pieces``: dense name → ``[(offsets in the dense tensor, view to fill)]`` (a rank's boxes,
    e.g. a 2D weight block); a tied head's dense name is ``embed.tok.weight``. Returns the bytes read."""
    directory = Path(directory)
    _check_config(directory, model_cfg)
    read = 0
    with HFCheckpoint(directory) as ckpt:
        names, shapes = _checked_names(ckpt, model_cfg), dense_shapes(model_cfg)
        for dense, boxes in pieces.items():
            hf, how = names[dense]
            for offsets, view in boxes:
                box = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                part = _read(ckpt, hf, how, box, shapes[dense])
                read += part.numel() * part.element_size()
                with torch.no_grad():
                    view.copy_(part)
    return read


def _stored(hf: str, how: str, dense_shape) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors (name, shape) a dense tensor of ``dense_shape`` is read from by ``how``."""
    want = tuple(dense_shape)
    if how == "t":
        return [(hf, want[::-1])]
    if how == "experts":  # one per expert: the dense tensor's first dimension
        return [(hf.format(e=e), want[1:]) for e in range(want[0])]
    if how in ("gate_half", "up_half"):  # the fused gate_up_proj [E, 2I, h]
        return [(hf, (want[0], 2 * want[1], *want[2:]))]
    return [(hf, want)]


def _read(ckpt: HFCheckpoint, hf: str, how: str, box: tuple[slice, ...], dense_shape) -> torch.Tensor:
    """The dense tensor's ``box`` (slices of ``dense_shape``) read from the checkpoint by ``how``: only those
    slices of the stored tensors (the experts in the box, each one's slice, for ``experts``)."""
    if how == "t":
        return ckpt.read_tensor(hf, box[::-1]).t()
    if how == "experts":
        return torch.stack([ckpt.read_tensor(hf.format(e=e), box[1:]) for e in range(box[0].start, box[0].stop)])
    if how in ("gate_half", "up_half"):
        width = dense_shape[1]
        shift = width if how == "up_half" else 0
        return ckpt.read_tensor(hf, (box[0], slice(box[1].start + shift, box[1].stop + shift), *box[2:]))
    return ckpt.read_tensor(hf, box)


# ----------------------------------------------------------------------------- writing

def hf_config(model_cfg, dtype: torch.dtype) -> dict:
    """The ``config.json`` of :func:`save_hf`: the family spec's ``hf_config`` (gpt2 →
    ``GPT2LMHeadModel``; llama → ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` with ``qkv_bias``, ``Qwen3ForCausalLM``
    with ``qk_norm``)
    around the keys every family writes: no bos/eos ids (the dense model has neither), ``dtype``."""
    m = model_cfg
    common = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
              "dtype": str(dtype).removeprefix("torch.")}
    return spec(m.arch).hf_config(m, common)


class DenseSource(Protocol):
    """Dense tensors by name, read a block of rows at a time: what :func:`save_hf` writes. A dict of
    tensors is one (:class:`_Tensors`); ``checkpoint/export.py`` reads a checkpoint's this way."""

    shapes: dict[str, tuple[torch.Size, torch.dtype]]  # dense name → (shape, dtype)

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (a 0-dim one whole)."""


class _Tensors:
    """:class:`DenseSource` over a dict of tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.shapes = {k: (t.shape, t.dtype) for k, t in tensors.items()}

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        t = self.tensors[name].detach()
        return (t if t.dim() == 0 else t[start:stop]).cpu()


def tensor_source(tensors: dict[str, torch.Tensor]) -> DenseSource:
    """A dict of dense tensors as a :class:`DenseSource`."""
    return _Tensors(tensors)


def remove_stale_weights(out: Path, files: list[str]) -> None:
    """Remove from ``out`` a previous save's weight files (``model*.safetensors``, the index) that are not
    among ``files``, the new save's: transformers would read an old ``model.safetensors`` before a new index."""
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        if stale.name not in files and stale.exists():
            os.remove(stale)


def fit_problem(shapes: dict[str, torch.Size], model_cfg) -> str | None:
    """Why dense tensors of ``shapes`` (name → shape) are not ``model_cfg``'s: the first name missing, else
    the first unexpected, else the first of another shape (None when they are its tensors)."""
    want = dense_shapes(model_cfg)
    missing, unexpected = [k for k in want if k not in shapes], sorted(set(shapes) - set(want))
    if missing or unexpected:
        return f"{missing[0]!r} is missing" if missing else f"{unexpected[0]!r} is unexpected"
    wrong = [k for k in want if shapes[k] != want[k]]
    return f"{wrong[0]!r} is {list(shapes[wrong[0]])}, expected {list(want[wrong[0]])}" if wrong else None


def stored_tensors(model_cfg) -> dict[str, tuple[str, str, int | None]]:
    """Every tensor :func:`save_hf` writes: Hugging Face name → ``(dense name, transform, expert)``, in the
    model's order; an ``experts`` entry is one tensor per expert (``expert``: its index, the dense tensor's row
    along the first dimension; None for every other tensor), as transformers' ``save_pretrained`` writes them."""
    shapes, out = dense_shapes(model_cfg), {}
    for p4d, (hf, how) in p4d_to_hf(model_cfg).items():
        for e, (name, _) in enumerate(_stored(hf, how, shapes[p4d])):
            out[name] = (p4d, how, e if how == "experts" else None)
    return out


def _stored_shape(shape: torch.Size, how: str) -> list[int]:
    """The shape a dense tensor of ``shape`` is stored as: transposed (``t``), one expert's (``experts``)."""
    return list(reversed(shape)) if how == "t" else list(shape[1:]) if how == "experts" else list(shape)


def save_hf(state: dict[str, torch.Tensor] | DenseSource, model_cfg, out_dir, max_shard_bytes: int = 5 << 30) -> Path:
    """Write the dense ``state`` (a state dict, or a :class:`DenseSource`) of ``config.ModelConfig``
    ``model_cfg`` as a Hugging Face checkpoint in ``out_dir``: ``config.json`` (:func:`hf_config`,
    dtype that of ``embed.tok.weight``) and ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    + ``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own). Each file is written as it is read, a block of rows at a time
    (:func:`write_safetensors`): memory stays bounded whatever the model's size.
    Tied embeddings: the token table once (no ``lm_head.weight``, as transformers writes it); experts one
    tensor per expert and projection (:func:`stored_tensors`).
    ``ValueError`` for a missing, unexpected or wrong-shaped tensor, or a model no transformers type
    holds (:func:`hf_config`). Returns ``out_dir``."""
    source = _Tensors(state) if isinstance(state, dict) else state
    problem = fit_problem({k: shape for k, (shape, _) in source.shapes.items()}, model_cfg)
    if problem:
        raise ValueError(f"state dict does not fit the model: {problem}")
    if model_cfg.tie_embeddings and isinstance(state, dict) \
            and not torch.equal(state["head.weight"], state["embed.tok.weight"]):
        raise ValueError("model.tie_embeddings is true but head.weight differs from embed.tok.weight")
    dtype = source.shapes["embed.tok.weight"][1]
    config = hf_config(model_cfg, dtype)  # before any file: a model no transformers type holds is refused
    tensors = stored_tensors(model_cfg)
    nbytes = {name: _nbytes(_stored_shape(source.shapes[p4d][0], how), source.shapes[p4d][1])
              for name, (p4d, how, _) in tensors.items()}
    shards, size = [[]], 0
    for name in tensors:
        if shards[-1] and size + nbytes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    remove_stale_weights(out, files)
    for file, names in zip(files, shards):
        write_safetensors(out / file, {n: tensors[n] for n in names}, source)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())},
                 "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------- safetensors, streamed

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
BLOCK_BYTES = 64 << 20  # rows read and written at a time


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def write_safetensors(path: Path, tensors: dict[str, tuple[str, str, int | None]], source: DenseSource) -> None:
    """Write ``tensors`` (safetensors name → ``(dense name in source, transform, expert)``, in file order:
    :func:`stored_tensors`' entries) to the safetensors file ``path``: the header first (every shape, dtype and
    offset is known), then each tensor's bytes, read from ``source`` ~:data:`BLOCK_BYTES` of rows at a time
    and written in place. ``t`` (the dense tensor transposed): each block of dense rows is a block of the
    file's columns; ``experts``: the dense tensor's row ``expert``, one expert's projection, read whole.
    Written as ``.NAME.tmp`` and renamed once complete."""
    header, offset = {}, 0
    for name, (p4d, how, _) in tensors.items():
        shape, dtype = source.shapes[p4d]
        shape = _stored_shape(shape, how)
        header[name] = {"dtype": _DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + _nbytes(shape, dtype)]}
        offset += _nbytes(shape, dtype)
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as safetensors writes it
    base = 8 + len(text)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(base + offset)
        for name, (p4d, how, expert) in tensors.items():
            at = base + header[name]["data_offsets"][0]
            if how == "experts":  # rows [e, e+1): one expert's [I, h] or [h, I], the whole stored tensor
                _pwrite(f.fileno(), source.read(p4d, expert, expert + 1), at)
            else:
                _write_tensor(f.fileno(), at, p4d, how, source)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_tensor(fd: int, at: int, p4d: str, how: str, source: DenseSource) -> None:
    """Dense tensor ``p4d`` (transposed for ``t``) at byte ``at`` of file ``fd``, a block of rows at a time."""
    shape, dtype = source.shapes[p4d]
    rows = shape[0] if len(shape) else 1
    row_bytes = max(_nbytes(shape[1:], dtype), 1)
    step = max(1, BLOCK_BYTES // row_bytes)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        block = source.read(p4d, a, b)
        if how == "t" and b - a < rows:  # the file's columns [a, b): one write per file row
            cols = block.t().contiguous()
            for i in range(cols.shape[0]):
                _pwrite(fd, cols[i], at + (i * rows + a) * dtype.itemsize)
        else:
            _pwrite(fd, block.t().contiguous() if how == "t" else block.contiguous(), at + a * row_bytes)
        del block  # before the next block is read: one block in memory at a time


def _pwrite(fd: int, t: torch.Tensor, at: int) -> None:
    """The elements of ``t`` in row-major order at byte ``at`` of file ``fd``."""
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.new_empty(flat.shape).copy_(flat)  # a size-1 row of a transposed block keeps its stride
    data = memoryview(flat.view(torch.uint8).numpy())
    while len(data):
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n
