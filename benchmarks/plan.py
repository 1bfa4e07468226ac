"""The time model against measured steps on this machine: ``parallel4d plan``'s prediction (this
machine calibrated: :mod:`parallel4d.planning.calibrate`) beside the median of real training steps,
for every layout that fits the cores (world 1 and 2, one thread per rank), and the two rankings.

Usage::

    python benchmarks/plan.py            # calibrate, then predict and measure every layout
    python benchmarks/plan.py --quick    # two layouts, few repeats: proves the script runs

Each layout's step is timed in its own workers (:func:`parallel4d.launcher.spawn.spawn`, gloo, one
thread each): ``--warmup`` steps, then ``--steps`` steps each between two barriers, the median kept.
Tokens are random (the step's time does not depend on them). The calibration never sees these jobs.
Writes ``benchmarks/results/plan[_quick].json``: per layout the predicted and measured step and
their ratio, the predicted parts, and Spearman's rank correlation of predicted and measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

from report import RESULTS, save  # noqa: E402

BASE = os.path.join(HERE, "..", "configs", "quickstart.yaml")
ONE = ["parallel.dp=1", "train.threads_per_worker=1", "model.layers=4", "model.hidden=256", "model.seq_len=128",
       "data.batch_size=16", "train.steps=10"]
LAYOUTS = [  # (name, overrides over quickstart's model at world 1)
    ("gpt2 w1", []),
    ("gpt2 w1 recompute", ["train.activation_checkpointing=blocks"]),
    ("gpt2 w1 m=4", ["pipeline.microbatches=4"]),
    ("gpt2 w1 wide", ["model.hidden=384", "model.heads=6"]),
    ("gpt2 w1 long", ["model.seq_len=512", "data.batch_size=4"]),
    ("llama w1", ["model.arch=llama", "model.kv_heads=2"]),
    ("gpt2 w1 hetero", ["hetero.enabled=true"]),
    ("gpt2 dp2", ["parallel.dp=2"]),
    ("gpt2 sp2 ring", ["parallel.sp=2"]),
    ("gpt2 pp2 1f1b m=4", ["parallel.pp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"]),
    ("gpt2 pp2 gpipe m=2", ["parallel.pp=2", "pipeline.schedule=gpipe", "pipeline.microbatches=2"]),
    ("gpt2 pp2 hanayo m=4", ["parallel.pp=2", "pipeline.schedule=hanayo", "pipeline.microbatches=4"]),
]
QUICK = ["gpt2 w1", "gpt2 dp2"]


def measure_worker(path: str, overrides: list[str], warmup: int, steps: int) -> float:
    """One rank: build the job, run ``warmup`` steps, then the median of ``steps`` timed ones."""
    import torch.distributed as dist

    from parallel4d.config.load import load_config
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    cfg = load_config(path, overrides)
    p = cfg.parallel
    torch.manual_seed(0)
    mesh = init_mesh(p.pp, p.dp, p.sp, p.tp, timeout_s=cfg.train.timeout_s)
    engine = compose(cfg, mesh)
    tokens = torch.randint(cfg.model.vocab_size, (cfg.data.batch_size, cfg.model.seq_len),
                           generator=torch.Generator().manual_seed(0))
    for _ in range(warmup):
        float(engine.train_step(tokens, tokens))
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        float(engine.train_step(tokens, tokens))
        dist.barrier()
        times.append(time.perf_counter() - t)
    engine.close()
    return statistics.median(times)


def measured(path: str, overrides: list[str], warmup: int, steps: int) -> float:
    import plan as this  # by module name, so the spawned workers can unpickle measure_worker

    from parallel4d.config.load import load_config
    from parallel4d.launcher.spawn import spawn

    cfg = load_config(path, overrides)
    return spawn(this.measure_worker, cfg.world_size, (path, overrides, warmup, steps), timeout_s=1800,
                 threads_per_worker=cfg.train.threads_per_worker or 1)[0]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for i, k in enumerate(order):
            r[k] = float(i)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from parallel4d.config.load import load_config
    from parallel4d.planning.calibrate import calibrate
    from parallel4d.planning.cost import predict
    from parallel4d.planning.dry_run import plan

    layouts = [x for x in LAYOUTS if x[0] in QUICK] if a.quick else LAYOUTS
    steps = 3 if a.quick else a.steps
    t0 = time.perf_counter()
    # one profile per world size: a rank's rates while the job's other ranks run beside it on these cores
    profiles = {w: calibrate([torch.float32], threads=1, repeats=5 if a.quick else 15, ranks=w)
                for w in sorted({load_config(BASE, [*ONE, *x[1]]).world_size for x in layouts})}
    for w, profile in profiles.items():
        print(f"calibrated (world {w}) in {time.perf_counter() - t0:.0f} s: {profile.as_dict()}")
    rows = []
    for name, extra in layouts:
        overrides = [*ONE, *extra]
        cfg = load_config(BASE, overrides)
        t = time.perf_counter()
        pred = predict(cfg, plan(cfg, timed=True), profiles[cfg.world_size])
        planned_s = time.perf_counter() - t
        real = measured(BASE, overrides, a.warmup, steps)
        rows.append({"layout": name, "overrides": overrides, "world": cfg.world_size, "predicted_s": pred.step_s,
                     "measured_s": real, "ratio": pred.step_s / real, "parts": pred.parts, "bubble": pred.bubble,
                     "plan_s": planned_s})
        print(f"{name:<22} predicted {pred.step_s * 1e3:8.1f} ms  measured {real * 1e3:8.1f} ms  "
              f"ratio {pred.step_s / real:5.3f}", flush=True)
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]) if len(rows) > 2 else None
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"largest deviation {100 * worst:.1f} %; Spearman {rho}")
    out = a.out or os.path.join(RESULTS, f"plan{'_quick' if a.quick else ''}.json")
    save(out, "plan", "cpu", {"cores": os.cpu_count(), "threads_per_rank": 1, "warmup": a.warmup, "steps": steps,
                              "base": "configs/quickstart.yaml"},
         profiles={w: p.as_dict() for w, p in profiles.items()}, rows=rows, spearman=rho, largest_deviation=worst)


if __name__ == "__main__":
    main()
