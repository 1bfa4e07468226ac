"""Save / resume through ``torch.distributed.checkpoint`` (DCP), atomically.

Layout under the checkpoint directory::

    step_00000010/        one DCP checkpoint (written as .step_00000010.tmp, then renamed)
    latest                the name of the newest complete checkpoint (replaced atomically)

A crash mid-save leaves only a ``.tmp`` directory, which is never loaded and is
removed by the next save: a checkpoint either loads completely or is not seen.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

LATEST = "latest"


def _name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    root = Path(root)
    marker = root / LATEST
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if (path / ".metadata").is_file() else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _dcp():
    # torch.distributed.checkpoint costs ~1 s to import; with 16 workers on a small
    # machine that is seconds of start-up for jobs that never save. Imported on first use.
    import torch.distributed.checkpoint as dcp

    return dcp


def __getattr__(name: str):  # ``checkpoint.dcp``, for callers (and tests) that patch it
    if name == "dcp":
        return _dcp()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save(state: dict, root: str | Path, step: int, keep: int = 2, extra_files: dict[str, str] | None = None) -> Path:
    """Collectively save ``state`` as checkpoint ``step``; every rank calls this."""
    root = Path(root)
    final = root / _name(step)
    tmp = root / f".{_name(step)}.tmp"
    if _is_writer():
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.tmp"):  # leftovers of an interrupted save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    _dcp().save(state, checkpoint_id=str(tmp))
    _barrier()
    if _is_writer():
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = root / f".{LATEST}.tmp"
        marker_tmp.write_text(final.name)
        os.replace(marker_tmp, root / LATEST)
        old = sorted(p for p in root.glob("step_*") if p.is_dir())
        for p in old[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def load(state: dict, path: str | Path) -> dict:
    """Load checkpoint ``path`` into ``state`` in place (every rank calls this)."""
    _dcp().load(state, checkpoint_id=str(path))
    return state
