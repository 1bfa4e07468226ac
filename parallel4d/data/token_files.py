"""Flat token files (``data.source: tokens``): the rules, standard library only.

``OUT.bin`` holds token ids back to back (``uint16`` or ``uint32``, the machine's byte order); ``OUT.json``
beside it says ``{"dtype", "tokens", "vocab_size", "max_id", "sha256", "tokenizer", "tokenizer_sha256",
"tokenizer_fingerprint", "eos_token_id"}``, and for chat data ``"loss_mask": {"sha256", "tokens_with_loss"}``:
the loss mask ``OUT.mask`` beside (:func:`loss_mask_path`: one byte per token, 1 where the token is a
target that carries loss — an answer's — and 0 where it is not) (``tokenizer_fingerprint``: a hash of each part of the
tokenizer.json that decides the ids, :mod:`.tokenizer_identity`; sidecars from before it hold the file's
``tokenizer_sha256`` only). ``parallel4d tokenize`` writes both; the config checks the sidecar before any worker
starts (sizes, vocabulary, largest id), and :func:`content_problems` the file's bytes against its
``sha256``, and a loss mask's against the ``loss_mask`` entry's (once: a stamp ``.OUT.bin.verified`` —
``.OUT.mask.verified`` — beside each records a verified file, keyed by its size, times and inode, so an
unchanged file is not hashed again); the dataset maps the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

from parallel4d.data.tokenizer_identity import differing_parts, fingerprint

ITEM_BYTES = {"uint16": 2, "uint32": 4}
HASH_BLOCK = 8 << 20  # bytes hashed per read: the file is never in memory whole
PROGRESS_BYTES = 1 << 30  # files from this size on say on stderr how far the hashing is
_SHA256 = re.compile(r"[0-9a-f]{64}")


def sidecar_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def loss_mask_path(path: str | Path) -> Path:
    """The loss mask of token file ``path`` (``train.bin`` → ``train.mask``): one uint8 per token."""
    path = Path(path)
    return path.with_name(path.stem + ".mask")


def stamp_path(path: str | Path) -> Path:
    """Where a verified ``path`` is recorded (a dot file beside it)."""
    path = Path(path)
    return path.with_name(f".{path.name}.verified")


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _is_count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _sidecar_type_problem(meta: dict) -> str | None:
    if meta["dtype"] not in ITEM_BYTES:
        return f"dtype {meta['dtype']!r} (uint16 or uint32)"
    for key, least in (("tokens", 0), ("vocab_size", 1), ("max_id", 0)):
        if key in meta and not _is_count(meta[key], least):
            return f"{key} {meta[key]!r} (an integer ≥ {least})"
    for key in ("sha256", "tokenizer_sha256"):
        if key in meta and not _is_sha256(meta[key]):
            return f"{key} {meta[key]!r} (64 lowercase hex digits)"
    mask = meta.get("loss_mask")
    if mask is not None and not (isinstance(mask, dict) and _is_sha256(mask.get("sha256"))
                                 and _is_count(mask.get("tokens_with_loss"), 1)):
        return f"loss_mask {mask!r} (its sha256 and tokens_with_loss ≥ 1)"
    parts = meta.get("tokenizer_fingerprint")
    if parts is not None and not (isinstance(parts, dict) and parts and all(map(_is_sha256, parts.values()))):
        return f"tokenizer_fingerprint {parts!r} (each part's 64 lowercase hex digits)"
    return None


def _is_sha256(value) -> bool:
    return isinstance(value, str) and bool(_SHA256.fullmatch(value))


def read_sidecar(path: str | Path, field: str = "data.path") -> dict:
    """The sidecar of token file ``path`` (the config ``field`` naming it); ValueError naming the
    file and the fix."""
    side = sidecar_path(path)
    try:
        meta = json.loads(side.read_text())
    except OSError as e:
        raise ValueError(f"{field}={str(path)!r}: cannot read its sidecar {side} ({e.strerror}); write both "
                         "with `parallel4d tokenize`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{field}={str(path)!r}: its sidecar {side} is not JSON ({e}); write it again with "
                         "`parallel4d tokenize`") from None
    missing = [k for k in ("dtype", "tokens", "vocab_size") if k not in meta] if isinstance(meta, dict) else ["all"]
    if missing:
        raise ValueError(f"{field}={str(path)!r}: its sidecar {side} needs dtype (uint16 or uint32), tokens and "
                         f"vocab_size; it lacks {', '.join(missing)}; write it again with `parallel4d tokenize`")
    wrong = _sidecar_type_problem(meta)
    if wrong:
        raise ValueError(f"{field}={str(path)!r}: its sidecar {side} has {wrong}; write it again with "
                         "`parallel4d tokenize`")
    return meta


def token_file_problems(path: str | Path, vocab_size: int, seq_len: int, field: str = "data.path") -> list[str]:
    """What stops ``path`` (the config ``field``) from feeding a model of ``vocab_size`` and ``seq_len``,
    from its size and sidecar (its bytes: :func:`content_problems`)."""
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
    elif "loss_mask" in meta and _size(loss_mask_path(path)) != meta["tokens"]:
        out.append(f"{field}={str(path)!r}: its loss mask {loss_mask_path(path)} should hold one byte per token "
                   f"({meta['tokens']}) but has {_size(loss_mask_path(path))}; tokenize it again")
    elif meta["tokens"] <= seq_len + 1:
        out.append(f"{field}={str(path)!r} holds {meta['tokens']} tokens, not more than model.seq_len+1="
                   f"{seq_len + 1}; tokenize more text or lower model.seq_len")
    if meta["vocab_size"] > vocab_size:
        out.append(f"{field}={str(path)!r} was tokenized with a vocabulary of {meta['vocab_size']} but "
                   f"model.vocab_size={vocab_size}; set model.vocab_size≥{meta['vocab_size']}")
    elif meta.get("max_id", -1) >= vocab_size:
        out.append(f"{field}={str(path)!r} holds token id {meta['max_id']} (its sidecar's max_id) but "
                   f"model.vocab_size={vocab_size}; set model.vocab_size≥{meta['max_id'] + 1}, or tokenize with "
                   "the model's tokenizer")
    return out


def _size(path: Path) -> int | None:
    """``path``'s size in bytes, None where it cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def _say(line: str, end: str = "\n") -> None:
    print(line, end=end, file=sys.stderr, flush=True)


