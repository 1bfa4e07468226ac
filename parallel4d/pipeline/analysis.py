"""Pure tools over a :class:`~.types.Schedule`: validate, simulate, message plan.

Dependencies (``S`` chunks, last chunk ``S-1`` computes the loss):

* ``F(i, c)`` needs ``F(i, c-1)`` (for ``c > 0``);
* ``B(i, c)`` needs ``F(i, c)`` and ``B(i, c+1)`` (for ``c < S-1``);
* ``W(i, c)`` (split backward only: the weight gradient) needs ``B(i, c)``, on the same rank.

A schedule with W actions splits every backward: each ``(i, c)`` has exactly one W, B is
then the input gradient alone, and the chunk's stored activation lives until its W.

A dependency on another rank's action is a point-to-point message (activation
for F, input-gradient for B); on the same rank it is a local hand-off. :func:`message_order`
puts every message in one global order (the executor posts in it). Every
rank runs its list strictly in order and blocks until the inputs of its next
action exist, exactly like the executor, so a schedule deadlocks iff this
blocking simulation stops before every list is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from parallel4d.pipeline.types import Action, Schedule


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the first rank/action that does."""


def dependencies(a: Action, num_chunks: int) -> list[Action]:
    """The actions whose results ``a`` consumes."""
    if a.kind == "W":
        return [Action("B", a.microbatch, a.chunk)]
    if a.kind == "F":
        return [Action("F", a.microbatch, a.chunk - 1)] if a.chunk > 0 else []
    deps = [Action("F", a.microbatch, a.chunk)]
    if a.chunk < num_chunks - 1:
        deps.append(Action("B", a.microbatch, a.chunk + 1))
    return deps


def consumer(a: Action, num_chunks: int) -> Action | None:
    """The action on the next chunk that consumes ``a``'s output (``None`` at the ends, and for W)."""
    if a.kind == "W":
        return None
    if a.kind == "F":
        return Action("F", a.microbatch, a.chunk + 1) if a.chunk < num_chunks - 1 else None
    return Action("B", a.microbatch, a.chunk - 1) if a.chunk > 0 else None


def stored_change(a: Action, split: bool) -> int:
    """How ``a`` changes its rank's stored chunk activations: +1 at F, −1 when they are freed
    (at B, or at W when the backward is split)."""
    if a.kind == "F":
        return 1
    return -1 if (a.kind == "W") == split else 0


def kinds(s: Schedule) -> tuple[str, ...]:
    """The action kinds each ``(micro-batch, chunk)`` runs exactly once in ``s``."""
    return ("F", "B", "W") if s.split_backward else ("F", "B")


def _where(r: int, i: int, a: Action) -> str:
    return f"rank {r}, action #{i} {a.describe()}"


def _check_structure(s: Schedule) -> None:
    if s.pp < 1 or s.microbatches < 1 or s.num_chunks < 1:
        raise ScheduleError(f"pp={s.pp}, microbatches={s.microbatches}, num_chunks={s.num_chunks} must all be ≥ 1")
    if sorted(s.placement) != list(range(s.pp)):
        raise ScheduleError(f"placement must name ranks 0..{s.pp - 1}, got {sorted(s.placement)}")
    if sorted(s.actions) != list(range(s.pp)):
        raise ScheduleError(f"actions must name ranks 0..{s.pp - 1}, got {sorted(s.actions)}")
    seen: dict[int, int] = {}
    for r in range(s.pp):
        chunks = s.placement[r]
        if not chunks:
            raise ScheduleError(f"rank {r} holds no chunk")
        if list(chunks) != sorted(chunks):
            raise ScheduleError(f"rank {r}: placement {chunks} is not in model order (ascending)")
        for c in chunks:
            if not 0 <= c < s.num_chunks:
                raise ScheduleError(f"rank {r}: chunk {c} out of range 0..{s.num_chunks - 1}")
            if c in seen:
                raise ScheduleError(f"rank {r}: chunk {c} is also placed on rank {seen[c]}")
            seen[c] = r
    missing = sorted(set(range(s.num_chunks)) - set(seen))
    if missing:
        raise ScheduleError(f"chunks {missing} are placed on no rank")


