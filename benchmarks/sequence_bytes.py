"""Bytes and activation memory per rank of ring, hybrid and Ulysses sequence parallelism.

For sp = 4 and 8 and every Ulysses group size U dividing sp (U = 1: the ring alone, U = sp: pure
Ulysses), ``parallel4d plan``'s dry run (the job's own code on fake tensors, no values, no devices)
of a Llama-shaped layer counts what each rank sends per step over the sp axes, and what it holds. Per
layer: the difference between a 2-layer and a 1-layer model. The counted bytes are compared with the
analytic count (``parallel4d.sequence.ulysses.ulysses_bytes``); the activations show the O(s/sp) a
rank holds per layer.

Default shape: hidden 4096, 32 heads, 8 key/value heads (head size 128), s = 32768, batch 1, float32
(so every tensor saved for the backward is an activation: under bf16 autocast the bf16 copies of the
weights autocast saves, ~470 MiB per layer at this width, count as well, whatever the sequence).
``--quick``: s = 4096. Prints a table; writes JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from parallel4d.config.load import make_config
from parallel4d.sequence.ulysses import ulysses_bytes
from parallel4d.planning.dry_run import dry_run
from report import RESULTS, save
SP_AXES = ("sp", "sp_ring", "sp_ulysses")


def job(sp: int, u: int, layers: int, seq: int, hidden: int, heads: int, kv_heads: int) -> dict:
    return {"parallel": {"sp": sp}, "sequence": {"ulysses": u, "layout": "zigzag"},
            "model": {"arch": "llama", "vocab_size": 1024, "seq_len": seq, "hidden": hidden, "heads": heads,
                      "kv_heads": kv_heads, "layers": layers, "intermediate_size": 4 * hidden},
            "data": {"source": "synthetic", "batch_size": 1}, "train": {"dtype": "float32"}}


def per_layer(sp: int, u: int, args) -> dict:
    plans = [dry_run(make_config(job(sp, u, layers, args.seq, args.hidden, args.heads, args.kv_heads)))
             for layers in (1, 2)]
    sent = [sum(v for k, v in p.sent_by_axis.items() if k in SP_AXES) for p in plans]
    by_axis = {k: plans[1].sent_by_axis.get(k, 0) - plans[0].sent_by_axis.get(k, 0) for k in SP_AXES}
    want = sum(ulysses_bytes(sp, u, 1, args.heads, args.kv_heads, args.seq, args.hidden // args.heads,
                             torch.float32).values())
    return {"sp": sp, "ulysses": u, "ring": sp // u, "sent_per_layer": sent[1] - sent[0],
            "sent_per_layer_by_axis": {k: v for k, v in by_axis.items() if v}, "analytic_per_layer": want,
            "activations_per_layer": plans[1].activations - plans[0].activations}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="s = 4096")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(RESULTS, "sequence_bytes.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.seq = 4096
    rows = [per_layer(sp, u, args) for sp in (4, 8) for u in range(1, sp + 1)
            if sp % u == 0 and args.kv_heads % u == 0]
    print(f"per rank and layer, forward + backward; llama h={args.hidden} heads={args.heads}/{args.kv_heads} "
          f"s={args.seq} b=1 float32 (plan's dry run on fake tensors)")
    print(f"{'sp':>3} {'U':>3} {'ring':>4} | {'sent MiB':>9} {'analytic':>9} {'equal':>5} | {'activations MiB':>15}")
    for r in rows:
        print(f"{r['sp']:>3} {r['ulysses']:>3} {r['ring']:>4} | {r['sent_per_layer'] / 2**20:>9.1f} "
              f"{r['analytic_per_layer'] / 2**20:>9.1f} {str(r['sent_per_layer'] == r['analytic_per_layer']):>5} | "
              f"{r['activations_per_layer'] / 2**20:>15.1f}")
    return save(args.out, "sequence_bytes", f"none (fake tensors; {platform.machine()})", vars(args), rows=rows)


if __name__ == "__main__":
    main()
