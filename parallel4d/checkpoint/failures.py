"""When checkpoint I/O fails: :class:`CheckpointError`, why (:func:`diagnose`: permission, free space,
file size limit), and every rank agreeing on it — rank 0 decides and broadcasts (:func:`on_writer`), or
every rank's outcome is gathered (:func:`any_failed`), so that none waits for a peer that gave up.
Every function works without a process group (one process).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from parallel4d.distributed import comm


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, verified or loaded; the message names the path and why."""


class UnusableCheckpoint(CheckpointError):
    """What the user pointed at (a checkpoint, a directory of them, a run to resume) holds nothing this
    job or command can use: a refusal (the CLI's one line, exit 2), where a save or read that fails
    midway is a failure (exit 1). The message names the path, why and what to do."""


def is_writer() -> bool:
    """Whether this rank writes the checkpoint's own files (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def failure_types() -> tuple[type[BaseException], ...]:
    """What a checkpoint operation may raise on failure."""
    # DCP reports a failure on any rank as CheckpointException, a BaseException.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _plain(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def on_writer(fn: Callable[[], Any], what: str, explain: Callable[[BaseException], str] = _plain) -> Any:
    """Run ``fn`` on the writer; every rank returns its result, or raises CheckpointError(explain(error))
    (:class:`UnusableCheckpoint` where the writer's error was one: a refusal on every rank).
    ``what`` names the step for a peer that waits too long (``comm.CommTimeout``)."""
    value, error, message = None, None, None
    if is_writer():
        try:
            value = fn()
        except failure_types() as e:
            error, message = e, explain(e)
    refused = isinstance(error, UnusableCheckpoint)
    if dist.is_initialized():
        box = [(value, message, refused)]
        with comm.named(f"{what} (rank 0 decides, every rank waits for it)", None):
            dist.broadcast_object_list(box, src=0)
        value, message, refused = box[0]
    if message is not None:
        raise (UnusableCheckpoint if refused else CheckpointError)(message) from error
    return value


def any_failed(what: str, message: str | None, own: bool = True) -> str | None:
    """Every rank's ``message`` (None: this rank succeeded) gathered: the first one about a rank's
    own failure (``own``), else the first one; None if every rank succeeded."""
    if not dist.is_initialized():
        return message
    out: list = [None] * dist.get_world_size()
    with comm.named(f"{what} (every rank's outcome gathered)", None):
        dist.all_gather_object(out, (own, message))
    failed = [(not o, m) for o, m in out if m is not None]
    return min(failed, key=lambda f: f[0])[1] if failed else None


def own_failure(error: BaseException) -> bool:
    """False when ``error`` only reports that another rank failed (DCP lists the failing ranks)."""
    failures = getattr(error, "failures", None)
    return not (failures and dist.is_initialized() and dist.get_rank() not in failures)


# --- why a save failed ------------------------------------------------------------------------------


def _causes(exc: BaseException):
    """``exc``, its chain, and the per-rank failures DCP wraps, depth first."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple) and f]


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def diagnose(exc: BaseException, path: str | Path) -> str:
    """Why writing under ``path`` failed with ``exc``: errno, permission, free space, file size limit."""
    where = _existing(Path(path))
    os_err = next((e for e in _causes(exc) if isinstance(e, OSError) and e.errno), None)
    code = os_err.errno if os_err else None
    facts = []
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or not os.access(where, os.W_OK | os.X_OK):
        facts.append(f"no permission to write in {where}")
    free = shutil.disk_usage(where).free
    if code in (errno.ENOSPC, errno.EDQUOT) or free < (1 << 20):
        facts.append(f"the disk or the quota is full, {free} bytes free on the file system of {where}")
    limit = _file_size_limit()
    if code == errno.EFBIG or (code is None and limit is not None):
        facts.append(f"the file size limit RLIMIT_FSIZE (ulimit -f) is {limit} bytes" if limit is not None
                     else "a file grew past the largest size the file system allows")
    if code:
        detail = f"{os.strerror(code)}, errno {errno.errorcode.get(code, code)}" + \
            (f", {os_err.filename}" if os_err.filename else "")
    else:
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    return f"{'; '.join(facts)} ({detail})" if facts else detail


def describe(exc: BaseException) -> str:
    """``exc`` in one line; each failing rank's error when DCP gathered them."""
    failures = getattr(exc, "failures", None)
    if failures:
        return "; ".join(f"rank {r}: {type(f[0]).__name__}: {f[0]}" for r, f in failures.items())
    return f"{type(exc).__name__}: {exc}"
