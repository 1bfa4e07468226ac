"""hetero's host updates beside the training thread, on the CPU: the overlapped step against the sum of its parts.

A host-optimizer-bound job: a GPT with many parameters and few tokens per step (``--hidden``, ``--layers``,
``--seq``, ``--batch``) under ``parallel4d.hetero`` on the CPU compute device with 16-bit chunks (bf16
compute copy and gradients, float32 master parameters and Adam moments). Its static device budget is exactly
the compute chunks' arena, so no row's master state fits on the "device": every row's AdamW update is a host
update, stepped from the gradient's host backing by hetero's single-tensor arithmetic (its default on a CPU
compute device; ``--host-optimizer fused``: torch's fused CPU AdamW, what a GPU job's host rows run). The
update is then the largest part of the step.

Two modes (three with ``--all-threads``) take turns on the one model, in rounds (the order reversed every
other round so that drift falls on all alike); a round's step is its steady state: ``--steps-per-round``
steps timed from the start of the round's second step to the start of its last (so each timed window holds
as many updates as forward and backward passes), medians over the rounds:

* ``overlapped``: the host updates on hetero's worker thread (``model._hetero_runtime.updates``), row by row
  in forward order, while the training thread goes on into the next forward (its use of row *i* waits for
  row *i*'s update);
* ``in_backward``: the same worker, each row handed over in the backward once its last gradient is written
  (``opt.update_in_backward()``, what the engine does without clipping or a float16 loss scale), so the
  updates can hide behind the rest of the backward as well;
* ``sequential``: ``updates.inline = True``, the same updates one after another on the training thread
  inside ``opt.step()`` (bit-identical results); its parts are timed apart: forward + backward, and the
  host updates (``stats()["host_update_seconds"]``). Their sum is what the overlap hides from;
* ``sequential_all_threads`` (``--all-threads``): the same, with the worker's threads given to the training
  thread too — what a job without the worker could use of the machine. On cores other processes share,
  an OpenMP team of several threads can wait on a descheduled member for a long time: 2 threads on 2 busy
  cores took 1.7–3.4 s per step here (against 0.2 s with 1).

``--threads`` (default: half the cores, at least 1) is ``torch.set_num_threads`` of the training thread and
so of the worker's kernels too: the overlapped mode keeps ``2 × threads`` cores busy at most, the sequential
mode ``threads`` (``--all-threads``: ``2 × threads``). In the ``overlapped`` mode the updates are submitted at
``opt.step()`` and the next forward needs each row's before it uses the row, so they can hide behind that forward only: the best
overlapped step is ``max(forward, update) + backward`` (and the step's own work), and only with a core free
for the worker. On 2 cores other processes share, the worker and the training thread slow each other down.

Prints a table and writes ``benchmarks/results/hetero_overlap.json`` (CPU, cores, load average, torch,
threads, config, each mode's medians, the derived ratios).

Usage: ``python benchmarks/hetero_overlap.py [--rounds 6] [--steps-per-round 4] [--threads N] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from parallel4d.hetero import wrap
from parallel4d.models.gpt2.model import GPTShape, build_gpt

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("overlapped", "in_backward", "sequential")
ALL_THREADS = "sequential_all_threads"  # --all-threads


def shape_of(args) -> GPTShape:
    return GPTShape(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden, heads=args.heads,
                    layers=args.layers, tie_embeddings=False)


def hetero_model(args, budget: int | None):
    """The seeded GPT wrapped by hetero on the CPU: bf16 chunks, float32 master, ``budget`` bytes."""
    model = build_gpt(shape_of(args), seed=0)
    hetero = {"compute_device": "cpu", "device_budget_bytes": budget, "chunk_elems": args.chunk_elems}
    return wrap(model, {"name": "adamw", "lr": 1e-4, "weight_decay": 0.01}, hetero, compute_dtype=torch.bfloat16)


def chunks_only_budget(args) -> int:
    """The compute chunks' bytes (every chunk resident, nothing left for a row's master state), read from a
    throwaway wrap without a budget."""
    model, opt = hetero_model(args, None)
    budget = opt.stats()["model_data_bytes"]
    opt.remove_hooks()
    return budget


def batches(args):
    g = torch.Generator().manual_seed(0)
    while True:
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        yield x, torch.roll(x, -1, dims=1)


def train_step(model, opt, x, y) -> tuple[float, float, float]:
    """One step; ``(forward, backward, opt.step + zero_grad)`` seconds."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        loss = model(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def run_round(model, opt, data, mode: str, steps: int, threads: int) -> dict:
    """``steps + 2`` steps in ``mode``, timed from the start of the second to the start of the last: ``steps``
    whole steps of steady state (the first one's updates overlap the window's first forward, the window's
    last updates the forward after it). Per step: the wall time, forward+backward and opt.step (means over
    the window), and the host updates' own time (over the round)."""
    updates = model._hetero_runtime.updates
    updates.inline = mode not in ("overlapped", "in_backward")
    opt.update_in_backward(mode == "in_backward")  # no clipping here: a row's update may start in the backward
    torch.set_num_threads(2 * threads if mode == "sequential_all_threads" else threads)
    before = opt.stats()["host_update_seconds"]
    starts, parts = [], []
    for _ in range(steps + 2):
        starts.append(time.perf_counter())
        parts.append(train_step(model, opt, *next(data)))
    updates.wait_all()
    window = parts[1:-1]
    fwd, bwd, opt_step = (statistics.mean(p[k] for p in window) for k in range(3))
    return {"step_s": (starts[-1] - starts[1]) / steps, "forward_s": fwd, "backward_s": bwd, "fwd_bwd_s": fwd + bwd,
            "opt_step_s": opt_step, "host_update_s": (opt.stats()["host_update_seconds"] - before) / (steps + 2)}


