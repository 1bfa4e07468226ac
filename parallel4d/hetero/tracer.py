"""Warm-up access trace, next-use lookups and the OPT lower bounds.

An *iteration* is everything from the end of one ``optimizer.step()`` to the end
of the next (so gradient-accumulation micro-batches belong to one iteration).
Each chunk access is one *moment*. The first iteration records the sequence of
chunk ids (and, per moment, the non-model bytes alive, whether the content was
live and whether the access writes the chunk); later iterations replay it: every
access is checked against the recorded one, and on the first mismatch the trace
is declared diverged (the policy falls back to LRU) and the current iteration is
recorded as the new reference.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict


class AccessTrace:
    """Reference trace (last complete recording) + the recording in progress."""

    def __init__(self) -> None:
        self.ref: list[int] | None = None
        self.ref_nonmodel: list[int] = []
        self.ref_live: list[bool] = []
        self._index: dict[int, list[int]] = {}
        self._settle: dict[int, list[int]] = {}  # per chunk: moments that write it or after which it dies
        self.rec: list[int] = []
        self.rec_nonmodel: list[int] = []
        self.rec_live: list[bool] = []
        self.rec_write: list[bool] = []
        self.rec_pin_end: list = []  # per moment: the moment its chunk is unpinned before (None: not yet)
        self._open: dict[int, list[int]] = {}  # chunk → its moments still pinned
        self.pos = 0
        self.diverged = False
        self.divergences = 0
        self.iterations = 0

    @property
    def valid(self) -> bool:
        """True while the current iteration follows the reference trace."""
        return self.ref is not None and not self.diverged

    def record(self, cid: int, nonmodel_bytes: int, live: bool, write: bool = False) -> None:
        """Log one access (``live``: the content before it is live; ``write``: it dirties the
        chunk); check it against the reference."""
        if self.ref is not None and not self.diverged:
            if self.pos >= len(self.ref) or self.ref[self.pos] != cid:
                self.diverged = True
                self.divergences += 1
        self.rec.append(cid)
        self.rec_nonmodel.append(nonmodel_bytes)
        self.rec_live.append(live)
        self.rec_write.append(write)
        self.rec_pin_end.append(None)
        self._open.setdefault(cid, []).append(len(self.rec) - 1)
        self.pos += 1

    def unpinned(self, cid: int) -> None:
        """``cid`` is no longer pinned: it was held through every moment since its open accesses."""
        for i in self._open.pop(cid, ()):
            self.rec_pin_end[i] = self.pos

    def end_iteration(self) -> dict:
        """Close the iteration; (re-)adopt its recording when there was no valid reference, else
        take its liveness and writes (the first iteration's differ: Adam's moments are dead
        until the first step writes them)."""
        if self.ref is not None and not self.diverged and self.pos != len(self.ref):
            self.diverged = True
            self.divergences += 1
        pin_end = [i + 1 if e is None else e for i, e in enumerate(self.rec_pin_end)]  # unknown: none
        finished = {"trace": self.rec, "live": self.rec_live, "write": self.rec_write, "pin_end": pin_end,
                    "nonmodel": self.rec_nonmodel}
        if self.ref is None or self.diverged:
            self.ref = list(self.rec)
            self.ref_nonmodel = list(self.rec_nonmodel)
            index = defaultdict(list)
            for i, c in enumerate(self.ref):
                index[c].append(i)
            self._index = dict(index)
        self.ref_live = list(self.rec_live)
        self._settle = {c: [i for k, i in enumerate(idx)  # rewritten there, or dead after it
                            if self.rec_write[i] or not self.rec_live[idx[(k + 1) % len(idx)]]]
                        for c, idx in self._index.items()}
        self.rec, self.rec_nonmodel, self.rec_live, self.rec_write, self.rec_pin_end = [], [], [], [], []
        self._open = {}
        self.pos = 0
        self.diverged = False
        self.iterations += 1
        return finished

    def next_use(self, cid: int) -> float:
        """Position of ``cid``'s next access after the current moment (cyclic over iterations)."""
        return self._next(self._index.get(cid))

    def next_settle(self, cid: int) -> float:
        """Position of ``cid``'s next access that writes it, or after which its content is dead
        (its next access finds it so): where a write-back owed now stops being owed if the
        chunk stays resident until then."""
        return self._next(self._settle.get(cid))

    def _next(self, idx) -> float:
        if not idx:
            return math.inf
        j = bisect.bisect_left(idx, self.pos)
        return idx[j] if j < len(idx) else len(self.ref) + idx[0]

    def next_live(self, cid: int) -> bool:
        """Whether ``cid``'s next access finds live content (False: a zero-fill, or never used)."""
        nxt = self.next_use(cid)
        return nxt != math.inf and self.ref_live[int(nxt) % len(self.ref)]

    def nonmodel_ahead(self) -> int:
        """PatrickStar's rule: max non-model bytes of this moment and the next (the
        current access is already recorded, so this moment is ``pos - 1``)."""
        if not self.valid or not self.ref_nonmodel:
            return 0
        n = len(self.ref_nonmodel)
        now = min(max(self.pos - 1, 0), n - 1)
        return max(self.ref_nonmodel[now], self.ref_nonmodel[min(now + 1, n - 1)])