def file_sha256(path: str | Path, label: str | None = None) -> str:
    """The sha256 of ``path``, read in blocks; a file of at least :data:`PROGRESS_BYTES` reports its
    progress on stderr as ``label`` (on one line at a terminal, a start and an end line in a log)."""
    size = os.stat(path).st_size
    loud = label is not None and size >= PROGRESS_BYTES
    live = loud and sys.stderr.isatty()
    digest, block, done = hashlib.sha256(), bytearray(HASH_BLOCK), 0
    view, start, shown = memoryview(block), time.monotonic(), 0.0
    if loud and not live:
        _say(f"[parallel4d] {label}: hashing {size / 1e9:.1f} GB once (an unchanged file is not hashed again)")
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            digest.update(view[:n])
            done += n
            if live and time.monotonic() - shown > 0.5:
                shown = time.monotonic()
                _say(f"\r[parallel4d] {label}: hashing {done / 1e9:.1f}/{size / 1e9:.1f} GB", end="")
    if loud:
        took = time.monotonic() - start
        _say(f"{chr(13) if live else ''}[parallel4d] {label}: hashed {size / 1e9:.1f} GB in {took:.1f} s "
             f"({size / 1e6 / max(took, 1e-9):.0f} MB/s)")
    return digest.hexdigest()


def _stamp_key(path: Path, sha256: str) -> dict:
    """What must not change for a verified file to count as verified still: any write moves its
    mtime and ctime (ctime cannot be set back), a replacement its inode."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "dev": st.st_dev,
            "ino": st.st_ino, "sha256": sha256}


def _stamped(path: Path, key: dict) -> bool:
    """Whether the stamp records ``key``, and was written after the file's last change: file times
    move in clock ticks of milliseconds, so a write in the very tick of the stamp could leave them
    as they were; a stamp from a later tick cannot miss one (as git's "racily clean" index entries)."""
    stamp = stamp_path(path)
    try:
        return json.loads(stamp.read_text()) == key and stamp.stat().st_mtime_ns > key["ctime_ns"]
    except (OSError, ValueError):
        return False


def record_verified(path: str | Path, sha256: str, key: dict | None = None) -> None:
    """Stamp ``path`` as holding the bytes of ``sha256`` (``key``: as it was before they were hashed;
    nothing is recorded if it changed since); silently nothing where its directory is not writable
    (the next check hashes it again)."""
    now = _stamp_key(Path(path), sha256)
    if key is not None and key != now:
        return
    stamp = stamp_path(path)
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(now) + "\n")
        os.replace(tmp, stamp)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _warn(line: str) -> None:
    _say(f"[parallel4d] warning: {line}")