def _check_actions(s: Schedule) -> None:
    owner = {c: r for r, cs in s.placement.items() for c in cs}
    every = kinds(s)  # once: it scans every action list
    each = " and ".join(every)
    done: set[Action] = set()
    for r in range(s.pp):
        local: set[Action] = set()
        for i, a in enumerate(s.actions[r]):
            if not isinstance(a, Action) or a.kind not in ("F", "B", "W"):
                raise ScheduleError(f"rank {r}, action #{i} {a!r}: kind must be 'F', 'B' or 'W'")
            if not 0 <= a.microbatch < s.microbatches:
                raise ScheduleError(f"{_where(r, i, a)}: micro-batch out of range 0..{s.microbatches - 1}")
            if not 0 <= a.chunk < s.num_chunks:
                raise ScheduleError(f"{_where(r, i, a)}: chunk out of range 0..{s.num_chunks - 1}")
            if owner[a.chunk] != r:
                raise ScheduleError(f"{_where(r, i, a)}: chunk {a.chunk} is held by rank {owner[a.chunk]}, not rank {r}")
            if a in done:
                raise ScheduleError(f"{_where(r, i, a)}: runs a second time (each {each} exactly once)")
            for d in dependencies(a, s.num_chunks):
                # Same-rank dependencies must come earlier in this rank's own list.
                if owner[d.chunk] == r and d not in local:
                    raise ScheduleError(f"{_where(r, i, a)}: comes before {d.describe()} that it needs, "
                                        f"which is on the same rank")
            done.add(a)
            local.add(a)
    for c in range(s.num_chunks):
        for mb in range(s.microbatches):
            for kind in every:
                a = Action(kind, mb, c)
                if a not in done:
                    raise ScheduleError(f"rank {owner[c]}: missing {a.describe()} (each {each} exactly once)")


@dataclass
class SimResult:
    """What :func:`simulate` measures.

    ``makespan``: time from the first action to the last. ``bubble_ratio``:
    idle share of all ranks' time, ``1 - Σ busy / (P · makespan)``.
    ``peak_activations[r]``: most chunk activations stored at once on rank ``r``
    (forward done, backward not yet). ``peak_microbatches[r]``: most distinct
    micro-batches with a stored activation on rank ``r``. ``start``/``end``:
    per action, keyed by ``(rank, index in its list)``.
    """

    makespan: float
    bubble_ratio: float
    busy: list[float]
    peak_activations: list[int]
    peak_microbatches: list[int]
    start: dict[tuple[int, int], float] = field(repr=False)
    end: dict[tuple[int, int], float] = field(repr=False)

    @property
    def rank_bubble(self) -> list[float]:
        """Idle share of each rank."""
        return [1.0 - b / self.makespan if self.makespan else 0.0 for b in self.busy]


def _indexed(s: Schedule, cost: Callable[[Action], float]) -> list[list[tuple]]:
    """Per rank, its actions as ``(id, dep, dep_crosses, dep2, dep2_crosses, seconds)``: ids index one flat
    table of finish times (``(kind·m + micro-batch)·S + chunk``, kinds F, B, W = 0, 1, 2; -1 for no
    dependency), so the simulation hashes no :class:`Action` (a 16-rank order has tens of thousands).
    The dependencies are :func:`dependencies`' in that arithmetic."""
    m, n, owner = s.microbatches, s.num_chunks, s.owners()
    out = []
    for r in range(s.pp):
        rows = []
        for a in s.actions[r]:
            i, c = a.microbatch, a.chunk
            if a.kind == "F":
                dep = (i * n + c - 1, owner[c - 1] != r) if c > 0 else (-1, False)
                row = ((i * n + c), *dep, -1, False)
            elif a.kind == "B":
                dep = ((m + i) * n + c + 1, owner[c + 1] != r) if c < n - 1 else (-1, False)
                row = ((m + i) * n + c, i * n + c, False, *dep)
            else:
                row = ((2 * m + i) * n + c, (m + i) * n + c, False, -1, False)
            rows.append((*row, cost(a)))
        out.append(rows)
    return out


