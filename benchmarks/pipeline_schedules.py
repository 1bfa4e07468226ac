"""Our pipeline schedules next to torch's own, in one simulator (#17.3, #32.1).

torch 2.13's multi-stage schedules — ``ScheduleLoopedBFS``, ``ScheduleInterleaved1F1B`` and
``ScheduleInterleavedZeroBubble`` with 2 and with 4 stages per rank, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV`` — are built with stand-in stages (no process group, no model: only the
attributes their constructors read), and the per-rank order each computes (``pipeline_order``)
becomes our :class:`~parallel4d.pipeline.Schedule`: F → F, I (input gradient) → B, W → W, a full
backward → B and W back to back, an overlapped F+B → its parts in order. (``Schedule1F1B`` runs
exactly our 1F1B order; its ``pipeline_order`` in torch 2.13 is not what it runs: the last rank's
list starts at F1 and ends with an F8 of 8 micro-batches, so it is left out; ``ScheduleGPipe``
has no ``pipeline_order``.) Ours (1F1B, interleaved, Hanayo W=1 and W=2, zb_h1, zbv, Hanayo W=1 and
W=2 with a split backward) and theirs are validated and simulated alike, in *stage* units: a rank's
layers take 1 forward, 2 backward (input gradient 1 + weight gradient 1) per micro-batch, so a
chunk of a schedule with ``v`` chunks per rank costs ``1/v`` of that; a cross-rank hop costs 0 (free
transfers) or 0.5 of a stage forward. Our zb_h1, zbv and Hanayo orders are built for the hop cost
they are simulated at (``p2p_cost``, in their chunk forwards: what ``pipeline.hop_cost`` gives a
job); torch's orders are fixed.

The target (#32.1), for m ∈ {2P, 4P}, at each hop cost: among the schedules holding at most 1F1B's
activation memory (P stage activations on its first rank), our best bubble at or below torch's best.

Usage::

    python benchmarks/pipeline_schedules.py            # P ∈ {4, 8}, m ∈ {P, 2P, 4P}
    python benchmarks/pipeline_schedules.py --quick    # P = 4, m = 8 only

Prints a table (bubble ratio and the largest per-rank peak of stored chunk activations, counted
until the weight gradient; with two chunks per rank a chunk is half a rank's layers, so 16 chunk
activations are 8 "stage" activations) and writes ``benchmarks/results/pipeline_schedules[_quick].json``
(torch version, costs). No timing here: these are simulated orders, the same costs for all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402
import torch.distributed.pipelining.schedules as torch_schedules  # noqa: E402

from parallel4d.pipeline import Action, Schedule, hanayo, interleaved_1f1b, one_f_one_b, simulate  # noqa: E402
from parallel4d.pipeline.zero_bubble import zb_h1, zbv  # noqa: E402

FORWARD, BACKWARD, WEIGHT = 1.0, 2.0, 1.0  # the input gradient is BACKWARD - WEIGHT
HOPS = (0.0, 0.5)
TORCH = {  # name → (class, stages per rank, placement style)
    "torch looped BFS (v=2)": (torch_schedules.ScheduleLoopedBFS, 2, "loop"),
    "torch interleaved 1F1B (v=2)": (torch_schedules.ScheduleInterleaved1F1B, 2, "loop"),
    "torch interleaved 1F1B (v=4)": (torch_schedules.ScheduleInterleaved1F1B, 4, "loop"),
    "torch interleaved ZB (v=2)": (torch_schedules.ScheduleInterleavedZeroBubble, 2, "loop"),
    "torch interleaved ZB (v=4)": (torch_schedules.ScheduleInterleavedZeroBubble, 4, "loop"),
    "torch ZB-V": (torch_schedules.ScheduleZBVZeroBubble, 2, "v"),
    "torch DualPipe-V": (torch_schedules.ScheduleDualPipeV, 2, "v"),
}


class _StandInStage:
    """What torch's schedule constructors read of a stage; nothing runs on it."""

    def __init__(self, index: int, num_stages: int, rank: int, pp: int):
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, num_stages, rank, pp
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.has_backward = True
        self.submod = None
        self.stage_index_to_group_rank: dict = {}


