"""``parallel4d schedule``: print a schedule's per-rank actions and its simulated cost.

    parallel4d schedule --schedule hanayo --pp 4 --microbatches 8 --waves 2 [--plot out.png]

Its arguments are defined with the other commands' in :mod:`parallel4d.tools.cli`, which imports
this module (and so the pipeline package, and torch) only when the command runs.
"""

from __future__ import annotations

import argparse
import sys

from parallel4d.checkpoint.outputs import check_output, new_file
from parallel4d.config.rules.pipeline import check_schedule_name
from parallel4d.pipeline.analysis import ScheduleError, bubble_formula, simulate
from parallel4d.pipeline.plot import plot
from parallel4d.pipeline.schedule import make_schedule
from parallel4d.tools.plot import image_format


def run_schedule_command(args: argparse.Namespace) -> int:
    """Print the action table and simulated makespan, bubble ratio and peaks; 0 on success."""
    out = check_output(args.plot, "--plot") if args.plot else None  # before any work (ConfigError: exit 2)
    kind = image_format(out, "--plot") if out else None
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
    if out is not None:
        with new_file(out, "--plot") as tmp:
            plot(s, str(tmp), forward_cost=args.forward_cost, backward_cost=args.backward_cost,
                 p2p_cost=args.p2p_cost, weight_cost=args.weight_cost, image_format=kind)
        print(f"timeline written to {out}")
    return 0
