"""What a job's ``model.pretrained`` directory brings besides weights, carried to ``parallel4d export``.

A Hugging Face model directory holds more than tensors: its ``config.json`` (with fields no
``model:`` field maps: special-token ids, ``transformers_version``, …), ``generation_config.json``,
the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
``vocab.json``, ``merges.txt``, ``tokenizer.model``, ``added_tokens.json``, ``chat_template.*``),
a README or licence. Rank 0 reads these small files once when training starts
(:func:`source_files`) and every checkpoint carries them under :data:`SOURCE_DIR` (checksummed with
the rest), so the export works wherever the pretrained directory has gone since.

The export (:func:`carry_source`) writes them beside the tensors, and ``config.json`` as the
original with only what training changed: the keys where the config parallel4d generates for the
trained model differs from the one it generates for the original's fields (none, for a model whose
``model:`` fields all came from the checkpoint), and ``dtype``, the tensors' own. Standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from parallel4d.config.hf_fields import model_fields_from_hf

if TYPE_CHECKING:
    from parallel4d.config.schema import ModelConfig

SOURCE_DIR = "pretrained"  # in each checkpoint: the pretrained directory's small files
MAX_SOURCE_FILE_BYTES = 64 << 20  # a tokenizer.json of a 256k vocabulary is ~35 MB; weights are not carried
# files that hold weights (or their index), never carried: the export writes the trained ones
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".npz",
                    ".npy", ".tflite", ".ot", ".pdparams", ".index.json")


def _carried(path: Path) -> bool:
    """A top-level regular file (a link to one included: the hub's cache links its blobs) that is not
    weights nor hidden (``.gitattributes``, a download's lock)."""
    return path.is_file() and not path.name.startswith(".") and not path.name.endswith(_WEIGHT_SUFFIXES)


def source_files(directory: str | Path) -> tuple[dict[str, bytes], list[str]]:
    """``({name: content}, [skipped])`` of the files of a pretrained ``directory`` that are not weights:
    each at most :data:`MAX_SOURCE_FILE_BYTES` (a larger one is skipped: ``"name (N bytes)"``)."""
    carried, skipped = {}, []
    for path in sorted(Path(directory).iterdir()):
        if not _carried(path):
            continue
        size = path.stat().st_size
        if size > MAX_SOURCE_FILE_BYTES:
            skipped.append(f"{path.name} ({size} bytes)")
        else:
            carried[path.name] = path.read_bytes()
    return carried, skipped


def checkpoint_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """:func:`source_files`' files under their names in a checkpoint (``pretrained/NAME``)."""
    return {f"{SOURCE_DIR}/{name}": data for name, data in files.items()}


def merged_config(original: dict, trained: dict, untrained: dict) -> dict:
    """``original`` (a pretrained ``config.json``) with the keys where ``trained`` (parallel4d's
    config.json of the trained model) differs from ``untrained`` (the same of the original's fields),
    then ``dtype`` (and an older file's ``torch_dtype``) as ``trained`` says."""
    changed = {k: v for k, v in trained.items() if k not in untrained or untrained[k] != v}
    out = {**original, **changed, "dtype": trained["dtype"]}
    if "torch_dtype" in original:  # transformers before 4.56 wrote this key
        out["torch_dtype"] = trained["dtype"]
    return out


def carry_source(ckpt: Path, out_dir: Path, model_cfg: ModelConfig,
                 hf_config: Callable[[ModelConfig], dict]) -> list[Path]:
    """Into an export ``out_dir`` (its tensors and parallel4d's ``config.json`` already written): the
    files checkpoint ``ckpt`` carries from its ``model.pretrained``, with ``config.json`` merged
    (:func:`merged_config`; ``hf_config(m)``: parallel4d's config.json of model ``m``, the tensors' dtype).
    Returns the files written (none for a job without ``model.pretrained``)."""
    source = Path(ckpt) / SOURCE_DIR
    if not source.is_dir():
        return []
    written = []
    for path in sorted(source.iterdir()):
        if path.name == "config.json":
            original = json.loads(path.read_text())
            # validated, not model_copy(update=...): the fields are plain values (rope_scaling a dict),
            # and only validation makes them the model's types
            untrained = type(model_cfg).model_validate({**model_cfg.model_dump(), **model_fields_from_hf(original)})
            config = merged_config(original, hf_config(model_cfg), hf_config(untrained))
            (out_dir / path.name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            (out_dir / path.name).write_bytes(path.read_bytes())
        written.append(out_dir / path.name)
    return written
