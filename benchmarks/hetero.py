"""Chunk traffic per training iteration: LRU vs Belady (warm-up trace) vs the OPT bounds.

Trains the reference GPT under ``parallel4d.hetero`` on the CPU compute device (the
state machine, budget and copies run exactly as on CUDA; "device" and "host" are both
CPU memory here) at several device budgets, from the measured minimum to nearly
everything resident, and reports for the last (steady-state) iteration:

* loads (host→device bytes of live content), write-backs (device→host bytes of dirty
  live content), zero-fills (dead content materialised without a copy: not host traffic),
  ``moved`` = loads + write-backs;
* ``opt_load_bytes``: the fewest loads on that iteration's recorded access trace with the
  same number of slots, from the same resident set, without pinning or write-backs;
* ``opt_traffic_bytes``: a lower bound on loads + write-backs of any policy on that
  iteration's trace, from the same resident and dirty chunks to the same resident ones at
  its end, with the recorded pins (``parallel4d.hetero.tracer.opt_traffic``), and
  ``vs_opt`` = moved / that bound;
* ``belady+pf``: Belady plus trace-driven prefetch of the next 2 chunks (what runs on
  CUDA, where the fills overlap with compute; it only evicts dead or clean chunks
  needed later than the prefetched one, so its extra traffic is small);
* a dynamic-budget row (PatrickStar's rule: capacity − traced non-model peak; its bounds
  take the whole arena as the capacity, so they are loose there).

Usage: ``python benchmarks/hetero.py [--layers 4 --hidden 64 --iters 4] [--every]``
(``--every``: every budget from the minimum to the whole model, one chunk apart); prints
a table and writes ``benchmarks/results/hetero.json``. Traffic is deterministic (no
timing), so the numbers are reproducible on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.hetero import opt_loads, opt_traffic_of, wrap  # noqa: E402
from parallel4d.models.gpt2.model import GPTShape, build_gpt  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run(shape, budget, policy, iters, micro, batch, dynamic=False, prefetch=0):
    model = build_gpt(shape, seed=0)
    model, opt = wrap(model, dict(name="adamw", lr=1e-3),
                      dict(compute_device="cpu", device_budget_bytes=budget, policy=policy, dynamic_budget=dynamic))
    model._hetero_runtime.mgr.prefetch_depth = prefetch
    g = torch.Generator().manual_seed(0)
    for _ in range(iters):
        for _ in range(micro):
            x = torch.randint(0, shape.vocab_size, (batch, shape.seq_len), generator=g)
            (model(x, torch.roll(x, -1, 1)) / micro).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def row(model, opt, label, policy, budget):
    st = opt.stats()
    mgr = model._hetero_runtime.mgr
    last = mgr.history[-1]
    cb = st["chunk_bytes"]
    slots = mgr.pools["main"].n_slots
    opt_bytes = opt_loads(last["trace"], last["live"], slots, set(last["start_resident"])) * cb
    bound = opt_traffic_of([last], slots) * cb
    return {
        "label": label, "policy": policy, "budget_bytes": budget, "budget_chunks": slots,
        "load_bytes": last["load_bytes"], "writeback_bytes": last["writeback_bytes"],
        "zero_fill_bytes": last["zero_fill_bytes"], "moved_bytes": last["moved_bytes"],
        "loads": last["loads"], "writebacks": last["writebacks"], "zero_fills": last["zero_fills"],
        "drops": last["drops"], "opt_load_bytes": opt_bytes, "opt_traffic_bytes": bound,
        "vs_opt": last["moved_bytes"] / bound if bound else None, "accesses": len(last["trace"]),
        "peak_resident_bytes": st["peak_resident_bytes"], "trace_divergences": st["trace_divergences"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--every", action="store_true", help="every budget from the minimum to the whole model")
    ap.add_argument("--out", default=os.path.join(RESULTS, "hetero.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = GPTShape(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden, heads=args.heads,
                     layers=args.layers, tie_embeddings=True)

    model, opt = run(shape, None, "belady", 1, args.micro, args.batch)
    base = opt.stats()
    cb, lo, total = base["chunk_bytes"], base["min_feasible_budget_bytes"], base["model_data_bytes"]
    n = total // cb
    budgets = sorted({lo + i * cb for i in range(5)} | {(lo + total) // 2 // cb * cb, total - 2 * cb, total - cb, total})
    if args.every:
        budgets = list(range(lo, total + 1, cb))
    rows = []
    for budget in budgets:
        for policy, pf in (("lru", 0), ("belady", 0), ("belady+pf", 2)):
            m, o = run(shape, budget, policy.split("+")[0], args.iters, args.micro, args.batch, prefetch=pf)
            rows.append(row(m, o, f"{budget // cb}/{n} chunks", policy, budget))
            rows[-1]["prefetches"] = o.stats()["last_iteration"]["prefetches"]
    cap = lo + 4 * cb  # dynamic: the same capacity must also hold the live activations
    m, o = run(shape, cap, "belady", args.iters, args.micro, args.batch, dynamic=True)
    dyn = row(m, o, f"dynamic cap {cap // cb} chunks", "belady", cap)
    dyn["peak_resident_plus_nonmodel"] = m._hetero_runtime.mgr.peak_steady_total
    rows.append(dyn)

    hdr = (f"{'budget':>18} {'policy':>9} {'loads B':>10} {'wback B':>10} {'zero B':>9} {'moved B':>10} "
           f"{'OPT loads B':>12} {'OPT moved B':>12} {'vs OPT':>7} {'vs LRU':>7}")
    print(f"model data {total} B = {n} chunks of {cb} B; minimum feasible budget {lo} B; "
          f"chunk_elems {base['chunk_elems']}")
    print(hdr)
    lru = {}
    for r in rows:
        if r["policy"] == "lru":
            lru[r["budget_bytes"]] = r["moved_bytes"]
        ref = lru.get(r["budget_bytes"]) if r["policy"] != "lru" and r["label"].endswith("chunks") else None
        r["vs_lru"] = (r["moved_bytes"] / ref - 1) if ref else None
        rel = f"{100 * r['vs_lru']:+.1f}%" if r["vs_lru"] is not None else ""
        vs_opt = f"{r['vs_opt']:.3f}" if r["vs_opt"] is not None else ""
        print(f"{r['label']:>18} {r['policy']:>9} {r['load_bytes']:>10} {r['writeback_bytes']:>10} "
              f"{r['zero_fill_bytes']:>9} {r['moved_bytes']:>10} {r['opt_load_bytes']:>12} "
              f"{r['opt_traffic_bytes']:>12} {vs_opt:>7} {rel:>7}")
    out = {
        "benchmark": "hetero_traffic",
        "device": "cpu (compute device = cpu; host and device are both CPU memory)",
        "torch": torch.__version__, "python": platform.python_version(),
        "config": {**vars(args), "out": os.path.relpath(args.out, os.path.join(RESULTS, "..", "..")),
                   "optimizer": "adamw", "iteration_reported": "last (steady state)"},
        "model_data_bytes": total, "chunk_bytes": cb, "chunk_elems": base["chunk_elems"],
        "min_feasible_budget_bytes": lo, "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
