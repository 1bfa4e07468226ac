"""launch(config): join a torchrun job, or spawn the local workers, and train.

Under torchrun (``RANK``/``WORLD_SIZE`` set) this process *is* one rank and
joins through env://. Otherwise ``pp·dp·sp·tp`` local workers are spawned with
a file-based rendezvous: gloo on CPU, NCCL when every rank gets its own GPU.
If a worker raises, the others are stopped and the error is re-raised here.

Before any worker starts (:func:`prepared`): :func:`~.preflight.check_job` (the local
limits, a deepspeed: section, model.pretrained's and the token files' contents),
:func:`~.preflight.check_memory` (the job's least memory against this machine's), then the run and checkpoint directories are writable, no other job holds them,
and a fresh run does not write over another run's checkpoints.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from parallel4d.checkpoint.failures import CheckpointError
from parallel4d.checkpoint.resume import check_resume_base, check_resume_model, check_start, holds_checkpoints, latest_checkpoint
from parallel4d.checkpoint.steps import save_in_progress
from parallel4d.distributed import elastic
from parallel4d.distributed.deadlines import group_timeout_s
from parallel4d.config.rules.job import local_ranks, torchrun_job_problems
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config
from parallel4d.config.schema import Config
from parallel4d.distributed.startup import (cpu_fallback_note, device_and_backend, gpu_memory_bytes,
                                            init_process_group_from_env, worker_threads)
from parallel4d.launcher.preflight import check_job, check_memory, under_torchrun
from parallel4d.launcher.rundir import RunLock, check_history, check_writable, first_missing, remove_if_unused
from parallel4d.training.host_memory import return_large_blocks
from parallel4d.training.loop import run_training
from parallel4d.launcher.spawn import TRAINING_IMPORTS, spawn
from parallel4d.launcher.supervise import Signals, WorkerTimeout


@contextmanager
def prepared(cfg: Config, local: bool, device_type: str = "cpu", source: str | None = None):
    """:func:`check_job` and :func:`check_memory` (this machine's memory and GPUs against the job's lower
    bound), then the run directories checked and locked for the job.

    The lock comes before the look for another run's checkpoints, so a job still writing them is
    reported as a job in use, not as leftovers. A launch refused or failed before writing in the
    directories it created leaves none of them behind.
    """
    check_job(cfg, local, device_type, source)
    gpus = gpu_memory_bytes(local_ranks(cfg)) if device_type == "cuda" else None
    check_memory(cfg, device_type, gpus, source)
    dirs = {Path(cfg.train.out_dir): "train.out_dir"}
    if cfg.checkpoint.enabled:
        dirs.setdefault(cfg.checkpoint_dir, "checkpoint.dir" if cfg.checkpoint.dir else "train.out_dir")
    created = [top for top in dict.fromkeys(map(first_missing, dirs)) if top is not None]
    try:
        for path, field in dirs.items():
            check_writable(path, field)
        with RunLock(list(dirs)):
            try:
                _check_other_runs(cfg)
                yield
            except BaseException:
                _remove_unused(created)  # while locked: no other job can have started writing there
                raise
    except BaseException:
        _remove_unused(created)  # e.g. the second directory not writable, or in use: the first one goes
        raise


def _check_other_runs(cfg: Config) -> None:
    """In the locked run directories: no other run's checkpoints or history is written over, and a resumed
    checkpoint holds this model."""
    if cfg.checkpoint.enabled:
        check_start(cfg.checkpoint_dir, cfg.train.resume)
    continues = cfg.checkpoint.enabled and holds_checkpoints(cfg.checkpoint_dir)
    check_history(cfg.train.out_dir, cfg.train.resume, continues)
    if cfg.checkpoint.enabled and cfg.train.resume:
        check_resume_model(cfg.checkpoint_dir, cfg.model)
        check_resume_base(cfg.checkpoint_dir, cfg)


def _remove_unused(created: list[Path]) -> None:
    """A refused or failed launch leaves nothing behind: of the directories it created, those it wrote
    nothing in (an earlier check created them, the run never wrote there) are removed."""
    for top in created:
        remove_if_unused(top)


def _train_entry(cfg_dict: dict) -> dict:
    cfg = Config.model_validate(cfg_dict)
    _own_process(cfg)
    return run_training(cfg)


def _own_process(cfg: Config) -> None:
    """What a process that runs one rank of ``cfg``'s job and nothing else sets for itself (a launch's
    workers, torchrun's processes; not a process that calls ``run_training`` among other work): under
    hetero, large freed blocks returned to the kernel, so that its host memory is what the plan counts
    (:func:`.host_memory.return_large_blocks`)."""
    if cfg.hetero.enabled:
        return_large_blocks()


def _preload(cfg: Config) -> tuple[str, ...]:
    """What every worker of ``cfg``'s job imports on its way to the first step, imported once by the
    zygote instead: what training imports, and DeepSpeed for a ``deepspeed:`` section."""
    return (*TRAINING_IMPORTS, *(("deepspeed",) if cfg.deepspeed is not None else ()))


def _newest_checkpoint(ckpt_dir: Path) -> str | None:
    found = latest_checkpoint(ckpt_dir)
    return str(found) if found is not None else None


def _say(message: str) -> None:
    print(f"[parallel4d] {message}", file=sys.stderr, flush=True)


def _say_starting(cfg: Config, device: str, threads: int) -> Callable[[], None]:
    """Say that the local workers are starting (their imports and rendezvous take seconds); returns what
    says, once they have all joined the process group, how long that took."""
    n, p = cfg.world_size, cfg.parallel
    workers = f"{n} worker{'s' if n > 1 else ''}"
    _say(f"starting {workers} ({p.sizes}) on {device}, "
         f"{threads} thread{'s' if threads > 1 else ''} each")
    t0 = time.monotonic()
    return lambda: _say(f"{workers} joined the process group in {time.monotonic() - t0:.1f}s; building the model")


def launch(config: str | Path | Config | dict, overrides: list[str] | None = None) -> dict:
    """Validate ``config`` (a YAML path, dict or :class:`Config`) and train it.

    Returns rank 0's summary (the content of ``<train.out_dir>/summary.json``), also when a signal
    stopped the run after its workers saved (``stop_signal``, ``finished: false``). A local job
    stopped before its workers could save raises :class:`~parallel4d.launcher.supervise.Interrupted`.
    """
    cfg = load_config(config, overrides)
    source = str(config) if isinstance(config, (str, Path)) else None
    device, backend = device_and_backend(cfg)
    fallback = cpu_fallback_note(cfg)
    if fallback and os.environ.get("RANK", "0") == "0":  # once: the launcher, or torchrun's rank 0
        _say(f"warning: {fallback}")
    if under_torchrun():
        problems = torchrun_job_problems(cfg, int(os.environ["WORLD_SIZE"]),
                                         int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)))
        if problems:  # every rank raises: none is left waiting for a peer that refused the job
            raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
        warning = elastic.replacement_warning()
        if warning and os.environ["RANK"] == "0":
            _say(f"warning: {warning}")
        torch.set_num_threads(worker_threads(cfg))  # as a launch's workers: not torchrun's one
        _own_process(cfg)
        with prepared(cfg, False, device, source) if os.environ["RANK"] == "0" else nullcontext():
            init_process_group_from_env(backend, cfg.train.timeout_s, cfg.train.join_timeout_s)
            try:
                return run_training(cfg)
            finally:
                dist.destroy_process_group()
                # Frees what of the run's cycles Python can before interpreter exit. A gloo thread that
                # drops a finished work's tensors mid-finalization aborts the process; the step's last
                # collective waits for that drop itself (comm.wait_released).
                gc.collect()
    threads = worker_threads(cfg)
    started = time.time() - 2.0  # a file system's timestamps may be that coarse
    enabled = cfg.checkpoint.enabled
    # the stop signals counted from the first word about the workers on: their start is the supervisor's
    with prepared(cfg, True, device, source), Signals() as signals:
        joined = _say_starting(cfg, device, threads)
        try:
            results = spawn(
                _train_entry, cfg.world_size, (cfg.model_dump(mode="json"),), backend=backend,
                timeout_s=cfg.train.job_timeout_s or 7 * 24 * 3600.0,
                pg_timeout_s=group_timeout_s(backend, cfg.train.timeout_s), threads_per_worker=threads,
                saving=lambda: save_in_progress(cfg.checkpoint_dir, started) if enabled else None,
                saved=lambda: _newest_checkpoint(cfg.checkpoint_dir) if enabled else None,
                refusals=(ConfigError, CheckpointError), joined=joined, preload=_preload(cfg), signals=signals,
            )
        except WorkerTimeout as e:  # the limit is the job's field: named, with the fix
            raise WorkerTimeout(e.limit_s, e.running, e.starting, field="train.job_timeout_s") from None
    return results[0]
