"""Save / resume through ``torch.distributed.checkpoint`` (DCP): atomic, verified, one run at a time.

Layout under the checkpoint directory::

    step_00000010/         one checkpoint, written as .step_00000010.tmp and renamed once complete
        .metadata, *.distcp    DCP's files (each rank writes its own shards), or DeepSpeed's
                               (*_model_states.pt, *_optim_states.pt) under a deepspeed: section
        config.yaml            the job's config (extra_files of the caller)
        run.json               run id, step, save time and the caller's info (train.py: loss history)
        checksums.json         size and sha256 of every other file; written last, before the rename
    latest                 the name of the newest checkpoint (replaced atomically)

Rules, each there so that nothing a user trained is lost:

* A crash mid-save leaves only a ``.tmp`` directory, never loaded, removed by the next save.
* Every checkpoint belongs to a run (``run.json``'s ``run_id``: new at a fresh start, inherited on
  resume). Retention (``keep``) deletes only older checkpoints of the saving run and never the one
  ``latest`` names: checkpoints of other runs are left alone. :func:`check_start` refuses a fresh
  run in a directory that already holds checkpoints.
* A step that exists already is never deleted before its replacement is complete: the same run's
  verified copy is kept and the save skipped; otherwise the old directory is renamed aside
  (``.step_*.old``) only after the new one is complete, and removed after the new one is in
  place. An aside directory whose step is missing (a crash between the two renames) is put back.
* Loading checks every file against ``checksums.json``. :func:`choose_checkpoint` tries the one
  ``latest`` names, then older ones, warning on stderr for each broken one and renaming it
  ``step_*.broken`` (kept for inspection; retention then never keeps it in place of a good
  one); if none is usable it raises :class:`CheckpointError` naming them. Checkpoints from before checksums (no ``run.json``
  and no ``checksums.json``) load unverified.
* A failing save raises :class:`CheckpointError` on every rank (the ranks agree after each step of
  the save, so none waits for a peer that gave up), naming the directory and the diagnosed cause;
  the previous checkpoints and ``latest`` are untouched.

Every function works without a process group (one process); with one, rank 0 is the writer and
the collective functions must be called by every rank.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import yaml

from parallel4d.distributed import comm
from parallel4d.checkpoint import shards
from parallel4d.config.errors import ConfigError
from parallel4d.config.schema import ModelConfig, model_shape_changes
from parallel4d.checkpoint.files import fsync_dir, write_synced

LATEST = "latest"
RUN_INFO = "run.json"
CHECKSUMS = "checksums.json"
_STEP = re.compile(r"step_(\d+)")
_BROKEN = re.compile(r"step_\d+\.broken\d*")
WHY_BROKEN = "BROKEN.txt"  # in a checkpoint set aside: why it failed verification


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, verified or loaded; the message names the path and why."""


# --- names and small files ------------------------------------------------------------------------


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(path: Path) -> int | None:
    m = _STEP.fullmatch(path.name)
    return int(m.group(1)) if m else None


def _step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories (final names only) under ``root``, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _step_of(p) is not None and p.is_dir()]
    return sorted(found, key=_step_of, reverse=True)


def _broken_dirs(root: Path) -> list[Path]:
    """The checkpoints an earlier resume set aside as broken (``step_*.broken*``), newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _BROKEN.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _why_broken(aside: Path) -> str:
    try:
        return (aside / WHY_BROKEN).read_text().strip() or "set aside as broken"
    except OSError:
        return "set aside as broken by an earlier resume"


def _tmp_name(step: int) -> str:
    """Where a checkpoint is written until it is complete (then renamed to :func:`_name`)."""
    return f".{_name(step)}.tmp"


_TMP_GLOB = ".step_*.tmp"  # every _tmp_name


def save_in_progress(root: str | Path, since: float) -> str | None:
    """``"step 12"`` while a save into ``root`` started after ``since`` (epoch seconds) is under way,
    else None: a temporary directory older than that is an earlier crash's (the next save removes it)."""
    for tmp in Path(root).glob(_TMP_GLOB):
        try:
            if tmp.stat().st_mtime >= since:
                return f"step {int(tmp.name[len('.step_'):-len('.tmp')])}"
        except (OSError, ValueError):  # renamed meanwhile, or not one of save's names
            continue
    return None


