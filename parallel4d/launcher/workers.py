"""Spawn local worker processes joined by a file-based rendezvous.

Used by :func:`parallel4d.launch` when not under torchrun, and by the tests.
Guarantees: every collective has the process-group timeout; when one worker
raises, dies or stops answering, the others are terminated and :class:`WorkerError`
names the cause (:func:`_blame`: a real error before a killed worker before one
that stopped answering, never a peer that only saw it leave) with its traceback, or
the zygote when that dies; a job that outlives ``timeout_s`` is killed with
:class:`WorkerTimeout`. SIGINT and SIGTERM to the launcher are counted, never raised
(:class:`_Signals`): the first is passed on to the workers (they finish the step, save
and return), a second waits too (for a save in progress above all), a third kills them
(:class:`Interrupted`, saying what was lost). The launcher never returns while a worker
or the zygote lives; a worker whose parent dies exits by itself, one whose job directory
is gone exits quietly; the temporary directory is always removed.

On Linux the workers are forked from one *zygote* process (``worker_entry PAYLOAD --fork N``) that
imports torch, the package and the function's module once: N workers then start for the price of
one interpreter (a 16-worker job on 2 cores started in ~1 s instead of ~16 s). Elsewhere, or with
``PARALLEL4D_FORK=0``, each worker is its own interpreter. :func:`worker_pids` finds them either way.
"""

from __future__ import annotations

import importlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable


class WorkerError(RuntimeError):
    """A worker raised or died (``rank``), or the zygote that forks them died (``rank`` None);
    ``details`` say why."""

    def __init__(self, rank: int | None, details: str):
        self.rank = rank
        self.details = details
        super().__init__(details if rank is None else f"worker rank {rank} failed:\n{details}")


class WorkerTimeout(RuntimeError):
    """The job did not finish within its time limit."""


# What a user or a scheduler sends to stop a job: the workers finish the step and save.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


def _zygote_main(payload_path: str, world_size: int) -> None:
    """``python -m parallel4d.worker_entry PAYLOAD --fork N``: import once, fork the N workers, record
    each one's pid (``pid{r}``) and exit status (``exit{r}``) in the job's directory, exit after them."""
    # Ctrl-C and `kill -TERM -<group>` are for the workers (they save) and the launcher: the zygote
    # exits after its workers, or when the launcher is gone
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    payload = _load(payload_path)
    os.environ.update(payload[-1])
    importlib.import_module("torch.distributed")  # the expensive import, shared by every worker
    out_dir, launcher = payload[7], payload[8]
    ranks = {}
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            for sig in _STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            _worker_main(payload_path, rank, parent_pid=os.getppid())  # never returns
        ranks[pid] = rank
        with _quiet_once_the_job_is_gone(out_dir):
            _write(os.path.join(out_dir, f"pid{rank}"), str(pid))
    threading.Thread(target=_watch_parent, args=(launcher,), daemon=True).start()
    while ranks:
        pid, status = os.wait()
        if pid in ranks:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with _quiet_once_the_job_is_gone(out_dir):
                _write(os.path.join(out_dir, f"exit{ranks.pop(pid)}"), str(code))
    os._exit(0)


@contextmanager
def _quiet_once_the_job_is_gone(out_dir: str):
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


