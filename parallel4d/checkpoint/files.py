"""Durable small writes, shared by checkpoints and token files: a file's content flushed before
the rename that publishes it, and the directory's renames flushed after."""

from __future__ import annotations

import os
from pathlib import Path


def write_synced(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` and flush it to the disk: the rename that publishes it must not
    outlive its content in a power cut."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make the renames into directory ``path`` survive a power cut (where the file system can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # not every file system syncs directories; the rename itself is still atomic
        pass
