"""Checksums of a checkpoint's files (``checksums.json``: size and sha256 of every other file, written last
by the save) and :func:`verify`, which names the first file that does not match."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from parallel4d.checkpoint.files import write_synced
from parallel4d.checkpoint.steps import RUN_INFO

CHECKSUMS = "checksums.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(directory: Path) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    table = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    write_synced(directory / CHECKSUMS, json.dumps({"files": table}, indent=1))


def verify(path: str | Path) -> str | None:
    """What is wrong with checkpoint ``path`` (naming the file), or None if every file matches.

    Reads every file once (sha256). A checkpoint from before checksums (neither
    ``run.json`` nor ``checksums.json``) is accepted unverified.
    """
    path = Path(path)
    if not path.is_dir():
        return "the directory does not exist"
    if not (path / CHECKSUMS).is_file():
        if (path / RUN_INFO).exists():
            return f"no {CHECKSUMS} (an incomplete save)"
        if not (path / ".metadata").is_file():
            return "no .metadata file (an incomplete save)"
        return None  # the layout before checksums
    try:
        table = json.loads((path / CHECKSUMS).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{CHECKSUMS} is unreadable ({e})"
    for name, want in table.items():
        file = path / name
        if not file.is_file():
            return f"file {name} is missing"
        try:
            size = file.stat().st_size
            if size != want["size"]:
                return f"file {name} has {size} bytes, {want['size']} were saved (truncated or overwritten)"
            if _sha256(file) != want["sha256"]:
                return f"file {name} does not match its sha256 checksum (corrupted)"
        except OSError as e:
            return f"file {name} cannot be read ({e.strerror or e})"
    return None
