"""The schedule generators, and :func:`make_schedule` to pick one by name.

A :class:`~.types.Schedule` is pure data: a placement (pp rank → the model chunks it
holds, in model order) and, per rank, the ordered list of :class:`~.types.Action` it
runs in one optimizer step. Chunk ids ``0..num_chunks-1`` follow the model
(chunk 0 holds the embedding, the last chunk the LM head + loss). The executor
(:mod:`.executor`), the validator / simulator (:mod:`.analysis`) and the plot
only read this data, so a new scheme is a new generator and nothing else.

Generators (``P`` = pp ranks, ``m`` = micro-batches):

* :func:`gpipe` — one chunk per rank, all forwards then all backwards.
* :func:`one_f_one_b` — one chunk per rank, ``P-1-r`` warm-up forwards then
  alternate forward/backward (PipeDream-Flush / DAPPLE).
* :func:`interleaved_1f1b` — ``v`` chunks per rank, chunk ``c`` on rank
  ``c mod P`` (Megatron's interleaved schedule, groups of ``P`` micro-batches).
* :func:`~.hanayo.hanayo` — ``2·W·P`` chunks placed as ``W`` waves (chunk ``c`` on rank
  ``c mod P`` when ``c // P`` is even, on ``P-1-(c mod P)`` when odd), ordered
  by a small search over greedy orders under a per-rank activation cap; with
  ``split_backward`` its backwards are split into B and W.
* :func:`~.zero_bubble.zb_h1` — 1F1B's placement and memory, backward split into B and W.
* :func:`~.zero_bubble.zbv` — the V placement (Hanayo's one wave) at 1F1B's memory, split.
"""

from __future__ import annotations

from typing import Callable

from parallel4d.config.rules.common import positive_int
from parallel4d.config.rules.pipeline import SPLIT_SCHEDULES, check_schedule_name, interleaved_microbatch_problem
from parallel4d.pipeline.hanayo import hanayo
from parallel4d.pipeline.types import Action, Schedule, linear_placement, looped_placement  # noqa: F401 (placements re-exported)
from parallel4d.pipeline.zero_bubble import zb_h1, zbv


# --- generators ------------------------------------------------------------------


def gpipe(pp: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` backwards.

    Peak stored activations: ``m`` on every rank; bubble ``(P-1)/(m+P-1)``.
    """
    pp, m = positive_int("pp", pp), positive_int("microbatches", microbatches)
    actions = {r: [Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]
               for r in range(pp)}
    return Schedule("gpipe", pp, m, pp, linear_placement(pp), actions)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): ``min(P-1-r, m)`` warm-up forwards, then one
    forward / one backward, then the remaining backwards.

    Peak stored activations on rank ``r``: ``min(P-r, m)``; bubble ``(P-1)/(m+P-1)``.
    """
    pp, m = positive_int("pp", pp), positive_int("microbatches", microbatches)
    actions = {}
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        acts = [Action("F", i, r) for i in range(warm)]
        for k in range(m - warm):
            acts += [Action("F", warm + k, r), Action("B", k, r)]
        acts += [Action("B", i, r) for i in range(m - warm, m)]
        actions[r] = acts
    return Schedule("1f1b", pp, m, pp, linear_placement(pp), actions)


def interleaved_1f1b(pp: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron): ``v`` chunks per rank on the looped placement.

    Forwards on rank ``r`` run in groups of ``P`` micro-batches: for each group,
    chunk ``r`` for the group, then chunk ``P+r``, ... (backwards likewise, chunks
    descending). ``min((v-1)·P + 2·(P-1-r), v·m)`` warm-up forwards, then one
    forward / one backward. When ``m`` is not a multiple of ``P`` the last group
    is shorter. Bubble ``(P-1)/(v·m+P-1)`` when ``P`` divides ``m``.

    Takes ``m ≤ P`` or ``m`` a multiple of ``P`` (like Megatron): with a short
    *last* group after full ones, the warm-up of rank 0 runs ahead into the short
    group's later chunks and the ranks wait on each other in a cycle (``validate``
    finds that deadlock), so other counts raise ``ValueError``.
    """
    pp, m = positive_int("pp", pp), positive_int("microbatches", microbatches)
    v = positive_int("chunks_per_rank", chunks_per_rank)
    problem = interleaved_microbatch_problem(pp, m, v)
    if problem:
        raise ValueError(problem)
    actions = {}
    for r in range(pp):
        fwd, bwd = [], []
        for g0 in range(0, m, pp):
            group = range(g0, min(g0 + pp, m))
            for k in range(v):
                fwd += [Action("F", i, k * pp + r) for i in group]
            for k in reversed(range(v)):
                bwd += [Action("B", i, k * pp + r) for i in group]
        total = v * m
        warm = min((v - 1) * pp + 2 * (pp - 1 - r), total)
        acts = fwd[:warm]
        for k in range(total - warm):
            acts += [fwd[warm + k], bwd[k]]
        acts += bwd[total - warm:]
        actions[r] = acts
    return Schedule(f"interleaved(v={v})", pp, m, v * pp, looped_placement(pp, v), actions)


def make_schedule(name: str, pp: int, microbatches: int, *, waves: int = 1, chunks_per_rank: int = 2,
                  split_backward: bool = False, p2p_cost: float | None = None) -> Schedule:
    """Build a schedule by config name (``gpipe``, ``1f1b``, ``interleaved``, ``hanayo``, ``zb_h1``,
    ``zbv``); ``split_backward`` splits Hanayo's backward (zb_h1 and zbv always split it); ``p2p_cost``:
    the searched orders (hanayo, zb_h1, zbv) built for a hop of that many chunk forwards (the others
    have one order)."""
    name = check_schedule_name(name)
    if split_backward and name not in ("hanayo", *SPLIT_SCHEDULES):
        raise ValueError(f"split_backward applies to hanayo, not {name} (zb_h1 and zbv always split)")
    if name == "gpipe":
        return gpipe(pp, microbatches)
    if name == "1f1b":
        return one_f_one_b(pp, microbatches)
    if name == "interleaved":
        return interleaved_1f1b(pp, microbatches, chunks_per_rank)
    if name == "zb_h1":
        return zb_h1(pp, microbatches, p2p_cost=p2p_cost)
    if name == "zbv":
        return zbv(pp, microbatches, p2p_cost=p2p_cost)
    return hanayo(pp, microbatches, waves, split_backward=split_backward, p2p_cost=p2p_cost)


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "hanayo": hanayo, "zb_h1": zb_h1, "zbv": zbv,
}
