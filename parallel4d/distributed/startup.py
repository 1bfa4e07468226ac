"""Joining the job's process group: which device and backend a config runs on, and the join
under torchrun (env://) through a store of this restart attempt's own (:mod:`.elastic`).

A local job's workers join through :mod:`parallel4d.launcher.spawn`'s file rendezvous instead;
:func:`parallel4d.distributed.mesh.init_mesh` joins from the environment when no process group exists.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel4d.config.errors import ConfigError
from parallel4d.config.rules.job import local_ranks
from parallel4d.config.schema import Config
from parallel4d.distributed import elastic
from parallel4d.distributed.deadlines import group_timeout_s


def visible_gpus() -> int:
    """How many CUDA devices this process sees, asked without initialising CUDA in it.

    ``torch.cuda.is_available()`` initialises the CUDA driver (``cuInit``) in the asking process, and
    no process forked from it afterwards can use CUDA: a launcher's zygote that asked would fork
    workers that fail at ``set_device``. NVML answers instead (torch's count, which honours
    ``CUDA_VISIBLE_DEVICES``); where it cannot (no NVML, MIG devices), a child interpreter asks.
    Once CUDA is initialised here anyway, torch's own count."""
    if not torch.backends.cuda.is_built():
        return 0
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    count = _management_library_count()
    return count if count >= 0 else _count_in_child(os.environ.get("CUDA_VISIBLE_DEVICES"))


def _management_library_count() -> int:
    """torch's NVML (ROCm: AMD SMI) device count, which leaves CUDA uninitialised; -1 where it cannot say."""
    probe = getattr(torch.cuda, "_device_count_amdsmi" if torch.version.hip else "_device_count_nvml", None)
    try:
        return int(probe()) if probe is not None else -1
    except Exception:  # a private helper of torch's: any failure means "cannot say"
        return -1


@functools.lru_cache(maxsize=None)
def _count_in_child(visible: str | None) -> int:
    """``torch.cuda.device_count()`` asked of a child interpreter (CUDA initialised there, not here),
    once per ``CUDA_VISIBLE_DEVICES`` value; 0 when the child fails."""
    code = "import torch; print(torch.cuda.device_count())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def gpu_memory_bytes(count: int) -> int | None:
    """The smallest total memory among the first ``count`` GPUs this process sees (one per local rank),
    asked without initialising CUDA: NVML's figure for each device ``CUDA_VISIBLE_DEVICES`` names
    (torch's own once CUDA is initialised here). None where it cannot say (no NVML, MIG devices, ROCm)."""
    if torch.cuda.is_initialized():
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
    if torch.version.hip or count < 1:
        return None
    try:  # torch's private NVML helpers (CUDA_VISIBLE_DEVICES as CUDA parses it): any failure means "cannot say"
        visible = torch.cuda._parse_visible_devices()
        if visible and isinstance(visible[0], str):
            if visible[0].startswith("MIG-"):
                return None
            visible = torch.cuda._transform_uuid_to_ordinals(visible, torch.cuda._raw_device_uuid_nvml())
        if len(visible) < count:
            return None
        return min(_nvml_total_memory(index) for index in visible[:count])
    except Exception:
        return None


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml_total_memory(index: int) -> int:
    """NVML's total memory of device ``index`` (NVML's numbering); OSError where NVML fails."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    handle, info = ctypes.c_void_p(), _NvmlMemory()
    if (nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
            or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info))):
        raise OSError(f"NVML cannot read the memory of device {index}")
    return int(info.total)


def default_backend() -> str:
    """NCCL when this process has its own GPU, gloo otherwise (asked without initialising CUDA)."""
    return "nccl" if visible_gpus() > 0 else "gloo"


def _gpus_and_local_ranks(cfg: Config) -> tuple[int, int]:
    """``(visible GPUs, ranks on this machine)``: torchrun's LOCAL_WORLD_SIZE, else the whole job."""
    gpus = visible_gpus()
    return gpus, local_ranks(cfg)


def worker_threads(cfg: Config) -> int:
    """torch threads per rank: ``train.threads_per_worker``, else this machine's cores over its ranks
    (torchrun's LOCAL_WORLD_SIZE, else the whole job). The host optimizer and every CPU op use them;
    torchrun alone would leave each rank one (it sets OMP_NUM_THREADS=1)."""
    return cfg.train.threads_per_worker or max(1, (os.cpu_count() or 1) // local_ranks(cfg))


def device_and_backend(cfg: Config) -> tuple[str, str]:
    """``(device type, backend)`` for ``train.device``: ``("cuda", "nccl")`` when every local rank
    gets its own GPU, ``("cpu", "gloo")`` otherwise (:func:`cpu_fallback_note` says why, when GPUs are
    there); ConfigError when cuda is asked for and missing. CUDA stays uninitialised here
    (:func:`visible_gpus`): the launcher may fork the workers after."""
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
                            timeout=timedelta(seconds=group_timeout_s(backend, timeout_s)))
