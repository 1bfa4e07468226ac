"""Save and load checkpoints through ``torch.distributed.checkpoint`` (DCP): atomic, verified, one run at a time.

Layout under the checkpoint directory::

    step_00000010/         one checkpoint, written as .step_00000010.tmp and renamed once complete
        .metadata, *.distcp    DCP's files (each rank writes its own shards), or DeepSpeed's
                               (*_model_states.pt, *_optim_states.pt) under a deepspeed: section
        config.yaml            the job's config (extra_files of the caller)
        pretrained/            model.pretrained's config.json, tokenizer and other small files (checkpoint/hf_source.py)
        lora_base.json         a LoRA job's base, named: its model.* tensors are the adapters only (checkpoint/lora_base.py)
        run.json               run id, step, save time and the caller's info (train.py: loss history)
        checksums.json         size and sha256 of every other file; written last, before the rename
    latest                 the name of the newest checkpoint (replaced atomically)

Rules, each there so that nothing a user trained is lost:

* A crash mid-save leaves only a ``.tmp`` directory, never loaded, removed by the next save.
* Every checkpoint belongs to a run (``run.json``'s ``run_id``: new at a fresh start, inherited on
  resume). Retention (``keep``) deletes only older checkpoints of the saving run and never the one
  ``latest`` names: checkpoints of other runs are left alone. :func:`.resume.check_start` refuses a fresh
  run in a directory that already holds checkpoints.
* A step that exists already is never deleted before its replacement is complete: the same run's
  verified copy is kept and the save skipped; otherwise the old directory is renamed aside
  (``.step_*.old``) only after the new one is complete, and removed after the new one is in
  place. An aside directory whose step is missing (a crash between the two renames) is put back.
* Loading checks every file against ``checksums.json``. :func:`.resume.choose_checkpoint` tries the one
  ``latest`` names, then older ones, warning on stderr for each broken one and renaming it
  ``step_*.broken`` (kept for inspection; retention then never keeps it in place of a good
  one); if none is usable it raises :class:`CheckpointError` naming them. Checkpoints from before checksums (no ``run.json``
  and no ``checksums.json``) load unverified.
* A failing save raises :class:`CheckpointError` on every rank (the ranks agree after each step of
  the save, so none waits for a peer that gave up), naming the directory and the diagnosed cause;
  the previous checkpoints and ``latest`` are untouched.

Elsewhere in the package: the directory's names (:mod:`.steps`); checksums (:mod:`.checksums`); the
checkpoint to resume from and the refusals before a start (:mod:`.resume`); a failure's diagnosis and
the ranks' agreement on it (:mod:`.failures`). Every function works without a process group (one
process); with one, rank 0 is the writer and the collective functions must be called by every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from parallel4d.checkpoint import shards
from parallel4d.checkpoint.checksums import CHECKSUMS, verify, write_checksums
from parallel4d.checkpoint.failures import (CheckpointError, UnusableCheckpoint, any_failed, describe, diagnose,
                                            failure_types, is_writer, on_writer, own_failure)
from parallel4d.checkpoint.files import fsync_dir, write_synced
from parallel4d.checkpoint.steps import (RUN_INFO, TMP_GLOB, latest_name, new_run_id, read_info, recover,
                                         set_latest, step_dirs, step_name, step_of, tmp_name)

_SKIP = "skip"


def _prepare(root: Path, final: Path, tmp: Path, run_id: str | None) -> str:
    """Writer: clean up, resolve the run id, and return it, or _SKIP if ``final`` is already this state."""
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    for stale in root.glob(TMP_GLOB):  # leftovers of an interrupted save
        shutil.rmtree(stale, ignore_errors=True)
    if run_id is None:
        named = latest_name(root)
        run_id = (read_info(root / named).get("run_id") if named else None) or new_run_id()
    if final.is_dir() and read_info(final).get("run_id") == run_id and (final / CHECKSUMS).is_file() \
            and verify(final) is None:
        set_latest(root, final)  # the same run's verified copy of this step: keep it
        return _SKIP
    tmp.mkdir()
    return run_id


def _publish(root: Path, final: Path, tmp: Path, run_id: str, step: int, info: dict | None,
             extra_files: dict[str, str | bytes] | None, keep: int) -> None:
    """Writer, after every rank wrote its shards: small files, checksums, rename, ``latest``, retention."""
    for name, text in (extra_files or {}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # a name may be in a folder ("pretrained/…")
        write_synced(tmp / name, text)
    write_synced(tmp / RUN_INFO, json.dumps({**(info or {}), "run_id": run_id, "step": step, "saved": time.time()}))
    write_checksums(tmp)
    fsync_dir(tmp)
    aside = root / f".{final.name}.old"
    if final.exists():  # moved aside only now that its replacement is complete
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        if aside.exists():
            os.replace(aside, final)
        raise
    fsync_dir(root)
    set_latest(root, final)
    shutil.rmtree(aside, ignore_errors=True)
    _retain(root, run_id, keep, final)


def _retain(root: Path, run_id: str, keep: int, latest: Path) -> None:
    """Delete this run's checkpoints beyond the ``keep`` most recently saved; never ``latest``."""
    mine = []
    for p in step_dirs(root):
        info = read_info(p)
        if info.get("run_id") == run_id:
            mine.append((float(info.get("saved", 0.0)), step_of(p), p))
    for _, _, p in sorted(mine)[:-keep]:
        if p != latest:
            shutil.rmtree(p, ignore_errors=True)


