"""``benchmarks/pipeline.py --emulate``: every schedule on the real executor and real gloo p2p,
with each chunk's F, B and W replaced by sleeps of known length, against the simulator.

A rank-stage's forward, input-gradient and weight-gradient each sleep ``--unit`` seconds, so a
chunk sleeps ``unit / chunks per rank`` for each (the same model, cut finer); a schedule that does
not split the backward sleeps B + W in its backward. Sleeping ranks leave the cores free, so P = 4
and 8 run on a 2-core machine and time only the schedule, the transfers and the executor.

The simulator gets the same costs (:func:`action_cost`) and the per-hop latency measured by a
ping-pong of one activation between pp ranks 0 and 1; the measured step (from the first rank's
start to the last rank's end, after a barrier) is compared with its makespan.

Chunk 0's input is token ids, which need no gradient: under a split backward its B has nothing to
compute and its W is the whole backward (pipeline/split_grad.py); :func:`action_cost` says so.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

from parallel4d.tensor2d.summa import _wanted  # which halves of a backward this pass asks for
from pipeline import SCHEDULES as UNSPLIT

SCHEDULES = UNSPLIT + [  # pipeline.py's, and the ones that split the backward
    ("zb_h1", "zb_h1", {}),
    ("zbv", "zbv", {}),
    ("hanayo(W=1, split)", "hanayo", {"waves": 1, "split_backward": True}),
    ("hanayo(W=2, split)", "hanayo", {"waves": 2, "split_backward": True}),
]
ROWS, SEQ, HIDDEN, VOCAB = 2, 8, 16, 32  # the activation is tiny: sleeps are the work


class _Sleeps(torch.autograd.Function):
    """``y = x + w``; forward sleeps ``f``; the backward sleeps ``b`` for x's gradient and ``wt`` for
    w's, each only when this pass asks for it (a split schedule asks in two passes)."""

    @staticmethod
    def forward(ctx, x, w, f, b, wt):
        ctx.b, ctx.wt = b, wt
        time.sleep(f)
        return x + w

    @staticmethod
    def backward(ctx, g):
        dx = dw = None
        if _wanted(ctx, 0):
            time.sleep(ctx.b)
            dx = g
        if _wanted(ctx, 1):
            time.sleep(ctx.wt)
            dw = g.sum(dim=(0, 1))
        return dx, dw, None, None, None


class SleepChunk(nn.Module):
    """One emulated chunk; chunk 0 first looks its tokens up in a table (a weight, no input gradient)."""

    def __init__(self, first: bool, seconds: float):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(VOCAB, HIDDEN)) if first else None
        self.w = nn.Parameter(torch.zeros(HIDDEN))
        self.seconds = seconds

    def forward(self, x):
        if self.table is not None:
            x = self.table[x]
        return _Sleeps.apply(x, self.w, self.seconds, self.seconds, self.seconds)


def action_cost(schedule, unit: float):
    """Each action's sleep: ``unit / chunks per rank`` for F, B and W; B + W for an unsplit B;
    under a split backward, chunk 0's B is free and its W both."""
    c = unit / schedule.chunks_per_rank
    split = schedule.split_backward

    def cost(a) -> float:
        if a.kind == "F":
            return c
        if not split:
            return 2 * c
        if a.chunk == 0:
            return 0.0 if a.kind == "B" else 2 * c
        return c

    return cost


def _hop_latency(mesh, rounds: int = 40) -> float:
    """One-way time of one activation between pp ranks 0 and 1 (median of ``rounds`` ping-pongs)."""
    import torch.distributed as dist

    me, group = mesh.rank("pp"), mesh.group("pp")
    peer = mesh.global_rank("pp", 1 - me) if me < 2 else None
    buf = torch.zeros(ROWS, SEQ, HIDDEN)
    trips = []
    dist.barrier(group=group)
    if peer is not None:
        for _ in range(rounds):
            t0 = time.perf_counter()
            if me == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            trips.append(time.perf_counter() - t0)
    lat = torch.tensor([statistics.median(trips) / 2 if trips else 0.0], dtype=torch.float64)
    dist.broadcast(lat, mesh.global_rank("pp", 0), group=group)
    return float(lat.item())


