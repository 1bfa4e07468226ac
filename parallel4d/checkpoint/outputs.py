"""What a command writes where the user says (``export``'s OUT_DIR, ``checkpoint gather``'s OUT,
``tokenize -o``, ``plot -o``, ``plan --json / --write / --write-profile``, ``schedule --plot``): the one
set of rules every such output follows.

* :func:`user_path`: ``~`` expands (an argument the shell left alone: ``--out=~/x``, a quoted path).
* :func:`check_output`, before any work: the output is refused in one line (``ConfigError``: the
  flag, the path, why, what to give instead) where it is one of the command's inputs or lies inside
  one, lies inside a checkpoint (or takes a checkpoint directory's own name: ``latest``, ``step_*``),
  is a directory where a file is written (or a file where a directory is), or is a place this process
  cannot write. Writability is asked of the kernel — a probe file created in the nearest directory
  that exists — not read off permission bits: root writes through modes, and a read-only mount, an
  immutable directory or a parent that is a regular file refuse everyone alike.
* :func:`new_file` and :func:`new_directory`: the output is written under a temporary name beside
  its place (the same file system) and renamed there only once complete, so a failure, Ctrl-C or
  SIGTERM leaves an earlier output as it was and no temporary or half-written file behind; an
  ``OSError`` while writing becomes one line naming the file.

Standard library only.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from parallel4d.config.errors import ConfigError
from parallel4d.checkpoint.checksums import CHECKSUMS
from parallel4d.checkpoint.files import fsync_dir
from parallel4d.checkpoint.steps import LATEST, step_dirs

#: (path, what it is to the command): e.g. ``(ckpt, "the checkpoint it reads")``
Inputs = Iterable[tuple[Path, str]]
_CHECKPOINT_FILES = (".metadata", CHECKSUMS)  # DCP's metadata; parallel4d's checksums, written last
# a checkpoint directory's own entries: latest, step_N, a save's .step_N.tmp, step_N.broken, ...
_OWN_NAME = re.compile(rf"{LATEST}|\.?step_\d+.*|\.{LATEST}\.tmp")


def user_path(path: str | Path) -> Path:
    """``path`` with a leading ``~`` (or ``~user``) expanded, as a shell would have."""
    return Path(os.path.expanduser(os.fspath(path)))


def same_file(a: Path, b: Path) -> bool:
    """One file: the same resolved path, or (hard or symbolic links) the same device and inode."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def _inside(path: Path, directory: Path) -> bool:
    """Whether ``path`` is ``directory`` or lies under it (symbolic links resolved)."""
    return path.resolve().is_relative_to(directory.resolve())


def _is_checkpoint(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _CHECKPOINT_FILES)


def _checkpoint_problem(out: Path) -> str | None:
    """Why writing ``out`` would change a checkpoint, or None."""
    resolved = out.resolve()
    for directory in (resolved, *resolved.parents):
        if _is_checkpoint(directory):
            return f"lies inside checkpoint {directory}, which it would change (its checksums would no longer hold)"
    root = resolved.parent
    if _OWN_NAME.fullmatch(resolved.name) and ((root / LATEST).is_file() or step_dirs(root)):
        return f"takes the name of an entry of checkpoint directory {root}, which a resume reads"
    return None


def _alias_problem(out: Path, inputs: Inputs) -> str | None:
    """Why writing ``out`` would write over or into one of ``inputs``, or None."""
    for source, what in inputs:
        if same_file(out, source):
            return f"is {what} ({source}), which it would write over"
        if source.is_dir() and _inside(out, source):
            return f"lies inside {what} ({source}), which it would change"
    return None


def _kind_problem(out: Path, kind: str) -> str | None:
    if kind == "file" and out.is_dir():
        return "is a directory, and a file is written there"
    if kind == "directory" and out.exists() and not out.is_dir():
        return "is a file, and a directory is written there"
    return None


def _writable_problem(out: Path, kind: str) -> str | None:
    """Why this process cannot create ``out`` (``kind``) or the files in it, or None: a probe file in
    the nearest directory that exists (then removed)."""
    place = out if kind == "directory" else out.parent
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        return f"cannot be created: {place} is a file, not a directory"
    failed = probe_write(place)
    return None if failed is None else f"cannot be written ({failed.strerror or failed} in {place})"


