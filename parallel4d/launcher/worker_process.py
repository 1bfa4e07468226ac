"""What runs inside the processes of a local job: the zygote (``worker_entry PAYLOAD --fork N``) and
each worker (``worker_entry PAYLOAD RANK``, or forked by the zygote).

They talk to the launcher through the job's temporary directory only: the payload spawn wrote
(``payload.pkl``: ``sys.path``, then the function, its arguments, the job's settings and the modules
the zygote imports before forking), the
rendezvous file, and what they write back: ``result{r}.pkl`` (``("ok", result)`` or ``("error",
(details, refusal))``), and from the zygote ``pid{r}`` and ``exit{r}``. A worker whose launcher (or
zygote) dies exits by itself; one whose job directory is gone exits quietly.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

# What a user or a scheduler sends to stop a job: the workers finish the step and save.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Written into the job's directory by rank 0 once every worker has joined the process group.
JOINED = "joined"


def _watch_parent(parent_pid: int) -> None:
    # A worker orphaned by a killed launcher would otherwise block its peers forever.
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(1.0)


def _load(payload_path: str) -> tuple:
    with open(payload_path, "rb") as f:
        sys.path[:0] = [p for p in pickle.load(f) if p not in sys.path]  # before unpickling fn
        return pickle.load(f)


def zygote_main(payload_path: str, world_size: int) -> None:
    """``python -m parallel4d.launcher.worker_entry PAYLOAD --fork N``: import once, fork the N workers, record
    each one's pid (``pid{r}``) and exit status (``exit{r}``) in the job's directory, exit after them."""
    # Ctrl-C and `kill -TERM -<group>` are for the workers (they save) and the launcher: the zygote
    # exits after its workers, or when the launcher is gone
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    payload = _load(payload_path)
    os.environ.update(payload[-1])
    # the expensive imports, shared by every worker
    for module in ("torch.distributed", *payload[10]):
        importlib.import_module(module)
    out_dir, launcher = payload[7], payload[8]
    ranks = {}
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            worker_main(payload_path, rank, parent_pid=os.getppid())  # never returns
        ranks[pid] = rank
        with quiet_once_the_job_is_gone(out_dir):
            _write(os.path.join(out_dir, f"pid{rank}"), str(pid))
    threading.Thread(target=_watch_parent, args=(launcher,), daemon=True).start()
    while ranks:
        pid, status = os.wait()
        if pid in ranks:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with quiet_once_the_job_is_gone(out_dir):
                _write(os.path.join(out_dir, f"exit{ranks.pop(pid)}"), str(code))
    os._exit(0)


@contextmanager
def quiet_once_the_job_is_gone(out_dir: str):
    """Around a write into the job's directory: once that is gone, the launcher is gone or done and no
    one is left to tell, so exit quietly (not with a traceback about a missing file)."""
    try:
        yield
    except FileNotFoundError:
        if os.path.isdir(out_dir):
            raise
        os._exit(1)


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def read_int(path: str) -> int | None:
    """The number :func:`_write` put in ``path``; None while it is not there."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _say_joined(out_dir: str) -> None:
    try:
        _write(os.path.join(out_dir, JOINED), "1")
    except OSError:  # only a message depends on it: the job goes on
        pass


def worker_main(payload_path: str, rank: int, parent_pid: int | None = None) -> None:
    """Entry point of one worker process (``python -m parallel4d.launcher.worker_entry PAYLOAD RANK``, or
    forked by the zygote, which is then ``parent_pid``).

    Workers are plain subprocesses rather than multiprocessing children, so the
    caller's ``__main__`` is never re-imported: ``parallel4d.launch`` works from a
    script without an ``if __name__ == "__main__"`` guard.
    """
    fn, world_size, backend, init_file, pg_timeout_s, args, kwargs, out_dir, launcher, refusals, preload, env = \
        _load(payload_path)
    parent_pid = parent_pid or launcher
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    result_path = os.path.join(out_dir, f"result{rank}.pkl")

    def report(status, payload):
        with quiet_once_the_job_is_gone(out_dir):
            with open(result_path + ".tmp", "wb") as f:
                pickle.dump((status, payload), f)
            os.replace(result_path + ".tmp", result_path)

    try:
        for module in preload:  # a forked worker has them from the zygote already
            importlib.import_module(module)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(env.get("PARALLEL4D_THREADS", "1")))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend=backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        # gloo may let a rank out of its connection set-up before a peer is through its own: with a
        # function that makes no collective, that rank could exit and close a connection the peer
        # was still completing ("connectFullMesh failed … Connection closed by peer")
        dist.barrier()
        if rank == 0:  # every rank is through the barrier: the launcher may say so
            _say_joined(out_dir)
        result = fn(*args, **kwargs)
        for sig in STOP_SIGNALS:  # the function is done: a stop signal now must not lose its result
            signal.signal(sig, signal.SIG_IGN)
    except BaseException as e:  # report everything, including KeyboardInterrupt, to the parent
        # Report before tearing the group down: peers fail *because* we leave, and the
        # parent names the earliest report as the cause.
        refusal = e if isinstance(e, refusals) else None  # the user's mistake: its message is the whole story
        details = f"{type(e).__name__}: {e}" + ("" if refusal else f"\n\n{traceback.format_exc()}")
        report("error", (details, refusal))
        os._exit(1)
    report("ok", result)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads can make it slow
