"""A kept zygote template: a launcher that runs many jobs forks each job's zygote from it.

A job's zygote (:mod:`.workers`) spends ~3 s of one core importing torch and the training stack
before it forks the workers. A process that launches job after job — a test session, a sweep, a
notebook — can keep one *template* instead: a child that imported them once and forks each job's
zygote on request, at the launcher's working directory, environment and standard streams of the
moment (sent over a Unix socket with the descriptors), so a job starts without those imports. The
zygote then runs exactly as a started one (:func:`~.worker_process.zygote_main`); the template records
its exit status in the job's directory (:class:`~.workers.TemplateChild` reads it). The template
exits when its launcher does.

Opt-in: ``PARALLEL4D_ZYGOTE_TEMPLATE=<pid>`` keeps a template for the process with that pid only (a
process it starts, e.g. a ``parallel4d launch`` subprocess, starts its zygotes as usual).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

from parallel4d.launcher.worker_process import TRAINING_IMPORTS, stop_signals_blocked
from parallel4d.training.signals import stop_signals

ENV = "PARALLEL4D_ZYGOTE_TEMPLATE"
ARG = "--template"  # worker_entry's argument: a template's command line says it is one
# What the template imports once: a training job's imports and the launcher's entry (the whole stack).
PRELOAD = (*TRAINING_IMPORTS, "parallel4d.launcher.launch")
_held: dict[str, "Template"] = {}  # this process's template, while it lives (one per launcher process)


def wanted() -> bool:
    """Whether this process keeps a template (``PARALLEL4D_ZYGOTE_TEMPLATE`` names its pid)."""
    return os.environ.get(ENV) == str(os.getpid())


class Template:
    """The launcher's side of a kept template: :meth:`fork` a job's zygote; ``registry``: the directory
    where the template names each live zygote's job directory (``registry/<pid>``)."""

    def __init__(self):
        self.registry = tempfile.mkdtemp(prefix="parallel4d-template-")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock, self.lock = ours, threading.Lock()
        entry = [sys.executable, "-m", "parallel4d.launcher.worker_entry", ARG, self.registry,
                 str(os.getpid()), str(theirs.fileno()), ",".join(PRELOAD)]
        with stop_signals_blocked():  # until it ignores them
            self.proc = subprocess.Popen(entry, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, payload: str, world_size: int) -> int:
        """The pid of a zygote forked now for the job of ``payload`` (``OSError`` if the template is gone)."""
        # the signals that stop this launcher's workers, as a zygote it started would take them
        request = json.dumps([payload, world_size, os.getcwd(), dict(os.environ), stop_signals()]).encode()
        streams, opened = [], []
        for fd in (0, 1, 2):  # a closed standard stream is /dev/null in the zygote
            if not _is_open(fd):
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
            streams.append(fd)
        try:
            with self.lock:
                socket.send_fds(self.sock, [request], streams)
                reply = self.sock.recv(64)
        finally:
            for fd in opened:
                os.close(fd)
        if not reply:
            raise OSError("the zygote template has ended")
        return int(reply)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.registry, ignore_errors=True)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def fork_zygote(payload: str, world_size: int) -> tuple[int, Template]:
    """A zygote for the job of ``payload`` forked by this process's template (started, or started again
    when the one held has ended): its pid and the template."""
    t = _alive()
    try:
        return t.fork(payload, world_size), t
    except OSError:  # it ended between the check and the request: once more, with a new one
        t.proc.kill()
        t = _alive()
        return t.fork(payload, world_size), t


def _alive() -> Template:
    t = _held.get("template")
    if t is None or not t.alive():
        if t is not None:
            t.close()
        t = _held["template"] = Template()
    return t
