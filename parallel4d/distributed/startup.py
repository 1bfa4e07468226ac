"""Joining the job's process group: which device and backend a config runs on, and the join
under torchrun (env://) through a store of this restart attempt's own (:mod:`.elastic`).

A local job's workers join through :mod:`parallel4d.launcher.spawn`'s file rendezvous instead;
:func:`parallel4d.distributed.mesh.init_mesh` joins from the environment when no process group exists.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel4d.config.errors import ConfigError
from parallel4d.config.schema import Config
from parallel4d.distributed import elastic


def default_backend() -> str:
    """NCCL when this process has its own GPU, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _gpus_and_local_ranks(cfg: Config) -> tuple[int, int]:
    """``(visible GPUs, ranks on this machine)``: torchrun's LOCAL_WORLD_SIZE, else the whole job."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus, int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))


def device_and_backend(cfg: Config) -> tuple[str, str]:
    """``(device type, backend)`` for ``train.device``: ``("cuda", "nccl")`` when every local rank
    gets its own GPU, ``("cpu", "gloo")`` otherwise (:func:`cpu_fallback_note` says why, when GPUs are
    there); ConfigError when cuda is asked for and missing."""
    want = cfg.train.device
    gpus, local_world = _gpus_and_local_ranks(cfg)
    if want == "cuda" and gpus == 0:
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if want == "cuda" and gpus < local_world:
        raise ConfigError(f"train.device=cuda needs one GPU per local rank ({local_world}) but {gpus} are visible; "
                          "use train.device=cpu or fewer ranks (parallel.pp·dp·sp·tp)")
    use_cuda = want == "cuda" or (want == "auto" and gpus >= local_world)
    return ("cuda", "nccl") if use_cuda else ("cpu", "gloo")


def cpu_fallback_note(cfg: Config) -> str | None:
    """Why a ``train.device=auto`` job runs on the CPU although GPUs are visible (fewer than its
    local ranks: NCCL needs one GPU per rank), and what to change; None when nothing fell back."""
    gpus, local_world = _gpus_and_local_ranks(cfg)
    if cfg.train.device != "auto" or gpus == 0 or gpus >= local_world:
        return None
    p = cfg.parallel
    return (f"train.device=auto: {gpus} GPU{'s' if gpus > 1 else ''} visible for {local_world} local ranks "
            f"(pp·dp·sp·tp = {p.pp}·{p.dp}·{p.sp}·{p.tp}), and NCCL needs one GPU per rank, so this job runs on the "
            f"CPU over gloo. To train on the GPU, make pp·dp·sp·tp ≤ {gpus} (e.g. --set parallel.dp=1) or use "
            f"a machine with {local_world} GPUs; train.device=cpu says the CPU is meant")


def init_process_group_from_env(backend: str | None = None, timeout_s: float = 300.0,
                                join_timeout_s: float = 600.0) -> None:
    """Join the job described by RANK/WORLD_SIZE/MASTER_ADDR (torchrun's env://).

    The process group meets in a store of this (restart) attempt's own (:func:`elastic.job_store`).
    ``timeout_s`` bounds each collective; ``join_timeout_s`` the wait for the other ranks to
    start and join.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"no default process group and {missing} not set: call "
            "torch.distributed.init_process_group first, run under torchrun, or use parallel4d.launch"
        )
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = elastic.job_store(rank, world, join_timeout_s)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