def measure(args) -> dict:
    modes = MODES + ((ALL_THREADS,) if args.all_threads else ())
    budget = chunks_only_budget(args)
    model, opt = hetero_model(args, budget)
    rt = model._hetero_runtime
    if args.host_optimizer:
        rt.host_optimizer = args.host_optimizer
    data = batches(args)
    for mode in modes:  # warm-up: the first step traces and places the master rows (the worker starts with
        run_round(model, opt, data, mode, 1, args.threads)  # `threads` threads: overlapped comes first)
    st = opt.stats()
    if st["optimizer_rows_on_device"] != 0:
        raise RuntimeError(f"{st['optimizer_rows_on_device']} master rows on the device: the budget left room")
    rounds = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            rounds[mode].append(run_round(model, opt, data, mode, args.steps_per_round, args.threads))
            print(f"  round {r} {mode:<24} {rounds[mode][-1]['step_s']:.3f} s/step", flush=True)
    rt.updates.inline = False
    medians = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in rounds.items()}
    return {"stats": {k: st[k] for k in ("params", "model_data_bytes", "device_budget_bytes", "chunks", "rows",
                                         "optimizer_rows_on_device", "optimizer_rows_on_host",
                                         "optimizer_host_bytes", "host_optimizer", "compute_dtype", "master_dtype")},
            "modes": medians, "rounds": rounds, "derived": derived(medians)}