def _read_int(path: str) -> int | None:
    """The number :func:`_write` put in ``path``; None while it is not there."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _worker_main(payload_path: str, rank: int, parent_pid: int | None = None) -> None:
    """Entry point of one worker process (``python -m parallel4d.worker_entry PAYLOAD RANK``, or
    forked by the zygote, which is then ``parent_pid``).

    Workers are plain subprocesses rather than multiprocessing children, so the
    caller's ``__main__`` is never re-imported: ``parallel4d.launch`` works from a
    script without an ``if __name__ == "__main__"`` guard.
    """
    fn, world_size, backend, init_file, pg_timeout_s, args, kwargs, out_dir, launcher, refusals, env = \
        _load(payload_path)
    parent_pid = parent_pid or launcher
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    result_path = os.path.join(out_dir, f"result{rank}.pkl")

    def report(status, payload):
        with _quiet_once_the_job_is_gone(out_dir):
            with open(result_path + ".tmp", "wb") as f:
                pickle.dump((status, payload), f)
            os.replace(result_path + ".tmp", result_path)

    try:
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
        result = fn(*args, **kwargs)
        for sig in _STOP_SIGNALS:  # the function is done: a stop signal now must not lose its result
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


class _Forked:
    """A worker forked by the job's zygote, with the calls supervision makes of a ``Popen``.

    While the zygote lives it says how each worker ended (``exit<r>``). Once it is gone, a worker
    still running is no child of anyone here: it is watched and signalled by the pid the zygote
    recorded, together with its start time, so that a reused pid is never taken for it."""

    def __init__(self, tmp: str, rank: int, zygote: subprocess.Popen):
        self.tmp, self.rank, self.zygote = tmp, rank, zygote
        self.returncode: int | None = None
        self._pid: int | None = None
        self._started: str | None = None  # the worker's start time, read with its pid

    @property
    def pid(self) -> int:
        deadline = time.monotonic() + 60.0
        while self._known_pid() is None:
            if self.zygote.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker of rank {self.rank} was never started "
                                   f"(zygote exit status {self.zygote.poll()})")
            time.sleep(0.01)
        return self._pid

    def forked(self) -> bool:
        """Whether the zygote has forked this worker (its pid is known)."""
        return self._known_pid() is not None

    def _known_pid(self) -> int | None:
        if self._pid is None:
            pid = _read_int(os.path.join(self.tmp, f"pid{self.rank}"))
            if pid is not None:
                self._pid, self._started = pid, _start_time(pid)
        return self._pid

    def _running(self) -> bool:
        """Asked of ``/proc`` (once the zygote, which would say, is gone)."""
        return self._known_pid() is not None and self._started is not None and _start_time(self._pid) == self._started

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _read_int(os.path.join(self.tmp, f"exit{self.rank}"))
            if self.returncode is None and self.zygote.poll() is not None and not self._running():
                self.returncode = _UNRECORDED
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        pid = self._known_pid()
        if pid is None:  # not forked yet: stop the zygote (a worker forked meanwhile sees its parent go)
            self.zygote.kill()
            return
        try:
            os.kill(pid, sig)
        except OSError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# How a forked worker ended when the zygote died before saying: unknown, so a failure.
_UNRECORDED = 1


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (``/proc/<pid>/stat``); None once it has ended (a zombie too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _forking() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("PARALLEL4D_FORK", "1") != "0"


def _start(payload: str, tmp: str, world_size: int) -> tuple[list, subprocess.Popen | None]:
    """The workers (one ``Popen`` each, or forked by one zygote) and the zygote (None without)."""
    entry = [sys.executable, "-m", "parallel4d.launcher.worker_entry", payload]
    if not _forking():
        return [subprocess.Popen([*entry, str(r)]) for r in range(world_size)], None
    zygote = subprocess.Popen([*entry, "--fork", str(world_size)])
    return [_Forked(tmp, r, zygote) for r in range(world_size)], zygote


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the live workers of the job started by the process ``launcher_pid`` (Linux
    ``/proc``): its ``worker_entry`` children, or the workers its zygote forked."""
    out = {}
    for pid, cmd in child_processes(launcher_pid):
        if b"parallel4d.launcher.worker_entry" not in cmd:
            continue
        if cmd[-3:-1] == [b"--fork", cmd[-2]]:  # the zygote: its workers are its children
            tmp = os.path.dirname(cmd[-4].decode())
            forked = {_read_int(os.path.join(tmp, f"pid{r}")): r for r in range(int(cmd[-2]))}
            out.update({forked[child]: child for child, _ in child_processes(pid) if child in forked})
        else:
            out[int(cmd[-2])] = pid
    return out


