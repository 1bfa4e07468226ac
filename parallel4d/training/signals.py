"""The signals that stop a job (the workers finish the step, save and return), and a terminal that hung up.

Torch-free and standard library only: a local job's processes (the zygote, each worker) import it
before torch, the launcher before any worker starts, the training loop in each rank.

SIGHUP is a stop signal as SIGINT and SIGTERM are: closing the terminal of a job (or an ssh session
without ``nohup``) sends it, and a job ended by it would lose what it trained since its last checkpoint.
A process that starts with SIGHUP ignored (``nohup``) keeps it ignored: that is what the user asked for.
"""

from __future__ import annotations

import errno
import os
import signal

# Those that stop a job wherever they are not ignored on entry (:func:`stop_signals`)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a job in this process: SIGINT and SIGTERM, and SIGHUP unless it is ignored
    here (``nohup``). Asked before the process changes SIGHUP's action."""
    hup_ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    return tuple(s for s in STOP_SIGNALS if not (s == signal.SIGHUP and hup_ignored))


def silence_a_hung_up_terminal() -> None:
    """Standard output and error pointed at /dev/null where they are a terminal that hung up (closed:
    every write fails with EIO), so that saying what the job does — the save, the summary — cannot end
    it with an ``OSError``. Called on a stop signal: the terminal's SIGHUP comes after its hang-up."""
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError as e:
            if e.errno != errno.EIO:
                continue
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