def _run(s: Schedule, forward_cost: float, backward_cost: float, p2p_cost: float,
         weight_cost: float | None = None, action_cost: Callable[[Action], float] | None = None) -> SimResult:
    """Blocking in-order simulation; raises ScheduleError on a deadlock. Under a split backward,
    B costs ``backward_cost − weight_cost`` and W ``weight_cost`` (default: half the backward);
    ``action_cost(action)``, when given, is the time of each action instead."""
    split = s.split_backward
    w_cost = backward_cost / 2 if weight_cost is None else weight_cost
    by_kind = {"F": forward_cost, "B": backward_cost - w_cost if split else backward_cost, "W": w_cost}
    plans = _indexed(s, action_cost or (lambda a: by_kind[a.kind]))
    finished = [-1.0] * (3 * s.microbatches * s.num_chunks)  # -1: not yet
    pos, free = [0] * s.pp, [0.0] * s.pp
    start: list[list[float]] = [[] for _ in range(s.pp)]
    total, n = sum(len(p) for p in plans), 0
    while n < total:
        before = n
        for r, plan in enumerate(plans):
            i, t_free, began = pos[r], free[r], start[r]
            while i < len(plan):
                ident, d1, x1, d2, x2, seconds = plan[i]
                t0 = t_free
                if d1 >= 0:
                    e = finished[d1]
                    if e < 0:
                        break
                    t0 = max(t0, e + p2p_cost if x1 else e)
                if d2 >= 0:
                    e = finished[d2]
                    if e < 0:
                        break
                    t0 = max(t0, e + p2p_cost if x2 else e)
                t_free = finished[ident] = t0 + seconds
                began.append(t0)
                i += 1
            n += i - pos[r]
            pos[r], free[r] = i, t_free
        if n == before:
            raise ScheduleError(_deadlock_report(s, pos))
    return _result(s, plans, start, finished)


def _result(s: Schedule, plans: list[list[tuple]], start: list[list[float]], finished: list[float]) -> SimResult:
    """The simulation's timeline as a :class:`SimResult` (makespan, bubble, busy time and peaks per rank)."""
    begin = {(r, i): t for r in range(s.pp) for i, t in enumerate(start[r])}
    end = {(r, i): finished[row[0]] for r in range(s.pp) for i, row in enumerate(plans[r])}
    makespan = max(end.values()) - min(begin.values()) if end else 0.0
    busy = [sum(finished[row[0]] - t for row, t in zip(plans[r], start[r])) for r in range(s.pp)]
    ratio = 1.0 - sum(busy) / (s.pp * makespan) if makespan else 0.0
    split = s.split_backward
    peaks, peak_mbs = [], []
    for r in range(s.pp):
        live: dict[int, int] = {}
        n_live = best = best_mb = 0
        for a in s.actions[r]:
            change = stored_change(a, split)
            n_live += change
            live[a.microbatch] = live.get(a.microbatch, 0) + change
            if live[a.microbatch] == 0:
                del live[a.microbatch]
            best, best_mb = max(best, n_live), max(best_mb, len(live))
        peaks.append(best)
        peak_mbs.append(best_mb)
    return SimResult(makespan, ratio, busy, peaks, peak_mbs, begin, end)


