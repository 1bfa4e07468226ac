"""Schedules that split the backward into B (input gradient) and W (weight gradient).

Only B is on the critical path between ranks: the next rank up the pipeline waits for the input
gradient, never for the weight gradient. So a rank can run its W actions later, in the time it
would otherwise wait, which is where 1F1B's bubble is (the zero-bubble idea, Qi et al. 2023).
Both generators here are :func:`~.hanayo.list_schedule` with a split backward (a rank runs its
oldest W when no F or B can start), on two placements, at 1F1B's activation memory.
"""

from __future__ import annotations

from parallel4d.config.rules.common import positive_int
from parallel4d.pipeline.hanayo import hanayo, list_schedule, shortest_at
from parallel4d.pipeline.types import Schedule, linear_placement


def zb_h1(pp: int, microbatches: int, p2p_cost: float | None = None) -> Schedule:
    """ZB-H1: one chunk per rank, no rank storing more than ``min(P, m)`` chunk activations (1F1B's
    first rank), W actions filling 1F1B's bubble. With F = B = W its bubble is ZB-H1's
    ``(P-1)/(3m+P-1)`` for ``m ≥ P``, a third of 1F1B's idle time (P=4, m=8: 0.111 against 0.273).
    ``p2p_cost`` (a hop's time in chunk forwards): the greedy orders built with that delay, half of it
    and none, under each policy and new-micro-batch reserve, the shortest at that cost kept."""
    pp, m = positive_int("pp", pp), positive_int("microbatches", microbatches)
    cap = min(pp, m)
    if not p2p_cost:
        s = list_schedule("zb_h1", pp, m, linear_placement(pp), memory_cap=cap, policy="alternate",
                          split_backward=True)
        if s is None:  # the cap admits every rank's first micro-batch: it cannot starve
            raise RuntimeError(f"zb_h1({pp}, {m}): the greedy order starved (a bug)")
        return s
    orders = [list_schedule("zb_h1", pp, m, linear_placement(pp), memory_cap=cap, policy=policy,
                            split_backward=True, p2p_cost=delay, reserve=reserve)
              for delay in (0.0, p2p_cost / 2, p2p_cost) for policy in ("alternate", "forward_first")
              for reserve in sorted({0, 1, min(2, cap - 1)})]
    return shortest_at([s for s in orders if s is not None], p2p_cost)


def zbv(pp: int, microbatches: int, p2p_cost: float | None = None) -> Schedule:
    """ZB-V: two chunks per rank in a V (chunk ``c`` on rank ``c`` going down, ``2P-1-c``
    coming back: Hanayo's one-wave placement), backward split, no rank storing more than
    ``2P`` chunk activations (``P`` stage activations: 1F1B's first rank). The order is
    Hanayo's split-backward search at that cap; ``p2p_cost``: see :func:`~.hanayo.hanayo`."""
    pp, m = positive_int("pp", pp), positive_int("microbatches", microbatches)
    s = hanayo(pp, m, 1, memory_cap=2 * pp, split_backward=True, p2p_cost=p2p_cost)
    return Schedule("zbv", s.pp, s.microbatches, s.num_chunks, s.placement, s.actions)
