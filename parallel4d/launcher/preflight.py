"""The checks of a valid config that need the machine but no lock, no worker and no torch: what
``parallel4d validate`` runs, and ``launch`` before it locks the run directories.

Torch-free at module top: the local job limits, the token files' contents, ``model.pretrained``'s
headers (through the hf extra, imported when the field is set) and a ``deepspeed:`` section against
DeepSpeed (the extra, imported when the section is there). ``launch`` alone also checks the job's
memory against this machine's (:func:`check_memory`): ``validate`` may run on another machine.
"""

from __future__ import annotations

import os
from pathlib import Path

from parallel4d.checkpoint.pretrained import check_adapter, check_pretrained
from parallel4d.config.errors import ConfigError
from parallel4d.config.memory import memory_problems
from parallel4d.config.rules.data import byte_text_problems
from parallel4d.config.rules.hetero import dynamic_budget_problems
from parallel4d.config.rules.job import local_job_problems, local_ranks
from parallel4d.config.schema import Config
from parallel4d.data.token_files import content_problems
from parallel4d.integrations import deepspeed_integration


def check_job(cfg: Config, local: bool, device_type: str = "cpu", source: str | None = None) -> None:
    """Every check of a valid config that needs the machine but no lock and no worker: the local
    limits (``local``: this process spawns the workers), a dynamic hetero budget where ``auto`` finds
    only the CPU, a ``deepspeed:`` section against DeepSpeed
    for ``device_type``, ``model.pretrained``'s weight files, ``model.lora.adapter``'s tensors, byte text under its tokenizer, the token
    files' contents. A ``ConfigError`` names ``source`` (the job file) first, as the config's own errors do."""
    try:
        problems = local_job_problems(cfg) if local else []
        if device_type == "cpu" and "cpu" not in (cfg.train.device, cfg.hetero.compute_device):
            problems += dynamic_budget_problems(cfg.hetero, "train.device=auto finds no GPU on this machine")
        if problems:
            raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
        if cfg.deepspeed is not None:
            deepspeed_integration().resolve(cfg, device_type)
        if cfg.model.pretrained:  # every weight file there and of the model's shape, from the headers
            check_pretrained(cfg.model)
        if cfg.model.lora is not None and cfg.model.lora.adapter:  # peft's adapter: its tensors' shapes
            check_adapter(cfg.model)
        _refuse(byte_text_problems(cfg))  # byte ids under a model whose tokenizer reads them as other tokens
        verify_token_files(cfg)  # the token files' bytes against their sidecars (hashed once, then stamped)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


def verify_token_files(cfg: Config) -> None:
    """Before any worker starts: each token file a ``Config`` reads holds the bytes ``parallel4d
    tokenize`` wrote (:func:`.token_files.content_problems`: hashed once, then stamped) and was
    tokenized with ``model.pretrained``'s tokenizer where that has one; ConfigError naming the file."""
    d = cfg.data
    if d.source != "tokens":
        return
    files = [("data.path", d.path)] + ([("data.val_path", d.val_path)] if d.val_path else [])
    _refuse([p for field, path in files for p in content_problems(path, field, cfg.model.pretrained)])


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def under_torchrun() -> bool:
    """Whether this process is one rank of a job torchrun (or another env:// launcher) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_memory(cfg: Config, device_type: str, gpu_bytes: int | None, source: str | None = None) -> None:
    """Refuse, in one line, a job whose ranks on this machine need more memory than it has, by
    :func:`.config.memory.memory_problems`' lower bound: the host's (:func:`host_memory_available`, for
    the local ranks: torchrun's ``LOCAL_WORLD_SIZE``, else the whole job) and, on CUDA, each rank's GPU
    (``gpu_bytes``, None when unknown). Reads two small files: launches stay as fast."""
    problems = memory_problems(cfg, local_ranks(cfg), device_type, host_memory_available(), gpu_bytes)
    if problems:
        message = "; and ".join(problems)
        raise ConfigError(f"{source}: {message}" if source else message)


def host_memory_available() -> tuple[int, str] | None:
    """``(bytes, what they are)`` a new job may use on this machine: ``MemAvailable`` plus free swap, or
    less where the memory cgroup this process is in (or one above it) allows less (its limit minus
    what it holds besides the page cache, plus free swap). Generous where unsure (the check refuses
    only what cannot fit); None where /proc/meminfo cannot be read."""
    info = _meminfo()
    if "MemAvailable" not in info:
        return None
    swap = info.get("SwapFree", 0)
    found = (info["MemAvailable"] + swap, "MemAvailable" + (" and free swap" if swap else ""))
    limit = _cgroup_headroom()
    if limit is not None and limit + swap < found[0]:
        found = (limit + swap, "the memory cgroup's limit less what it holds" + (", and free swap" if swap else ""))
    return found


MEMINFO, SELF_CGROUP = Path("/proc/meminfo"), Path("/proc/self/cgroup")


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where unreadable)."""
    out = {}
    try:
        for line in MEMINFO.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except OSError:
        return {}
    return out


_CGROUP_ROOTS = {"v2": Path("/sys/fs/cgroup"), "v1": Path("/sys/fs/cgroup/memory")}
# (limit file, usage file, memory.stat's reclaimable page-cache key), per cgroup version
_CGROUP_FILES = {"v2": ("memory.max", "memory.current", "file"),
                 "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")}


def _cgroup_headroom() -> int | None:
    """The least that any memory cgroup from this process's up to its hierarchy's root lets it add
    (limit − usage + page cache); None where none sets a limit or none can be read."""
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:  # "0::/path" (v2), "4:memory:/path" (v1)
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if version is not None:
            found += [_headroom(d, version) for d in _ancestors(_CGROUP_ROOTS[version], path)]
    return min((h for h in found if h is not None), default=None)


def _ancestors(root: Path, path: str) -> list[Path]:
    """``root/path`` and each directory above it up to ``root`` (under a cgroup namespace the path may be
    another's: ``root`` itself is then this process's)."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [root.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def _headroom(directory: Path, version: str) -> int | None:
    limit_file, usage_file, cache_key = _CGROUP_FILES[version]
    try:
        limit = (directory / limit_file).read_text().strip()
        usage = int((directory / usage_file).read_text())
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return None
    if not limit.isdigit() or int(limit) >= 2**60:  # "max", or v1's "no limit" (a page-rounded 2**63)
        return None
    return max(0, int(limit) - usage + int(stat.get(cache_key, 0)))
