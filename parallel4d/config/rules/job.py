"""A job's rules on the machine that starts it: the local launcher's worker and thread limits,
and a torchrun job's world size and restarts."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config


def local_ranks(cfg: Config) -> int:
    """This job's ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else the whole job (a local launch)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))


def local_job_problems(cfg: Config, cores: int | None = None) -> list[str]:
    """Rules for a job the local launcher spawns itself (not under torchrun) on a machine of ``cores``
    (default: this one's): one message per problem."""
    p, limit, out = cfg.parallel, cfg.train.max_local_workers, []
    if cfg.world_size > limit:
        out.append(f"parallel.pp·dp·sp·tp = {p.pp}·{p.dp}·{p.sp}·{p.tp} = {cfg.world_size} local workers is more "
                   f"than train.max_local_workers={limit}; lower the parallel sizes, raise train.max_local_workers "
                   "if this machine really runs that many processes, or start the job with torchrun")
    cores = cores or os.cpu_count() or 1
    threads = cfg.train.threads_per_worker
    if threads is not None and threads > cores:
        out.append(f"train.threads_per_worker={threads} is more than this machine's {cores} cores; use "
                   f"train.threads_per_worker={max(1, cores // cfg.world_size)} (cores / workers) or leave it unset")
    return out


def torchrun_job_problems(cfg: Config, world_size: int, max_restarts: int) -> list[str]:
    """Rules for a job torchrun started (``WORLD_SIZE`` processes, ``--max-restarts``): one message per problem."""
    p, problems = cfg.parallel, []
    if world_size != cfg.world_size:
        problems.append(f"WORLD_SIZE={world_size} but parallel.pp·dp·sp·tp = {p.pp}·{p.dp}·{p.sp}·{p.tp} = "
                        f"{cfg.world_size}; start {cfg.world_size} processes (torchrun --nnodes × --nproc-per-node) "
                        "or change the parallel sizes")
    if max_restarts > 0 and cfg.checkpoint.enabled and not cfg.train.resume:
        problems.append(f"torchrun --max-restarts {max_restarts} restarts the workers after a failure, and with "
                        "train.resume=false the restarted job would refuse this run's own checkpoints; set "
                        "train.resume=true so that a restart continues from the newest checkpoint")
    return problems
