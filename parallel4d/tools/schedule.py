"""``parallel4d schedule``: print a schedule's per-rank actions and its simulated cost.

    parallel4d schedule --schedule hanayo --pp 4 --microbatches 8 --waves 2 [--plot out.png]
"""

from __future__ import annotations

import argparse
import sys

from parallel4d.config.rules.pipeline import SCHEDULES, check_schedule_name
from parallel4d.pipeline.analysis import ScheduleError, bubble_formula, simulate
from parallel4d.pipeline.plot import plot
from parallel4d.pipeline.schedule import make_schedule


def add_schedule_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``schedule`` sub-command on the project CLI's subparsers."""
    p = subparsers.add_parser("schedule", help="print a pipeline schedule and its simulated bubble / memory")
    _add_args(p)
    p.set_defaults(func=run_schedule_command)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="hanayo", help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--microbatches", "-m", type=int, default=8)
    p.add_argument("--waves", type=int, default=1, help="Hanayo waves W (2·W·pp chunks)")
    p.add_argument("--chunks-per-rank", type=int, default=2, help="chunks per rank for interleaved")
    p.add_argument("--split-backward", action="store_true",
                   help="hanayo: split each backward into B (input gradient) and W (weight gradient)")
    p.add_argument("--forward-cost", type=float, default=1.0, help="one chunk's forward time")
    p.add_argument("--backward-cost", type=float, default=2.0, help="one chunk's backward time")
    p.add_argument("--weight-cost", type=float, default=None,
                   help="a split schedule's W time, part of --backward-cost (default half of it)")
    p.add_argument("--p2p-cost", type=float, default=0.0, help="latency of one cross-rank transfer")
    p.add_argument("--plot", metavar="PNG", help="also write a timeline PNG")


def run_schedule_command(args: argparse.Namespace) -> int:
    """Print the action table and simulated makespan, bubble ratio and peaks; 0 on success."""
    try:
        name = check_schedule_name(args.schedule)
        s = make_schedule(name, args.pp, args.microbatches, waves=args.waves, chunks_per_rank=args.chunks_per_rank,
                          split_backward=args.split_backward)
        sim = simulate(s, args.forward_cost, args.backward_cost, args.p2p_cost, weight_cost=args.weight_cost)
    except (ValueError, ScheduleError) as e:
        print(f"parallel4d schedule: {e}", file=sys.stderr)
        return 2
    print(f"{s.name}: pp={s.pp}, microbatches={s.microbatches}, {s.num_chunks} chunks "
          f"({s.chunks_per_rank} per rank)")
    print(s.table())
    c = s.chunks_per_rank
    split = f" of which W={args.backward_cost / 2 if args.weight_cost is None else args.weight_cost:g}" \
        if s.split_backward else ""
    print(f"makespan            {sim.makespan:g}  (chunk forward={args.forward_cost:g}, "
          f"backward={args.backward_cost:g}{split}, p2p={args.p2p_cost:g})")
    bound = "" if s.split_backward else (f"  (closed form (P-1)/({c}·m+P-1) = "
                                         f"{bubble_formula(name, s.pp, s.microbatches, c):.4f})")
    print(f"bubble ratio        {sim.bubble_ratio:.4f}{bound}")
    print(f"peak activations    {sim.peak_activations}  (chunk activations stored per rank)")
    print(f"peak micro-batches  {sim.peak_microbatches}  (distinct in-flight micro-batches per rank)")
    if args.plot:
        plot(s, args.plot, forward_cost=args.forward_cost, backward_cost=args.backward_cost,
             p2p_cost=args.p2p_cost, weight_cost=args.weight_cost)
        print(f"timeline written to {args.plot}")
    return 0


def schedule_command(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m parallel4d.pipeline.cli --schedule hanayo ...``."""
    p = argparse.ArgumentParser(prog="parallel4d schedule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    return run_schedule_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(schedule_command())
