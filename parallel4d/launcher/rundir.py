"""The run directory before any worker starts: writable, and used by one job at a time.

``check_writable`` creates the directory and a probe file in it, so a chmod-555 or
read-only ``train.out_dir`` is reported before training rather than at the first
save; a launch refused (or ended) before writing in a directory it created removes it again
(:func:`first_missing`, :func:`remove_if_unused`). :class:`RunLock` holds an exclusive ``flock`` on
``<dir>/.parallel4d.lock`` for the job's lifetime, with the holder's pid, host and start time written in
it: a second job on the same directory is refused at once, naming them. The
kernel drops the lock when its holder dies, so a lock file left by a killed job
is stale by construction: the next job takes it over (and says so).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from parallel4d.checkpoint.outputs import probe_write
from parallel4d.config.errors import ConfigError

LOCK_NAME = ".parallel4d.lock"


def check_writable(path: str | Path, field: str) -> None:
    """Create ``path`` and a probe file in it; ``ConfigError`` naming ``field`` and why not."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        failed = probe_write(path)
    except OSError as e:
        failed = e
    if failed is not None:
        why = os.strerror(failed.errno) if failed.errno else str(failed)
        raise ConfigError(f"{field}={str(path)!r} is not writable ({why}: {failed.filename or path}); "
                          f"choose a directory you can write to, or fix its permissions") from None


def first_missing(path: str | Path) -> Path | None:
    """The outermost directory of ``path`` (itself or a parent) that does not exist yet: what creating it
    creates; None when it exists."""
    path = Path(path).absolute()
    missing = None
    for d in (path, *path.parents):
        if d.exists() or d.is_symlink():
            return missing
        missing = d
    return missing


def remove_if_unused(directory: Path) -> None:
    """Remove ``directory`` when it holds nothing but empty directories and run locks (:class:`RunLock`'s,
    which a launch that ended having written nothing leaves): a launch leaves nothing behind that it
    created for a run it never ran. Anything else in it keeps it whole."""
    if _unused(directory):
        try:
            _remove_unused(directory)
        except OSError:  # written meanwhile: what is left stays
            pass


def _unused(d: Path) -> bool:
    try:
        return d.is_dir() and not d.is_symlink() and all(
            (e.name == LOCK_NAME and e.is_file() and not e.is_symlink()) or _unused(e) for e in d.iterdir())
    except OSError:
        return False


def _remove_unused(d: Path) -> None:
    for entry in d.iterdir():
        if entry.is_dir():
            _remove_unused(entry)
        else:
            entry.unlink()
    d.rmdir()


HISTORY = ("summary.json", "metrics.jsonl")  # what a run writes into train.out_dir about itself


def check_history(out_dir: str | Path, resume: bool, continues: bool) -> None:
    """Refuse a run that would rewrite another run's history in ``out_dir``: a fresh run (``resume``
    false), or a resumed one with no checkpoint it ``continues`` from (it would start at step 0).
    ``ConfigError`` naming the files, ``train.resume`` and the fix."""
    found = [name for name in HISTORY if (Path(out_dir) / name).exists()]
    if not found or (resume and continues):
        return
    shown = " and ".join(found)
    if resume:
        raise ConfigError(f"train.resume=true but no checkpoint continues the run whose history ({shown}) is in "
                          f"train.out_dir={str(out_dir)!r} (checkpoints disabled, or none saved), so this run would "
                          "start at step 0 and write over it; give this run another train.out_dir, or move those "
                          "files away")
    raise ConfigError(f"train.resume=false but train.out_dir={str(out_dir)!r} holds another run's history ({shown}), "
                      "which a fresh run would write over; set train.resume=true to continue that run, give this "
                      "run another train.out_dir, or move those files away")


class RunDirInUse(ConfigError):
    """Another live job holds the run directory's lock."""


class RunLock:
    """Exclusive lock on each of ``dirs`` for one job (a context manager)."""

    def __init__(self, dirs: list[str | Path], field: str = "train.out_dir"):
        self.dirs = list(dict.fromkeys(Path(d).resolve() for d in dirs))
        self.field = field
        self._files: list = []

    def __enter__(self) -> "RunLock":
        try:
            for d in self.dirs:
                self._files.append(self._acquire(d))
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _acquire(self, directory: Path):
        path = directory / LOCK_NAME
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _describe(_read(f))
            f.close()
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirInUse(f"{directory} is in use by another parallel4d job ({holder}); wait for it to "
                              f"finish, or give this job another {self.field}") from None
        stale = _read(f)
        if stale and stale.get("pid") != os.getpid():
            print(f"[parallel4d] taking over the stale lock of {directory} ({_describe(stale)}, no longer running)",
                  file=sys.stderr, flush=True)
        f.seek(0)
        f.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "command": " ".join(sys.argv)[:200]}, f)
        f.flush()
        return f

    def release(self) -> None:
        for f in self._files:
            try:
                f.seek(0)
                f.truncate()  # an empty lock file is not reported as stale
                fcntl.flock(f, fcntl.LOCK_UN)
            finally:
                f.close()
        self._files.clear()


def _read(f) -> dict:
    try:
        f.seek(0)
        return json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(info: dict) -> str:
    if not info:
        return "holder unknown"
    return f"pid {info.get('pid')} on host {info.get('host')}, started {info.get('started')}"