def _placement(pp: int, per_rank: int, style: str) -> dict[int, list[int]]:
    if style == "v":
        return {r: sorted([r, 2 * pp - 1 - r]) for r in range(pp)}
    return {r: [r + k * pp for k in range(per_rank)] for r in range(pp)}


def torch_order(name: str, pp: int, m: int) -> Schedule:
    """torch's order for ``name`` at ``pp`` ranks and ``m`` micro-batches, as our Schedule."""
    cls, per_rank, style = TORCH[name]
    placement = _placement(pp, per_rank, style)
    num = pp * per_rank
    stages = [_StandInStage(i, num, 0, pp) for i in placement[0]]
    schedule = cls(stages[0], m) if per_rank == 1 else cls(stages, m)
    actions = {r: [a for x in schedule.pipeline_order[r] if x is not None for a in _ours(x)] for r in range(pp)}
    split = any(a.kind == "W" for acts in actions.values() for a in acts)
    if split:  # a full backward among split ones: its two halves back to back
        actions = {r: [y for a in acts for y in ([a, Action("W", a.microbatch, a.chunk)]
                                                 if a.kind == "FULL" else [a])] for r, acts in actions.items()}
    actions = {r: [Action("B", a.microbatch, a.chunk) if a.kind == "FULL" else a for a in acts]
               for r, acts in actions.items()}
    return Schedule(name, pp, m, num, placement, actions)


def _ours(x) -> list[Action]:
    kind = x.computation_type.value
    if x.sub_actions:
        return [a for sub in x.sub_actions for a in _ours(sub)]
    mapped = {"F": "F", "I": "B", "W": "W", "B": "FULL"}.get(kind)
    if mapped is None:  # communication or sharding bookkeeping: not compute
        return []
    return [Action(mapped, x.microbatch_index, x.stage_index)]


SPLIT_HANAYO = ("hanayo W=1 split", "hanayo W=2 split")


def our_orders(pp: int, m: int, hop: float) -> dict[str, Schedule]:
    """Ours; the searched orders built for the hop cost they are simulated at (``hop`` in stage forwards:
    ``hop · v`` of a chunk's, with ``v`` chunks per rank)."""
    def link(per_rank: int) -> float | None:
        return hop * per_rank or None

    out = {"1f1b": one_f_one_b(pp, m), "interleaved (v=2)": interleaved_1f1b(pp, m, 2)}
    for w in (1, 2):
        out[f"hanayo W={w}"] = hanayo(pp, m, w, p2p_cost=link(2 * w))
    out["zb_h1"] = zb_h1(pp, m, p2p_cost=link(1))
    out["zbv"] = zbv(pp, m, p2p_cost=link(2))
    for w, name in zip((1, 2), SPLIT_HANAYO):
        out[name] = hanayo(pp, m, w, split_backward=True, p2p_cost=link(2 * w))
    # at DualPipe-V's memory (one chunk activation above ZB-V's): the comparison at equal bytes
    out["hanayo W=1 split, cap 2P+1"] = hanayo(pp, m, 1, memory_cap=2 * pp + 1, split_backward=True,
                                               p2p_cost=link(2))
    return out


def row(name: str, s: Schedule, hop: float) -> dict:
    per_rank = s.num_chunks / s.pp  # chunk costs are 1/per_rank of a stage's
    sim = simulate(s, FORWARD / per_rank, BACKWARD / per_rank, hop, weight_cost=WEIGHT / per_rank)
    return {"schedule": name, "split_backward": s.split_backward, "chunks": s.num_chunks,
            "bubble": round(sim.bubble_ratio, 4), "peak_activations": sim.peak_activations,
            "max_peak": max(sim.peak_activations),
            # in whole-stage activations: a chunk is 1/(chunks per rank) of a rank's layers
            "stage_peak": max(sim.peak_activations) * s.pp / s.num_chunks, "makespan": sim.makespan}


