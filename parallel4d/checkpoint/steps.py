"""The names in a checkpoint directory: ``step_*`` checkpoints, the temporary and aside directories a
save goes through, those set aside as broken, ``latest``, and each checkpoint's ``run.json``."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from parallel4d.checkpoint.files import fsync_dir, write_synced

LATEST = "latest"
RUN_INFO = "run.json"
_STEP = re.compile(r"step_(\d+)")
_BROKEN = re.compile(r"step_\d+\.broken\d*")
WHY_BROKEN = "BROKEN.txt"  # in a checkpoint set aside: why it failed verification


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    m = _STEP.fullmatch(path.name)
    return int(m.group(1)) if m else None


def step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories (final names only) under ``root``, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and p.is_dir()]
    return sorted(found, key=step_of, reverse=True)


def broken_dirs(root: Path) -> list[Path]:
    """The checkpoints an earlier resume set aside as broken (``step_*.broken*``), newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _BROKEN.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def tmp_name(step: int) -> str:
    """Where a checkpoint is written until it is complete (then renamed to :func:`step_name`)."""
    return f".{step_name(step)}.tmp"


TMP_GLOB = ".step_*.tmp"  # every tmp_name


def save_in_progress(root: str | Path, since: float) -> str | None:
    """``"step 12"`` while a save into ``root`` started after ``since`` (epoch seconds) is under way,
    else None: a temporary directory older than that is an earlier crash's (the next save removes it)."""
    for tmp in Path(root).glob(TMP_GLOB):
        try:
            if tmp.stat().st_mtime >= since:
                return f"step {int(tmp.name[len('.step_'):-len('.tmp')])}"
        except (OSError, ValueError):  # renamed meanwhile, or not one of save's names
            continue
    return None


def latest_name(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def set_latest(root: Path, final: Path) -> None:
    if latest_name(root) == final.name:
        return
    tmp = root / f".{LATEST}.tmp"
    write_synced(tmp, final.name)
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def read_info(path: str | Path) -> dict:
    """``run.json`` of checkpoint ``path`` (run id, step, the saver's info); ``{}`` if absent or unreadable."""
    try:
        info = json.loads((Path(path) / RUN_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def describe_checkpoint(path: Path) -> str:
    """``"step 340 of runs/first/checkpoints"`` (the step its ``run.json`` records, else its name's), or
    ``"checkpoint PATH"`` for a directory that tells no step: what a command that read it says."""
    step = read_info(path).get("step")
    step = step if isinstance(step, int) else step_of(path)
    return f"checkpoint {path}" if step is None else f"step {step} of {path.parent}"


def new_run_id() -> str:
    """A fresh run id: readable start time plus random bits."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def recover(root: Path) -> None:
    """Finish what a crash during a replacement left: put an aside step back if its step is missing."""
    for aside in root.glob(".step_*.old"):
        final = root / aside.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)
