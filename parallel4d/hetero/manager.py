"""Chunk residency: a slot arena on the compute device, a byte budget, eviction.

The compute device owns one preallocated *arena* per pool: ``n_slots × slot_elems``
elements. A chunk is resident iff it occupies a slot; its host ``backing`` (pinned
on CUDA) is the home copy. A resident chunk is *dirty* when written since its load;
eviction writes back only dirty live chunks, drops dead ones (all tensors FREE) and
clean ones for free, and a load of dead content is a zero-fill instead of a copy.

The budget is checked on every access: ``resident_bytes ≤ budget`` (static), or
``≤ capacity − traced non-model peak`` (dynamic, PatrickStar's rule). Eviction victim:
dead first; then, under ``belady`` with a valid trace (the warm-up iteration's accesses,
replayed), the chunk whose stay is worth least per moment, ``load/d + wb/r``. Evicting it
costs a load at its next use, ``d`` moments ahead, if that use finds live content (``load``
1, 0 for a zero-fill), and a write-back now if it is dirty (``wb`` 1) — which staying saves
only up to its next access that rewrites it or after which it is dead, ``r ≥ d`` ahead. So
clean chunks go in Belady's order (farthest next use); a dirty one rewritten at its next use
weighs as two loads; one whose write-back is due far ahead anyway (a parameter dirtied by the
last step, read before the next) little more than a clean one. Ties: the cheaper eviction,
the farther use, the least recent. ``lru``: least recently used (also the fallback while the
trace is missing or has diverged). Total traffic = loads + write-backs; zero-fills of dead
content are not host traffic (:func:`~parallel4d.hetero.tracer.opt_traffic` bounds it).

Fills and write-backs go through :class:`~parallel4d.hetero.transfers.Transfers` (on CUDA a stream
per direction, with per-chunk ready events and per-slot freed events), so that fills issued ahead of
use (trace-driven prefetch, Belady-consistent and never past the budget) overlap with compute; a
fill that is a ZeRO all-gather is posted asynchronously, prefetched the same way (every dp rank
replays the same trace under the same budget, so the collectives match), and waited for at first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from parallel4d.hetero.chunk import Chunk, TensorInfo, TensorState
from parallel4d.hetero.tracer import AccessTrace
from parallel4d.hetero.transfers import MoveStats, Transfers

S = TensorState


@dataclass
class Pool:
    """``n_slots`` device slots of ``slot_elems`` elements (the arena); ``limit`` = budget in slots."""

    name: str
    slot_elems: int
    n_slots: int
    limit: int
    arena: Optional[torch.Tensor] = None
    free: list = field(default_factory=list)
    owner: list = field(default_factory=list)
    peak_pinned: int = 0
    freed: dict = field(default_factory=dict)  # slot → the event its last write-back completes at (CUDA)


class BudgetError(ValueError):
    """The device budget cannot hold the chunks that must be resident at once."""


class ChunkManager:
    """Residency, budget, eviction and movement accounting for a set of chunks.

    ``pools``: ``{name: (slot_elems, n_slots)}``; ``policy``: ``"belady" | "lru"``;
    ``dynamic_capacity``: total device bytes for model + non-model data (dynamic budget)
    or ``None`` (static: each pool's ``n_slots`` is its budget).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, pools: dict[str, tuple[int, int]],
                 policy: str = "belady", dynamic_capacity: Optional[int] = None,
                 nonmodel_fn: Optional[Callable[[], int]] = None, budget_bytes: Optional[int] = None):
        self.device, self.dtype = device, dtype
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.policy = policy
        self.pools: dict[str, Pool] = {}
        for name, (elems, n) in pools.items():
            p = Pool(name, elems, n, n)
            p.arena = torch.zeros(n * elems, dtype=dtype, device=device)
            p.free = list(range(n - 1, -1, -1))
            p.owner = [None] * n
            self.pools[name] = p
        self.budget_bytes = budget_bytes if budget_bytes is not None else self.arena_bytes
        self.dynamic_capacity = dynamic_capacity
        self.nonmodel_fn = nonmodel_fn or (lambda: 0)
        self.chunks: list[Chunk] = []
        self.trace = AccessTrace()
        self.tick = 0
        self.stats = MoveStats()     # cumulative
        self.iter_stats = MoveStats()  # current iteration
        self.history: list[dict] = []  # finished iterations: stats + trace
        self.peak_resident_bytes = 0
        self.peak_steady_total = 0  # dynamic budget: max resident + live non-model after warm-up
        self._iter_start: dict = {"start_resident": [], "start_dirty": []}
        self.cuda = device.type == "cuda"
        self.transfers = Transfers(device, dtype)
        # chunks filled ahead of use once the trace is replayed: overlap on CUDA; on the CPU
        # there is nothing to overlap with (tests switch it on to exercise the logic)
        self.prefetch_depth = 2 if self.cuda else 0
        self.host_bytes = 0
        # device bytes hetero holds outside the arena (the master state of device rows): a dynamic budget
        # leaves them out of what the chunks may take
        self.reserved_bytes = 0
        # gives back the pins taken for overlap (``pin(lent=True)``) when a fill finds no room; True if any
        self.release_lent_pins: Callable[[], bool] = lambda: False

    # --- setup -----------------------------------------------------------------
    @property
    def arena_bytes(self) -> int:
        return sum(p.n_slots * p.slot_elems for p in self.pools.values()) * self.esize

    def slot_bytes(self, pool: str) -> int:
        return self.pools[pool].slot_elems * self.esize

    def add(self, chunk: Chunk, backing: bool = True) -> Chunk:
        """Register ``chunk``; its host backing is sliced later by :meth:`allocate_backings`."""
        chunk.cid = len(self.chunks)
        if chunk.capacity != self.pools[chunk.pool].slot_elems:
            raise RuntimeError(f"chunk of {chunk.capacity} elements in pool {chunk.pool!r} of "
                               f"{self.pools[chunk.pool].slot_elems}-element slots")
        chunk.meta["needs_backing"] = backing
        self.chunks.append(chunk)
        return chunk

    def allocate_backings(self, chunks: Optional[list[Chunk]] = None) -> int:
        """One host buffer (exact size) for the backings of ``chunks`` (default: every chunk) that need
        one and have none; returns its bytes. Allocated row by row as the parameters move in, so that the
        model's own storage is freed as hetero's grows."""
        need = [c for c in (self.chunks if chunks is None else chunks)
                if c is not None and c.meta.get("needs_backing") and c.backing is None]
        total = sum(c.capacity for c in need)
        buf = self.transfers.host_buffer(total)
        off = 0
        for c in need:
            c.backing = buf.narrow(0, off, c.capacity)
            off += c.capacity
        self.host_bytes += total * self.esize
        return total * self.esize

    # --- views -----------------------------------------------------------------
    def slot_view(self, c: Chunk) -> torch.Tensor:
        p = self.pools[c.pool]
        return p.arena.narrow(0, c.slot * p.slot_elems, p.slot_elems)

    def view(self, c: Chunk, t: TensorInfo) -> torch.Tensor:
        """The resident tensor ``t`` of chunk ``c`` with its shape (a view into the arena)."""
        return self.slot_view(c).narrow(0, t.offset, t.numel).view(t.shape)

    def read(self, c: Chunk) -> torch.Tensor:
        """Current content of ``c`` (slot if resident, else backing), without an access."""
        if c.slot is not None:
            self._wait_fill(c)
            return self.slot_view(c)
        if c.backing is None:
            raise RuntimeError(f"chunk {c.kind}[{c.index}] has no content off the device")
        self.transfers.sync()
        return c.backing

    def locate(self, t: torch.Tensor):
        """``(pool, chunk, offset_in_chunk)`` if ``t`` aliases an arena, else ``None``."""
        # the storage itself, not its address: a plan's fake tensors have no address
        storage = t.untyped_storage()._cdata
        for p in self.pools.values():
            if p.arena.untyped_storage()._cdata == storage:
                off = t.storage_offset()
                s = off // p.slot_elems
                c = p.owner[s]
                if c is None:
                    raise RuntimeError("a tensor aliases a free slot of the chunk arena")
                return p, c, off - s * p.slot_elems
        return None

    # --- budget ----------------------------------------------------------------
    def resident_bytes(self) -> int:
        return sum((p.n_slots - len(p.free)) * p.slot_elems for p in self.pools.values()) * self.esize

    def _pinned(self, p: Pool) -> int:
        return sum(1 for c in p.owner if c is not None and c.pinned)

    def _limit(self, p: Pool, extra: int = 0) -> int:
        """Slots pool ``p`` may occupy now (``extra``: slots about to be pinned by this access).

        Static: ``n_slots``. Dynamic (main pool): ``(capacity − other pools − max traced
        non-model of this and the next moment) // slot``; during warm-up (no valid trace)
        a quarter of the arena, as PatrickStar keeps most memory free while it traces.
        Never below what is pinned right now (those chunks cannot leave).
        """
        if self.dynamic_capacity is None or p.name != "main":
            return p.n_slots
        if not self.trace.valid:
            base = max(1, p.n_slots // 4)
        else:
            others = sum(q.n_slots * q.slot_elems for q in self.pools.values() if q is not p) * self.esize
            avail = self.dynamic_capacity - self.trace.nonmodel_ahead() - others - self.reserved_bytes
            base = avail // (p.slot_elems * self.esize)
        return min(p.n_slots, max(base, self._pinned(p) + extra, 1))

    def budget_now(self, using: Optional[Chunk] = None) -> int:
        """Bytes allowed now; ``using``: the chunk being accessed (about to be pinned)."""
        return sum(self._limit(p, int(using is not None and using.pool == p.name and not using.pinned))
                   * p.slot_elems for p in self.pools.values()) * self.esize

    def _too_small(self, p: Pool, need: int) -> BudgetError:
        sb = p.slot_elems * self.esize
        pinned = [f"{c.kind}[{c.index}]" for c in p.owner if c is not None and c.pinned]
        others = sum(q.n_slots * q.slot_elems for q in self.pools.values() if q is not p) * self.esize
        minimum = need * sb + others
        return BudgetError(
            f"hetero.device_budget_bytes={self.budget_bytes} is too small: {need} chunks of {sb} bytes must be "
            f"resident at once here (in use: {', '.join(pinned) or 'none'}, plus one more), so the minimum "
            f"feasible value is at least {minimum}; use hetero.device_budget_bytes≥{minimum} "
            f"(run once with hetero.device_budget_bytes=None and read stats()['min_feasible_budget_bytes'] "
            f"for the exact minimum of this model and loop)")

    def _check_budget(self, using: Optional[Chunk] = None) -> None:
        r = self.resident_bytes()
        self.peak_resident_bytes = max(self.peak_resident_bytes, r)
        if self.dynamic_capacity is not None and self.trace.valid:
            self.peak_steady_total = max(self.peak_steady_total, r + self.nonmodel_fn())
        limit = self.budget_now(using)
        if r > limit:
            raise RuntimeError(f"hetero internal error: {r} resident bytes exceed the budget of {limit}")

    # --- residency ---------------------------------------------------------------
    def _victim(self, p: Pool, protect: Optional[Chunk] = None) -> Optional[Chunk]:
        cands = [c for c in p.owner if c is not None and not c.pinned and c is not protect]
        if not cands:
            return None
        dead = [c for c in cands if c.dead]
        if dead:
            return min(dead, key=lambda c: c.last_use)
        if self.policy == "belady" and self.trace.valid:
            return max(cands, key=self._rank)
        return min(cands, key=lambda c: c.last_use)

    def _rank(self, c: Chunk) -> tuple:
        """Belady with the write-back's cost (module docstring): the larger, the sooner evicted."""
        now = self.trace.pos - 1  # the current access is recorded already
        d = self.trace.next_use(c.cid) - now
        load, wb = int(self.trace.next_live(c.cid)), int(c.dirty and c.backing is not None)
        worth = load / d + wb / (self.trace.next_settle(c.cid) - now)  # 0 when never used again
        return (-worth, -(load + wb), d, -c.last_use)

    def evict(self, c: Chunk) -> None:
        """Give up ``c``'s slot; write back only dirty live content.

        On CUDA the write-back is queued on the copy stream after everything queued so
        far on the compute stream (the slot's last readers/writers); the next fill of the
        slot is queued behind it on the same stream, so nothing here blocks the host.
        """
        p = self.pools[c.pool]
        st = (self.stats, self.iter_stats)
        if c.dirty and not c.dead and c.backing is None:
            if "spill" not in c.meta:
                raise RuntimeError(f"hetero internal error: chunk {c.kind}[{c.index}] holds live content and "
                                   "has no host copy to evict it to")
            c.extra_pins += 1  # the spill accesses other chunks: none of that may evict this one again
            c.meta["spill"]()  # its content goes elsewhere (ZeRO: reduced into this rank's shard)
            c.extra_pins -= 1
        self._wait_fill(c)  # a prefetched gather still in flight lands before the slot is reused
        if c.dirty and not c.dead and c.backing is not None:
            self.before_host_write(c)
            self.transfers.run(lambda: c.backing.copy_(self.slot_view(c), non_blocking=self.cuda), "d2h", c.cid)
            p.freed[c.slot] = self.transfers.written_back()
            for s in st:
                s.writeback_bytes += c.capacity * self.esize
                s.writebacks += 1
        else:
            for s in st:
                s.drops += 1
        for s in st:
            s.evictions += 1
        p.owner[c.slot] = None
        p.free.append(c.slot)
        c.slot = None
        c.dirty = False
        c.meta.pop("ready", None)

    def _make_room(self, p: Pool, keep: int, protect: Optional[Chunk] = None) -> None:
        """Evict until at most ``keep`` slots of ``p`` are occupied (never ``protect``)."""
        while p.n_slots - len(p.free) > keep:
            v = self._victim(p, protect)
            if v is None:
                raise self._too_small(p, p.n_slots - len(p.free) + 1)
            self.evict(v)

    def _fill(self, c: Chunk) -> None:
        """Give ``c`` a free slot and its content: gathered (ZeRO), zero-filled (dead) or loaded."""
        p = self.pools[c.pool]
        c.slot = p.free.pop()
        p.owner[c.slot] = c
        dst = self.slot_view(c)
        st = (self.stats, self.iter_stats)
        gathers = c.loader is not None and not c.dead and c.meta.get("gathers")
        self.transfers.wait_freed(p.freed.pop(c.slot, None), on_compute=bool(gathers))  # the last write-back
        if gathers:  # posted now, waited for at first use (_wait_fill): a prefetched one overlaps
            self.transfers.note("gather", c.cid)
            c.meta["pending"] = c.loader(dst)
        elif c.loader is not None and not c.dead:  # a copy of other content (the master, rounded)
            crossed = c.loader(dst)  # False: rounded from a master on the device, no host traffic
            for s in st:
                if crossed is False:
                    s.device_fills += 1
                else:
                    s.load_bytes += c.capacity * self.esize
                    s.loads += 1
        elif c.dead or c.backing is None:
            self.transfers.run(dst.zero_, "h2d", c.cid)
            for s in st:
                s.zero_fill_bytes += c.capacity * self.esize
                s.zero_fills += 1
        else:
            self.transfers.run(lambda: dst.copy_(c.backing, non_blocking=self.cuda), "h2d", c.cid)
            for s in st:
                s.load_bytes += c.capacity * self.esize
                s.loads += 1
        if not gathers:
            self.transfers.mark_ready(c)
        c.dirty = False

    def _wait_fill(self, c: Chunk) -> None:
        """What uses ``c``'s slot next waits for its fill: the copy's event, or the gather's work."""
        self.transfers.wait_ready(c)
        finish = c.meta.pop("pending", None)
        if finish is not None:
            finish()

    def ensure_resident(self, c: Chunk) -> None:
        p = self.pools[c.pool]
        if c.slot is None:
            limit = self._limit(p, extra=1)
            if p.n_slots - len(p.free) >= limit:
                try:
                    self._make_room(p, limit - 1)
                except BudgetError:
                    if not self.release_lent_pins():
                        raise self._too_small(p, self._pinned(p) + 1) from None
                    self._make_room(p, limit - 1)  # what overlap held is free now
            if c.slot is not None:
                raise RuntimeError(f"hetero internal error: chunk {c.kind}[{c.index}] was filled while room was "
                                   "made for it")
            self._fill(c)
        elif self.dynamic_capacity is not None:
            # proactive: the budget may have shrunk since the last moment
            self._make_room(p, self._limit(p, extra=int(not c.pinned)), protect=c)
        self._wait_fill(c)  # compute waits for this chunk's fill, and only for it

    def prefetch(self, current: Chunk) -> None:
        """Fill the next ``prefetch_depth`` chunks of the replayed trace ahead of use.

        Only into a free slot or in place of the chunk the demand rule would evict now
        (:meth:`_rank`), and only if that one is dead, or clean and not needed before the
        prefetched chunk (no write-back ahead of time, nothing needed sooner evicted);
        never beyond the budget. On CUDA the fills overlap with compute.
        """
        if not self.prefetch_depth or not self.trace.valid or self.policy != "belady":
            return
        ref, pos = self.trace.ref, self.trace.pos
        for j in range(pos, min(pos + self.prefetch_depth, len(ref))):
            c = self.chunks[ref[j]]
            if c.slot is not None:  # a gather too: every dp rank replays the same trace and budget
                continue
            p = self.pools[c.pool]
            if p.n_slots - len(p.free) >= self._limit(p):
                cands = [x for x in p.owner if x is not None and not x.pinned and x is not current]
                if not cands:
                    return
                v = max(cands, key=lambda x: (x.dead,) + self._rank(x))
                if not v.dead and (v.dirty or self.trace.next_use(v.cid) <= j):
                    return  # a write-back or a victim needed sooner: leave it to demand time
                self.evict(v)
            self._fill(c)
            self.stats.prefetches += 1
            self.iter_stats.prefetches += 1
            self._check_budget()

    def access(self, c: Chunk, record: bool = True, write: bool = False) -> None:
        """Record the moment (unless ``record`` is False: state-dict traffic outside the
        training loop) and make ``c`` resident (evicting per policy); ``write``: the caller
        writes ``c`` (it becomes dirty)."""
        self.tick += 1
        self.transfers.note("access", c.cid)
        if record:
            self.trace.record(c.cid, self.nonmodel_fn(), live=not c.dead, write=write and c.backing is not None)
        self.ensure_resident(c)
        c.last_use = self.tick
        self._check_budget(c)
        if record:
            self.prefetch(c)

    def _note_pins(self, c: Chunk) -> None:
        """The most chunks of ``c``'s pool pinned at once, pins lent to overlap left out (they give way)."""
        p = self.pools[c.pool]
        needed = sum(1 for x in p.owner if x is not None and x.pinned and x.extra_pins > x.lent_pins
                     or x is not None and any(t.state == S.COMPUTE for t in x.tensors))
        p.peak_pinned = max(p.peak_pinned, needed)

    # --- tensor-level holds ---------------------------------------------------------
    def acquire(self, c: Chunk, tensors: Optional[list[TensorInfo]] = None, write: bool = False,
                zero_free: bool = True, record: bool = True) -> None:
        """Tensors of ``c`` → COMPUTE (nested holds counted); the chunk becomes resident and pinned.

        A FREE tensor's range is zeroed on its way to COMPUTE unless ``zero_free`` is
        False (the caller overwrites it).
        """
        self.access(c, record, write)
        for t in (c.tensors if tensors is None else tensors):
            if t.holds == 0:
                if t.state == S.FREE and zero_free:
                    a, b = max(t.offset, c.base), min(t.end, c.base + c.capacity)
                    if a < b:
                        self.slot_view(c)[a - c.base:b - c.base].zero_()
                t.set_state(S.COMPUTE)
            t.holds += 1
        if write:
            c.dirty = True
        self._note_pins(c)

    def release(self, c: Chunk, tensors: Optional[list[TensorInfo]], to: TensorState) -> None:
        for t in (c.tensors if tensors is None else tensors):
            if t.holds <= 0:
                raise RuntimeError(f"hetero: release of tensor {t.name!r} that is not held")
            t.holds -= 1
            if t.holds == 0:
                t.set_state(to)
        if not c.pinned:
            self.trace.unpinned(c.cid)

    def pin(self, c: Chunk, lent: bool = False) -> None:
        """Keep ``c`` resident until :meth:`unpin`. ``lent``: for overlap only (a collective in flight),
        given back through ``release_lent_pins`` when a fill finds no room, and so not counted in the
        minimum feasible budget."""
        self.access(c)
        c.extra_pins += 1
        c.lent_pins += lent
        if not lent:
            self._note_pins(c)

    def unpin(self, c: Chunk, lent: bool = False) -> None:
        c.extra_pins -= 1
        c.lent_pins -= lent
        if not c.pinned:
            self.trace.unpinned(c.cid)

    def flush(self, c: Chunk) -> None:
        """Write ``c`` back if it is resident and dirty (it stays resident, now clean)."""
        if c.slot is not None and c.dirty and not c.dead and c.backing is not None:
            self._wait_fill(c)
            self.before_host_write(c)
            self.transfers.run(lambda: c.backing.copy_(self.slot_view(c), non_blocking=self.cuda), "d2h", c.cid)
            for s in (self.stats, self.iter_stats):
                s.writeback_bytes += c.capacity * self.esize
                s.writebacks += 1
            c.dirty = False

    @staticmethod
    def before_host_write(c: Chunk) -> None:
        """A backing the host optimizer may still read (a host row's gradient) is written only after it."""
        guard = c.meta.get("before_host_write")
        if guard is not None:
            guard()

    def count(self, **delta) -> None:
        """Add ``delta`` (``MoveStats`` fields) to the cumulative and the iteration counters."""
        for s in (self.stats, self.iter_stats):
            for k, v in delta.items():
                setattr(s, k, getattr(s, k) + v)

    def invalidate(self, c: Chunk) -> None:
        """Drop ``c`` from the device without write-back (its content is stale)."""
        if c.slot is not None:
            c.dirty = False
            self.evict(c)

    # --- iterations --------------------------------------------------------------
    def end_iteration(self) -> dict:
        for c in self.chunks:  # a gather prefetched for a moment that never came (a diverged trace)
            if "pending" in c.meta:
                self._wait_fill(c)
        secs = self.transfers.take_copy_seconds()
        if secs is not None:
            self.stats.copy_seconds += secs
            self.iter_stats.copy_seconds += secs
        finished = self.trace.end_iteration()
        rec = self.iter_stats.as_dict()
        rec.update(self._iter_start)
        self._iter_start = {"start_resident": [c.cid for c in self.chunks if c.slot is not None],
                            "start_dirty": [c.cid for c in self.chunks if c.slot is not None and c.dirty]}
        # what opt_traffic needs: the state at the end
        rec["end_resident"] = self._iter_start["start_resident"]
        rec["live_at_end"] = [c.cid for c in self.chunks if not c.dead]
        rec.update(finished)
        self.history.append(rec)
        if len(self.history) > 4:  # keep the recent ones only (traces can be long)
            self.history.pop(0)
        self.iter_stats = MoveStats()
        return rec

    def min_feasible_bytes(self) -> int:
        """Smallest static budget that runs what was seen so far: the most chunks pinned at
        once in the main pool, plus the fixed-size other pools (ZeRO shard slots)."""
        return sum((max(p.peak_pinned, 1) if p.name == "main" else p.n_slots) * p.slot_elems
                   for p in self.pools.values()) * self.esize