def child_processes(parent: int) -> list[tuple[int, list[bytes]]]:
    """Live (not zombie) children of ``parent``: ``(pid, argv)``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append((int(entry), cmd))
    return found


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            _signal(p, signal.SIGCONT)  # a stopped worker acts on SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.kill(p.pid, sig)
    except OSError:
        pass


class Interrupted(KeyboardInterrupt):
    """A signal to the launcher ended the job before its workers stopped cleanly (a third signal, the
    interrupt grace run out, or a worker the signal killed): ``signum``, and what was lost in the message."""

    def __init__(self, signum: int, message: str):
        self.signum = signum
        super().__init__(message)


class _Signals:
    """SIGINT and SIGTERM to the launcher while it supervises, counted in ``received``, never raised: an
    exception unwinding through the supervisor would leave before the workers (a second signal even
    from the handling of the first); the supervision loop acts on them instead."""

    def __init__(self):
        self.received: list[int] = []
        self._old: dict = {}

    def __enter__(self):
        for sig in _STOP_SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._record)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _record(self, signum, frame) -> None:
        self.received.append(signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


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
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes; return each rank's result.

    ``fn`` must be importable (module level). Each process has the default
    process group initialised (``backend``, file rendezvous, collective timeout
    ``pg_timeout_s``, default ``timeout_s``). Raises :class:`WorkerError` with
    the first failing rank's traceback, :class:`WorkerTimeout` after ``timeout_s``; an exception of
    one of ``refusals`` (a user's mistake, e.g. ConfigError) that caused the failure is raised as itself.

    SIGINT or SIGTERM to this process is passed on to the workers (the signal received), which are
    expected to stop cleanly: their results are returned as usual. ``saving()`` names the save in
    progress (e.g. ``"step 12"``) or None, ``saved()`` the newest complete checkpoint: the interrupt
    grace never ends while a save is in progress, a second signal says what it waits for, and a third
    (or the grace run out) kills the workers and raises :class:`Interrupted` saying what was lost.
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
                     child_env), f)
    procs: list = []
    zygote = None
    with _Signals() as signals:
        try:
            procs, zygote = _start(payload, tmp, world_size)
            _Supervisor(procs, zygote, tmp, signals, timeout_s, interrupt_grace_s, saving, saved).run()
            results = []
            for r in range(world_size):
                with open(os.path.join(tmp, f"result{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f)[1])
            return results
        except BaseException:
            _stop(procs)
            raise
        finally:
            if zygote is not None:
                _end_zygote(zygote)
            shutil.rmtree(tmp, ignore_errors=True)  # no process of the job is left to write there


def _end_zygote(zygote: subprocess.Popen) -> None:
    """The zygote exits after its last worker; never leave it behind (it ignores SIGTERM: SIGKILL)."""
    try:
        zygote.wait(5.0)
    except subprocess.TimeoutExpired:
        zygote.kill()
        zygote.wait()


# How long to wait, once only consequences (timeouts, lost peers) are reported, for
# the cause to show itself before naming the ranks that stopped answering.
BLAME_GRACE_S = 1.0


def _say(message: str) -> None:
    print(f"[parallel4d] {message}", file=sys.stderr, flush=True)


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class _Supervisor:
    """Watches one job's workers (and zygote) until every one has ended, and acts on the launcher's signals.

    The first signal is passed on to each worker (to one the zygote has not forked yet as soon as it
    has); the workers finish the step, save and return. A second only says what the launcher waits
    for. A third, or ``interrupt_grace_s`` after the first with no save in progress, kills them."""

    def __init__(self, procs: list, zygote: subprocess.Popen | None, tmp: str, signals: _Signals, timeout_s: float,
                 interrupt_grace_s: float, saving: Callable[[], str | None] | None,
                 saved: Callable[[], str | None] | None):
        self.procs, self.zygote, self.tmp, self.signals = procs, zygote, tmp, signals
        self.timeout_s, self.interrupt_grace_s = timeout_s, interrupt_grace_s
        self.saving, self.saved = saving or (lambda: None), saved
        self.handled = 0  # signals acted on
        self.passed_on: set[int] = set()  # ranks the first signal has been passed on to
        self.grace_until = 0.0  # once a signal came: when the workers are killed unless a save is in progress

    def run(self) -> None:
        """Return when every worker exited 0; raise for the first failure, the deadline or a stop at once."""
        deadline = time.monotonic() + self.timeout_s
        first_failure_at = None
        while True:
            self._act_on_signals()
            if self.zygote is not None and self.zygote.poll() not in (None, 0):  # it exits 0, after its workers
                _stop(self.procs)
                raise self._zygote_failure()
            if any(p.poll() not in (None, 0) for p in self.procs):
                first_failure_at = first_failure_at or time.monotonic()
                blamed = _blame(self.procs, self.tmp, settled=time.monotonic() - first_failure_at >= BLAME_GRACE_S)
                if blamed is not None:
                    _stop(self.procs)
                    refusal = _refusal(self.tmp, blamed[0])
                    if refusal is not None:  # raised as itself: one line for the user, no worker traceback
                        raise refusal
                    raise self._failure(*blamed)
            elif all(p.poll() == 0 for p in self.procs):
                return
            if time.monotonic() > deadline:
                running = [r for r, p in enumerate(self.procs) if p.poll() is None]
                _stop(self.procs)
                raise WorkerTimeout(f"job did not finish within {self.timeout_s:.0f}s; ranks still running: {running}")
            time.sleep(0.05)

    def _act_on_signals(self) -> None:
        while self.handled < len(self.signals.received):
            signum = self.signals.received[self.handled]
            self.handled += 1
            if self.handled == 1:
                self.grace_until = time.monotonic() + self.interrupt_grace_s
                _say(f"{_name(signum)} received: the workers finish the step, save and stop (waiting up to "
                     f"{self.interrupt_grace_s:g}s, and for as long as a save is in progress; a third signal "
                     "stops them at once)")
            elif self.handled == 2:
                save = self.saving()
                _say(f"{_name(signum)} again: waiting for the save of {save} to complete; another signal stops at "
                     "once and loses it" if save else
                     f"{_name(signum)} again: still waiting for the workers to finish the step and save; another "
                     f"signal stops them at once and loses {self._lost()}")
            else:
                self._kill_now(signum, f"stopped at once by a third signal ({_name(signum)})")
        if self.handled:
            self._pass_on(self.signals.received[0])
            self._check_grace()

    def _pass_on(self, signum: int) -> None:
        """The signal the launcher received, to each worker once (SIGINT stays SIGINT: summary.json says which)."""
        for rank, p in enumerate(self.procs):
            if rank in self.passed_on or (isinstance(p, _Forked) and not p.forked()):
                continue
            self.passed_on.add(rank)
            if p.poll() is None:
                _signal(p, signum)

    def _check_grace(self) -> None:
        now = time.monotonic()
        if self.saving() is not None:  # never cut a save short: the grace starts again after it
            self.grace_until = max(self.grace_until, now + self.interrupt_grace_s)
        elif now > self.grace_until:
            signum = self.signals.received[0]
            self._kill_now(signum, f"the workers did not stop within interrupt_grace_s={self.interrupt_grace_s:g}s "
                                   f"of {_name(signum)}: stopped at once")

    def _kill_now(self, signum: int, why: str) -> None:
        lost = self._lost()  # while the save in progress is still there to name
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        raise Interrupted(signum, f"{why}; lost: {lost}")

    def _lost(self) -> str:
        """What stopping the workers now loses."""
        save = self.saving()
        parts = [f"the save of {save} in progress"] if save else []
        newest = self.saved() if self.saved is not None else None
        if self.saved is None:
            parts.append("whatever the workers had not saved")
        elif newest is not None:
            parts.append(f"the steps trained since {newest}, the newest complete checkpoint")
        else:
            parts.append("everything trained (there is no complete checkpoint)")
        return " and ".join(parts)

    def _stopped_by_the_signal(self, code: int) -> bool:
        """Did the signal the launcher received (and passed on) end a process that exited with ``code``?"""
        return self.handled > 0 and code in [-s for s in _STOP_SIGNALS]

    def _failure(self, rank: int, details: str) -> BaseException:
        """The error for worker ``rank``'s failure: the stop itself when the launcher's signal killed or
        interrupted it (before its own handler was in place: nothing of this process was saved)."""
        interrupted = self.handled > 0 and details.startswith("KeyboardInterrupt")  # a worker not forked (FORK=0)
        if interrupted or self._stopped_by_the_signal(self.procs[rank].returncode):
            signum = self.signals.received[0]
            return Interrupted(signum, f"{_name(signum)} stopped the worker of rank {rank} before it could save; "
                                       f"lost: {self._lost()}")
        return WorkerError(rank, details)

    def _zygote_failure(self) -> BaseException:
        """The error for the zygote's death: the stop itself when a group signal reached it during its
        imports, before it ignores SIGINT and SIGTERM (and so before it forked any worker)."""
        if self._stopped_by_the_signal(self.zygote.returncode):
            signum = self.signals.received[0]
            return Interrupted(signum, f"{_name(signum)} stopped the job before its workers started: nothing was lost")
        return WorkerError(None, f"the process that forks the workers (zygote, pid {self.zygote.pid}) "
                                 f"{_exit_status(self.zygote.returncode)}; its workers were stopped")


def _error_report(tmp: str, rank: int) -> tuple[float, str, BaseException | None] | None:
    """``(time, details, the exception if one of spawn's refusals)`` of rank's error report, or None."""
    path = os.path.join(tmp, f"result{rank}.pkl")
    try:
        with open(path, "rb") as f:
            status, payload = pickle.load(f)
        when = os.path.getmtime(path)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    if status != "error":
        return None
    details, refusal = payload
    return when, details, refusal


def _refusal(tmp: str, rank: int | None) -> BaseException | None:
    report = _error_report(tmp, rank) if rank is not None else None
    return report[2] if report else None


def _reports(procs, tmp) -> dict[int, tuple[float, str]]:
    """``{rank: (time, details)}`` of every error a worker has reported so far."""
    found = {r: _error_report(tmp, r) for r in range(len(procs))}
    return {r: report[:2] for r, report in found.items() if report is not None}


def _blame(procs, tmp, settled: bool) -> tuple[int, str] | None:
    """``(rank, details)`` of the failure that caused the others, or None to look again later.

    Order: the earliest error that is not a consequence of another rank leaving; then a
    worker that died without a word (killed); then, once ``settled``, a rank that stopped
    answering (alive but silent while its peers timed out), else the earliest consequence.
    The consequence shown is the earliest timeout before any lost peer: a timed-out rank's gloo
    closes its sockets before its own report is written, so a peer's "connection closed" can be
    on disk first, though it only echoes the timeout (which names the action that never finished).
    """
    reports = _reports(procs, tmp)
    causes = sorted((t, r, d) for r, (t, d) in reports.items() if not is_consequence(d))
    if causes:
        _, r, details = causes[0]
        return r, details
    died = [r for r, p in enumerate(procs) if p.poll() not in (None, 0) and r not in reports]
    if died:
        r = died[0]
        return r, f"process {_exit_status(procs[r].returncode)} without reporting an error (killed?)"
    if not settled or not reports:
        return None
    lost, t, first, details = min((lost_peer(d), t, r, d) for r, (t, d) in reports.items())
    silent = [r for r, p in enumerate(procs) if p.poll() is None and r not in reports]
    if not silent:
        return first, details
    states = {r: _process_state(procs[r].pid) for r in silent}
    silent.sort(key=lambda r: states[r] != "stopped")  # a stopped process is the likeliest culprit
    said = ", ".join(f"rank {r} ({states[r]})" for r in silent)
    return silent[0], (f"stopped answering: {said} reported nothing while its peers gave up waiting; "
                       f"rank {first} {'reported first' if lost else 'timed out first'}:\n{details}")


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _process_state(pid: int) -> str:
    """'stopped' for a SIGSTOP-ed process, 'alive' otherwise (Linux /proc; 'alive' elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "alive"
    return "stopped" if state in ("T", "t") else "alive, but not in the collective"


_CONSEQUENCES = ("CommTimeout", "PeerLost")
_LOST_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "socket closed", "remote worker")
_TIMEOUT_WORDS = ("timed out", "timeout")


def lost_peer(details: str) -> bool:
    """Does this error report a peer's connection closing (rather than a timeout)?"""
    first = details.splitlines()[0] if details else ""
    return first.startswith("PeerLost") or any(k in first.lower() for k in _LOST_WORDS)


def is_consequence(details: str) -> bool:
    """Does this error look like a consequence of another rank leaving or stalling?"""
    first = details.splitlines()[0] if details else ""
    return first.startswith(_CONSEQUENCES) or any(k in first.lower() for k in _LOST_WORDS + _TIMEOUT_WORDS)
