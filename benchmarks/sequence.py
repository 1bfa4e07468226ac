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

GPU (the issue's setting): ``python benchmarks/sequence.py`` → s 16k/32k, heads 32, d 128,
bf16, causal and not, N 4 and 8, block kernels cudnn and flash.
CPU smoke run: ``python benchmarks/sequence.py --quick`` → tiny sizes, fp32, CPU kernels
(numbers labelled CPU; they say nothing about GPUs).

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

from parallel4d.sequence import causal_balance
from parallel4d.sequence.emulate import ring_backward, ring_forward, shard, unshard
from parallel4d.sequence.kernels import merge_

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


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


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
    ap.add_argument("--compile-merge", action="store_true", help="also time a torch.compile'd (fused) merge")
    ap.add_argument("--ulysses", type=int, nargs="+", default=[1],
                    help="Ulysses group sizes U (1: the ring alone; U = N: pure Ulysses; between: hybrid); "
                         "those not dividing N or the heads are skipped")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sequence_<device>.json)")
    args = ap.parse_args(argv)

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
    merges = {"eager": merge_}
    if args.compile_merge:
        merges["compiled"] = torch.compile(merge_, dynamic=True)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

    rows = []
    hdr = (f"{'s':>6} {'causal':>6} {'N':>3} {'U':>3} {'blocks':>9} {'merge':>8} | {'mono':>9} {'mono fwd':>9} "
           f"{'mono f+b':>9} | {'ring fwd':>9} {'ring f+b':>9} | {'x fwd':>6} {'x f+b':>6} | {'rel err':>8}")
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
            for n, u, blk, (merge_name, merge) in itertools.product(rings, args.ulysses, blocks, merges.items()):
                if n % u or heads % u:
                    continue
                try:
                    out, r_fwd, r_fb = time_ring(q, k, v, do, causal, n, blk, args, merge, u)
                except (RuntimeError, ValueError) as e:
                    print(f"  (ring blocks {blk} failed: {str(e).splitlines()[0][:100]})")
                    continue
                row = dict(seq=s, causal=causal, ring=n, ulysses=u, layout="zigzag" if causal else "contiguous",
                           blocks=blk, merge=merge_name, mono_backend=best, mono_fwd_ms=m_fwd,
                           mono_fwd_bwd_ms=m_fb, ring_fwd_ms=r_fwd, ring_fwd_bwd_ms=r_fb,
                           ratio_fwd=r_fwd / m_fwd, ratio_fwd_bwd=r_fb / m_fb,
                           out_rel_err_vs_mono=rel_err(out, ref_out),
                           mono_backends_ms={m: [mono[m][1], mono[m][2]] for m in mono},
                           mono_rel_diff_between_backends=mono_diffs)
                rows.append(row)
                print(f"{s:>6} {str(causal):>6} {n:>3} {u:>3} {blk:>9} {merge_name:>8} | {best:>9} {m_fwd:>9.3f} "
                      f"{m_fb:>9.3f} | {r_fwd:>9.3f} {r_fb:>9.3f} | {row['ratio_fwd']:>6.2f} "
                      f"{row['ratio_fwd_bwd']:>6.2f} | {row['out_rel_err_vs_mono']:>8.1e}")
            del q, k, v, do, mono, ref_out
    target = [r for r in rows if r["seq"] == 32768 and r["ring"] == 8 and r["causal"]]
    if target:
        best_row = min(target, key=lambda r: r["ratio_fwd_bwd"])
        verdict = "meets" if best_row["ratio_fwd_bwd"] <= 1.20 else "misses"
        print(f"target (N=8, s=32k, causal, fwd+bwd <= 1.20x): best {best_row['ratio_fwd_bwd']:.2f}x "
              f"({best_row['blocks']} blocks, {best_row['merge']} merge) -> {verdict}")
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
        rows=rows,
    )
    path = args.out or os.path.join(RESULTS, f"sequence_{'cpu_quick' if device.type == 'cpu' else 'gpu'}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
