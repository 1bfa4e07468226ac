"""Durable small writes, shared by checkpoints and token files: a file's content flushed before
the rename that publishes it, and the directory's renames flushed after."""

from __future__ import annotations

import os
from pathlib import Path


def write_synced(path: str | Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes) to ``path`` and flush it to the disk: the rename that publishes it
    must not outlive its content in a power cut."""
    with open(path, "wb" if isinstance(text, bytes) else "w") as f:
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


def default_mode(paths: list[Path]) -> None:
    """Give each of ``paths`` the mode ``open()`` gives a new file (``0666`` less the umask: ``0644``
    under the usual ``022``): a writer that goes through a private temporary file (safetensors'
    ``save_file``) leaves ``0600``, unreadable by the others an exported model is for. The mode is
    read off a probe file created beside them, so the process's umask is never changed."""
    if not paths:
        return
    fd, probe = None, Path(paths[0]).parent / f".mode-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        if fd is not None:
            os.close(fd)
            os.unlink(probe)
    for path in paths:
        os.chmod(path, mode)