def _latest_name(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def _set_latest(root: Path, final: Path) -> None:
    if _latest_name(root) == final.name:
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


def new_run_id() -> str:
    """A fresh run id: readable start time plus random bits."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


# --- checksums ------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_checksums(directory: Path) -> None:
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


# --- agreement between ranks -------------------------------------------------------------------


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _failures() -> tuple[type[BaseException], ...]:
    # DCP reports a failure on any rank as CheckpointException, a BaseException.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _plain(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def _on_writer(fn: Callable[[], Any], what: str, explain: Callable[[BaseException], str] = _plain) -> Any:
    """Run ``fn`` on the writer; every rank returns its result, or raises CheckpointError(explain(error)).
    ``what`` names the step for a peer that waits too long (``comm.CommTimeout``)."""
    value, error, message = None, None, None
    if _is_writer():
        try:
            value = fn()
        except _failures() as e:
            error, message = e, explain(e)
    if dist.is_initialized():
        box = [(value, message)]
        with comm.named(f"{what} (rank 0 decides, every rank waits for it)", None):
            dist.broadcast_object_list(box, src=0)
        value, message = box[0]
    if message is not None:
        raise CheckpointError(message) from error
    return value


def _any_failed(what: str, message: str | None, own: bool = True) -> str | None:
    """Every rank's ``message`` (None: this rank succeeded) gathered: the first one about a rank's
    own failure (``own``), else the first one; None if every rank succeeded."""
    if not dist.is_initialized():
        return message
    out: list = [None] * dist.get_world_size()
    with comm.named(f"{what} (every rank's outcome gathered)", None):
        dist.all_gather_object(out, (own, message))
    failed = [(not o, m) for o, m in out if m is not None]
    return min(failed, key=lambda f: f[0])[1] if failed else None


def _own(error: BaseException) -> bool:
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


# --- save ---------------------------------------------------------------------------------------------


_SKIP = "skip"


def _recover(root: Path) -> None:
    """Finish what a crash during a replacement left: put an aside step back if its step is missing."""
    for aside in root.glob(".step_*.old"):
        final = root / aside.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)


def _prepare(root: Path, final: Path, tmp: Path, run_id: str | None) -> str:
    """Writer: clean up, resolve the run id, and return it, or _SKIP if ``final`` is already this state."""
    root.mkdir(parents=True, exist_ok=True)
    _recover(root)
    for stale in root.glob(_TMP_GLOB):  # leftovers of an interrupted save
        shutil.rmtree(stale, ignore_errors=True)
    if run_id is None:
        named = _latest_name(root)
        run_id = (read_info(root / named).get("run_id") if named else None) or new_run_id()
    if final.is_dir() and read_info(final).get("run_id") == run_id and (final / CHECKSUMS).is_file() \
            and verify(final) is None:
        _set_latest(root, final)  # the same run's verified copy of this step: keep it
        return _SKIP
    tmp.mkdir()
    return run_id


def _publish(root: Path, final: Path, tmp: Path, run_id: str, step: int, info: dict | None,
             extra_files: dict[str, str] | None, keep: int) -> None:
    """Writer, after every rank wrote its shards: small files, checksums, rename, ``latest``, retention."""
    for name, text in (extra_files or {}).items():
        write_synced(tmp / name, text)
    write_synced(tmp / RUN_INFO, json.dumps({**(info or {}), "run_id": run_id, "step": step, "saved": time.time()}))
    _write_checksums(tmp)
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
    _set_latest(root, final)
    shutil.rmtree(aside, ignore_errors=True)
    _retain(root, run_id, keep, final)


def _retain(root: Path, run_id: str, keep: int, latest: Path) -> None:
    """Delete this run's checkpoints beyond the ``keep`` most recently saved; never ``latest``."""
    mine = []
    for p in _step_dirs(root):
        info = read_info(p)
        if info.get("run_id") == run_id:
            mine.append((float(info.get("saved", 0.0)), _step_of(p), p))
    for _, _, p in sorted(mine)[:-keep]:
        if p != latest:
            shutil.rmtree(p, ignore_errors=True)


def save(state: dict | Callable[[Path], Any], root: str | Path, step: int, keep: int = 2,
         extra_files: dict[str, str] | None = None, *, run_id: str | None = None, info: dict | None = None) -> Path:
    """Collectively save ``state`` as checkpoint ``step`` under ``root``; every rank calls this.

    ``state``: a state dict for DCP, or ``write(directory)``, a collective that writes the
    checkpoint's files into ``directory`` (DeepSpeed's ``save_checkpoint``); either way the files
    get checksums and the directory its atomic rename, ``latest`` and retention.

    ``run_id``: the run this checkpoint belongs to (only the writer's value is used);
    None continues the run of the checkpoint ``latest`` names, or starts a new one.
    ``info`` (JSON-able) is stored in ``run.json``; ``extra_files`` maps names to texts.
    A step this run saved already and that verifies is not written again.
    Returns the checkpoint's path. Raises :class:`CheckpointError` on every rank,
    naming the path and why, if any rank failed; earlier checkpoints stay intact.
    """
    root = Path(root)
    final = root / _name(step)
    tmp = root / _tmp_name(step)

    def explain(error: BaseException, where: Path) -> str:
        return f"checkpoint {final} not saved: {diagnose(error, where)}"

    def clean_up() -> None:  # the half-written directory; earlier checkpoints are untouched
        if _is_writer():
            shutil.rmtree(tmp, ignore_errors=True)

    run = _on_writer(lambda: _prepare(root, final, tmp, run_id), f"checkpoint {final.name}: preparing", lambda e: explain(e, root))
    if run == _SKIP:
        return final
    error = None
    try:
        if callable(state):
            state(tmp)
        else:
            _dcp().save(state, checkpoint_id=str(tmp), planner=shards.save_planner())
    except _failures() as e:
        error = e
    # the same verdict on every rank, in the words of a rank that failed itself (its own disk, limits)
    message = _any_failed(f"checkpoint {final.name}: writing", explain(error, root) if error is not None else None,
                          error is None or _own(error))
    if message is not None:
        clean_up()
        raise CheckpointError(message) from error
    try:
        _on_writer(lambda: _publish(root, final, tmp, run, step, info, extra_files, keep),
                   f"checkpoint {final.name}: publishing", lambda e: explain(e, root))
    finally:
        clean_up()  # gone already (renamed) unless publishing failed
    return final


# --- find and load ------------------------------------------------------------------------------------


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names if it has its data, else the newest one that has; None if none.

    Cheap (no checksums): use :func:`choose_checkpoint` to pick one to resume from.
    """
    root = Path(root)
    named = _latest_name(root)
    if named and _has_data(root / named):
        return root / named
    return next((p for p in _step_dirs(root) if _has_data(p)), None)


def _has_data(path: Path) -> bool:
    return (path / ".metadata").is_file() or (path / CHECKSUMS).is_file()


def _candidates(root: Path) -> list[Path]:
    """``latest``'s checkpoint first, then the older ones, newest first (all of them without ``latest``)."""
    named = _latest_name(root)
    # `latest` may name a step an earlier resume set aside: it is not a candidate any more
    first = root / named if named and _step_of(Path(named)) is not None and (root / named).is_dir() else None
    rest = _step_dirs(root)
    if first is None:
        return rest
    return [first] + [p for p in rest if _step_of(p) < _step_of(first)]


def _warn(msg: str) -> None:
    print(f"[parallel4d] warning: {msg}", file=sys.stderr, flush=True)


def _set_aside(path: Path, problem: str) -> Path:
    """Rename a broken checkpoint out of the step names (kept for inspection, never loaded, never
    counted by retention, never in the way of the step when it is saved again), with ``problem``
    written in it so that every later resume reports the same."""
    aside = path.with_name(f"{path.name}.broken")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.broken{n}")
    os.replace(path, aside)
    try:
        (aside / WHY_BROKEN).write_text(problem + "\n")
    except OSError:  # a read-only checkpoint: the name alone says it is broken
        pass
    return aside


def _choose(root: Path) -> Path | None:
    if root.is_dir():
        _recover(root)
    for path in _candidates(root):
        problem = verify(path)
        if problem is None:
            if not (path / CHECKSUMS).is_file():
                _warn(f"checkpoint {path} has no {CHECKSUMS} (saved before checksums): loading it unverified")
            return path
        aside = _set_aside(path, problem)
        _warn(f"checkpoint {path} is not usable: {problem}; kept as {aside.name} and trying the previous one")
    broken = _broken_dirs(root)  # set aside now or by an earlier resume: the same report every time
    if broken:
        raise CheckpointError(f"no usable checkpoint under {root}: "
                              + "; ".join(f"{p}: {_why_broken(p)}" for p in broken)
                              + ". Restore one, or start afresh with train.resume=false in another directory")
    return None


def choose_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint to resume from: ``latest``'s if it verifies, else the newest older one that does.

    Warns on stderr for each broken checkpoint skipped; None if ``root`` holds no
    checkpoint; :class:`CheckpointError` naming each one if none is usable. With a
    process group every rank must call it: rank 0 chooses and broadcasts its choice.
    """
    return _on_writer(lambda: _choose(Path(root)), f"checkpoint choice under {root}")


def holds_checkpoints(root: str | Path) -> bool:
    """Whether ``root`` holds a checkpoint, usable or set aside as broken (names only: cheap)."""
    return bool(_step_dirs(Path(root)) or _broken_dirs(Path(root)))


def check_start(root: str | Path, resume: bool) -> None:
    """Refuse a fresh run (``resume`` false) in a checkpoint directory that already holds checkpoints.

    Needs no process group and reads only directory names. ``ConfigError`` says
    what to change.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"the checkpoint directory {root} is a file; set checkpoint.dir (or train.out_dir) "
                          "to a directory")
    if resume:
        return
    steps = _step_dirs(root)
    found = [p.name for p in steps + _broken_dirs(root)]
    if found and not steps:
        raise ConfigError(
            f"train.resume=false but the checkpoint directory {root} holds an earlier run's checkpoints, all set "
            f"aside as broken ({', '.join(found[:3])}); give this run another checkpoint.dir or train.out_dir, or "
            f"delete {root} if they are no longer needed")
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(
            f"train.resume=false but the checkpoint directory {root} already holds checkpoints ({shown}) "
            "from an earlier run. Set train.resume=true to continue that run, give this run another "
            f"checkpoint.dir or train.out_dir, or delete {root} if it is no longer needed")


