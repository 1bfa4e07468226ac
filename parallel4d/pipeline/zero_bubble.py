"""Schedules that split the backward into B (input gradient) and W (weight gradient).

Only B is on the critical path between ranks: the next rank up the pipeline waits for the input
gradient, never for the weight gradient. So a rank can run its W actions later, in the time it
would otherwise wait, which is where 1F1B's bubble is (the zero-bubble idea, Qi et al. 2023).

:func:`zb_h1` keeps 1F1B's peak memory: no rank stores more than ``min(P, m)`` chunk
activations (1F1B's first rank), each counted until its W. Its order is found by a greedy list
scheduler over uniform costs (F = B = W = 1): when a rank is free it runs a ready B, else the
next F if the memory allows, else its oldest pending W, else it waits. The result is plain
schedule data, checked by :func:`~.analysis.validate` like any other.

Simulated with forward 1, backward 2 (B 1 + W 1), free transfers, its bubble is about 60 % of
1F1B's (P=4, m=8: 0.172 against 0.273; P=8, m=32: 0.086 against 0.179). The paper's hand-made
ZB-H1 order reaches about a third ((P-1) idle units against 1F1B's 3(P-1)); closing that gap
is the schedule work still open in #17.
"""

from __future__ import annotations

from ..rules import positive_int
from .analysis import validate
from .hanayo import hanayo
from .types import Action, Schedule, linear_placement


def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1: one chunk per rank, 1F1B's activation memory, W actions filling the bubble."""
    pp, m = positive_int("pp", pp), positive_int("microbatches", microbatches)
    caps = [min(pp, m)] * pp
    done: dict[Action, float] = {}  # action → finish time
    free = [0.0] * pp
    next_f = [0] * pp
    next_b = [0] * pp  # B runs in micro-batch order on every rank, as in 1F1B
    pending_w: list[list[int]] = [[] for _ in range(pp)]
    stored = [0] * pp
    actions: dict[int, list[Action]] = {r: [] for r in range(pp)}
    total = 3 * pp * m
    t = 0.0
    while sum(len(a) for a in actions.values()) < total:
        for r in range(pp):
            if free[r] > t:
                continue
            pick = _pick(r, pp, m, t, caps, done, next_f, next_b, pending_w, stored)
            if pick is None:
                continue
            actions[r].append(pick)
            done[pick] = free[r] = t + 1.0
            if pick.kind == "F":
                next_f[r] += 1
                stored[r] += 1
            elif pick.kind == "B":
                next_b[r] += 1
                pending_w[r].append(pick.microbatch)
            else:
                pending_w[r].pop(0)
                stored[r] -= 1
        later = [x for x in [*free, *done.values()] if x > t]
        if not later:
            break
        t = min(later)
    schedule = Schedule("zb_h1", pp, m, pp, linear_placement(pp), actions)
    validate(schedule)
    return schedule


def _ready(a: Action, t: float, done: dict[Action, float]) -> bool:
    return a in done and done[a] <= t


def _pick(r, pp, m, t, caps, done, next_f, next_b, pending_w, stored) -> Action | None:
    """What rank ``r``, free at time ``t``, runs next (None: it waits)."""
    i = next_b[r]
    if i < m and _ready(Action("F", i, r), t, done) and (r == pp - 1 or _ready(Action("B", i, r + 1), t, done)):
        return Action("B", i, r)
    i = next_f[r]
    if i < m and stored[r] < caps[r] and (r == 0 or _ready(Action("F", i, r - 1), t, done)):
        return Action("F", i, r)
    if pending_w[r]:
        return Action("W", pending_w[r][0], r)
    return None


def zbv(pp: int, microbatches: int, p2p_cost: float | None = None) -> Schedule:
    """ZB-V: two chunks per rank in a V (chunk ``c`` on rank ``c`` going down, ``2P-1-c``
    coming back: Hanayo's one-wave placement), backward split, no rank storing more than
    ``2P`` chunk activations (``P`` stage activations: 1F1B's first rank). The order is
    Hanayo's split-backward search at that cap; ``p2p_cost``: see :func:`~.hanayo.hanayo`."""
    pp, m = positive_int("pp", pp), positive_int("microbatches", microbatches)
    s = hanayo(pp, m, 1, memory_cap=2 * pp, split_backward=True, p2p_cost=p2p_cost)
    return Schedule("zbv", s.pp, s.microbatches, s.num_chunks, s.placement, s.actions)
