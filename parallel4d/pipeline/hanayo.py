"""Hanayo: the wave placement and the search for an order of its actions.

``2·W·P`` chunks placed as ``W`` waves (chunk ``c`` on rank ``c mod P`` when ``c // P``
is even, on ``P-1-(c mod P)`` when odd). The order is the best of a few candidates: a
constructed slot order (:func:`wave_slot_schedule`) and greedy list schedules
(:func:`list_schedule`) under several rules and per-rank activation caps. The study
behind these choices is in docs/hanayo.md.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Iterable, Iterator, Optional

from parallel4d.config.rules.common import positive_int
from parallel4d.pipeline.analysis import _run, stored_change
from parallel4d.pipeline.types import Action, Schedule

# --- placement --------------------------------------------------------------------


def wave_rank(chunk: int, pp: int) -> int:
    """Hanayo placement: rank ``c mod P`` when ``c // P`` is even, else ``P-1-(c mod P)``."""
    return chunk % pp if (chunk // pp) % 2 == 0 else pp - 1 - chunk % pp


def wave_placement(pp: int, waves: int) -> dict[int, list[int]]:
    """``2·W·P`` chunks as ``W`` waves; rank ``d`` holds ``{2kP+d, 2kP+2P-1-d}``."""
    placement: dict[int, list[int]] = {r: [] for r in range(pp)}
    for c in range(2 * waves * pp):
        placement[wave_rank(c, pp)].append(c)
    return placement


# --- greedy list scheduling ---------------------------------------------------------

POLICIES = ("alternate", "backward_first", "forward_first")


def list_schedule(
    name: str,
    pp: int,
    microbatches: int,
    placement: dict[int, list[int]],
    *,
    memory_cap: int | list[int],
    policy: str = "alternate",
    group: int = 1,
    forward_order: str = "microbatch",
    backward_order: str = "group",
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    p2p_cost: float = 0.0,
    split_backward: bool = False,
    weight_cost: float | None = None,
    reserve: int = 0,
    weight_slack: int | None = None,
) -> Schedule | None:
    """Order the actions of any placement by simulating the ranks greedily.

    Each idle rank picks one of the actions whose inputs have arrived:

    * ``policy="alternate"``: the kind (F/B) it did not run last, if one is
      ready (1F1B's steady state), else the other kind;
    * ``"backward_first"`` / ``"forward_first"``: that kind whenever ready.

    Among forwards (``forward_order``): ``"microbatch"``, the lowest
    micro-batch (then chunk); ``"diagonal"``, the lowest ``(i mod group) + c``
    within the lowest group of ``group`` micro-batches ``i // group`` — the
    action an ideal fill would reach first, so a rank mixes the chunks of
    several waves instead of finishing one micro-batch first. Among backwards
    (``backward_order``): ``"group"``, the lowest group of ``group``
    micro-batches, then the highest chunk, then the lowest micro-batch
    (``group=1``: plain oldest-first); ``"microbatch"``, oldest-first
    whatever ``group``; ``"diagonal"``, the lowest
    ``i + (S-1-c)`` (``S`` chunks), then micro-batch. A forward only starts
    while the rank stores fewer than ``memory_cap`` chunk activations (one
    int, or a list with one cap per rank). Returns
    ``None`` when the cap starves the pipeline. Costs are per chunk; the
    *order* is what the schedule keeps (deadlock-free by construction);
    ``p2p_cost`` delays an input that crosses ranks.

    ``split_backward``: each backward becomes B (input gradient, ``backward_cost −
    weight_cost``, default half) and W (weight gradient, ``weight_cost``) on the same rank.
    Only B feeds another chunk, so a rank runs its oldest W only when no F or B can start
    (the bubble it would idle in, or a forward held back by the cap); an activation is
    stored until its W.

    ``reserve``: a new micro-batch (chunk 0's forward) starts only while the rank stores
    fewer than ``memory_cap − reserve``. The slots kept free let the micro-batches already
    in flight through the rank's later chunks, which a transfer delay can otherwise block
    behind new ones (a memory deadlock: ``None``).

    ``weight_slack``: a rank storing at least ``memory_cap − weight_slack`` activations runs its oldest
    ready W before any F or B (ZB-V's steady state: F, B, W in turn), freeing the memory the next
    forward needs before it waits for it; None: W only in the time a rank would idle.
    """
    _check_rules(policy, forward_order, backward_order)
    num_chunks = sum(len(c) for c in placement.values())
    caps = list(memory_cap) if isinstance(memory_cap, (list, tuple)) else [memory_cap] * pp
    keys = _priorities(forward_order, backward_order, max(1, group), num_chunks - 1)
    w = (backward_cost / 2 if weight_cost is None else weight_cost) if split_backward else 0.0
    greedy = _Greedy(pp, microbatches, placement, caps, policy, keys,
                     (forward_cost, backward_cost - w, p2p_cost, w), split_backward, reserve, weight_slack)
    actions = greedy.run()
    if actions is None:
        return None
    return Schedule(name, pp, microbatches, num_chunks, {r: list(c) for r, c in placement.items()}, actions)


def _check_rules(policy: str, forward_order: str, backward_order: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
    if forward_order not in ("microbatch", "diagonal"):
        raise ValueError(f"forward_order={forward_order!r} must be 'microbatch' or 'diagonal'")
    if backward_order not in ("group", "microbatch", "diagonal"):
        raise ValueError(f"backward_order={backward_order!r} must be 'group', 'microbatch' or 'diagonal'")


Key = Callable[[Action], tuple]


def _priorities(forward_order: str, backward_order: str, g: int, last_chunk: int) -> tuple[Key, Key]:
    """The sort keys (forward, backward) of :func:`list_schedule`'s rules; each is unique per action."""
    if forward_order == "microbatch":
        def f_key(a: Action):
            return (a.microbatch, a.chunk)
    else:
        def f_key(a: Action):
            return (a.microbatch // g, a.microbatch % g + a.chunk, a.microbatch)
    if backward_order == "group":
        def b_key(a: Action):
            return (a.microbatch // g, -a.chunk, a.microbatch)
    elif backward_order == "microbatch":
        def b_key(a: Action):
            return (a.microbatch, -a.chunk)
    else:
        def b_key(a: Action):
            return (a.microbatch + last_chunk - a.chunk, a.microbatch)
    return f_key, b_key


class _Greedy:
    """:func:`list_schedule`'s event simulation: ranks start ready actions, finished ones feed the next chunk."""

    def __init__(self, pp: int, m: int, placement: dict[int, list[int]], caps: list[int], policy: str,
                 keys: tuple[Key, Key], costs: tuple[float, float, float, float], split: bool = False,
                 reserve: int = 0, weight_slack: int | None = None):
        self.pp, self.caps, self.policy, self.split, self.reserve = pp, caps, policy, split, reserve
        self.weight_slack = weight_slack
        self.f_key, self.b_key = keys
        self.forward_cost, self.backward_cost, self.p2p_cost, self.weight_cost = costs
        self.owner = {c: r for r, cs in placement.items() for c in cs}
        self.last_chunk = len(self.owner) - 1
        self.remaining = (3 if split else 2) * m * len(self.owner)
        # per rank: (time its input arrives, action) not started yet
        self.ready: dict[int, list[tuple[float, Action]]] = {r: [] for r in range(pp)}
        self.ready[self.owner[0]] = [(0.0, Action("F", i, 0)) for i in range(m)]
        self.free_at = [0.0] * pp
        self.stored = [0] * pp
        self.last_kind = ["B"] * pp
        self.running: list[tuple[float, int, Action]] = []
        self.actions: dict[int, list[Action]] = {r: [] for r in range(pp)}

    def run(self) -> Optional[dict[int, list[Action]]]:
        """Each rank's order, or None when the memory cap starves the pipeline."""
        t = 0.0
        while self.remaining:
            for r in range(self.pp):
                if self.free_at[r] <= t:
                    self._start(r, t)
            t = min(min((e for e, _, _ in self.running), default=math.inf),
                    min((rt for ready in self.ready.values() for rt, _ in ready if rt > t), default=math.inf))
            if t == math.inf:
                return None
            self._finish(t)
        return self.actions

    def _start(self, r: int, t: float) -> None:
        ready, room = self.ready[r], self.caps[r] - self.stored[r]
        ws, bs, fs = [], [], []
        for rt, a in ready:
            if rt > t:
                continue
            if a.kind == "W":
                ws.append((rt, a.microbatch, -a.chunk, a))
            elif a.kind == "B":
                bs.append(a)
            elif room > (self.reserve if a.chunk == 0 else 0):
                fs.append(a)
        if ws and self.weight_slack is not None and room <= self.weight_slack:
            pick = min(ws)[3]  # near the cap: the oldest weight gradient frees its activation first
        elif bs or fs:
            want_b = self.last_kind[r] == "F" if self.policy == "alternate" else self.policy == "backward_first"
            pick = min(bs, key=self.b_key) if bs and (want_b or not fs) else min(fs, key=self.f_key)
            self.last_kind[r] = pick.kind
        else:
            if not ws:
                return
            pick = min(ws)[3]  # the oldest weight gradient
        del ready[next(j for j, x in enumerate(ready) if x[1] is pick)]
        end = t + {"F": self.forward_cost, "B": self.backward_cost, "W": self.weight_cost}[pick.kind]
        self.free_at[r] = end
        self.stored[r] += stored_change(pick, self.split)
        self.actions[r].append(pick)
        self.running.append((end, r, pick))

    def _finish(self, t: float) -> None:
        still = []
        for (end, r, a) in self.running:
            if end > t:
                still.append((end, r, a))
                continue
            self.remaining -= 1
            if self.split and a.kind == "B":
                self.ready[r].append((t, Action("W", a.microbatch, a.chunk)))
            nxt = self._next(a)
            if nxt is not None:
                dst = self.owner[nxt.chunk]
                self.ready[dst].append((t + (self.p2p_cost if dst != r else 0.0), nxt))
        self.running = still

    def _next(self, a: Action) -> Optional[Action]:
        """The action ``a``'s result makes ready on the next chunk (None after chunk 0's backward, and W)."""
        if a.kind == "W":
            return None
        if a.kind == "F":
            # The loss is computed in the last chunk's forward: its backward may start on the same rank.
            return Action("F", a.microbatch, a.chunk + 1) if a.chunk < self.last_chunk else Action("B", a.microbatch, a.chunk)
        return Action("B", a.microbatch, a.chunk - 1) if a.chunk > 0 else None


# --- the constructed slot order -------------------------------------------------------


def wave_slot_schedule(name: str, pp: int, microbatches: int, waves: int) -> Schedule:
    """A constructed (not greedy) order on the wave placement, in 1F1B slots.

    Slot ``σ`` holds at most one forward then one backward per rank. Micro-batch
    ``i`` enters at ``b(i) = 2·(i mod P) + S·(i div P)`` (``S = 2WP`` chunks);
    ``F(i, c)`` sits in slot ``b(i) + c`` and ``B(i, c)`` in ``b(i) + 2(S-1) - c``.
    Rank ``d`` holds chunks ``≡ d`` and ``≡ 2P-1-d (mod 2P)``, of opposite
    parity, so a group of ``P`` micro-batches spaced 2 apart fills every slot of
    a rank once, and the next group (``S`` slots later) continues it without a
    collision; a chunk's set is symmetric (``c`` held ⇔ ``S-1-c`` held), so the
    backwards tile the slots the same way. Each input is produced one slot
    earlier (or earlier in the same slot on the same rank), so the order is
    deadlock-free; a rank stores at most ``S`` activations, below interleaved's
    ``S + P - 1``. The lists keep only the order: ranks run ahead of the slots
    whenever their inputs allow.
    """
    placement = wave_placement(pp, waves)
    s = 2 * waves * pp
    actions = {}
    for r in range(pp):
        items = []
        for i in range(microbatches):
            base = 2 * (i % pp) + s * (i // pp)
            for c in placement[r]:
                items.append((base + c, 0, Action("F", i, c)))
                items.append((base + 2 * (s - 1) - c, 1, Action("B", i, c)))
        actions[r] = [a for _, _, a in sorted(items, key=lambda x: (x[0], x[1]))]
    return Schedule(name, pp, microbatches, s, placement, actions)


# --- the search -------------------------------------------------------------------------

# hanayo's search keeps the orders within FREE_SLACK of the shortest makespan with free
# transfers, then the one with the shortest summed makespan under these hop latencies
# (per cross-rank transfer, in chunk-forward units): a real link is neither free nor known.
FREE_SLACK = 0.01
HOP_LATENCIES = (0.25, 0.5)


def peak_activations(actions: Iterable[Action]) -> int:
    """Most chunk activations one rank's list stores at once (F done; not yet freed by its B,
    or by its W when the list splits the backward)."""
    actions = list(actions)
    split = any(a.kind == "W" for a in actions)
    n = best = 0
    for a in actions:
        n += stored_change(a, split)
        best = max(best, n)
    return best


def interleaved_peak(pp: int, chunks_per_rank: int) -> int:
    """Rank 0's peak stored chunk activations under interleaved 1F1B (m ≥ P multiple of P)."""
    return chunks_per_rank * pp + pp - 1 if chunks_per_rank > 1 else pp


def hanayo(pp: int, microbatches: int, waves: int = 1, memory_cap: int | None = None, *,
           split_backward: bool = False, p2p_cost: float | None = None) -> Schedule:
    """Hanayo wave schedule: ``2·W·P`` chunks on the wave placement, in the best order found.

    Candidates: the slot order of :func:`wave_slot_schedule` and :func:`list_schedule`
    under a few greedy rules and activation caps. Kept: the orders within ``FREE_SLACK``
    (1 %) of the shortest simulated makespan with free transfers (uniform chunks,
    backward = 2 × forward), then the shortest summed makespan at ``HOP_LATENCIES``,
    then the shorter free makespan, then the lower peak memory. Given ``p2p_cost`` (the
    transfer time per hop, in chunk forwards), the shortest makespan at that cost instead.

    ``split_backward``: B (input gradient) and W (weight gradient) actions, W filling the
    time a rank would wait (:func:`list_schedule`); the default cap is then ``2W·P``, the
    bytes of ``P`` stage activations (1F1B's and ZB-V's first rank). The candidates are the
    greedy rules under several new-micro-batch reserves, built with free transfers and,
    given ``p2p_cost``, with that delay too.

    Guarantees: a valid, deadlock-free order; no rank stores more than ``memory_cap``
    chunk activations (default: interleaved 1F1B's rank-0 peak for the same chunks per
    rank, ``2W·P + P - 1``; a cap that starves the pipeline is a ``ValueError``); the
    embedding (chunk 0) and LM head (last chunk) both on rank 0, so a tied weight stays
    on one rank; the same arguments give the same order (cached; each call returns a
    fresh copy). The bubble cannot go below ``(P-1)/(2W·m + P-1)`` once
    ``m ≥ P + (P-1)/(2W)`` without splitting the backward; W=1 reaches it for ``m ≥ 2P``.
    ``hanayo(8, 32, 3)`` takes about 1.2 s on one core.

    docs/hanayo.md has the bound's derivation, the measured bubbles against interleaved
    1F1B, where the search falls short and the offline CP-SAT study.
    """
    pp, m = positive_int("pp", pp), positive_int("microbatches", microbatches)
    w = positive_int("waves", waves)
    if memory_cap is not None:
        memory_cap = positive_int("memory_cap", memory_cap)
    if p2p_cost is not None and not p2p_cost >= 0:
        raise ValueError(f"p2p_cost={p2p_cost} must be ≥ 0 (chunk-forward units per transfer)")
    s = _hanayo(pp, m, w, memory_cap, bool(split_backward), p2p_cost)
    # A fresh copy: callers may edit their schedule, the cache must not change.
    return Schedule(s.name, s.pp, s.microbatches, s.num_chunks,
                    {r: list(c) for r, c in s.placement.items()},
                    {r: list(a) for r, a in s.actions.items()})


def default_cap(pp: int, waves: int, split_backward: bool) -> int:
    """hanayo's default per-rank activation cap, in chunk activations."""
    return 2 * waves * pp if split_backward else interleaved_peak(pp, 2 * waves)


@lru_cache(maxsize=256)
def _hanayo(pp: int, m: int, w: int, memory_cap: int | None, split: bool, p2p_cost: float | None) -> Schedule:
    name = f"hanayo(W={w}, split)" if split else f"hanayo(W={w})"
    top = memory_cap or default_cap(pp, w, split)
    orders = _split_orders(name, pp, m, w, top, p2p_cost) if split else _orders(name, pp, m, w, top)
    orders = [s for s in orders if s is not None]  # valid by construction; tests validate
    if not orders:
        raise ValueError(f"memory_cap={memory_cap} starves the hanayo pipeline (P={pp}, W={w}); "
                         f"use memory_cap≥{default_cap(pp, w, split)}")
    return _most_robust(orders) if p2p_cost is None else shortest_at(orders, p2p_cost)


def _split_orders(name: str, pp: int, m: int, w: int, top: int,
                  p2p_cost: float | None) -> Iterator[Optional[Schedule]]:
    """Greedy split-backward orders: each rule × new-micro-batch reserve, built at each transfer delay;
    for a known hop also with W run first near the cap (``weight_slack``: ZB-V's steady state, which
    a hop's delay rewards)."""
    placement = wave_placement(pp, w)
    delays = sorted({0.0, p2p_cost / 2, p2p_cost}) if p2p_cost else [0.0]
    # W first near the cap: built without delay (where it won in every case of the benchmark)
    variants = [(d, None) for d in delays] + ([(0.0, k) for k in sorted({1, 2, max(1, pp // 2)})] if p2p_cost else [])
    rules = [("diagonal", pp, "diagonal"), ("diagonal", pp, "microbatch"), ("microbatch", 1, "group")]
    reserves = sorted({min(k, top - 1) for k in (0, 1, 2, 3, pp // 2, pp, 3 * pp // 2)})
    for delay, slack in variants:
        for reserve in reserves:
            for policy in ("forward_first", "alternate"):
                for fwd, group, back in rules:
                    yield list_schedule(name, pp, m, placement, memory_cap=top, policy=policy, group=group,
                                        forward_order=fwd, backward_order=back, split_backward=True,
                                        p2p_cost=delay, reserve=reserve, weight_slack=slack)


def shortest_at(orders: list[Schedule], p2p_cost: float) -> Schedule:
    """The shortest makespan at ``p2p_cost``, then with free transfers, then memory; first on a tie
    (an order the candidates repeat is simulated once)."""
    unique = list({tuple(tuple(a) for _, a in sorted(s.actions.items())): s for s in reversed(orders)}.values())

    def key(s: Schedule):
        at, free = _run(s, 1.0, 2.0, p2p_cost), _run(s, 1.0, 2.0, 0.0)
        return round(at.makespan, 9), round(free.makespan, 9), max(free.peak_activations), orders.index(s)

    return min(unique, key=key)


def _orders(name: str, pp: int, m: int, w: int, top: int) -> Iterator[Optional[Schedule]]:
    """The slot order (if it fits ``top``), then each greedy candidate's order (None when starved)."""
    slot = wave_slot_schedule(name, pp, m, w)
    yield slot if max(peak_activations(a) for a in slot.actions.values()) <= top else None
    placement = wave_placement(pp, w)
    for caps, policy, fwd, group, back in _candidates(pp, m, w, top):
        yield list_schedule(name, pp, m, placement, memory_cap=caps, policy=policy, group=group,
                            forward_order=fwd, backward_order=back)


def _candidates(pp: int, m: int, w: int, top: int) -> list[tuple]:
    """(caps, policy, forward order, group, backward order) for :func:`list_schedule`.

    Rank r's first backward can start at 2WP + 2r, so a rank that never idles in the fill
    holds about 2WP + r activations then: per-rank caps around that line, never above top.
    """
    c = 2 * w
    candidates = [(top, policy, "microbatch", 1, "group") for policy in POLICIES]  # oldest micro-batch first
    ramps = [[min(top, c * pp + r + a) for r in range(pp)] for a in sorted({1, 2, 3, pp // 2, pp - 2, pp - 1})]
    for caps in [top] + ramps:
        for group in sorted({pp, m}):
            for back in ("microbatch", "diagonal"):
                candidates.append((caps, "alternate", "diagonal", group, back))
    return candidates


def _most_robust(orders: list[Schedule]) -> Schedule:
    """Near-best with free transfers (within FREE_SLACK), then the most robust to hop latency
    (simulated only for those), then the shorter free makespan, then memory; first on a tie."""
    free = [_run(s, 1.0, 2.0, 0.0) for s in orders]
    limit = min(f.makespan for f in free) * (1 + FREE_SLACK) + 1e-9

    def key(i: int):
        lat = sum(_run(orders[i], 1.0, 2.0, hop).makespan for hop in HOP_LATENCIES)
        return round(lat, 9), round(free[i].makespan, 9), max(free[i].peak_activations)

    return orders[min((i for i in range(len(orders)) if free[i].makespan <= limit), key=key)]
