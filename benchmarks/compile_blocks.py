"""``train.compile: blocks`` against eager: the same job's training step, side by side in one process.

Builds the job twice in this process (a one-rank gloo group; :func:`parallel4d.compose`), once with
``train.compile=none`` and once with ``blocks`` (each transformer block compiled by inductor, torch's
default backend), runs the warm-up steps of each (the compiled job's first step compiles), then times
the steps alternately (eager, compiled, eager, …: a busy machine slows both alike) and reports each
one's median step, tokens per second and the speed-up, with the compile time (the compiled first
step less an eager one). Both run the same batches from the same initial parameters; their losses
are printed beside the times.

Usage: ``python benchmarks/compile_blocks.py [--steps 20 --warmup 3 --threads N --set FIELD=VALUE …]``
(default model: 4 layers of hidden 256, sequence 128, batch 8, float32); prints a table and writes
``benchmarks/results/compile_blocks.json`` (device, torch version, config, each figure, and the
machine's load average: on a shared machine the two jobs' absolute times move together). On a GPU,
``--device cuda`` (an NCCL group of one on GPU 0; each step is timed between synchronizations) and
``--out`` another file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.data.batches import build_dataset  # noqa: E402
from parallel4d.distributed.mesh import init_mesh  # noqa: E402
from parallel4d.engine.compose import compose  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
JOB = {"model": {"vocab_size": 256, "seq_len": 128, "hidden": 256, "heads": 8, "layers": 4},
       "data": {"source": "synthetic", "batch_size": 8},
       "optimizer": {"lr": 1e-3, "warmup_steps": 2},
       "train": {"dtype": "float32", "steps": 1000, "device": "cpu"}, "checkpoint": {"enabled": False}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Job:
    """One engine of the job and its batches; :meth:`step` returns (seconds, loss)."""

    def __init__(self, overrides: list[str], mode: str):
        self.cfg = make_config(JOB, [*overrides, f"train.compile={mode}"])
        p = self.cfg.parallel
        self.engine = compose(self.cfg, init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp))
        self.data, self.n = build_dataset(self.cfg), 0

    def step(self) -> tuple[float, float]:
        batch = self.data.batch(self.n)
        _sync(self.engine.device)
        start = time.perf_counter()
        loss = self.engine.train_step(*batch)
        _sync(self.engine.device)
        seconds = time.perf_counter() - start
        self.n += 1
        return seconds, float(loss)


def measure(overrides: list[str], steps: int, warmup: int) -> dict:
    jobs = {mode: Job(overrides, mode) for mode in ("none", "blocks")}
    first = {mode: job.step() for mode, job in jobs.items()}  # the compiled job compiles here
    for _ in range(warmup - 1):
        for job in jobs.values():
            job.step()
    times = {mode: [] for mode in jobs}
    losses = {mode: [] for mode in jobs}
    for _ in range(steps):
        for mode, job in jobs.items():
            seconds, loss = job.step()
            times[mode].append(seconds)
            losses[mode].append(loss)
    cfg = jobs["none"].cfg
    tokens = cfg.data.batch_size * cfg.model.seq_len
    out = {"config": {"model": cfg.model.model_dump(include={"arch", "vocab_size", "seq_len", "hidden", "heads",
                                                             "layers", "mlp_ratio"}),
                      "parallel": cfg.parallel.model_dump(), "batch_size": cfg.data.batch_size,
                      "dtype": cfg.train.dtype, "activation_checkpointing": cfg.train.activation_checkpointing,
                      "device": str(jobs["none"].engine.device), "overrides": overrides,
                      "warmup_steps": warmup, "timed_steps": steps},
           "compile_s": first["blocks"][0] - first["none"][0]}
    for mode, label in (("none", "eager"), ("blocks", "compiled")):
        med = statistics.median(times[mode])
        out[label] = {"median_step_ms": 1e3 * med, "mean_step_ms": 1e3 * statistics.fmean(times[mode]),
                      "min_step_ms": 1e3 * min(times[mode]), "tokens_per_s": tokens / med,
                      "first_step_s": first[mode][0], "last_loss": losses[mode][-1]}
    out["speedup"] = out["eager"]["median_step_ms"] / out["compiled"]["median_step_ms"]
    out["max_loss_difference"] = max(abs(a - b) for a, b in zip(losses["none"], losses["blocks"]))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each job (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each job; the first compiles")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                    help="a config override, e.g. --set model.layers=8 (repeatable)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "compile_blocks.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{tmp}/rendezvous",
                                rank=0, world_size=1)
        try:
            result = measure([f"train.device={args.device}", *args.overrides], args.steps, args.warmup)
        finally:
            dist.destroy_process_group()
    device = result["config"]["device"]
    result = {"benchmark": "compile_blocks",
              "device": (torch.cuda.get_device_name(0) if device.startswith("cuda")
                         else f"cpu ({platform.machine()}, {os.cpu_count()} cores)") + ", 1 process",
              "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
              "backend": "inductor", "load_average_1min": os.getloadavg()[0], **result}
    c = result["config"]
    m = c["model"]
    print(f"train.compile: blocks vs none — {m['layers']} layers, hidden {m['hidden']}, seq {m['seq_len']}, "
          f"batch {c['batch_size']}, {c['dtype']}, {result['device']}, torch {result['torch']}, "
          f"{result['threads']} threads; {c['timed_steps']} timed steps each after {c['warmup_steps']} warm-up")
    print(f"{'':10} {'median step':>12} {'mean step':>10} {'tokens/s':>10} {'first step':>11} {'last loss':>10}")
    for label in ("eager", "compiled"):
        r = result[label]
        print(f"{label:10} {r['median_step_ms']:9.1f} ms {r['mean_step_ms']:7.1f} ms {r['tokens_per_s']:10.0f} "
              f"{r['first_step_s']:9.2f} s {r['last_loss']:10.4f}")
    print(f"speed-up {result['speedup']:.2f}x (eager median / compiled median); compiling took "
          f"{result['compile_s']:.1f} s; largest loss difference {result['max_loss_difference']:.2e}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
