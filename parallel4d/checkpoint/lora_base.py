"""The frozen base of a LoRA job, named in its checkpoints instead of copied (no tensor read).

A checkpoint of a job with ``model.lora`` holds the adapters and their optimizer state only; the base
it was trained on is recorded in :data:`BASE_FILE` (``lora_base.json``): ``model.pretrained``'s
directory (absolute) with a fingerprint of its weight files (:func:`fingerprint`), or — a job without
``model.pretrained`` — the ``train.seed`` its random base is built from. A resume, ``parallel4d export``
and ``parallel4d generate`` rebuild the base from that record and refuse one that is not the base the
adapters were trained on (:func:`base_problem`), naming both.

The fingerprint is not a checksum of every byte (a 60 GB base would take minutes to hash at each
start): it hashes each ``*.safetensors`` file's name, size and header (every tensor's name, dtype, shape
and offsets) and :data:`SAMPLES` blocks of :data:`SAMPLE_BYTES` spread evenly over its data, so another
model, another fine-tune of the same architecture or a re-saved copy in another dtype differs, while a
copy of the same files elsewhere (another path, the hub's cache) is the same base.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from parallel4d.checkpoint.failures import UnusableCheckpoint

BASE_FILE = "lora_base.json"
SAMPLES = 16
SAMPLE_BYTES = 4096


def fingerprint(directory: str | Path) -> str:
    """sha256 over the ``*.safetensors`` of ``directory`` (sorted by name): each file's name, size, header
    and :data:`SAMPLES` evenly spaced blocks of its data; ``OSError`` for an unreadable file."""
    h = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            h.update(f.read(min(n, size)))
            start = 8 + n
            span = max(size - start - SAMPLE_BYTES, 0)
            for i in range(SAMPLES):
                f.seek(start + span * i // max(SAMPLES - 1, 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def base_record(model_cfg, seed: int) -> dict:
    """What :data:`BASE_FILE` says of the base of ``model_cfg`` (a job with ``model.lora``): its pretrained
    directory and :func:`fingerprint`, or the seed of its random initialisation."""
    if model_cfg.pretrained:
        where = Path(model_cfg.pretrained).expanduser().resolve()
        return {"pretrained": str(where), "fingerprint": fingerprint(where)}
    return {"pretrained": None, "seed": seed}


def base_file(model_cfg, seed: int) -> dict[str, str]:
    """``{BASE_FILE: its JSON}`` for a checkpoint's extra files (none without ``model.lora``)."""
    if model_cfg.lora is None:
        return {}
    return {BASE_FILE: json.dumps(base_record(model_cfg, seed), indent=2) + "\n"}


def saved_base(ckpt: str | Path) -> dict | None:
    """The base record checkpoint ``ckpt`` carries; None when it has none (not a LoRA job's)."""
    path = Path(ckpt) / BASE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _said(record: dict) -> str:
    if record.get("pretrained"):
        return f"model.pretrained={record['pretrained']!r} (fingerprint {record.get('fingerprint', '?')[:12]}…)"
    return f"the random base of train.seed={record.get('seed')}"


def base_problem(saved: dict, now: dict, ckpt: str | Path) -> str | None:
    """Why the base ``now`` (a :func:`base_record`) is not ``saved``, the one checkpoint ``ckpt``'s adapters were
    trained on (the caller says the fix); None when it is (the same fingerprint, wherever the files are now)."""
    if saved.get("pretrained") and now.get("pretrained"):
        same = saved.get("fingerprint") == now.get("fingerprint")
    else:
        same = saved.get("pretrained") is None and now.get("pretrained") is None and saved.get("seed") == now.get("seed")
    return None if same else f"checkpoint {ckpt} holds LoRA adapters trained on {_said(saved)}, not on {_said(now)}"


def check_base(ckpt: str | Path, model_cfg, seed: int) -> None:
    """:class:`~.failures.UnusableCheckpoint` unless checkpoint ``ckpt``'s adapters were trained on the base
    of ``model_cfg`` / ``seed`` (:func:`base_problem`); nothing to check for a checkpoint without a record."""
    saved = saved_base(ckpt)
    problem = base_problem(saved, base_record(model_cfg, seed), ckpt) if saved is not None else None
    if problem:
        raise UnusableCheckpoint(f"{problem}; point model.pretrained at the base the adapters were trained on (or "
                                 "set the train.seed they were), or start afresh in another train.out_dir")
