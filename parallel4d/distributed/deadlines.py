"""Bounded waits where waits are stream-ordered (NCCL): the deadlines the host checks at its read steps.

On gloo a wait blocks the host until the work is done, so ``comm.wait(works, timeout_s)`` bounds it
directly. On NCCL that would poll the host until the GPU got there, every layer: the host could
never queue ahead. There ``comm.wait`` only orders the current stream after the work (``work.wait()``
returns at once) and hands the limit to the mesh's :class:`Deadlines`, which records a marker on the
stream (a CUDA event: done when the stream got past the wait, i.e. when the work finished) with its
deadline and the action's name. The host checks them where it has to wait for the device anyway —
the training loop's read-back steps, a checkpoint's save (:meth:`Deadlines.settle`): it polls the
markers and raises ``CommTimeout`` naming the first action past its deadline, so a stopped peer
ends the job within ``train.timeout_s`` of the stuck wait, named, as on gloo.

NCCL's own watchdog is the backstop for a host blocked where it cannot poll (a CUDA call that
synchronises): the groups' timeout is :func:`group_timeout_s`, later than every deadline, and its
abort (SIGABRT) is a consequence in the launcher's blame, never the cause.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from parallel4d.distributed.comm import CommTimeout


class Marker(Protocol):
    """A point in the device's stream: ``query()`` says, without waiting, whether the stream got past it."""

    def query(self) -> bool: ...


def stream_marker() -> Marker:
    """A CUDA event recorded on the current stream now (a few microseconds, no wait)."""
    event = torch.cuda.Event()
    event.record()
    return event


def group_timeout_s(backend: str, timeout_s: float) -> float:
    """A process group's own limit for a job whose waits have ``timeout_s`` (``train.timeout_s``):
    that on gloo (its waits block, bounded by it); on NCCL the watchdog's, later than every deadline
    here, so that the host's ``CommTimeout`` naming the action comes first, yet soon enough to end a
    host that blocked."""
    return timeout_s + max(30.0, 0.5 * timeout_s) if backend == "nccl" else timeout_s


class Deadlines:
    """The stream-ordered waits of one rank not yet known to be done: ``(marker, deadline, what)``
    in posting order. ``default_s``: the limit of a wait that names none (the job's
    ``train.timeout_s``); ``marker`` makes a :class:`Marker` (:func:`stream_marker` on a GPU)."""

    POLL_S = (1e-4, 0.05)  # the first and the longest pause between polls while settling

    def __init__(self, default_s: float, marker: Callable[[], Marker] = stream_marker,
                 clock: Callable[[], float] = time.monotonic):
        self.default_s, self.marker, self.clock = float(default_s), marker, clock
        self.entries: list[tuple[Marker, float, str]] = []

    def add(self, timeout_s: float | None, what: str) -> None:
        """The stream just waited for ``what``: it must get past here within ``timeout_s`` (None: ``default_s``)."""
        limit = self.default_s if timeout_s is None else timeout_s
        self.entries.append((self.marker(), self.clock() + limit, what))
        self._drop_done()

    def settle(self, what: str, timeout_s: float | None = None) -> None:
        """Wait, polling, until the stream got past everything queued so far (all entries and ``what``,
        the work queued since: e.g. the step's read-back); ``CommTimeout`` naming the first entry past
        its deadline, or ``what`` after ``timeout_s``. Afterwards a read of the device waits for nothing."""
        self.add(timeout_s, what)
        pause = self.POLL_S[0]
        while self.entries:
            self._drop_done()
            if not self.entries:
                return
            _, deadline, late = self.entries[0]
            if self.clock() > deadline:
                self.entries.clear()
                me = dist.get_rank() if dist.is_initialized() else 0
                raise CommTimeout(f"rank {me}: {late} did not finish within its limit (the stream waited for "
                                  f"it): a peer stopped answering")
            time.sleep(pause)
            pause = min(2 * pause, self.POLL_S[1])

    def _drop_done(self) -> None:
        """Forget the entries the stream got past (in order: a later marker cannot be done before)."""
        done = 0
        while done < len(self.entries) and self.entries[done][0].query():
            done += 1
        del self.entries[:done]
