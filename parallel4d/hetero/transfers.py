"""How chunk content moves between host and compute device, and what that movement is counted as.

On CUDA the host backings are one page-locked buffer, and every fill and write-back runs on a side
stream: the copy stream first waits for the compute stream (the slot's previous readers/writers are
done), a fill records a *ready* event on the chunk, and the compute stream waits for that event when
the chunk is next accessed (or read) — so fills issued ahead of use overlap with compute. Host reads
of a backing drain the copy stream first. On the CPU every copy runs at once, in order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from parallel4d.hetero.chunk import Chunk

STAGING = 4  # page-locked staging buffers for casting uploads (one in use, the rest in flight)


@dataclass
class MoveStats:
    """Bytes and counts of chunk movement (host↔device) and ZeRO collectives."""

    load_bytes: int = 0        # host → device copies of live content
    writeback_bytes: int = 0   # device → host copies of dirty live content
    zero_fill_bytes: int = 0   # dead content materialised by zeroing, no copy
    loads: int = 0
    writebacks: int = 0
    zero_fills: int = 0
    drops: int = 0             # evictions without a copy (dead or clean)
    evictions: int = 0
    gather_bytes: int = 0      # ZeRO all-gather, bytes received
    reduce_scatter_bytes: int = 0  # ZeRO reduce-scatter, bytes sent
    copy_seconds: float = 0.0  # CUDA only when profiling: time inside chunk copies
    prefetches: int = 0        # fills issued ahead of use from the replayed trace

    @property
    def moved_bytes(self) -> int:
        return self.load_bytes + self.writeback_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["moved_bytes"] = self.moved_bytes
        return d


class Transfers:
    """The copy machinery of one compute ``device`` for chunks of ``dtype``: host buffers, the copy
    stream and the chunks' ready events (CUDA), and copy timing when ``profile`` is on."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.profile = False  # time every copy (CUDA events), summed by take_copy_seconds
        self._events: list = []
        self.pinned_host = False
        self._registered: list[torch.Tensor] = []
        self._stages: list = []  # (page-locked buffer, event) ring for upload_cast

    def host_buffer(self, n: int) -> torch.Tensor:
        """Zeroed host buffer of ``n`` elements; page-locked when the compute device is CUDA.

        Pinned by ``cudaHostRegister`` on one plain allocation: torch's pinned allocator
        rounds every request up to a power of two, which would cost up to 2× host memory.
        Falls back to pageable memory if registration fails (slower copies, still correct).
        """
        t = torch.zeros(n, dtype=self.dtype)
        if self.cuda and n:
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n * t.element_size(), 0)
            if int(getattr(rc, "value", rc)) == 0:
                self.pinned_host = True
                self._registered.append(t)
        return t

    def __del__(self):
        # hand registered host pages back before their memory is freed
        try:
            if self._registered:
                torch.cuda.synchronize(self.device)
                for t in self._registered:
                    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
                self._registered.clear()
        except Exception:
            pass

    def upload_cast(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (compute device, this dtype) ← ``src`` (host, a wider dtype), rounded on the host so
        that only this dtype's bytes cross the link: through a page-locked staging buffer on CUDA (a
        ring of :data:`STAGING` buffers; one is reused once the copy that last read it is done)."""
        if self.copy_stream is None:
            dst.copy_(src)
            return
        stage, done = self._staging(src.numel())
        stage.copy_(src)
        self.run(lambda: dst.copy_(stage, non_blocking=True))
        done.record(self.copy_stream)

    def _staging(self, n: int):
        """The next staging buffer of at least ``n`` elements and its completion event, waited for."""
        if not self._stages or self._stages[0][0].numel() < n:
            self._stages = [(self.host_buffer(n), torch.cuda.Event()) for _ in range(STAGING)]
        buf, ev = self._stages.pop(0)
        ev.synchronize()  # the copy that read this buffer STAGING loads ago (long done, as a rule)
        self._stages.append((buf, ev))
        return buf.narrow(0, 0, n), ev

    def run(self, op) -> None:
        """Run a slot/backing copy: directly on the CPU; on CUDA on the copy stream,
        ordered after the compute stream's queued work (the event-free half of the protocol;
        consumers wait on the chunk's ``ready`` event)."""
        if self.copy_stream is None:
            op()
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            if self.profile:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                op()
                b.record()
                self._events.append((a, b))
            else:
                op()

    def compute_waits(self) -> None:
        """The compute stream waits for every copy queued so far (CUDA)."""
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def sync(self) -> None:
        """Host reads of backings need the copy stream drained."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def mark_ready(self, c: Chunk) -> None:
        """Record on ``c`` the event its fill, queued last on the copy stream, completes (CUDA)."""
        if self.copy_stream is not None:
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
            c.meta["ready"] = ev

    def wait_ready(self, c: Chunk) -> None:
        """The compute stream waits for ``c``'s fill, and only for it."""
        ev = c.meta.pop("ready", None)
        if ev is not None:  # a prefetched fill may still be in flight
            torch.cuda.current_stream(self.device).wait_event(ev)

    def take_copy_seconds(self) -> float | None:
        """Seconds spent in the copies timed since the last call; None when none was timed."""
        if not (self.profile and self._events):
            return None
        torch.cuda.synchronize(self.device)
        secs = sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        self._events.clear()
        return secs