def _deadlock_report(s: Schedule, pos: list[int]) -> str:
    finished = {a for r in range(s.pp) for a in s.actions[r][:pos[r]]}
    lines = []
    for r in range(s.pp):
        if pos[r] >= len(s.actions[r]):
            continue
        a = s.actions[r][pos[r]]
        missing = [d for d in dependencies(a, s.num_chunks) if d not in finished]
        waits = ", ".join(f"{d.describe()} on rank {s.owner(d.chunk)}" for d in missing)
        lines.append(f"rank {r}, action #{pos[r]} {a.describe()} waits for {waits}")
    return "deadlock: no rank can make progress (cycle of waits across ranks):\n  " + "\n  ".join(lines)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first rank/action that breaks a rule.

    Rules: placement covers every chunk once; each F and B (and W, when the schedule has any)
    exactly once per (micro-batch, chunk); an action only on the rank holding its chunk;
    ``F(i,c)`` after ``F(i,c-1)``, ``B(i,c)`` after ``F(i,c)`` and ``B(i,c+1)``, ``W(i,c)``
    after ``B(i,c)``; no cycle of blocking waits across ranks (simulated).
    """
    _check_structure(schedule)
    _check_actions(schedule)
    _run(schedule, 1.0, 2.0, 0.0)


def simulate(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0,
             p2p_cost: float = 0.0, weight_cost: float | None = None,
             action_cost: Callable[[Action], float] | None = None) -> SimResult:
    """Timeline of ``schedule`` with per-chunk costs (uniform chunks).

    ``forward_cost`` / ``backward_cost``: time of one chunk's forward / whole backward
    for one micro-batch; ``p2p_cost``: latency added when a dependency crosses
    ranks (wave turns on one rank cost nothing); ``weight_cost``: the part of the
    backward a split schedule's W takes (default half). ``action_cost(action) → time``
    replaces the uniform costs (e.g. measured per chunk, or chunk 0's B, which has no
    input gradient to compute). Validates first.
    """
    validate(schedule)
    w = backward_cost / 2 if weight_cost is None else weight_cost
    if forward_cost <= 0 or backward_cost <= 0 or p2p_cost < 0 or not 0 < w < backward_cost:
        raise ValueError("forward_cost and backward_cost must be > 0, p2p_cost ≥ 0, and "
                         "0 < weight_cost < backward_cost")
    return _run(schedule, forward_cost, backward_cost, p2p_cost, weight_cost, action_cost)


def makespan_floor(schedule: Schedule, action_cost: Callable[[Action], float], p2p_cost: float = 0.0) -> float:
    """A lower bound on the makespan of *any* order of ``schedule``'s placement at these costs (its own, or one
    built for another hop): on each rank, its busy time, after the forwards of the chunks below its lowest
    (and their hops: its first action needs micro-batch 0 through them) and, without a split backward, before
    their backwards (its last action is a backward of its lowest chunk: the input gradient still goes down
    through them). ``action_cost`` is called on micro-batch 0 (costs are per chunk and kind)."""
    owner, split = schedule.owners(), schedule.split_backward
    every = kinds(schedule)
    floor = 0.0
    for r, chunks in schedule.placement.items():
        busy = schedule.microbatches * sum(action_cost(Action(k, 0, c)) for c in chunks for k in every)
        below = range(min(chunks))
        head = sum(action_cost(Action("F", 0, c)) + (p2p_cost if owner[c] != owner[c + 1] else 0.0) for c in below)
        tail = 0.0 if split else sum(action_cost(Action("B", 0, c)) for c in below)
        floor = max(floor, head + busy + tail)
    return floor


# --- closed forms ------------------------------------------------------------------


def bubble_formula(name: str, pp: int, microbatches: int, chunks_per_rank: int = 1) -> float:
    """``(P-1)/(c·m + P-1)`` with ``c`` chunks per rank (GPipe/1F1B: c=1,
    interleaved: c=v, Hanayo: c=2W — the bound, see :func:`~.hanayo.hanayo`)."""
    del name
    return (pp - 1) / (chunks_per_rank * microbatches + pp - 1)


# --- message plan for the executor ---------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One p2p transfer: ``producer`` on rank ``src`` feeds ``consumer`` on ``dst``.

    ``kind`` is ``"act"`` (output of a forward) or ``"grad"`` (input-gradient of
    a backward); the tensor has the shape of chunk ``boundary``'s output.
    """

    src: int
    dst: int
    producer: Action
    consumer: Action

    @property
    def kind(self) -> str:
        return "act" if self.producer.kind == "F" else "grad"

    @property
    def boundary(self) -> int:
        """The chunk whose *output* this tensor is (or the gradient of)."""
        return self.producer.chunk if self.producer.kind == "F" else self.consumer.chunk


def message_order(schedule: Schedule) -> list[Message]:
    """Every cross-rank message in one global order that all ranks derive alike: by the simulated
    end time of the producing action, then sender, then its position in the sender's list.

    Each rank posts its own messages (sends and receives, all peers) in this order, so every
    rank's posting order, and every pair's (a subsequence), is one total order — the property
    that keeps the executor deadlock-free when all of a rank's transfers share one stream and
    each completes only when its peer's matching op runs (NCCL: :mod:`parallel4d.distributed.nccl_replay`).
    The order never asks a rank to post a send it has not produced before a receive it needs: a
    message ahead of that receive ended earlier in the simulation, so its producer comes earlier
    in the rank's own list.
    """
    sim = simulate(schedule)
    owner = {c: r for r, cs in schedule.placement.items() for c in cs}
    keyed = []
    for r in range(schedule.pp):
        for i, a in enumerate(schedule.actions[r]):
            nxt = consumer(a, schedule.num_chunks)
            if nxt is not None and owner[nxt.chunk] != r:
                keyed.append((sim.end[(r, i)], r, i, Message(r, owner[nxt.chunk], a, nxt)))
    return [m for *_, m in sorted(keyed, key=lambda x: x[:3])]


def message_plan(schedule: Schedule) -> dict[tuple[int, int], list[Message]]:
    """Per unordered rank pair ``(a, b)``, ``a < b``: every message between them, both
    directions, in :func:`message_order` (the pair's canonical order: gloo and NCCL match p2p per
    pair in order, without tags)."""
    plan: dict[tuple[int, int], list[Message]] = {}
    for msg in message_order(schedule):
        plan.setdefault((min(msg.src, msg.dst), max(msg.src, msg.dst)), []).append(msg)
    return plan