def _tokenizer_problem(path, field: str, meta: dict, pretrained: str | Path | None) -> str | None:
    """The data's tokenizer against ``model.pretrained``'s tokenizer.json, where both are known,
    compared by what decides the ids (:mod:`.tokenizer_identity`), not by the files' bytes."""
    theirs = Path(pretrained) / "tokenizer.json" if pretrained else None
    if theirs is None or not theirs.is_file() or not ({"tokenizer_fingerprint", "tokenizer_sha256"} & set(meta)):
        return None
    try:
        model_parts = fingerprint(theirs)
    except ValueError as e:
        return f"model.pretrained={str(pretrained)!r}: its {e}"
    ours = meta.get("tokenizer_fingerprint") or _older_sidecars_fingerprint(meta, theirs, model_parts)
    if ours is None:  # an older sidecar whose tokenizer file is gone or changed: nothing left to compare
        named = meta.get("tokenizer", "it was tokenized with")
        return (f"{field}={str(path)!r}: its sidecar (written by an older parallel4d) records only the sha256 of the "
                f"file {named}, not that of {theirs} (model.pretrained's), and {named} is gone or changed, so what "
                f"decides their ids cannot be compared; tokenize again with --tokenizer {theirs}")
    differ = differing_parts(ours, model_parts)
    if not differ:
        return None
    return (f"{field}={str(path)!r} was tokenized with {meta.get('tokenizer', 'another tokenizer')} but "
            f"model.pretrained={str(pretrained)!r} has another tokenizer.json (their {', '.join(differ)} differ): "
            f"its ids mean other tokens to the model; tokenize again with --tokenizer {theirs}")


def _older_sidecars_fingerprint(meta: dict, theirs: Path, model_parts: dict) -> dict | None:
    """For a sidecar from before fingerprints (``tokenizer_sha256``, the file's hash, only): the model's
    own fingerprint ``model_parts`` when the files are equal, else that of the file the sidecar names
    while it still holds those bytes; None when neither can tell."""
    if file_sha256(theirs) == meta["tokenizer_sha256"]:
        return model_parts
    named = Path(meta.get("tokenizer") or "")
    try:
        if named.is_file() and file_sha256(named) == meta["tokenizer_sha256"]:
            return fingerprint(named)
    except (OSError, ValueError):
        pass
    return None


def content_problems(path: str | Path, field: str = "data.path", pretrained: str | Path | None = None,
                     warn: Callable[[str], None] = _warn) -> list[str]:
    """Whether ``path``'s bytes are those its sidecar's ``sha256`` records (hashed once: see
    :func:`record_verified`) and were tokenized with ``pretrained``'s tokenizer (where both are known).
    A sidecar from before checksums is accepted, and ``warn`` told so. Run after
    :func:`token_file_problems` found none."""
    try:
        return _content_problems(Path(path), field, pretrained, warn)
    except ValueError as e:  # the sidecar changed since the config was checked
        return [str(e)]
    except OSError as e:
        return [f"{field}={str(path)!r} cannot be read ({e.strerror}: {e.filename}); give the .bin file "
                "`parallel4d tokenize` wrote"]


def _content_problems(path: Path, field: str, pretrained, warn) -> list[str]:
    meta = read_sidecar(path, field)
    problem = _tokenizer_problem(path, field, meta, pretrained)
    if problem:
        return [problem]
    if "sha256" not in meta:
        warn(f"{field}={str(path)!r}: its sidecar records no sha256 (written by an older parallel4d), so its "
             "content cannot be checked; tokenize it again to record one")
        return []
    if not _holds(path, meta["sha256"], f"checking {field}={str(path)!r}"):
        return [f"{field}={str(path)!r} changed since `parallel4d tokenize` wrote it (its sha256 differs from the "
                f"one in {sidecar_path(path)}); tokenize it again"]
    mask = loss_mask_path(path)
    if "loss_mask" in meta and not _holds(mask, meta["loss_mask"]["sha256"], f"checking {mask}"):
        return [f"{field}={str(path)!r}: its loss mask {mask} changed since `parallel4d tokenize` wrote it (its "
                f"sha256 differs from the loss_mask one in {sidecar_path(path)}); tokenize it again"]
    return []


def _holds(path: Path, sha256: str, label: str) -> bool:
    """Whether ``path`` holds the bytes of ``sha256``: stamped as verified, or hashed now (and stamped)."""
    key = _stamp_key(path, sha256)
    if _stamped(path, key):
        return True
    if file_sha256(path, label) != sha256:
        return False
    record_verified(path, sha256, key)
    return True
