"""Flat token files (``data.source: tokens``): the rules, standard library only.

``OUT.bin`` holds token ids back to back (``uint16`` or ``uint32``, the machine's byte order); ``OUT.json``
beside it says ``{"dtype", "tokens", "vocab_size", "tokenizer", "eos_token_id"}``. ``parallel4d
tokenize`` writes both; the config checks them before any worker starts, the dataset maps the file.
"""

from __future__ import annotations

import json
from pathlib import Path

ITEM_BYTES = {"uint16": 2, "uint32": 4}


def sidecar_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def read_sidecar(path: str | Path, field: str = "data.path") -> dict:
    """The sidecar of token file ``path`` (the config ``field`` naming it); ValueError naming the
    file and the fix."""
    side = sidecar_path(path)
    try:
        meta = json.loads(side.read_text())
    except OSError as e:
        raise ValueError(f"{field}={str(path)!r}: cannot read its sidecar {side} ({e.strerror}); write both "
                         "with `parallel4d tokenize`") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}={str(path)!r}: its sidecar {side} is not JSON ({e}); write it again with "
                         "`parallel4d tokenize`") from None
    missing = [k for k in ("dtype", "tokens", "vocab_size") if k not in meta]
    if missing or meta["dtype"] not in ITEM_BYTES:
        raise ValueError(f"{field}={str(path)!r}: its sidecar {side} needs dtype (uint16 or uint32), tokens and "
                         f"vocab_size; it has {sorted(meta)} with dtype {meta.get('dtype')!r}")
    return meta


def token_file_problems(path: str | Path, vocab_size: int, seq_len: int, field: str = "data.path") -> list[str]:
    """What stops ``path`` (the config ``field``) from feeding a model of ``vocab_size`` and ``seq_len``."""
    try:
        meta = read_sidecar(path, field)
        size = Path(path).stat().st_size
    except ValueError as e:
        return [str(e)]
    except OSError as e:
        return [f"{field}={str(path)!r} cannot be read ({e.strerror}); give the .bin file `parallel4d tokenize` "
                "wrote"]
    out = []
    want = meta["tokens"] * ITEM_BYTES[meta["dtype"]]
    if size == 0:
        out.append(f"{field}={str(path)!r} is empty; tokenize some text into it (`parallel4d tokenize`)")
    elif size != want:
        out.append(f"{field}={str(path)!r} has {size} bytes but its sidecar {sidecar_path(path)} says "
                   f"{meta['tokens']} {meta['dtype']} tokens = {want} bytes (truncated or another file's sidecar?); "
                   "tokenize it again")
    elif meta["tokens"] <= seq_len + 1:
        out.append(f"{field}={str(path)!r} holds {meta['tokens']} tokens, not more than model.seq_len+1="
                   f"{seq_len + 1}; tokenize more text or lower model.seq_len")
    if meta["vocab_size"] > vocab_size:
        out.append(f"{field}={str(path)!r} was tokenized with a vocabulary of {meta['vocab_size']} but "
                   f"model.vocab_size={vocab_size}; set model.vocab_size≥{meta['vocab_size']}")
    return out