def derived(m: dict) -> dict:
    """The overlap's figures from the modes' medians. Bounds from the sequential mode's parts: the updates
    overlapping the next forward only (what hetero does: a row's update must end before the forward uses it,
    and all are submitted at ``opt.step()``), and overlapping the backward too (the ideal)."""
    ov, seq = m["overlapped"], m["sequential"]
    upd = seq["host_update_s"]
    rest = max(0.0, seq["opt_step_s"] - upd)  # opt.step's own work beside the updates (gradient write-back, …)
    parts = seq["fwd_bwd_s"] + upd
    return {"sum_of_parts_s": parts,  # forward+backward + host updates, measured apart (sequential mode)
            "bound_updates_beside_forward_s": max(seq["forward_s"], upd) + seq["backward_s"] + rest,
            "bound_updates_beside_forward_and_backward_s": max(seq["fwd_bwd_s"], upd) + rest,
            "speedup_vs_sequential": seq["step_s"] / ov["step_s"],
            "in_backward_speedup_vs_sequential": seq["step_s"] / m["in_backward"]["step_s"],
            "in_backward_speedup_vs_sum_of_parts": parts / m["in_backward"]["step_s"],
            "speedup_vs_sum_of_parts": parts / ov["step_s"],
            **({"speedup_vs_sequential_all_threads": m[ALL_THREADS]["step_s"] / ov["step_s"]}
               if ALL_THREADS in m else {}),
            "host_update_hidden_fraction": (seq["step_s"] - ov["step_s"]) / upd,
            "host_update_share_of_sequential_step": upd / seq["step_s"]}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def table(res: dict) -> list[str]:
    lines = [f"{'mode':<26}{'s/step':>9}{'forward s':>11}{'backward s':>12}{'opt.step s':>12}{'host update s':>15}"]
    for mode, r in res["modes"].items():
        lines.append(f"{mode:<26}{r['step_s']:>9.3f}{r['forward_s']:>11.3f}{r['backward_s']:>12.3f}"
                     f"{r['opt_step_s']:>12.3f}{r['host_update_s']:>15.3f}")
    d = res["derived"]
    lines += [f"sum of the parts (sequential forward+backward + host update): {d['sum_of_parts_s']:.3f} s; best "
              f"overlap beside the forward {d['bound_updates_beside_forward_s']:.3f} s, beside forward and backward "
              f"{d['bound_updates_beside_forward_and_backward_s']:.3f} s",
              f"overlapped step: {d['speedup_vs_sequential']:.2f}× faster than sequential, "
              f"{d['speedup_vs_sum_of_parts']:.2f}× the sum of parts, "
              + (f"{d['speedup_vs_sequential_all_threads']:.2f}× sequential on all threads, "
                 if "speedup_vs_sequential_all_threads" in d else "")
              + f"{100 * d['host_update_hidden_fraction']:.0f} % of the host update hidden",
              f"handed over in the backward: {d['in_backward_speedup_vs_sequential']:.2f}× faster than sequential, "
              f"{d['in_backward_speedup_vs_sum_of_parts']:.2f}× the sum of parts"]
    return lines


def main(argv=None):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--chunk-elems", type=int, default=2**20,
                    help="elements per chunk: the rows the updates overlap the forward by (None: searched)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=4)
    ap.add_argument("--threads", type=int, default=max(1, cores // 2),
                    help="torch.set_num_threads of the training thread (and so of the worker's kernels)")
    ap.add_argument("--host-optimizer", choices=("exact", "fused"), default="exact",
                    help="the host rows' AdamW: hetero's single-tensor arithmetic (its default on a CPU device) or "
                         "torch's fused kernel (what a GPU job's host rows run)")
    ap.add_argument("--all-threads", action="store_true", help="also the sequential order on 2 × threads")
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer rounds (seconds)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "hetero_overlap.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.rounds, args.steps_per_round, args.chunk_elems = 256, 4, 2, 2, 2**18
    load_before = os.getloadavg()
    res = {"benchmark": "hetero_overlap", "device": f"cpu: {cpu_name()}", "cores": cores, "torch": torch.__version__,
           "python": platform.python_version(), "threads": args.threads, "config": vars(args),
           "load_average_before": load_before}
    print(f"GPT h{args.hidden} L{args.layers} vocab {args.vocab}, {args.batch}×{args.seq} tokens, bf16 chunks over a "
          f"float32 master, every row's update on the host; {cores} cores, {args.threads} thread(s) per side",
          flush=True)
    res.update(measure(args))
    res["load_average_after"] = os.getloadavg()
    print("\n".join(table(res)))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
