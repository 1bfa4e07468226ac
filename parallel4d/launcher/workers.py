"""The launcher's handles on a local job's worker processes, and what ``/proc`` says about them.

On Linux the workers are forked from one *zygote* process (``worker_entry PAYLOAD --fork N``) that
imports torch, the package and the function's module once: N workers then start for the price of
one interpreter (a 16-worker job on 2 cores started in ~1 s instead of ~16 s). Elsewhere, or with
``PARALLEL4D_FORK=0``, each worker is its own interpreter (a ``Popen``). :class:`Forked` gives a
forked worker the calls supervision makes of a ``Popen``; :func:`worker_pids` finds the workers
either way. What runs inside them is :mod:`.worker_process`.
"""

from __future__ import annotations

import abc
import os
import signal
import subprocess
import sys
import time

from parallel4d.launcher import template
from parallel4d.launcher.worker_process import ZYGOTE_EXIT, read_int, read_text, stop_signals_blocked


class _Polled(abc.ABC):
    """``wait``, ``terminate`` and ``kill`` of a ``Popen``, for a process known by what ``poll()`` and
    ``send_signal()`` read and do (not a child of this process)."""

    returncode: int | None

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit status once known, else None (sets ``returncode``)."""

    @abc.abstractmethod
    def send_signal(self, sig: int) -> None:
        """``sig`` to the process while it runs."""

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(repr(self), timeout)
            time.sleep(0.01)
        return self.returncode

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forked(_Polled):
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
            pid = read_int(os.path.join(self.tmp, f"pid{self.rank}"))
            if pid is not None:
                self._pid, self._started = pid, _start_time(pid)
        return self._pid

    def _running(self) -> bool:
        """Asked of ``/proc`` (once the zygote, which would say, is gone)."""
        return self._known_pid() is not None and self._started is not None and _start_time(self._pid) == self._started

    def __repr__(self) -> str:
        return f"rank {self.rank}"

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = read_int(os.path.join(self.tmp, f"exit{self.rank}"))
            if self.returncode is None and self.zygote.poll() is not None and not self._running():
                self.returncode = _UNRECORDED
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



# How a forked worker ended when the zygote died before saying: unknown, so a failure.
_UNRECORDED = 1


class TemplateChild(_Polled):
    """A job's zygote forked by the launcher's template (:mod:`.template`), with the calls supervision
    makes of a ``Popen``: the template records its exit status in the job's directory (``zygote_exit``);
    it is signalled by pid, together with its start time, so that a reused pid is never taken for it."""

    def __init__(self, tmp: str, pid: int, template):
        self.tmp, self.pid, self.template = tmp, pid, template
        self.returncode: int | None = None
        self._started = _start_time(pid)

    def _running(self) -> bool:
        return self._started is not None and _start_time(self.pid) == self._started

    def __repr__(self) -> str:
        return f"zygote {self.pid}"

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = read_int(os.path.join(self.tmp, ZYGOTE_EXIT))
            if self.returncode is None and not self.template.alive() and not self._running():
                self.returncode = _UNRECORDED
        return self.returncode


    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._running():
            try:
                os.kill(self.pid, sig)
            except OSError:
                pass



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


def start(payload: str, tmp: str, world_size: int) -> tuple[list, subprocess.Popen | None]:
    """The workers (one ``Popen`` each, or forked by one zygote) and the zygote (None without)."""
    entry = [sys.executable, "-m", "parallel4d.launcher.worker_entry", payload]
    if not _forking():
        with stop_signals_blocked():  # each takes them once it can (worker_process.take_stop_signals)
            return [subprocess.Popen([*entry, str(r)]) for r in range(world_size)], None
    if template.wanted():  # forked by the launcher's kept template: no interpreter to start
        pid, kept = template.fork_zygote(payload, world_size)
        zygote = TemplateChild(tmp, pid, kept)
    else:
        with stop_signals_blocked():  # until it ignores them: no KeyboardInterrupt in its imports
            zygote = subprocess.Popen([*entry, "--fork", str(world_size)])
    return [Forked(tmp, r, zygote) for r in range(world_size)], zygote


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the live workers of the job started by the process ``launcher_pid`` (Linux
    ``/proc``): its ``worker_entry`` children, the workers its zygote forked, or those of the zygotes its
    template forked."""
    out = {}
    for pid, cmd in child_processes(launcher_pid):
        if b"parallel4d.launcher.worker_entry" not in cmd:
            continue
        if template.ARG.encode() in cmd:  # the template: each child is a job's zygote, named in its registry
            registry = cmd[cmd.index(template.ARG.encode()) + 1].decode()
            for zygote, _ in child_processes(pid):
                tmp = read_text(os.path.join(registry, str(zygote)))
                out.update(_forked_workers(zygote, tmp) if tmp else {})
        elif cmd[-3:-1] == [b"--fork", cmd[-2]]:  # the zygote: its workers are its children
            out.update(_forked_workers(pid, os.path.dirname(cmd[-4].decode())))
        else:
            out[int(cmd[-2])] = pid
    return out


def _forked_workers(zygote: int, tmp: str) -> dict[int, int]:
    """``{rank: pid}`` of the live workers ``zygote`` forked for the job of directory ``tmp``."""
    forked, rank = {}, 0
    while (pid := read_int(os.path.join(tmp, f"pid{rank}"))) is not None:
        forked[pid], rank = rank, rank + 1
    return {forked[child]: child for child, _ in child_processes(zygote) if child in forked}


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


def stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM to each process still running, SIGKILL to those left after ``grace_s``; returns once all ended."""
    for p in procs:
        if p.poll() is None:
            p.terminate()  # a worker not forked yet: its zygote is killed instead
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)  # a stopped worker acts on SIGTERM only once continued
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


def signal_process(p: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``p``; nothing if it has ended meanwhile."""
    try:
        os.kill(p.pid, sig)
    except OSError:
        pass


def end_zygote(zygote: subprocess.Popen) -> None:
    """The zygote exits after its last worker; never leave it behind (it ignores SIGTERM: SIGKILL)."""
    try:
        zygote.wait(5.0)
    except subprocess.TimeoutExpired:
        zygote.kill()
        zygote.wait()


def exit_status(code: int) -> str:
    """How a process with exit status ``code`` ended, in words (``was killed by SIGKILL``)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def process_state(pid: int) -> str:
    """'stopped' for a SIGSTOP-ed process, 'alive' otherwise (Linux /proc; 'alive' elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "alive"
    return "stopped" if state in ("T", "t") else "alive, but not in the collective"