def opt_loads(trace: list[int], live: list[bool], slots: int, resident: set[int] | None = None) -> int:
    """The fewest live misses (loads) on ``trace`` with ``slots`` cache entries.

    No pinning constraints and no write-backs (a lower bound on the chunk manager's loads);
    accesses to dead content (zero-fills) cost nothing. ``resident``: the cache contents at
    the start (the first ``slots`` of them). Exact: :func:`opt_traffic` with nothing written,
    a min-cost flow — Belady's farthest-next-use is optimal only while every miss costs the
    same, and with free zero-fills it can miss more than this.
    """
    return opt_traffic(trace, live, [False] * len(trace), slots, list(resident or ())[:slots])


_UNIT = 1 << 20  # one chunk move in the bound's integer costs (write-back weights are fractions of it)


def opt_traffic(trace: list[int], live: list[bool], write: list[bool], slots: int, resident=(), dirty=(),
                live_at_end=(), pin_end=None, end_resident=None, rounds: int = 32) -> int:
    """A lower bound on the chunk moves (loads + write-backs) any policy makes on ``trace``.

    ``slots`` chunks fit on the device; the run starts with ``resident`` there (``dirty``: those
    written since their load) and ends with ``live_at_end`` holding live content; ``pin_end[t]``:
    the access before which the chunk of access ``t`` stays pinned (``t + 1``: not past it);
    ``end_resident``: if given, only runs that end with exactly these chunks resident count (the
    measured run is one; without it the bound may leave work to after the end). Zero-fills of
    dead content are not host traffic and count nothing. One pool: filter a trace of several first.

    Why it is a lower bound. Cut each chunk's timeline at its accesses into *gaps* (from one access
    to the next, from the start to the first, from the last to the end). A run either keeps the
    chunk resident through a gap or not; if not, the chunk leaves at some moment inside it.

    * Loads: a chunk first accessed without being in ``resident`` costs one load if its content is
      live (``live``); so does every gap left before an access whose content is live.
    * Write-backs: a *write group* runs from an access that writes the chunk (or the start, for one
      in ``dirty``) to the chunk's next access that writes it or finds it dead (or the end). A gap
      counts as live only if the content is live at its end (``live`` of the access,
      ``live_at_end`` after the last one): the manager turns dead content live only inside an
      access, so a gap counted live really is (one whose content died late counts as dead, which
      only lowers the bound). A group's gaps are all live, so if the chunk leaves during one, its
      first departure after the write is live and finds it dirty — unless a write-back came
      earlier in the group: at least one write-back per group left, and a chunk's groups are
      disjoint in time.
    * Capacity: at each access its chunk and those kept through gaps spanning it fit in ``slots``;
      a pinned chunk is kept up to ``pin_end``, a chunk of ``end_resident`` through its last gap,
      and any other leaves its last gap (prefetches and the manager's other rules only remove
      options).

    So a run costs at least ``compulsory + Σ_left (load + λ)`` for any weights λ ≥ 0 summing to
    at most 1 over each group's gaps (a group's one write-back is at least any average of its
    departures). The kept gaps that minimise that are a max-weight family of intervals at most
    ``slots − 1`` deep at every access — a min-cost flow, solved exactly. A group with one gap
    gets λ = 1 (exact); groups over several gaps (a chunk dirty at the start read before it is
    written again) get subgradient steps, ``rounds`` flows at most, and the best bound is kept. The
    loop stops early when the flow's kept set costs what the bound says (then it is the optimum
    of this relaxation; the exact problem is NP-hard: Beckmann et al., "Writeback-aware
    caching", 2020).
    """
    if slots < 1 or len(set(resident)) > slots:
        raise ValueError(f"opt_traffic: {len(set(resident))} chunks resident at the start in {slots} slots")
    pin_end = pin_end or [t + 1 for t in range(len(trace))]
    end = None if end_resident is None else set(end_resident)
    compulsory, gaps, pins = _gaps(trace, live, write, pin_end, set(resident), set(dirty), set(live_at_end), end)
    must = 4 * _UNIT * (len(gaps) + 1)  # a forced span outweighs every gap together: always kept
    groups = defaultdict(list)
    for i, (_, _, _, g) in enumerate(gaps):
        if g is not None:
            groups[g].append(i)
    lam = [0] * len(gaps)
    for members in groups.values():
        for i in members:
            lam[i] = _UNIT // len(members)
    best, upper = -math.inf, math.inf
    for _ in range(rounds):
        weights = [load * _UNIT + lam[i] for i, (_, _, load, _) in enumerate(gaps)]
        arcs = [(a, b, w) for (a, b, _, _), w in zip(gaps, weights)] + [(a, b, must) for a, b in pins]
        total, kept = _max_kept(len(trace), arcs, slots - 1)
        if not set(range(len(gaps), len(arcs))) <= kept:
            raise ValueError(f"opt_traffic: the pinned and end-resident chunks do not fit in {slots} slots")
        best = max(best, compulsory * _UNIT + sum(weights) - (total - must * len(pins)))
        left = [i for i in range(len(gaps)) if i not in kept]
        upper = min(upper, compulsory + sum(gaps[i][2] for i in left) + len({gaps[i][3] for i in left} - {None}))
        if -(-best // _UNIT) >= upper:
            break  # this kept set is optimal for the relaxation
        _subgradient(lam, groups, kept)
    return -(-best // _UNIT)


def _gaps(trace, live, write, pin_end, resident, dirty, live_at_end, end):
    """``(compulsory moves, gaps, forced)``. A gap ``(a, b, load, group)`` keeps its chunk through
    accesses ``a..b−1``; ``load``: 1 if leaving it costs a load; ``group``: the write group it
    would cost a write-back to (``None``: none). Gaps that cost nothing to leave are dropped, and
    so are gaps spanning no access (always kept for free). A forced span ``(a, b)``: accesses the
    chunk must stay through (pinned, or to the end in ``end``), cut off its gap. ``end``: the
    resident set at the end, or ``None`` (free); a chunk outside it must leave its last gap, so
    that gap's write-back, if any, is compulsory (and its group's other gaps then cost no more)."""
    n, compulsory, gaps, forced = len(trace), 0, [], []
    last = {c: -1 for c in resident}
    held = {c: 0 for c in resident}  # the access before which the chunk stays pinned
    group = {c: ("start", c) for c in dirty & resident}

    def gap(c, t, load, g):
        i = last[c]
        a = max(min(held[c], t), i + 1)
        if i + 1 < a:
            forced.append((i + 1, a))
        if a < t and (load or g is not None):
            gaps.append((a, t, load, g))

    for t, c in enumerate(trace):
        if c not in last:
            compulsory += int(live[t])
        else:
            gap(c, t, int(live[t]), group.get(c) if live[t] else None)
        held[c] = max(pin_end[t], held.get(c, 0))  # a hold from before may outlast this access's
        last[c] = t
        if write[t] or not live[t]:  # a new group, or none: content found dead is written back by nothing
            group[c] = t if write[t] else None
    paid = set()
    for c, i in last.items():  # to the end: no load inside this iteration, a write-back if dirty and live
        g = group.get(c) if c in live_at_end else None
        if end is None:
            gap(c, n, 0, g)
        elif c in end:
            if i + 1 < n:
                forced.append((i + 1, n))
        else:
            gap(c, n, 0, None)  # its pinned part only: it leaves after that
            if g is not None:
                paid.add(g)
    compulsory += len(paid)
    gaps = [(a, b, load, None if g in paid else g) for a, b, load, g in gaps]
    return compulsory, [x for x in gaps if x[2] or x[3] is not None], forced


def _subgradient(lam: list[int], groups: dict, kept: set, step: float = 0.5) -> None:
    """Move half of each group's weight to the gaps it left, where the bound undercharges it
    (any weights give a bound; the best one is kept, so a large step only converges faster)."""
    for members in groups.values():
        out = [i for i in members if i not in kept]
        if len(members) < 2 or not out or sum(lam[i] for i in out) >= _UNIT:
            continue
        for i in members:
            lam[i] = int(lam[i] * (1 - step))
        share = (_UNIT - sum(lam[i] for i in members)) // len(out)
        for i in out:
            lam[i] += share


def _max_kept(n: int, arcs: list[tuple[int, int, int]], width: int) -> tuple[int, set]:
    """Largest total weight of ``arcs`` ``(a, b, w)`` (kept through accesses ``a..b−1``, a < b ≤ n)
    with at most ``width`` of them spanning any access: ``(total, kept arc indices)``.

    Min-cost flow of ``width`` units over the cuts 0 → n: a backbone edge t → t+1 per access (the
    slots not holding a kept chunk there), an edge a → b of cost −w and capacity 1 per arc;
    successive shortest paths with potentials, stopping when no path gains anything.
    """
    head: list[list[int]] = [[] for _ in range(n + 1)]
    to, cap, cost = [], [], []

    def edge(u, v, c, w):
        for a, b, cc, ww in ((u, v, c, w), (v, u, 0, -w)):
            head[a].append(len(to))
            to.append(b)
            cap.append(cc)
            cost.append(ww)

    for t in range(n):
        edge(t, t + 1, width, 0)
    first = len(to)
    for a, b, w in arcs:
        edge(a, b, 1, -w)
    pot = [math.inf] * (n + 1)  # every edge points forward at first: shortest paths in node order
    pot[0] = 0
    for u in range(n + 1):
        for e in head[u]:
            if cap[e] and pot[u] + cost[e] < pot[to[e]]:
                pot[to[e]] = pot[u] + cost[e]
    flow = total = 0
    while flow < width:
        dist, via = _dijkstra(head, to, cap, cost, pot, n)
        if dist[n] + pot[n] - pot[0] >= 0:
            break  # the rest of the slots gain nothing
        pot = [p + d for p, d in zip(pot, dist)]  # every node stays reachable along the backbone
        push, v = width - flow, n
        while v:
            push, v = min(push, cap[via[v]]), to[via[v] ^ 1]
        v = n
        while v:
            cap[via[v]] -= push
            cap[via[v] ^ 1] += push
            total -= push * cost[via[v]]
            v = to[via[v] ^ 1]
        flow += push
    return total, {i for i in range(len(arcs)) if cap[first + 2 * i] == 0}


def _dijkstra(head, to, cap, cost, pot, n):
    dist, via = [math.inf] * (n + 1), [-1] * (n + 1)
    dist[0], heap = 0, [(0, 0)]
    while heap:
        d, u = heapq.heappop(heap)
        if d > dist[u]:
            continue
        for e in head[u]:
            if cap[e]:
                nd = d + cost[e] + pot[u] - pot[to[e]]
                if nd < dist[to[e]]:
                    dist[to[e]], via[to[e]] = nd, e
                    heapq.heappush(heap, (nd, to[e]))
    return dist, via


def opt_traffic_of(iterations: list[dict], slots: int) -> int:
    """:func:`opt_traffic` of consecutive iterations together (the manager's ``history`` records),
    from the first one's start to the last one's end state: a bound on their moves together."""
    trace, live, write, pin_end = [], [], [], []
    for it in iterations:
        pin_end += [len(trace) + e for e in it["pin_end"]]
        trace += it["trace"]
        live += it["live"]
        write += it["write"]
    first, last = iterations[0], iterations[-1]
    return opt_traffic(trace, live, write, slots, first["start_resident"], first["start_dirty"],
                       last["live_at_end"], pin_end, last["end_resident"])