def target(rows: list[dict], pp: int) -> dict:
    """#32.1's target for one (P, m, hop): among the orders holding at most 1F1B's activation memory (``P``
    stage activations), our best bubble against torch's best; torch's best at any memory for reference."""
    by = {r["schedule"]: r for r in rows if "bubble" in r}
    within = {n: r for n, r in by.items() if r["stage_peak"] <= pp + 1e-9}
    ours = min((r for n, r in within.items() if not n.startswith("torch")), key=lambda r: r["bubble"])
    theirs = min((r for n, r in within.items() if n.startswith("torch")), key=lambda r: r["bubble"])
    anywhere = min((r for n, r in by.items() if n.startswith("torch")), key=lambda r: r["bubble"])
    return {"ours": ours["schedule"], "ours_bubble": ours["bubble"], "ours_stage_peak": ours["stage_peak"],
            "best_torch": theirs["schedule"], "torch_bubble": theirs["bubble"],
            "torch_stage_peak": theirs["stage_peak"], "memory_limit_stages": pp,
            "best_torch_any_memory": anywhere["schedule"], "torch_bubble_any_memory": anywhere["bubble"],
            "torch_stage_peak_any_memory": anywhere["stage_peak"],
            "reached": ours["bubble"] <= theirs["bubble"] + 1e-4}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="P = 4, m = 8 only")
    args = ap.parse_args(argv)
    cases = [(4, 8)] if args.quick else [(p, k * p) for p in (4, 8) for k in (1, 2, 4)]
    print("costs in stage units: a rank's layers forward 1, backward 2 (weight 1) per micro-batch; "
          "a chunk of v per rank 1/v of that")
    results, targets = [], []
    for pp, m in cases:
        theirs, refused = {}, {}
        for name in TORCH:
            try:
                theirs[name] = torch_order(name, pp, m)
            except ValueError as e:  # e.g. DualPipe-V wants m ≥ 2P
                refused[name] = str(e)
        for hop in HOPS:
            print(f"\nP={pp} m={m} hop={hop}: forward {FORWARD}, backward {BACKWARD} (weight {WEIGHT})")
            print(f"  {'schedule':<26}{'bubble':>8}{'max peak':>10}{'stages':>8}  peak per rank")
            rows = []
            for name, s in {**our_orders(pp, m, hop), **theirs}.items():
                r = {"pp": pp, "microbatches": m, "hop": hop, **row(name, s, hop)}
                rows.append(r)
                print(f"  {name:<26}{r['bubble']:>8.3f}{r['max_peak']:>10}{r['stage_peak']:>8g}  "
                      f"{r['peak_activations']}")
            for name, why in refused.items():
                rows.append({"pp": pp, "microbatches": m, "hop": hop, "schedule": name, "refused": why})
                print(f"  {name:<26}  refused by torch: {why}")
            results += rows
            if m >= 2 * pp:
                t = {"pp": pp, "microbatches": m, "hop": hop, **target(rows, pp)}
                targets.append(t)
                print(f"  target (≤ {pp} stage activations): {t['ours']} {t['ours_bubble']:.4f} at "
                      f"{t['ours_stage_peak']:g} against {t['best_torch']} {t['torch_bubble']:.4f} at "
                      f"{t['torch_stage_peak']:g}: {'reached' if t['reached'] else 'NOT reached'} (torch at any "
                      f"memory: {t['best_torch_any_memory']} {t['torch_bubble_any_memory']:.4f} at "
                      f"{t['torch_stage_peak_any_memory']:g})")
    out = os.path.join(RESULTS, "pipeline_schedules_quick.json" if args.quick else "pipeline_schedules.json")
    os.makedirs(RESULTS, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
                   "python": platform.python_version(), "device": "none (simulated orders)",
                   "costs": {"units": "stage (a rank's layers); a chunk of v per rank costs 1/v",
                             "forward": FORWARD, "backward": BACKWARD, "weight": WEIGHT, "hops": HOPS},
                   "results": results, "target": targets}, f, indent=1)
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
