"""Pipeline schedules measured side by side: GPipe, 1F1B, interleaved (2 chunks/rank),
Hanayo W=1 and W=2, on P CPU workers (one thread each), next to the simulator.

Usage::

    python benchmarks/pipeline.py                 # P = 4 and 8, m ∈ {P, 2P, 4P} (needs ≥ 8 cores)
    python benchmarks/pipeline.py --quick         # P = 2, tiny model: proves the script runs
    python benchmarks/pipeline.py --emulate       # every schedule with sleeps for compute, P = 4 and 8,
                                                  # measured step against simulate (2 cores are enough)
    python benchmarks/pipeline.py --emulate --quick   # P = 2, short sleeps: proves it runs

For each (P, schedule, m) the job runs one warm-up step and ``--steps`` timed
steps of the reference GPT (float32, gloo p2p). Reported per configuration:

* ``step_s``: median wall time of a step (all pp ranks start after a barrier;
  step = last rank's end − first rank's start);
* ``measured_bubble``: ``1 − Σ compute / (P · makespan)`` from the executor's
  per-action timestamps of the median step (compute = inside F/B actions; p2p
  waits count as bubble);
* ``sim_bubble``: :func:`parallel4d.pipeline.simulate` with uniform chunks
  (forward 1, backward 2, free transfers); ``sim_step_s``: the simulator with the
  measured mean forward / backward time of one chunk of this run.

Writes ``benchmarks/results/pipeline[_quick].json`` (core count, torch version,
config) and timeline PNGs of the measured m = 2P steps (``--png`` to change).
Per-chunk compute should dominate transfers: the default model has 30 blocks of
hidden 256 on micro-batches of 4 × 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

SCHEDULES = [
    ("gpipe", "gpipe", {}),
    ("1f1b", "1f1b", {}),
    ("interleaved(2)", "interleaved", {"chunks_per_rank": 2}),
    ("hanayo(W=1)", "hanayo", {"waves": 1}),
    ("hanayo(W=2)", "hanayo", {"waves": 2}),
]


def _worker(pp, shape_kw, mb_rows, ms, steps, threads):
    """One pp rank: every (schedule, m) in turn; returns per-step timestamps and traces."""
    import torch.distributed as dist

    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.models.gpt2.model import GPTShape, build_gpt
    from parallel4d.models.stages import cross_entropy
    from parallel4d.pipeline import PipelineExecutor, build_chunks, make_schedule, parameter_costs
    from parallel4d.pipeline import partition

    torch.set_num_threads(threads)
    mesh = init_mesh(pp=pp)
    me = mesh.rank("pp")
    shape = GPTShape(**shape_kw)
    model = build_gpt(shape, seed=0)
    stages = model.stages()
    costs = parameter_costs(stages)
    g = torch.Generator().manual_seed(1)
    out = []
    for label, name, kw in SCHEDULES:
        for m in ms:
            sched = make_schedule(name, pp, m, **kw)
            if sched.num_chunks > len(stages):
                out.append(dict(label=label, m=m, skipped=f"{sched.num_chunks} chunks > {len(stages)} stages"))
                continue
            chunks = build_chunks(stages, partition(costs, sched.num_chunks), sched.placement[me])
            ex = PipelineExecutor(sched, mesh, chunks, cross_entropy, (mb_rows, shape.seq_len, shape.hidden),
                                  torch.float32, timeout_s=600)
            tokens = torch.randint(0, shape.vocab_size, (m * mb_rows, shape.seq_len), generator=g)
            targets = torch.randint(0, shape.vocab_size, (m * mb_rows, shape.seq_len), generator=g)
            runs = []
            for k in range(steps + 1):  # the first step warms up allocators and p2p connections
                for p in model.parameters():
                    p.grad = None
                dist.barrier(group=mesh.group("pp"))
                t0 = time.perf_counter()
                res = ex.step(list(tokens.chunk(m)), list(targets.chunk(m)))
                t1 = time.perf_counter()
                if k:
                    trace = [(a.kind, a.microbatch, a.chunk, s, e) for (a, s, e) in res.trace]
                    runs.append(dict(t0=t0, t1=t1, trace=trace, wait_s=res.wait_s, loss=res.loss,
                                     peak=res.peak_activations))
            out.append(dict(label=label, name=name, kw=kw, m=m, runs=runs))
    return out


def _summarise(pp, per_rank, png_m, png_prefix):
    from parallel4d.pipeline import Action, make_schedule, simulate
    from parallel4d.pipeline.plot import plot

    rows = []
    for k, first in enumerate(per_rank[0]):
        if "skipped" in first:
            rows.append(dict(P=pp, schedule=first["label"], m=first["m"], skipped=first["skipped"]))
            continue
        label, name, kw, m = first["label"], first["name"], first["kw"], first["m"]
        sched = make_schedule(name, pp, m, **kw)
        steps = []
        for j in range(len(first["runs"])):
            runs = [r[k]["runs"][j] for r in per_rank]
            t_step = max(x["t1"] for x in runs) - min(x["t0"] for x in runs)
            acts = [(rank, a) for rank, x in enumerate(runs) for a in x["trace"]]
            start = min(a[3] for _, a in acts)
            end = max(a[4] for _, a in acts)
            busy = sum(a[4] - a[3] for _, a in acts)
            steps.append(dict(step_s=t_step, bubble=1.0 - busy / (pp * (end - start)), runs=runs))
        med = sorted(steps, key=lambda s: s["step_s"])[len(steps) // 2]
        f_times = [a[4] - a[3] for x in med["runs"] for a in x["trace"] if a[0] == "F"]
        b_times = [a[4] - a[3] for x in med["runs"] for a in x["trace"] if a[0] == "B"]
        f_mean, b_mean = statistics.fmean(f_times), statistics.fmean(b_times)
        sim_u = simulate(sched)
        sim_c = simulate(sched, forward_cost=f_mean, backward_cost=b_mean)
        row = dict(P=pp, schedule=label, m=m, chunks=sched.num_chunks,
                   step_s=statistics.median(s["step_s"] for s in steps),
                   measured_bubble=med["bubble"], sim_bubble=sim_u.bubble_ratio, sim_step_s=sim_c.makespan,
                   chunk_forward_s=f_mean, chunk_backward_s=b_mean,
                   wait_s_per_rank=[x["wait_s"] for x in med["runs"]],
                   peak_activations=[x["peak"] for x in med["runs"]],
                   sim_peak_activations=sim_u.peak_activations, loss=med["runs"][0]["loss"])
        if m == png_m and png_prefix:
            timings = {r: [(Action(a[0], a[1], a[2]), a[3], a[4]) for a in x["trace"]]
                       for r, x in enumerate(med["runs"])}
            safe = label.replace("(", "").replace(")", "").replace("=", "")
            path = f"{png_prefix}_P{pp}_m{m}_{safe}.png"
            plot(sched, path, timings=timings,
                 title=f"{label} measured: P={pp}, m={m}, step {row['step_s']:.3f}s, "
                       f"bubble {row['measured_bubble']:.1%} (sim {row['sim_bubble']:.1%})")
            row["png"] = os.path.relpath(path, HERE)
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="P=2, tiny model, m ∈ {2, 4}, one timed step")
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--m-factors", type=int, nargs="+", default=[1, 2, 4], help="m = factor · P")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--mb-rows", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per configuration (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--emulate", action="store_true",
                    help="sleeps instead of compute (benchmarks/pipeline_emulate.py), against the simulator")
    ap.add_argument("--unit", type=float, default=0.1, help="--emulate: seconds of one stage's F, B or W")
    ap.add_argument("--png", action="store_true", default=True)
    ap.add_argument("--no-png", dest="png", action="store_false")
    a = ap.parse_args(argv)
    if a.emulate:
        return emulate(a)
    if a.quick:
        a.pp, a.m_factors, a.layers, a.hidden, a.heads, a.seq, a.vocab, a.mb_rows, a.steps = \
            [2], [1, 2], 6, 32, 2, 16, 64, 2, 1
    import pipeline as this  # importable by module name, so the spawned workers can unpickle _worker

    from parallel4d.launcher.spawn import spawn

    cores = os.cpu_count() or 1
    shape_kw = dict(vocab_size=a.vocab, seq_len=a.seq, hidden=a.hidden, heads=a.heads, layers=a.layers,
                    tie_embeddings=True)
    os.makedirs(RESULTS, exist_ok=True)
    tag = "pipeline_quick" if a.quick else "pipeline"
    rows = []
    for pp in a.pp:
        if pp * a.threads > cores:
            print(f"warning: P={pp} workers × {a.threads} threads > {cores} cores; timings will be distorted",
                  file=sys.stderr)
        ms = [f * pp for f in a.m_factors]
        t0 = time.time()
        per_rank = spawn(this._worker, pp, (pp, shape_kw, a.mb_rows, ms, a.steps, a.threads),
                         timeout_s=3600, threads_per_worker=a.threads)
        print(f"P={pp}: {time.time() - t0:.0f}s", file=sys.stderr)
        rows += _summarise(pp, per_rank, 2 * pp, os.path.join(RESULTS, tag) if a.png else None)
    # Throughput of Hanayo vs the best prior schedule, per (P, m).
    summary = []
    for pp in a.pp:
        for f in a.m_factors:
            m = f * pp
            got = {r["schedule"]: r["step_s"] for r in rows if r["P"] == pp and r["m"] == m and "step_s" in r}
            prior = {k: v for k, v in got.items() if not k.startswith("hanayo")}
            for h in ("hanayo(W=1)", "hanayo(W=2)"):
                if h in got and prior:
                    best = min(prior, key=prior.get)
                    summary.append(dict(P=pp, m=m, hanayo=h, best_prior=best,
                                        throughput_gain=prior[best] / got[h] - 1.0))
    hdr = f"{'P':>2} {'m':>3} {'schedule':<15} {'step s':>8} {'sim step s':>10} {'bubble':>7} {'sim bub':>7} {'peak act (rank0)':>16}"
    print(hdr)
    for r in rows:
        if "skipped" in r:
            print(f"{r['P']:>2} {r['m']:>3} {r['schedule']:<15} skipped: {r['skipped']}")
            continue
        print(f"{r['P']:>2} {r['m']:>3} {r['schedule']:<15} {r['step_s']:>8.3f} {r['sim_step_s']:>10.3f} "
              f"{r['measured_bubble']:>7.1%} {r['sim_bubble']:>7.1%} {r['peak_activations'][0]:>16}")
    for s in summary:
        print(f"P={s['P']} m={s['m']}: {s['hanayo']} vs best prior {s['best_prior']}: "
              f"{s['throughput_gain']:+.1%} throughput (paper: up to +30.4%)")
    report = dict(
        benchmark="pipeline schedules", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        device="cpu", cores=cores, platform=platform.platform(), processor=platform.processor(),
        torch=torch.__version__, threads_per_worker=a.threads, backend="gloo",
        config=dict(pp=a.pp, m_factors=a.m_factors, model=shape_kw, mb_rows=a.mb_rows, steps=a.steps,
                    dtype="float32", quick=a.quick),
        results=rows, hanayo_vs_best_prior=summary,
    )
    path = os.path.join(RESULTS, f"{tag}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


def emulate(a) -> None:
    """``--emulate``: every schedule of pipeline_emulate.SCHEDULES, m = factor · P, measured against simulated."""
    import pipeline_emulate as em  # by module name, so the spawned workers can unpickle em.worker

    from parallel4d.launcher.spawn import spawn

    if a.quick:
        a.pp, a.m_factors, a.unit, a.steps = [2], [1, 2], 0.01, 1
    os.makedirs(RESULTS, exist_ok=True)
    tag = "pipeline_emulated_quick" if a.quick else "pipeline_emulated"
    png_case = ("hanayo(W=1, split)", 2 * max(a.pp))
    rows = []
    for pp in a.pp:
        t0 = time.time()
        per_rank = spawn(em.worker, pp, (pp, [f * pp for f in a.m_factors], a.unit, a.steps), timeout_s=3600)
        print(f"P={pp}: {time.time() - t0:.0f}s, hop latency {per_rank[0]['hop'] * 1e6:.0f} µs", file=sys.stderr)
        png = os.path.join(RESULTS, f"{tag}_P{pp}_m{png_case[1]}.png") if a.png and pp == max(a.pp) else None
        rows += em.summarise(pp, per_rank, a.unit, png_case, png)
    print(f"{'P':>2} {'m':>3} {'schedule':<20} {'step s':>8} {'sim s':>8} {'measured/sim':>12} {'sim bubble':>10} "
          f"{'peaks = sim':>11}")
    for r in rows:
        print(f"{r['P']:>2} {r['m']:>3} {r['schedule']:<20} {r['step_s']:>8.3f} {r['sim_step_s']:>8.3f} "
              f"{r['ratio']:>12.3f} {r['sim_bubble']:>10.1%} {str(r['peaks_equal']):>11}")
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(f"largest difference: {worst['schedule']} P={worst['P']} m={worst['m']}: measured/simulated "
          f"{worst['ratio']:.3f}")
    report = dict(
        benchmark="pipeline schedules, emulated compute", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        device="cpu (sleeps)", cores=os.cpu_count(), platform=platform.platform(), torch=torch.__version__,
        backend="gloo", config=dict(pp=a.pp, m_factors=a.m_factors, unit_s=a.unit, steps=a.steps, quick=a.quick,
                                    activation=[em.ROWS, em.SEQ, em.HIDDEN]),
        results=rows, largest_difference=dict(schedule=worst["schedule"], P=worst["P"], m=worst["m"],
                                              ratio=worst["ratio"]),
    )
    path = os.path.join(RESULTS, f"{tag}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