def probe_write(directory: Path) -> OSError | None:
    """Whether this process can create a file in the existing ``directory``, asked of the kernel (a probe
    file, then removed): root writes through modes, while a read-only mount or an immutable directory
    refuses everyone. The ``OSError`` that says why not, or None."""
    probe = Path(directory) / f".parallel4d-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        return e
    return None


def check_output(path: str | Path, flag: str, inputs: Inputs = (), kind: str = "file") -> Path:
    """``path`` (``~`` expanded) once a command may write its ``kind`` (``"file"`` or ``"directory"``)
    there; ``ConfigError`` naming ``flag`` and the path where it is or lies inside one of ``inputs``
    or a checkpoint, is of the other kind, or cannot be written (see the module docstring)."""
    out = user_path(path)
    problem = (_alias_problem(out, inputs) or _checkpoint_problem(out) or _kind_problem(out, kind)
               or _writable_problem(out, kind))
    if problem is not None:
        raise ConfigError(f"{flag} {out} {problem}; choose another {flag}: a {kind} where you can write, outside "
                          "the inputs and any checkpoint")
    return out


def through_link(path: Path) -> Path:
    """Where writing ``path`` lands: a symbolic link's target (an output kept on another disk stays
    there), else ``path`` itself."""
    return path.resolve() if path.is_symlink() else path


def _make_dirs(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; the ones created, outermost first."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()][::-1]
    for d in missing:
        d.mkdir()
    return missing


def _remove_dirs(created: list[Path]) -> None:
    """Remove the directories :func:`_make_dirs` created, where still empty (innermost first)."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            pass


def _failed(flag: str, target: Path, e: OSError) -> ConfigError:
    return ConfigError(f"{flag} {target}: writing failed ({e.strerror or e}: {e.filename or target}); nothing was "
                       f"left half written ({target} is as it was); free the space or fix the file and run it again")


@contextmanager
def temporary_beside(target: Path, flag: str) -> Iterator[Path]:
    """A new empty file beside ``target`` (the same directory: renamed over it atomically), with the
    mode ``open()`` gives a new file; removed on the way out unless it was renamed."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as e:
        raise _failed(flag, target, e) from None
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def new_file(path: Path, flag: str) -> Iterator[Path]:
    """Write the file ``path`` (through a symbolic link to its target): yields a temporary path beside
    it, renamed to ``path`` when the block ends without error; on an error it is removed (with the
    directories made for it) and ``path`` is as it was. An ``OSError`` becomes a ``ConfigError``."""
    target = through_link(path)
    created = []
    try:
        created = _make_dirs(target.parent)
        with temporary_beside(target, flag) as tmp:
            yield tmp
            os.replace(tmp, target)
        fsync_dir(target.parent)
    except OSError as e:
        _remove_dirs(created)
        raise _failed(flag, target, e) from None
    except BaseException:
        _remove_dirs(created)
        raise


def write_text(path: Path, flag: str, text: str) -> None:
    """``text`` into the file ``path`` by :func:`new_file`'s rules (a small output: a job, a profile, JSON)."""
    with new_file(path, flag) as tmp:
        tmp.write_text(text)


def _publish(tmp: Path, target: Path) -> None:
    """``tmp``'s files into ``target``: the directory renamed into place where ``target`` does not
    exist, else each file renamed over its namesake (``target``'s other files stay)."""
    if not target.exists():
        os.replace(tmp, target)
        fsync_dir(target.parent)
        return
    for f in sorted(tmp.iterdir()):
        os.replace(f, target / f.name)
    tmp.rmdir()
    fsync_dir(target)


@contextmanager
def new_directory(path: Path, flag: str) -> Iterator[Path]:
    """Write the directory ``path``: yields a new empty directory on its file system (beside it, or in
    it where it exists: a mount point), whose files go into ``path`` when the block ends without error
    (:func:`_publish`); on an error it is removed with everything in it and ``path`` is as it was. An
    ``OSError`` becomes a ``ConfigError``."""
    target = through_link(path)
    created, tmp = [], None
    try:
        created = _make_dirs(target.parent)
        where = target if target.is_dir() else target.parent
        tmp = where / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir()  # the mode a new directory gets (mkdtemp's would be 0700)
        yield tmp
        _publish(tmp, target)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        if isinstance(e, OSError):
            raise _failed(flag, target, e) from None
        raise
