"""Workers whose waits behave as NCCL's, over gloo on CPU: :func:`wait_as_on_nccl`.

On NCCL ``Work.wait()`` only makes the current stream wait for the work and returns at once: the host
runs on, and a work a stopped peer never completes leaves the stream stuck, not the host. Here an
untimed ``Work.wait()`` returns at once too (the host computes on whatever the buffers hold: fine
for a fault test, never for an exactness one), and every mesh's deadlines get the markers of an
emulated stream: a marker is past once every work the stream was told to wait for before it has
finished without error (gloo ends a work a stopped peer never answers with an error at the group's
timeout; a CUDA stream would simply never get past it).
"""

from __future__ import annotations

import sys
import warnings

import torch.distributed as dist

from parallel4d.distributed import comm

COMM = comm.__file__


def _finished(work) -> bool:
    if not work.is_completed():
        return False
    with warnings.catch_warnings():  # Work.exception() warns that it is deprecated
        warnings.simplefilter("ignore")
        return work.exception() is None


class EmulatedStream:
    """The works the stream was told to wait for, not yet known finished, in order."""

    def __init__(self):
        self.waiting: list = []

    def wait_for(self, work) -> None:
        self.waiting = [w for w in self.waiting if not _finished(w)] + [work]

    def marker(self):
        ahead = list(self.waiting)

        class Marker:
            @staticmethod
            def query() -> bool:
                return all(_finished(w) for w in ahead)

        return Marker()


def meshes_with_deadlines(marker) -> tuple:
    """Every ``Mesh`` built from now on gets ``Deadlines`` over ``marker`` (as a mesh on CUDA gets them
    over stream events); returns ``(Mesh, "__init__", the original)`` to undo it."""
    from parallel4d.distributed.deadlines import Deadlines
    from parallel4d.distributed.mesh import Mesh

    real_init = Mesh.__init__

    def init(mesh, *args, **kwargs):
        real_init(mesh, *args, **kwargs)
        mesh.deadlines = Deadlines(mesh.timeout_s, marker=marker)

    Mesh.__init__ = init
    return Mesh, "__init__", real_init


def wait_as_on_nccl() -> EmulatedStream:
    """In this (worker) process, from now on: an untimed ``Work.wait()`` of :func:`comm.wait` returns at
    once, handing the work to an :class:`EmulatedStream`, and every mesh built gets deadlines over that stream's markers."""
    stream = EmulatedStream()
    meshes_with_deadlines(stream.marker)
    real_wait = dist.Work.wait

    def wait(work, *args, **kwargs):
        # only the package's own waits (comm.wait): torch's object collectives wait inside and then read
        # the bytes back on the host, as they do on NCCL
        if args or kwargs.get("timeout") is not None or sys._getframe(1).f_code.co_filename != COMM:
            return real_wait(work, *args, **kwargs)
        stream.wait_for(work)
        return True

    dist.Work.wait = wait
    return stream
