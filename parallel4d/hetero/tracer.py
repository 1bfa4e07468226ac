"""Warm-up access trace, Belady next-use lookups and the OPT lower bound.

An *iteration* is everything from the end of one ``optimizer.step()`` to the end
of the next (so gradient-accumulation micro-batches belong to one iteration).
Each chunk access is one *moment*. The first iteration records the sequence of
chunk ids (and, per moment, the non-model bytes alive); later iterations replay
it: every access is checked against the recorded one, and on the first mismatch
the trace is declared diverged (the policy falls back to LRU) and the current
iteration is recorded as the new reference.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict


class AccessTrace:
    """Reference trace (last complete recording) + the recording in progress."""

    def __init__(self) -> None:
        self.ref: list[int] | None = None
        self.ref_nonmodel: list[int] = []
        self._index: dict[int, list[int]] = {}
        self.rec: list[int] = []
        self.rec_nonmodel: list[int] = []
        self.rec_live: list[bool] = []
        self.pos = 0
        self.diverged = False
        self.divergences = 0
        self.iterations = 0

    @property
    def valid(self) -> bool:
        """True while the current iteration follows the reference trace."""
        return self.ref is not None and not self.diverged

    def record(self, cid: int, nonmodel_bytes: int, live: bool) -> None:
        """Log one access; check it against the reference."""
        if self.ref is not None and not self.diverged:
            if self.pos >= len(self.ref) or self.ref[self.pos] != cid:
                self.diverged = True
                self.divergences += 1
        self.rec.append(cid)
        self.rec_nonmodel.append(nonmodel_bytes)
        self.rec_live.append(live)
        self.pos += 1

    def end_iteration(self) -> dict:
        """Close the iteration; (re-)adopt its recording when there was no valid reference."""
        if self.ref is not None and not self.diverged and self.pos != len(self.ref):
            self.diverged = True
            self.divergences += 1
        finished = {"trace": self.rec, "live": self.rec_live, "nonmodel": self.rec_nonmodel}
        if self.ref is None or self.diverged:
            self.ref = list(self.rec)
            self.ref_nonmodel = list(self.rec_nonmodel)
            index = defaultdict(list)
            for i, c in enumerate(self.ref):
                index[c].append(i)
            self._index = dict(index)
        self.rec, self.rec_nonmodel, self.rec_live = [], [], []
        self.pos = 0
        self.diverged = False
        self.iterations += 1
        return finished

    def next_use(self, cid: int) -> float:
        """Position of ``cid``'s next access after the current moment (cyclic over iterations)."""
        idx = self._index.get(cid)
        if not idx:
            return math.inf
        j = bisect.bisect_left(idx, self.pos)
        return idx[j] if j < len(idx) else len(self.ref) + idx[0]

    def nonmodel_ahead(self) -> int:
        """PatrickStar's rule: max non-model bytes of this moment and the next (the
        current access is already recorded, so this moment is ``pos - 1``)."""
        if not self.valid or not self.ref_nonmodel:
            return 0
        n = len(self.ref_nonmodel)
        now = min(max(self.pos - 1, 0), n - 1)
        return max(self.ref_nonmodel[now], self.ref_nonmodel[min(now + 1, n - 1)])


def opt_loads(trace: list[int], live: list[bool], slots: int, resident: set[int] | None = None) -> int:
    """Belady/OPT misses on ``trace`` with ``slots`` cache entries, counting only live misses.

    No pinning constraints (a lower bound for the chunk manager, whose COMPUTE
    chunks cannot be evicted); accesses to dead content (zero-fills) cost nothing.
    ``resident``: the cache contents at the start (at most ``slots`` of them).
    """
    where = defaultdict(list)
    for i, c in enumerate(trace):
        where[c].append(i)
    cache = set(list(resident or ())[:slots])
    misses = 0
    for i, c in enumerate(trace):
        if c in cache:
            continue
        if live[i]:
            misses += 1
        if len(cache) >= slots:
            def nxt(x):
                lst = where[x]
                j = bisect.bisect_right(lst, i)
                return lst[j] if j < len(lst) else math.inf
            cache.remove(max(cache, key=nxt))
        cache.add(c)
    return misses
