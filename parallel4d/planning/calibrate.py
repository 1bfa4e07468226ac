"""``parallel4d plan --calibrate``: a :class:`.profiles.Profile` of the machine this runs on.

Each op kind is timed at sizes from tiny to large with the torch threads a rank gets, and its
``latency_s`` and ``peak`` fitted to ``t = latency + work / peak`` (least squares on relative error,
so the small ops weigh as much as the large). Ops are timed as training runs them — forward and
backward through autograd, from Python — so their dispatch is in the latency. The link between
two ranks is a gloo ping-pong between two worker processes (the same fit over message sizes). With
``ranks`` > 1 the ops are timed in that many processes at once, as a job's ranks share the host; the
engine's own Python per op is what a tiny job's measured step has beyond its ops' predicted time.
Nothing here reads the job being planned (only its dtypes and rank count): the rates are the
machine's, the work is the job's.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel4d.config.load import make_config
from parallel4d.config.rules.job import local_ranks
from parallel4d.config.schema import Config
from parallel4d.distributed.mesh import init_mesh
from parallel4d.distributed.startup import worker_threads
from parallel4d.engine.compose import compose
from parallel4d.engine.model import TORCH_DTYPES
from parallel4d.launcher.spawn import spawn
from parallel4d.planning.dry_run import plan
from parallel4d.planning.profiles import Link, Profile, Rate

MATMUL_SIZES = [(32, 64), (128, 128), (256, 256), (1024, 256), (512, 512), (2048, 512), (1024, 1024)]  # (m, k = n)
ATTENTION_SIZES = [(1, 2, 64, 32), (2, 4, 128, 64), (4, 4, 256, 64), (4, 8, 512, 64), (2, 8, 1024, 64)]
MEMORY_SIZES = [2**10, 2**13, 2**16, 2**19, 2**22]
MESSAGE_SIZES = [2**8, 2**12, 2**16, 2**20, 2**22]
CHAIN = 8  # ops in one timed graph: the backward's start is shared, as in a step's


def _median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(latency, peak)`` of ``t = latency + work / peak`` through ``(work, seconds)`` points, weighing
    each by ``1/t²`` (relative error); latency ≥ 0."""
    w = [1 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * y for wi, (_, y) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    latency = (sy - slope * sx) / sw
    if latency < 0:  # through the origin
        latency, slope = 0.0, sxy / sxx
    return latency, 1 / slope


def _chain_seconds(first: torch.Tensor, step, g: torch.Tensor, repeats: int) -> float:
    """Seconds per op of :data:`CHAIN` applications of ``step`` forward and backward (2·CHAIN ops
    and, for a product, 3·CHAIN)."""
    def run():
        y = first
        for i in range(CHAIN):
            y = step(y, i)
        y.backward(g)

    return _median_seconds(run, repeats)


def matmul_rate(dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Products of ``2·m·k·k`` FLOPs, forward and both backward products."""
    points = []
    for m, k in MATMUL_SIZES:
        x = torch.randn(m, k, dtype=dtype, requires_grad=True)
        ws = [(torch.randn(k, k, dtype=dtype) / k**0.5).requires_grad_() for _ in range(CHAIN)]
        seconds = _chain_seconds(x, lambda y, i: y @ ws[i], torch.randn(m, k, dtype=dtype), repeats)
        points.append((2.0 * m * k * k, seconds / (3 * CHAIN)))
    return fit(points)


def attention_rate(dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Causal SDPA forward (``2·b·h·s²·d`` FLOPs, as :mod:`.trace` counts) and backward (2.5×)."""
    points = []
    for b, h, s, d in ATTENTION_SIZES:
        q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
        seconds = _chain_seconds(q, lambda y, i: F.scaled_dot_product_attention(y, y, y, is_causal=True),
                                 torch.randn(b, h, s, d, dtype=dtype), repeats)
        points.append((4.0 * b * h * s * s * d / 2 * 3.5 / 2, seconds / (2 * CHAIN)))  # per op
    return fit(points)


def memory_rate(dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """An elementwise product forward and backward (each pass reads two tensors and writes one)."""
    points = []
    for n in MEMORY_SIZES:
        x = torch.randn(n, dtype=dtype, requires_grad=True)
        cs = [torch.rand(n, dtype=dtype) + 0.5 for _ in range(CHAIN)]
        seconds = _chain_seconds(x, lambda y, i: y * cs[i], torch.randn(n, dtype=dtype), repeats)
        points.append((3.0 * n * x.element_size(), seconds / (2 * CHAIN)))
    return fit(points)


def view_latency(repeats: int) -> float:
    x = torch.randn(8, 8, requires_grad=True)
    steps = 100

    def run():
        y = x
        for _ in range(steps):
            y = y.view(64).view(8, 8)
        return y

    return _median_seconds(run, repeats) / (2 * steps)


def _ping_pong(sizes: list[int], repeats: int) -> list[tuple[float, float]]:
    rank, points = dist.get_rank(), []
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32)

        def run():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        dist.barrier()
        points.append((float(n), _median_seconds(run, repeats) / 2))
    return points


def link(repeats: int) -> Link:
    """Two worker processes on this machine (gloo, one thread each): one message's latency and bandwidth."""
    points = spawn(_ping_pong, 2, (MESSAGE_SIZES, repeats), timeout_s=300)[0]
    latency, bandwidth = fit(points)
    return Link(bandwidth, latency)


# a job whose step is all overhead: a few thousand tiny ops (not any job the benchmark compares)
TINY_JOB = {"model": {"arch": "gpt2", "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
            "data": {"source": "synthetic", "batch_size": 2}, "parallel": {}, "train": {"steps": 1}}


def _engine_step(job: dict, threads: int, warmup: int, steps: int) -> float:
    """One rank: the median of ``steps`` timed train steps of ``job`` after ``warmup``."""
    torch.set_num_threads(threads)
    cfg = make_config(job)
    mesh = init_mesh(1, 1, 1, 1, timeout_s=cfg.train.timeout_s)
    engine = compose(cfg, mesh)
    tokens = torch.randint(cfg.model.vocab_size, (cfg.data.batch_size, cfg.model.seq_len))
    times = []
    for _ in range(warmup + steps):
        t = time.perf_counter()
        float(engine.train_step(tokens, tokens))
        times.append(time.perf_counter() - t)
    engine.close()
    return statistics.median(times[warmup:])


def op_overhead(profile: Profile, dtype: torch.dtype, threads: int, repeats: int) -> float:
    """The engine's Python per op, beyond what the op microbenchmarks time: a tiny job's measured step
    less its ops at ``profile``'s rates, over its op count."""
    job = {**TINY_JOB, "train": {**TINY_JOB["train"], "dtype": str(dtype).removeprefix("torch.")}}
    measured = spawn(_engine_step, 1, (job, threads, 3, repeats), timeout_s=300)[0]
    ops = plan(make_config(job), timed=True)[0].ops
    predicted = sum(profile.op_seconds(op) * n for op, n in ops.items())
    return max(0.0, (measured - predicted) / sum(ops.values()))


def _op_rates(dtypes: list[torch.dtype], threads: int, repeats: int) -> dict[str, Rate]:
    """Each op kind's :class:`Rate`, timed with ``threads`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        mm = {n: matmul_rate(d, repeats) for n, d in zip(names, dtypes)}
        att = {n: attention_rate(d, repeats) for n, d in zip(names, dtypes)}
        mem = memory_rate(dtypes[0], repeats)
        view = view_latency(repeats)
    finally:
        torch.set_num_threads(before)
    first = names[0]
    return {"matmul": Rate(mm[first][0], {n: v[1] for n, v in mm.items()}),
            "attention": Rate(att[first][0], {n: v[1] for n, v in att.items()}),
            "memory": Rate(mem[0], mem[1]), "view": Rate(view)}


def calibrate(dtypes: list[torch.dtype], threads: int, repeats: int = 15, ranks: int = 1) -> Profile:
    """This machine's profile, every op timed with ``threads`` torch threads (a rank's) while ``ranks`` ranks
    time theirs at once (a job's ranks on one host share its memory bandwidth and caches: the rates one of
    them gets, not one alone)."""
    if ranks > 1:
        rates = spawn(_op_rates, ranks, (dtypes, threads, repeats), timeout_s=900, threads_per_worker=threads)[0]
    else:
        rates = _op_rates(dtypes, threads, repeats)
    wire = link(repeats)
    found = Profile(f"calibrated {os.uname().nodename}" + (f" ({ranks} ranks at once)" if ranks > 1 else ""), None,
                    rates, {"memory": rates["memory"]}, rates["memory"].peak, os.cpu_count() or 1,
                    {"node": wire, "network": wire}, threads)
    return replace(found, op_overhead_s=op_overhead(found, dtypes[0], threads, repeats))


def calibrate_for(cfg: Config) -> Profile:
    """This machine's profile for ``cfg``: its parameter and autocast dtypes, the threads one of its ranks gets,
    as many ranks at once as it runs here (at most the cores)."""
    dtypes = list(dict.fromkeys(TORCH_DTYPES[d] for d in (cfg.train.parameters, cfg.train.autocast) if d != "none"))
    here = local_ranks(cfg)
    return calibrate(dtypes, worker_threads(cfg), ranks=max(1, min(here, os.cpu_count() or 1)))
