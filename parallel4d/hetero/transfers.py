"""How chunk content moves between host and compute device, and what that movement is counted as.

On CUDA the host backings are one page-locked buffer, and copies run on two side streams, one per
direction (pinned host-to-device and device-to-host copies run at once on separate engines): each
first waits for the compute stream (the slot's previous readers and writers are done); a fill records
a *ready* event on the chunk, and the compute stream waits for that event when the chunk is next
accessed (or read), so fills issued ahead of use overlap with compute; a write-back records a *freed*
event on its slot, and the next fill of that slot waits for it. Host reads of a backing drain both
streams first. On the CPU every copy runs at once, in order. ``log`` (a list, when set) records every
copy, collective and access in order: what a test on the CPU checks the overlap's order with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from parallel4d.hetero.chunk import Chunk

STAGING = 4  # page-locked staging buffers for casting uploads (one in use, the rest in flight)
STAGE_ELEMS = 1 << 24  # elements per staging buffer (32 MiB in 16 bits): an upload goes in such pieces


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
    device_fills: int = 0      # fills rounded from a master the device holds: no host traffic

    @property
    def moved_bytes(self) -> int:
        return self.load_bytes + self.writeback_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["moved_bytes"] = self.moved_bytes
        return d


class Transfers:
    """The copy machinery of one compute ``device`` for chunks of ``dtype``: host buffers, the two
    copy streams and the chunks' ready events (CUDA), and copy timing when ``profile`` is on."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.cuda = device.type == "cuda"
        self.streams = {way: torch.cuda.Stream(device) for way in ("h2d", "d2h")} if self.cuda else {}
        self.log: list | None = None  # (what, detail) of every copy, collective and access, when a list
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
        that only this dtype's bytes cross the link: on CUDA in pieces through a ring of :data:`STAGING`
        page-locked staging buffers of :data:`STAGE_ELEMS` elements (one is reused once the copy that last
        read it is done), so staging costs a fixed few MiB of host memory, not a chunk's size."""
        if not self.cuda:
            self.run(lambda: dst.copy_(src), "h2d")
            return
        n = src.numel()
        self.allocate_staging(n)
        step = self._stages[0][0].numel()
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            stage, done = self._staging(hi - lo)
            stage.copy_(src[lo:hi])
            self.run(lambda a=lo, b=hi, st=stage: dst[a:b].copy_(st, non_blocking=True), "h2d")
            done.record(self.streams["h2d"])

    def allocate_staging(self, n: int) -> int:
        """The staging ring for windows of ``n`` elements (CUDA); returns its host bytes."""
        if self.cuda and not self._stages and n:
            size = min(n, STAGE_ELEMS)
            self._stages = [(self.host_buffer(size), torch.cuda.Event()) for _ in range(STAGING)]
        return sum(buf.numel() for buf, _ in self._stages) * torch.empty((), dtype=self.dtype).element_size()

    def _staging(self, n: int):
        """The next staging buffer's first ``n`` elements and its completion event, waited for."""
        buf, ev = self._stages.pop(0)
        ev.synchronize()  # the copy that read this buffer STAGING pieces ago (long done, as a rule)
        self._stages.append((buf, ev))
        return buf.narrow(0, 0, n), ev

    def note(self, what: str, detail) -> None:
        if self.log is not None:
            self.log.append((what, detail))

    def run(self, op, way: str, detail=None) -> None:
        """Run a slot/backing copy (``way``: "h2d" fills, "d2h" write-backs): directly on the CPU; on
        CUDA on that direction's stream, ordered after the compute stream's queued work (the event-free
        half of the protocol; consumers wait on the chunk's ``ready`` event)."""
        self.note(way, detail)
        stream = self.streams.get(way)
        if stream is None:
            op()
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if self.profile:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                op()
                b.record()
                self._events.append((a, b))
            else:
                op()

    def written_back(self):
        """The event the write-backs queued so far complete at (None off CUDA): a slot's next fill
        waits for it (:meth:`wait_freed`)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.streams["d2h"])
        return ev

    def wait_freed(self, ev, on_compute: bool = False) -> None:
        """The fill stream (or the compute stream, for a fill that is a collective) waits for a slot's
        last write-back."""
        if ev is not None:
            (torch.cuda.current_stream(self.device) if on_compute else self.streams["h2d"]).wait_event(ev)

    def compute_waits(self) -> None:
        """The compute stream waits for every copy queued so far (CUDA)."""
        for stream in self.streams.values():
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def sync(self) -> None:
        """Host reads (and writes) of backings need both copy streams drained."""
        for stream in self.streams.values():
            stream.synchronize()

    def mark_ready(self, c: Chunk) -> None:
        """Record on ``c`` the event its fill, queued last on the fill stream, completes (CUDA)."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.streams["h2d"])
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
