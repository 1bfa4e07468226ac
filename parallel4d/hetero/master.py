"""The master copy behind 16-bit chunks: parameters and Adam moments in the parameters' dtype, per row on
the compute device or on the host.

When the device chunks hold a narrower compute copy (``Layout.mixed``: bfloat16 or float16 chunks for
float32 parameters, as PatrickStar and ZeRO-Offload keep them), this rank's window of every row has its
master parameters ``W`` and Adam moments ``M``, ``V`` here. Where they live is a row's *placement*:

* ``device``: as many trainable rows as the device budget holds after the compute chunks (PatrickStar's
  rule: the 16-bit chunks first, the optimizer state in what is left; :mod:`.budget`). Such a row is
  updated on the device, from its gradient chunk where it is, and its parameter chunk is rounded from
  ``W`` on the device: nothing crosses the host link.
* ``host``: the rest. Such a row is updated on the host from
  its gradient's host backing by a worker beside the training thread (:class:`HostUpdates`), and a
  parameter chunk is filled by rounding ``W`` down on the host, so only 16-bit bytes cross the link.

Each row's state is one allocation of its own, so a row that changes placement after the warm-up frees
its old home. Host bytes per parameter of a host row (float32 master, 16-bit chunks, dp = 1): 4 (W) + 4
(M) + 4 (V) + 2 (the gradient's backing) = 14. Frozen rows (a LoRA base) have no state here: nothing updates
them, so their chunks' own backings in the compute dtype are their only copy (2 bytes per parameter).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import torch

from parallel4d.hetero.layout import Layout, Row
from parallel4d.hetero.optim import adam_update, fused_adam_update
from parallel4d.hetero.transfers import Transfers

DEVICE, HOST = "device", "host"
PIECE = 1 << 22  # elements updated at once: the master's copy of a gradient piece is the only temporary


class HostUpdates:
    """The host rows' optimizer updates, run in submission order by one worker thread beside the training
    thread (torch's kernels release the GIL), so that they overlap the GPU's next forward.

    ``wait(key)`` returns once that update is done — a parameter chunk's upload waits for its row's — and
    raises its error, naming it; ``timeout_s`` bounds every wait. ``note`` logs ``("host_update_queued", key)``
    when an update is handed over, ``("host_update", key)`` when it starts and ``("host_update_done", key)``
    when it ends (the order tests read)."""

    def __init__(self, note: Callable[[str, object], None], timeout_s: float):
        self.note, self.timeout_s = note, timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self.seconds = 0.0  # the worker's time in updates, summed
        self.inline = False  # run each update at once on the caller's thread (the sequential order)

    def submit(self, key: int, work: Callable[[], None]) -> None:
        if self.inline:
            self._run(key, work)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="parallel4d-host-optimizer")
        self.wait(key)  # one update of a row at a time
        self.note("host_update_queued", key)
        self._pending[key] = self._pool.submit(self._run, key, work)

    def _run(self, key: int, work: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        self.note("host_update", key)
        work()
        self.note("host_update_done", key)
        self.seconds += time.perf_counter() - t0

    def wait(self, key: int) -> None:
        """Until ``key``'s update is done (nothing when none is pending)."""
        f = self._pending.pop(key, None)
        if f is None:
            return
        try:
            f.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RuntimeError(f"hetero: the host optimizer's update of row {key} did not finish within "
                               f"{self.timeout_s:.0f} s (train.timeout_s)") from None
        except Exception as e:
            self.cancel()
            raise RuntimeError(f"hetero: the host optimizer's update of row {key} failed: "
                               f"{type(e).__name__}: {e}") from e

    def wait_all(self) -> None:
        for key in list(self._pending):
            self.wait(key)

    def cancel(self) -> None:
        """Drop what has not started (after a failure: the step ends with the error)."""
        for f in self._pending.values():
            f.cancel()
        self._pending.clear()

    def close(self) -> None:
        if self._pool is not None:
            self.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None


class MasterState:
    """``W``, ``M``, ``V``: per trainable row index, this rank's ``[hi − lo]`` window (``window_of(row)``) in the
    parameters' dtype, on ``device`` or on the host as ``place`` says; zeros until written."""

    def __init__(self, layout: Layout, window_of: Callable[[Row], tuple[int, int]], transfers: Transfers,
                 device: torch.device,
                 updates: HostUpdates):
        self.layout, self.window_of, self.transfers, self.device = layout, window_of, transfers, device
        self.updates = updates
        self.W: dict[int, torch.Tensor] = {}
        self.M: dict[int, torch.Tensor] = {}
        self.V: dict[int, torch.Tensor] = {}
        self.place: dict[int, str] = {}

    def row_bytes(self, row: Row) -> int:
        return 3 * self.elems(row) * self.layout.dtype.itemsize

    def elems(self, row: Row) -> int:
        lo, hi = self.window_of(row)
        return hi - lo

    def allocate(self, row: Row, where: str) -> None:
        """``row``'s state, zeros, on the device or the host (one allocation)."""
        buf = torch.zeros(3, self.elems(row), dtype=self.layout.dtype, device=self.device if where == DEVICE else "cpu")
        for store, x in zip((self.W, self.M, self.V), buf):
            store[row.index] = x
        self.place[row.index] = where

    def move(self, row: Row, where: str) -> None:
        """``row``'s state to ``where`` (its old home freed)."""
        if self.place.get(row.index) == where:
            return
        self.updates.wait(row.index)
        old = [store[row.index] for store in (self.W, self.M, self.V) if row.index in store]
        self.allocate(row, where)
        for store, x in zip((self.W, self.M, self.V), old):
            store[row.index].copy_(x)

    def bytes_on(self, where: str) -> int:
        return sum(self.row_bytes(row) for row in self.layout.rows if self.place.get(row.index) == where)

    def rows_on(self, where: str, trainable: bool = True) -> int:
        return sum(1 for row in self.layout.rows
                   if row.trainable == trainable and self.place.get(row.index) == where)

    @torch.no_grad()
    def upload(self, row: Row, dst: torch.Tensor) -> bool:
        """``dst`` (``[hi − lo]`` on the compute device, the chunks' dtype) ← ``W`` of ``row``, rounded: on
        the device for a device row; else on the host, once the row's host update is done. Whether the
        bytes crossed the host link."""
        if self.place[row.index] == DEVICE:
            dst.copy_(self.W[row.index])
            return False
        self.updates.wait(row.index)
        self.transfers.note("upload", row.index)
        self.transfers.upload_cast(dst, self.W[row.index])
        return True

    @torch.no_grad()
    def update(self, row: Row, grad: torch.Tensor, spans: list[tuple], grad_scale, fused: bool) -> None:
        """Adam(W) on ``row``'s master window from ``grad`` (its ``[hi − lo]`` gradient in the chunks'
        dtype, where the row's state is); ``spans``: ``(start, end, (step, hyperparameters))`` within the
        window. Elementwise, so it runs in pieces of :data:`PIECE`: the gradient's copy in the master's
        dtype (as torch's ``master.grad = grad.float()``) is the only temporary."""
        w, m, v = self.W[row.index], self.M[row.index], self.V[row.index]
        update = fused_adam_update if fused else adam_update
        # one buffer for every piece: a fresh allocation per piece would be mapped, faulted in and unmapped
        # each time (the training loop has large blocks returned to the kernel when freed)
        piece = torch.empty(min(PIECE, grad.numel()), dtype=self.layout.dtype, device=grad.device)
        for a, b, (st, hp) in spans:
            for lo in range(a, b, PIECE):
                hi = min(b, lo + PIECE)
                g = piece[:hi - lo].copy_(grad[lo:hi])
                if grad_scale is not None:
                    g.mul_(grad_scale)
                update(w[lo:hi], g, m[lo:hi], v[lo:hi], step=st, **hp)