def saved_config(ckpt: str | Path) -> dict:
    """The job config saved with checkpoint ``ckpt`` (``config.yaml``), without ``model.pretrained``
    (its fields are all in the saved model section); CheckpointError when it has none."""
    saved = Path(ckpt) / "config.yaml"
    if not saved.is_file():
        raise CheckpointError(f"{ckpt} has no config.yaml (saved by parallel4d before exports existed); "
                              "the model's architecture is unknown")
    data = yaml.safe_load(saved.read_text())
    data.get("model", {}).pop("pretrained", None)
    return data


def check_resume_model(root: str | Path, model: ModelConfig) -> None:
    """Refuse resuming, into ``model``, the newest checkpoint under ``root`` when it holds a model of
    another shape (read from its config.yaml, before any worker starts); ``ConfigError`` naming the
    fields. A checkpoint without a readable config.yaml is left to the workers' own shape check."""
    found = latest_checkpoint(root)
    try:
        saved = saved_config(found).get("model") if found is not None else None
    except (CheckpointError, OSError, yaml.YAMLError, AttributeError):
        return
    changes = model_shape_changes(saved, model) if isinstance(saved, dict) else []
    if changes:
        raise ConfigError(f"train.resume=true but checkpoint {found} holds another model: {'; '.join(changes)}; "
                          "resume with the model.* settings it was saved with, or start afresh in another "
                          "train.out_dir")


def _dcp():
    # torch.distributed.checkpoint costs ~1 s to import; with 16 workers on a small
    # machine that is seconds of start-up for jobs that never save. Imported on first use.
    import torch.distributed.checkpoint as dcp

    return dcp


def __getattr__(name: str):  # ``checkpoint.dcp``, for callers (and tests) that patch it
    if name == "dcp":
        return _dcp()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _describe(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if failures:
        return "; ".join(f"rank {r}: {type(f[0]).__name__}: {f[0]}" for r, f in failures.items())
    return f"{type(exc).__name__}: {exc}"


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
    Raises :class:`CheckpointError` naming the checkpoint (and the file) on failure.
    """
    if verify_files:
        problem = verify(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is not usable: {problem}")
    problem = _shape_problem(state, path, known)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} does not fit this config's model: {problem}; load it with the "
                              "model.* settings it was saved with, or start without it (train.resume=false)")
    try:
        _dcp().load(state, checkpoint_id=str(path), planner=shards.load_planner())
    except _failures() as e:
        raise CheckpointError(f"checkpoint {path} could not be loaded: {_describe(e)}") from e
    return state