def save(state: dict | Callable[[Path], Any], root: str | Path, step: int, keep: int = 2,
         extra_files: dict[str, str | bytes] | None = None, *, run_id: str | None = None, info: dict | None = None) -> Path:
    """Collectively save ``state`` as checkpoint ``step`` under ``root``; every rank calls this.

    ``state``: a state dict for DCP, or ``write(directory)``, a collective that writes the
    checkpoint's files into ``directory`` (DeepSpeed's ``save_checkpoint``); either way the files
    get checksums and the directory its atomic rename, ``latest`` and retention.

    ``run_id``: the run this checkpoint belongs to (only the writer's value is used);
    None continues the run of the checkpoint ``latest`` names, or starts a new one.
    ``info`` (JSON-able) is stored in ``run.json``; ``extra_files`` maps names (``a/b`` in a folder) to
    texts or bytes.
    A step this run saved already and that verifies is not written again.
    Returns the checkpoint's path. Raises :class:`CheckpointError` on every rank,
    naming the path and why, if any rank failed; earlier checkpoints stay intact.
    """
    root = Path(root)
    final = root / step_name(step)
    tmp = root / tmp_name(step)

    def explain(error: BaseException, where: Path) -> str:
        return f"checkpoint {final} not saved: {diagnose(error, where)}"

    def clean_up() -> None:  # the half-written directory; earlier checkpoints are untouched
        if is_writer():
            shutil.rmtree(tmp, ignore_errors=True)

    run = on_writer(lambda: _prepare(root, final, tmp, run_id), f"checkpoint {final.name}: preparing", lambda e: explain(e, root))
    if run == _SKIP:
        return final
    error = None
    try:
        if callable(state):
            state(tmp)
        else:
            write_state(state, tmp)
    except failure_types() as e:
        error = e
    # the same verdict on every rank, in the words of a rank that failed itself (its own disk, limits)
    message = any_failed(f"checkpoint {final.name}: writing", explain(error, root) if error is not None else None,
                          error is None or own_failure(error))
    if message is not None:
        clean_up()
        raise CheckpointError(message) from error
    try:
        on_writer(lambda: _publish(root, final, tmp, run, step, info, extra_files, keep),
                   f"checkpoint {final.name}: publishing", lambda e: explain(e, root))
    finally:
        clean_up()  # gone already (renamed) unless publishing failed
    return final


def write_state(state: dict, directory: Path) -> None:
    """Collectively write ``state`` (a DCP state dict; :class:`.shards.DenseShards` values are each rank's
    pieces of a dense tensor) as DCP's files in ``directory``."""
    _dcp().save(state, checkpoint_id=str(directory), planner=shards.save_planner())


def _dcp():
    # torch.distributed.checkpoint costs ~1 s to import; with 16 workers on a small
    # machine that is seconds of start-up for jobs that never save. Imported on first use.
    import torch.distributed.checkpoint as dcp

    return dcp


def __getattr__(name: str):  # ``checkpoint.dcp``, for callers (and tests) that patch it
    if name == "dcp":
        return _dcp()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _shape_problem(state: dict, path: str | Path, known: set[str] | None) -> str | None:
    """What makes the saved tensors differ from ``state``'s (names and dense shapes), or None.
    ``known``: every key of the whole job's state (a rank's ``state`` may hold only its stages)."""
    saved = _dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, value in state.items():
        if key not in saved:
            return f"it has no tensor {key!r}"
        want = value.size() if hasattr(value, "size") else None
        have = getattr(saved[key], "size", None)
        if want is not None and have is not None and tuple(want) != tuple(have):
            return f"tensor {key!r} is {list(have)} there and {list(want)} here"
    known = set(state) if known is None else known
    extra = sorted(k for k in saved if k.startswith(("model.", "optim.")) and k not in known)
    if extra:
        return f"it has tensors this model lacks, e.g. {extra[0]!r}"
    return None


def load(state: dict, path: str | Path, verify_files: bool = True, known: set[str] | None = None) -> dict:
    """Load checkpoint ``path`` into ``state`` in place (every rank calls this).

    ``verify_files`` checks every file against its checksum first (each rank reads
    the whole checkpoint: pass False for one :func:`choose_checkpoint` verified).
    Tensors are matched by name and dense shape first (``known``: every key the whole
    job loads, so that a checkpoint of a larger model is refused too); a mismatch names the tensor.
    Raises :class:`CheckpointError` naming the checkpoint (and the file) on failure
    (:class:`UnusableCheckpoint` for files that do not verify or tensors of other shapes: a refusal).
    """
    if verify_files:
        problem = verify(path)
        if problem is not None:
            raise UnusableCheckpoint(f"checkpoint {path} is not usable: {problem}")
    problem = _shape_problem(state, path, known)
    if problem is not None:
        raise UnusableCheckpoint(f"checkpoint {path} does not fit this config's model: {problem}; load it with the "
                                 "model.* settings it was saved with, or start without it (train.resume=false)")
    try:
        _dcp().load(state, checkpoint_id=str(path), planner=shards.load_planner())
    except failure_types() as e:
        raise CheckpointError(f"checkpoint {path} could not be loaded: {describe(e)}") from e
    return state