def worker(pp: int, ms: list[int], unit: float, steps: int, only: list[str] | None = None) -> dict:
    """One pp rank: the hop latency, then every (schedule, m) with one warm-up and ``steps`` timed
    steps (``only``: the schedules with these labels)."""
    import torch.distributed as dist

    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.pipeline import PipelineExecutor, make_schedule

    torch.set_num_threads(1)
    mesh = init_mesh(pp=pp)
    me = mesh.rank("pp")
    hop = _hop_latency(mesh)
    g = torch.Generator().manual_seed(1)
    out = []
    for label, name, kw in SCHEDULES:
        if only and label not in only:
            continue
        for m in ms:
            sched = make_schedule(name, pp, m, **kw)
            seconds = unit / sched.chunks_per_rank
            chunks = {c: SleepChunk(c == 0, seconds) for c in sched.placement[me]}
            ex = PipelineExecutor(sched, mesh, chunks, lambda y, t: y.mean(), (ROWS, SEQ, HIDDEN), torch.float32,
                                  timeout_s=600)
            tokens = torch.randint(0, VOCAB, (m * ROWS, SEQ), generator=g)
            runs = []
            for k in range(steps + 1):  # the first step warms up the p2p connections
                dist.barrier(group=mesh.group("pp"))
                t0 = time.perf_counter()
                res = ex.step(list(tokens.chunk(m)), list(tokens.chunk(m)))
                t1 = time.perf_counter()
                if k:
                    runs.append(dict(t0=t0, t1=t1, peak=res.peak_activations,
                                     trace=[(a.kind, a.microbatch, a.chunk, s, e) for (a, s, e) in res.trace]))
            out.append(dict(label=label, name=name, kw=kw, m=m, runs=runs))
    return dict(hop=hop, results=out)


def summarise(pp: int, per_rank: list[dict], unit: float, png_case: tuple | None, png_path: str | None) -> list[dict]:
    """One row per (schedule, m): median measured step, the simulated makespan at the measured hop
    latency, their ratio, and the peaks (measured = simulated, checked)."""
    from parallel4d.pipeline import Action, make_schedule, simulate
    from parallel4d.pipeline.plot import plot_against_simulation

    hop = per_rank[0]["hop"]
    rows = []
    for k, first in enumerate(per_rank[0]["results"]):
        label, m = first["label"], first["m"]
        sched = make_schedule(first["name"], pp, m, **first["kw"])
        sim = simulate(sched, p2p_cost=hop, action_cost=action_cost(sched, unit))
        steps = []
        for j in range(len(first["runs"])):
            runs = [r["results"][k]["runs"][j] for r in per_rank]
            steps.append((max(x["t1"] for x in runs) - min(x["t0"] for x in runs), runs))
        step_s, runs = sorted(steps, key=lambda s: s[0])[len(steps) // 2]
        peaks = [x["peak"] for x in runs]
        rows.append(dict(P=pp, schedule=label, m=m, chunks=sched.num_chunks, step_s=step_s,
                         sim_step_s=sim.makespan, ratio=step_s / sim.makespan, hop_s=hop,
                         sim_bubble=sim.bubble_ratio, peak_activations=peaks,
                         peaks_equal=peaks == sim.peak_activations))
        if png_path and (label, m) == png_case:
            timings = {r: [(Action(a[0], a[1], a[2]), a[3], a[4]) for a in x["trace"]] for r, x in enumerate(runs)}
            plot_against_simulation(sched, png_path, timings, p2p_cost=hop, action_cost=action_cost(sched, unit),
                                    title=f"{label}, P={pp}, m={m}: measured (sleeps of {unit * 1e3:.0f} ms per "
                                          f"stage action, gloo p2p) against simulated (hop {hop * 1e6:.0f} µs)")
            rows[-1]["png"] = png_path
    return rows
