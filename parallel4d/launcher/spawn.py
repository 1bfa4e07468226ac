"""``spawn(fn, world_size)``: run a function on local worker processes joined by a file-based rendezvous.

Used by :func:`parallel4d.launch` when not under torchrun, and by the tests. Every collective has
the process-group timeout; failures, time limits and stop signals are :mod:`.supervise`'s. The
launcher never returns while a worker or the zygote lives; the temporary directory is always removed.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from contextlib import nullcontext
from typing import Any, Callable

from parallel4d.launcher.supervise import Signals, Supervisor
from parallel4d.launcher.worker_process import TRAINING_IMPORTS
from parallel4d.launcher.workers import end_zygote, start, stop

__all__ = ["spawn", "TRAINING_IMPORTS"]


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    pg_timeout_s: float | None = None,
    threads_per_worker: int = 1,
    env: dict[str, str] | None = None,
    interrupt_grace_s: float = 120.0,
    saving: Callable[[], str | None] | None = None,
    saved: Callable[[], str | None] | None = None,
    refusals: tuple[type[BaseException], ...] = (),
    joined: Callable[[], None] | None = None,
    preload: tuple[str, ...] = (),
    signals: Signals | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes; return each rank's result.

    ``fn`` must be importable (module level). Each process has the default
    process group initialised (``backend``, file rendezvous, collective timeout
    ``pg_timeout_s``, default ``timeout_s``). Raises :class:`~.supervise.WorkerError` with
    the first failing rank's traceback, :class:`~.supervise.WorkerTimeout` after ``timeout_s``; an exception of
    one of ``refusals`` (a user's mistake, e.g. ConfigError) that caused the failure is raised as itself.

    A stop signal to this process (SIGINT, SIGTERM, SIGHUP) is passed on to the workers (the signal
    received), which are expected to stop cleanly: their results are returned as usual (``signals``: the
    caller's :class:`~.supervise.Signals`, entered already, else spawn's own). ``saving()`` names the save in
    progress (e.g. ``"step 12"``) or None, ``saved()`` the newest complete checkpoint: the interrupt
    grace never ends while a save is in progress, a second signal says what it waits for, and a third
    (or the grace run out) kills the workers and raises :class:`~.supervise.Interrupted` saying what was lost.
    ``joined()`` is called here once every worker has joined the process group (before ``fn`` runs).
    ``preload``: modules ``fn`` will import, imported in every worker before ``fn`` runs: once, by the
    zygote before it forks the workers, instead of once in each worker (:data:`TRAINING_IMPORTS` for a function that trains).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be ≥ 1")
    kwargs = kwargs or {}
    pg_timeout_s = pg_timeout_s or timeout_s
    tmp = tempfile.mkdtemp(prefix="parallel4d-")
    init_file = os.path.join(tmp, "rendezvous")
    child_env = {"PARALLEL4D_THREADS": str(threads_per_worker), **(env or {})}
    payload = os.path.join(tmp, "payload.pkl")
    with open(payload, "wb") as f:
        pickle.dump(list(sys.path), f)
        pickle.dump((fn, world_size, backend, init_file, pg_timeout_s, args, kwargs, tmp, os.getpid(), tuple(refusals),
                     tuple(preload), child_env), f)
    procs: list = []
    zygote = None
    with nullcontext(signals) if signals is not None else Signals() as signals:
        try:
            procs, zygote = start(payload, tmp, world_size)
            Supervisor(procs, zygote, tmp, signals, timeout_s, interrupt_grace_s, saving, saved, joined,
                       collective_limit_s=pg_timeout_s).run()
            results = []
            for r in range(world_size):
                with open(os.path.join(tmp, f"result{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f)[1])
            return results
        except BaseException:
            stop(procs)
            raise
        finally:
            if zygote is not None:
                end_zygote(zygote)
            shutil.rmtree(tmp, ignore_errors=True)  # no process of the job is left to write there
