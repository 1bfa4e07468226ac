"""Local-compute cost of ring attention: all block pairs of a whole ring on one device
versus one monolithic SDPA call of the fastest backend.

For each (s, causal, N) the script runs, on one device, exactly the kernel calls and
LSE merges that the N ranks of a ring perform (``parallel4d.sequence.emulate``: zigzag
layout when causal, contiguous otherwise; one kernel call per zigzag step), forward and
forward+backward, and divides by the time of one SDPA call on the full sequence
(fastest of the available backends, timed here). Communication is not included: this
is the compute ceiling of the ring (the overhead the ring adds even with perfect overlap).

``--ulysses 1 2 8``: the same ranks as Ulysses groups of U around rings of N/U (U = 1 the ring
alone, U = N pure Ulysses): U head groups of h/U heads, each a ring of N/U over the whole sequence —
the block work all N ranks do after the all-to-all.

Each ring row also times the same block kernel calls alone, back to back on inputs cut beforehand
(``g`` columns: the ring over its kernels = the glue's cost — merges, accumulation, row cuts, layout
copies, the host's launches), and the kernels alone over the single call (``kernels_ratio_fwd_bwd``:
what no glue can win back). Issue 47.2's targets (:data:`TARGETS`: causal, N = 8 at 32k 1.25×, at 16k
1.4×, N = 4 1.15×) are printed beside the measured ratios.

GPU (the issue's setting): ``python benchmarks/sequence.py`` → s 16k/32k, heads 32, d 128,
bf16, causal and not, N 4 and 8, block kernels cudnn and flash. ``--ring-check`` (:func:`ring_check`,
what ``make gpu-check`` calls for "the ring at 8 ranks"): only the targets' cases, cuDNN blocks, about
a minute on an H200 → ``results/gpu_sequence_ring.json``. ``--compile-merge``: rows for the eager merge
(the ring's) and the fused one (``kernels.fused_merge``).
CPU smoke run: ``python benchmarks/sequence.py --quick`` → tiny sizes, fp32, CPU kernels
(numbers labelled CPU; they say nothing about GPUs). ``--glue``: the ring's glue on CPU (thread CPU
time, least of alternating rounds, and ops dispatched per block call) → ``results/sequence_glue_cpu.json``
under ``--label``.

Prints a table and writes JSON under ``benchmarks/results/`` (device, torch version, config).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from parallel4d.sequence import causal_balance
from parallel4d.sequence.emulate import ring_backward, ring_forward, shard, unshard
from parallel4d.sequence.kernels import (block_backward, block_forward, default_scale, fused_merge, merge_,
                                         resolve_backend)
from parallel4d.sequence.layout import step_plan

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters: int, warmup: int, min_time_s: float = 0.5) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    t_start = time.perf_counter()
    while len(times) < iters or (time.perf_counter() - t_start < min_time_s and len(times) < 50):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def monolithic_backends(device) -> dict:
    """Name → SDPBackend list to try for the monolithic baseline."""
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    return {"cpu_flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def time_monolithic(q, k, v, do, causal, backend, args):
    from torch.nn.attention import sdpa_kernel

    device = q.device
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def fwd():
        with torch.no_grad(), sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd():
        for x in (ql, kl, vl):
            x.grad = None
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        out.backward(do)

    out = fwd()  # raises if the backend cannot run this case
    return out, timed(fwd, device, args.iters, args.warmup), timed(fwd_bwd, device, args.iters, args.warmup)


def time_ring(q, k, v, do, causal, n, block_backend, args, merge, ulysses: int = 1):
    """All ``n`` ranks' block work on this device: ``ulysses`` head groups (``h/U`` heads each, the
    whole sequence after the all-to-all), each a ring of ``n/U`` (``U = 1``: the ring alone; ``U = n``:
    pure Ulysses, one call per head group over the whole sequence). Communication excluded."""
    device = q.device
    layout = "zigzag" if causal else "contiguous"
    ring = n // ulysses
    groups = [[shard(x, ring, layout) for x in parts]
              for parts in zip(*(x.chunk(ulysses, dim=1) for x in (q, k, v, do)))]

    def fwd():
        return [ring_forward(qs, ks, vs, layout, causal, backend=block_backend, merge=merge)
                for qs, ks, vs, _ in groups]

    def fwd_bwd():
        for qs, ks, vs, dos in groups:
            outs, lses = ring_forward(qs, ks, vs, layout, causal, backend=block_backend, merge=merge)
            ring_backward(dos, qs, ks, vs, outs, lses, layout, causal, backend=block_backend)

    out = torch.cat([unshard(outs, layout) for outs, _ in fwd()], dim=1)
    return out, timed(fwd, device, args.iters, args.warmup), timed(fwd_bwd, device, args.iters, args.warmup)


def ring_kernel_calls(qs, ks, vs, dos, outs, lses, layout: str, causal: bool) -> list[tuple]:
    """Every rank's block calls of one ring pass, each as ``(dout, q, k, v, out, lse, causal)`` rows cut and
    made dense beforehand (``outs``/``lses``: the ring's final result, which the backward takes)."""
    n, L = len(qs), qs[0].shape[2]
    cut = lambda x, lo, hi: x[:, :, lo:hi].contiguous()  # noqa: E731
    return [(cut(dos[r], c.q_lo, c.q_hi), cut(qs[r], c.q_lo, c.q_hi), cut(ks[src], c.k_lo, c.k_hi),
             cut(vs[src], c.k_lo, c.k_hi), cut(outs[r], c.q_lo, c.q_hi), cut(lses[r], c.q_lo, c.q_hi), c.causal)
            for r in range(n) for src in ((r - t) % n for t in range(n))
            for c in step_plan(r, src, n, layout, causal, L)]


def kernels_only(calls, scale: float, backend: str):
    """``(fwd, bwd)``: functions running just the block kernels of :func:`ring_kernel_calls`' calls, back to
    back (no merge, no accumulation, no slicing, no layout copies)."""
    def fwd():
        for _, q, k, v, _, _, causal in calls:
            block_forward(q, k, v, causal, scale, backend)

    def bwd():
        for dout, q, k, v, out, lse, causal in calls:
            block_backward(dout, q, k, v, out, lse, causal, scale, backend)
    return fwd, bwd


def time_ring_kernels(q, k, v, do, causal, n, block_backend, args):
    """The same block kernel calls as :func:`time_ring` (every rank's, zigzag when causal) alone
    (:func:`kernels_only`). The ring's time over this one is its glue's cost (``g`` in the table);
    ``(fwd ms, fwd+bwd ms)``."""
    layout = "zigzag" if causal else "contiguous"
    qs, ks, vs, dos = (shard(x, n, layout) for x in (q, k, v, do))
    outs, lses = ring_forward(qs, ks, vs, layout, causal, backend=block_backend)
    fwd, bwd = kernels_only(ring_kernel_calls(qs, ks, vs, dos, outs, lses, layout, causal),
                            default_scale(q.shape[-1]), resolve_backend(block_backend, qs[0]))

    def fwd_bwd():
        fwd()
        bwd()
    return timed(fwd, q.device, args.iters, args.warmup), timed(fwd_bwd, q.device, args.iters, args.warmup)


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


# Issue 47.2's targets: the ring's blocks (forward + backward, causal zigzag, every rank's on one GPU) over
# one cuDNN call, by (ranks, sequence length).
TARGETS = {(8, 32768): 1.25, (8, 16384): 1.40, (4, 32768): 1.15, (4, 16384): 1.15}


def report_targets(rows) -> list[dict]:
    """Print and return, per target case the rows cover, the best ring (U = 1, causal, the ring's own eager
    merge) ratio beside its target, and the fused merge's where it was timed too."""
    out = []
    for (n, s), target in TARGETS.items():
        cands = [r for r in rows if r["ring"] == n and r["seq"] == s and r["causal"] and r["ulysses"] == 1]
        fused = [r["ratio_fwd_bwd"] for r in cands if r["merge"] == "fused"]
        cands = [r for r in cands if r["merge"] == "eager"]
        if not cands:
            continue
        best = min(cands, key=lambda r: r["ratio_fwd_bwd"])
        ok = best["ratio_fwd_bwd"] <= target
        out.append(dict(ring=n, seq=s, causal=True, target=target, ratio_fwd_bwd=best["ratio_fwd_bwd"],
                        kernels_ratio_fwd_bwd=best["kernels_ratio_fwd_bwd"], glue_fwd_bwd=best["overhead_fwd_bwd"],
                        blocks=best["blocks"], merge=best["merge"], meets=ok,
                        fused_merge_ratio_fwd_bwd=min(fused) if fused else None))
        # the kernels alone over one call say what no glue can win back (then only fewer, larger calls would)
        print(f"target N={n} s={s // 1024}k causal, fwd+bwd <= {target:.2f}x of one call: {best['ratio_fwd_bwd']:.2f}x "
              f"({best['blocks']} blocks, {best['merge']} merge; its kernels alone {best['kernels_ratio_fwd_bwd']:.2f}x, "
              f"glue {best['overhead_fwd_bwd']:.2f}x{f'; fused merge {min(fused):.2f}x' if fused else ''}) -> "
              f"{'meets' if ok else 'misses'}")
    return out


def ring_check(out: str | None = None, compile_merge: bool = False) -> dict:
    """The issue's ring cases only, for ``make gpu-check``: causal zigzag, cuDNN blocks, N = 8 and 4, s = 16k
    and 32k, ratio to one SDPA call with the targets beside (:data:`TARGETS`); writes
    ``results/gpu_sequence_ring.json`` (or ``out``). About a minute on an H200 (estimated from the
    first GPU run's timings: not yet run); ``--compile-merge`` adds the fused merge's rows (its compile,
    about a minute more)."""
    return main(["--ring-check"] + (["--out", out] if out else []) + (["--compile-merge"] if compile_merge else []))


class LaunchCount(TorchDispatchMode):
    """Counts the ops that compute (not views) dispatched while it is on: what a GPU launches (also
    tests/test_sequence.py's count of the ring's ops)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def _cpu_ms(fn, rounds: int) -> float:
    """Least thread CPU time of ``fn()`` over ``rounds`` (other processes on the machine do not count)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        fn()
        best = min(best, (time.thread_time() - t0) * 1e3)
    return best


def glue_case(s: int, heads: int, dim: int, n: int, dtype, rounds: int, merge=merge_) -> dict:
    """One causal zigzag ring of ``n`` on CPU (cpu_flash blocks): its forward and backward against the same
    block kernels alone (:func:`time_ring_kernels`' calls), in thread CPU time, alternating, least of
    ``rounds``; and the ops each dispatches per block call (what a GPU would launch). ``merge``: the LSE merge (the ring's
    by default)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, s, dim, dtype=dtype, generator=g) for _ in range(4))
    layout = "zigzag"
    qs, ks, vs, dos = (shard(x, n, layout) for x in (q, k, v, do))
    outs, lses = ring_forward(qs, ks, vs, layout, True, backend="cpu_flash", merge=merge)
    calls = ring_kernel_calls(qs, ks, vs, dos, outs, lses, layout, True)
    kernels_fwd, kernels_bwd = kernels_only(calls, default_scale(dim), "cpu_flash")
    fns = {"kernels_fwd": kernels_fwd,
           "ring_fwd": lambda: ring_forward(qs, ks, vs, layout, True, backend="cpu_flash", merge=merge),
           "kernels_bwd": kernels_bwd,
           "ring_bwd": lambda: ring_backward(dos, qs, ks, vs, outs, lses, layout, True, backend="cpu_flash")}
    ms = {name: float("inf") for name in fns}
    for _ in range(rounds):  # alternate, so that a busy moment hits both sides
        for name, fn in fns.items():
            ms[name] = min(ms[name], _cpu_ms(fn, 1))
    ops = {}
    for name, fn in fns.items():
        if merge is not merge_ and name.startswith("ring"):  # torch.compile runs under no dispatch mode
            continue
        with LaunchCount() as d:
            fn()
        ops[name] = d.count / len(calls)
    return dict(seq=s, heads=heads, dim=dim, ring=n, dtype=str(dtype), block_calls=len(calls), ms=ms,
                glue_fwd=ms["ring_fwd"] / ms["kernels_fwd"], glue_bwd=ms["ring_bwd"] / ms["kernels_bwd"],
                glue_fwd_bwd=(ms["ring_fwd"] + ms["ring_bwd"]) / (ms["kernels_fwd"] + ms["kernels_bwd"]),
                ops_per_call=ops, glue_ops_per_call=(ops["ring_fwd"] + ops["ring_bwd"] - ops["kernels_fwd"] - ops["kernels_bwd"]
                                                     if "ring_fwd" in ops else None))


GLUE_CASES = [(256, 4, 32, 8), (256, 4, 32, 4), (2048, 8, 64, 8)]  # tiny blocks: the host's share, as a busy GPU's


def glue_main(args) -> dict:
    """``--glue``: :func:`glue_case` over :data:`GLUE_CASES` (bf16, one thread), recorded under ``--label`` in
    ``results/sequence_glue_cpu.json`` (other labels' records kept: before and after a change side by side)."""
    torch.set_num_threads(1)
    rows = []
    print(f"{'s':>5} {'h':>3} {'d':>3} {'N':>3} | {'glue fwd':>8} {'glue bwd':>8} {'glue f+b':>8} | {'glue ops/call':>13}")
    merge = fused_merge() if args.compile_merge else merge_  # --compile-merge: inductor's C++ merge on CPU
    for s, h, d, n in GLUE_CASES:
        r = glue_case(s, h, d, n, torch.bfloat16, rounds=max(args.iters, 9), merge=merge)
        rows.append(r)
        ops = "-" if r["glue_ops_per_call"] is None else f"{r['glue_ops_per_call']:.1f}"
        print(f"{s:>5} {h:>3} {d:>3} {n:>3} | {r['glue_fwd']:>8.3f} {r['glue_bwd']:>8.3f} {r['glue_fwd_bwd']:>8.3f} | "
              f"{ops:>13}")
    path = args.out or os.path.join(RESULTS, "sequence_glue_cpu.json")
    doc = json.load(open(path)) if os.path.exists(path) else dict(
        benchmark="ring attention glue on CPU: ring time over its block kernels' time, ops per block call",
        note=("every rank's calls of a causal zigzag ring on one CPU thread, cpu_flash blocks, bf16 inputs with fp32 "
              "accumulators (the GPU's path); thread CPU time, least of alternating rounds. Not a GPU figure."),
        runs={})
    doc["runs"][args.label] = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                   torch=torch.__version__, rows=rows)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path} ({args.label})")
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU-sized run (proves the script works)")
    ap.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default 16384 32768)")
    ap.add_argument("--ring", type=int, nargs="+", help="ring sizes N (default 4 8)")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--blocks", nargs="+", help="block kernels (default cudnn flash on GPU, cpu_flash math on CPU)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile-merge", action="store_true",
                    help="time both merges, eager and fused (torch.compile'd), not only the one the ring uses here")
    ap.add_argument("--ring-check", action="store_true",
                    help="only the issue's ring cases (causal, cuDNN blocks, N 8 and 4, s 16k and 32k) with targets: "
                         "what make gpu-check runs (about a minute on an H200)")
    ap.add_argument("--glue", action="store_true",
                    help="CPU: the ring's glue (ring time / its block kernels' time), robust timing, into "
                         "results/sequence_glue_cpu.json")
    ap.add_argument("--ulysses", type=int, nargs="+", default=[1],
                    help="Ulysses group sizes U (1: the ring alone; U = N: pure Ulysses; between: hybrid); "
                         "those not dividing N or the heads are skipped")
    ap.add_argument("--label", default="after", help="--glue: the name of this run in the JSON (before/after)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sequence_<device>.json)")
    args = ap.parse_args(argv)
    if args.glue:
        return glue_main(args)
    if args.ring_check:  # the targets' cases (on CPU with --quick: the same path at tiny sizes)
        args.ring, args.causal = args.ring or [8, 4], "yes"
        if not args.quick:
            args.seq, args.blocks = args.seq or sorted({s for _, s in TARGETS}), args.blocks or ["cudnn"]

    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        seqs, rings, heads, dim, dtype = args.seq or [256, 512], args.ring or [2, 4], args.heads or 4, \
            args.dim or 32, torch.float32
        args.iters, args.warmup = min(args.iters, 3), 1
    else:
        seqs, rings, heads, dim = args.seq or [16384, 32768], args.ring or [4, 8], args.heads or 32, args.dim or 128
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    blocks = args.blocks or (["cudnn", "flash"] if device.type == "cuda" else ["cpu_flash", "math"])
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    merges = {"eager": merge_, "fused": fused_merge()} if args.compile_merge else {"eager": merge_}
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

    rows = []
    hdr = (f"{'s':>6} {'causal':>6} {'N':>3} {'U':>3} {'blocks':>9} {'merge':>8} | {'mono':>9} {'mono fwd':>9} "
           f"{'mono f+b':>9} | {'ring fwd':>9} {'ring f+b':>9} | {'x fwd':>6} {'x f+b':>6} | {'g fwd':>5} {'g f+b':>5} | "
           f"{'rel err':>8}")
    print(f"device: {dev_name}; torch {torch.__version__}; dtype {dtype}; b={args.batch} h={heads} d={dim}")
    balance = {n: {lay: causal_balance(n, lay).imbalance for lay in ("zigzag", "contiguous")} for n in rings}
    for n, b in balance.items():
        print(f"causal work imbalance (max/mean per rank), N={n}: zigzag {b['zigzag']:.2f}, "
              f"contiguous {b['contiguous']:.2f}")
    print(hdr)
    print("-" * len(hdr))
    for s in seqs:
        for causal in causals:
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v, do = (torch.randn(args.batch, heads, s, dim, device=device, dtype=dtype, generator=g)
                           for _ in range(4))
            mono = {}
            for name, be in monolithic_backends(device).items():
                try:
                    mono[name] = time_monolithic(q, k, v, do, causal, be, args)
                except RuntimeError as e:  # backend unavailable for this case
                    print(f"  (monolithic {name} unavailable: {str(e).splitlines()[0][:80]})")
            best = min(mono, key=lambda m: mono[m][2])
            ref_out, m_fwd, m_fb = mono[best]
            mono_diffs = {m: rel_err(mono[m][0], ref_out) for m in mono if m != best}
            kernels = {}
            for n, u, blk, (merge_name, merge) in itertools.product(rings, args.ulysses, blocks, merges.items()):
                if n % u or heads % u:
                    continue
                try:
                    out, r_fwd, r_fb = time_ring(q, k, v, do, causal, n, blk, args, merge, u)
                except (RuntimeError, ValueError) as e:
                    print(f"  (ring blocks {blk} failed: {str(e).splitlines()[0][:100]})")
                    continue
                if u == 1 and (n, blk) not in kernels:  # the same calls, whichever merge
                    kernels[(n, blk)] = time_ring_kernels(q, k, v, do, causal, n, blk, args)
                k_fwd, k_fb = kernels.get((n, blk), (float("nan"), float("nan"))) if u == 1 else (float("nan"),) * 2
                row = dict(seq=s, causal=causal, ring=n, ulysses=u, layout="zigzag" if causal else "contiguous",
                           blocks=blk, merge=merge_name, mono_backend=best, mono_fwd_ms=m_fwd,
                           mono_fwd_bwd_ms=m_fb, ring_fwd_ms=r_fwd, ring_fwd_bwd_ms=r_fb,
                           ratio_fwd=r_fwd / m_fwd, ratio_fwd_bwd=r_fb / m_fb,
                           kernels_fwd_ms=k_fwd, kernels_fwd_bwd_ms=k_fb,
                           overhead_fwd=r_fwd / k_fwd, overhead_fwd_bwd=r_fb / k_fb,
                           kernels_ratio_fwd_bwd=k_fb / m_fb,
                           out_rel_err_vs_mono=rel_err(out, ref_out),
                           mono_backends_ms={m: [mono[m][1], mono[m][2]] for m in mono},
                           mono_rel_diff_between_backends=mono_diffs)
                rows.append(row)
                print(f"{s:>6} {str(causal):>6} {n:>3} {u:>3} {blk:>9} {merge_name:>8} | {best:>9} {m_fwd:>9.3f} "
                      f"{m_fb:>9.3f} | {r_fwd:>9.3f} {r_fb:>9.3f} | {row['ratio_fwd']:>6.2f} "
                      f"{row['ratio_fwd_bwd']:>6.2f} | {row['overhead_fwd']:>5.2f} {row['overhead_fwd_bwd']:>5.2f} | "
                      f"{row['out_rel_err_vs_mono']:>8.1e}")
            del q, k, v, do, mono, ref_out
    targets = report_targets(rows)
    result = dict(
        benchmark="sequence ring attention local compute vs monolithic SDPA",
        device=dev_name, device_type=device.type, torch=torch.__version__,
        cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        config=dict(quick=args.quick, seqs=seqs, rings=rings, heads=heads, dim=dim, batch=args.batch,
                    dtype=str(dtype), blocks=blocks, merges=list(merges), iters=args.iters, warmup=args.warmup),
        note=("CPU smoke run: tiny sizes, not comparable with GPU numbers" if device.type == "cpu" else
              "times in ms (median); ratio = ring blockwise work of all N ranks on this one GPU / "
              "one monolithic SDPA call of the fastest backend; communication excluded"),
        causal_imbalance=balance,
        targets=targets,
        rows=rows,
    )
    default = "ring" if args.ring_check else ("cpu_quick" if device.type == "cpu" else "gpu")
    path = args.out or os.path.join(RESULTS, f"sequence_{default}.json" if default != "ring" else "gpu_sequence_ring.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
