"""What runs inside the processes of a local job: the zygote (``worker_entry PAYLOAD --fork N``) and
each worker (``worker_entry PAYLOAD RANK``, or forked by the zygote).

They talk to the launcher through the job's temporary directory only: the payload spawn wrote
(``payload.pkl``: ``sys.path``, then the function, its arguments, the job's settings and the modules
the zygote imports before forking), the
rendezvous file, and what they write back: ``result{r}.pkl`` (``("ok", result)`` or ``("error",
(details, refusal))``), and from the zygote ``pid{r}`` and ``exit{r}``, or ``zygote_failed`` (why it
forked no worker). A worker whose launcher (or zygote) dies exits by itself; one whose job directory is
gone exits quietly.

Stop signals (:mod:`parallel4d.training.signals`): each process starts with them blocked (the launcher
starts it inside :func:`stop_signals_blocked`) and unblocks them once it has chosen their action
(:func:`take_stop_signals`): the zygote and a template ignore them, a worker takes their default (it
ends, silently, until the training loop's handler is in place and saves). None of them can meet one
while Python's own SIGINT handler is there: a Ctrl-C in their interpreter's start would end it with a
``KeyboardInterrupt`` traceback.

CUDA and fork: a process forked after CUDA was initialised in its parent cannot use CUDA. The zygote
imports the function's module before forking, so it refuses to fork once torch has initialised CUDA
there (:func:`refuse_cuda_before_fork`), and while it imports, ``torch.cuda.is_available()`` asks NVML
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``), which leaves the driver alone; each worker gets the variable's
own value back.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

from parallel4d.training.signals import STOP_SIGNALS, stop_signals

# What a worker that trains imports on its way to the first step: torch's optimizers import
# torch._dynamo when constructed (~1.5 s of CPU per process), a checkpoint torch.distributed.checkpoint.
# ``spawn(preload=...)`` imports them once (a zygote template: once for all the launcher's jobs).
TRAINING_IMPORTS = ("torch._dynamo", "torch.distributed.checkpoint")
# Written into the job's directory by rank 0 once every worker has joined the process group.
JOINED = "joined"
# Written by the zygote when it exits before forking the workers: why, in words.
ZYGOTE_FAILED = "zygote_failed"
# Written by a template into the job's directory once the zygote it forked has ended: its exit status.
ZYGOTE_EXIT = "zygote_exit"
# torch asks NVML rather than the CUDA driver in torch.cuda.is_available() while this is "1"
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


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


def zygote_main(payload_path: str, world_size: int, parent_pid: int | None = None,
                stops: tuple[int, ...] | None = None) -> None:
    """``python -m parallel4d.launcher.worker_entry PAYLOAD --fork N``: import once, fork the N workers, record
    each one's pid (``pid{r}``) and exit status (``exit{r}``) in the job's directory, exit after them.
    ``parent_pid``: the process it must outlive no longer than (the launcher; a template that forked it);
    ``stops``: the signals that stop the workers (default: this process's :func:`stop_signals`)."""
    stops = stop_signals() if stops is None else stops  # asked before ignoring them: nohup's SIGHUP stays ignored
    # Ctrl-C and `kill -TERM -<group>` are for the workers (they save) and the launcher: the zygote
    # exits after its workers, or when the launcher is gone
    take_stop_signals(signal.SIG_IGN, STOP_SIGNALS)
    try:
        with _nvml_check():  # the workers get the variable's own value back
            payload = _load(payload_path)
            os.environ.update(payload[-1])
            # the expensive imports, shared by every worker
            for module in ("torch.distributed", *payload[10]):
                importlib.import_module(module)
        refuse_cuda_before_fork(payload[0])
    except BaseException as e:  # no worker forked: the launcher names this as the zygote's failure
        _fail_before_forking(os.path.dirname(payload_path), e)
    out_dir, launcher = payload[7], payload[8]
    ranks = {}
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            take_stop_signals(signal.SIG_DFL, stops)
            worker_main(payload_path, rank, parent_pid=os.getppid())  # never returns
        ranks[pid] = rank
        with quiet_once_the_job_is_gone(out_dir):
            _write(os.path.join(out_dir, f"pid{rank}"), str(pid))
    threading.Thread(target=_watch_parent, args=(parent_pid or launcher,), daemon=True).start()
    while ranks:
        pid, status = os.wait()
        if pid in ranks:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with quiet_once_the_job_is_gone(out_dir):
                _write(os.path.join(out_dir, f"exit{ranks.pop(pid)}"), str(code))
    os._exit(0)


def template_main(registry: str, launcher: int, sock_fd: int, preload: tuple[str, ...]) -> None:
    """``worker_entry --template REGISTRY LAUNCHER FD MODULES``: a process that has imported ``preload`` and
    forks, for each request the launcher sends over the socket ``FD``, a job's zygote (:func:`zygote_main`)
    at the launcher's working directory, environment and standard streams of that moment — so the
    launcher's later jobs start without an interpreter's imports. Replies the zygote's pid; records its
    job directory in ``REGISTRY/<pid>`` (for ``/proc`` lookups) and, once it ended, its exit status in
    ``zygote_exit`` there. Exits when the launcher closes the socket or is gone."""
    take_stop_signals(signal.SIG_IGN, STOP_SIGNALS)
    with _nvml_check():
        for module in ("torch.distributed", *preload):
            importlib.import_module(module)
    sock = socket.socket(fileno=sock_fd)
    jobs: dict[int, str] = {}
    while os.getppid() == launcher:  # no threads here: the process forks
        _reap_zygotes(jobs, registry)
        if not select.select([sock], [], [], 0.1)[0]:
            continue
        request, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not request:
            break
        payload, world_size, cwd, env, stops = json.loads(request)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become_the_launchers(fds, cwd, env)
            zygote_main(payload, world_size, parent_pid=os.getppid(), stops=tuple(stops))  # never returns
        for fd in fds:
            os.close(fd)
        jobs[pid] = os.path.dirname(payload)
        _write(os.path.join(registry, str(pid)), jobs[pid])
        sock.sendall(str(pid).encode())
    os._exit(0)


@contextmanager
def stop_signals_blocked():
    """Around the start of a child interpreter (the zygote, a template, an unforked worker) by this thread:
    the child starts with the stop signals blocked (a mask survives ``exec``) and takes them with
    :func:`take_stop_signals`. Here one sent meanwhile waits until the block ends (or another thread
    takes it): the launcher's handlers still record it."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def take_stop_signals(action, signals: tuple[int, ...]) -> None:
    """``action`` (``SIG_IGN``, ``SIG_DFL``) for ``signals``, then every stop signal unblocked: one that
    arrived meanwhile is acted on now (or dropped, where ignored)."""
    for sig in signals:
        signal.signal(sig, action)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextmanager
def _nvml_check():
    """``torch.cuda.is_available()`` asks NVML meanwhile (a module asking at import leaves CUDA alone)."""
    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        yield
    finally:
        _restore(NVML_CHECK, before)


def _become_the_launchers(fds: list[int], cwd: str, env: dict[str, str]) -> None:
    """In a template's fresh child: the launcher's standard streams, directory and environment."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)


def _reap_zygotes(jobs: dict[int, str], registry: str) -> None:
    """Record the exit status of each ended zygote in its job's directory (``zygote_exit``)."""
    while jobs:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        tmp = jobs.pop(pid, None)
        if tmp is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            _write(os.path.join(tmp, ZYGOTE_EXIT), str(code))
        except OSError:  # the job's directory is gone: its launcher is done with it
            pass
        with contextlib.suppress(OSError):
            os.remove(os.path.join(registry, str(pid)))


class CudaBeforeFork(RuntimeError):
    """CUDA was initialised in the zygote before it forked the workers (they could not use it)."""


def refuse_cuda_before_fork(fn) -> None:
    """:class:`CudaBeforeFork` when torch has initialised CUDA in this process (the zygote, after the
    import of ``fn``'s module): workers forked now would fail at ``set_device``."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    module = getattr(fn, "__module__", None) or "the function's module"
    raise CudaBeforeFork(
        f"CUDA was initialised in the process that forks the workers (the zygote) while it imported {module}, "
        "so no forked worker could use the GPU. Something ran CUDA at import time (a CUDA tensor, "
        "torch.cuda.init(), torch.cuda.current_device() … at module level): move it into a function, ask "
        "parallel4d.distributed.startup.visible_gpus() for a device count (it leaves CUDA uninitialised), "
        "or set PARALLEL4D_FORK=0 to start each worker as its own interpreter")


def _fail_before_forking(tmp: str, error: BaseException) -> None:
    """Record why the zygote forks no worker (``zygote_failed``, read by the launcher), say it, exit 1."""
    text = f"{type(error).__name__}: {error}"
    if not isinstance(error, CudaBeforeFork):
        text += "\n\n" + traceback.format_exc()
    with quiet_once_the_job_is_gone(tmp):
        _write(os.path.join(tmp, ZYGOTE_FAILED), text)
    print(text, file=sys.stderr, flush=True)
    os._exit(1)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


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


def read_text(path: str) -> str | None:
    """The text of ``path``; None while it is not there."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


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


def use_gpu(rank: int, forked: bool) -> None:
    """``torch.cuda.set_device`` for ``rank``; in a forked worker a failure also names the likely cause:
    CUDA's driver initialised in the zygote before the fork, which torch cannot tell (only its own
    initialisation is refused there, by :func:`refuse_cuda_before_fork`)."""
    import torch

    try:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    except RuntimeError as e:
        if not forked:
            raise
        raise RuntimeError(
            f"{e}\nThis worker was forked by the job's zygote: if the GPU works in a fresh process, CUDA's driver "
            "was initialised in the zygote before the fork, by code run while it imported the function's module "
            "(torch.cuda.is_available() or device queries at module level): use "
            "parallel4d.distributed.startup.visible_gpus() there, or set PARALLEL4D_FORK=0") from e


def worker_main(payload_path: str, rank: int, parent_pid: int | None = None) -> None:
    """Entry point of one worker process (``python -m parallel4d.launcher.worker_entry PAYLOAD RANK``, or
    forked by the zygote, which is then ``parent_pid``).

    Workers are plain subprocesses rather than multiprocessing children, so the
    caller's ``__main__`` is never re-imported: ``parallel4d.launch`` works from a
    script without an ``if __name__ == "__main__"`` guard.
    """
    if parent_pid is None:  # started by the launcher, stop signals blocked (forked: the zygote chose already)
        take_stop_signals(signal.SIG_DFL, stop_signals())
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
            use_gpu(rank, forked=parent_pid != launcher)
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
