"""Heterogeneous memory on one GPU: throughput, largest trainable GPT, copy bandwidth.

For the H100 machine (see ``../shared/reference/gpu_baselines.md`` for the reference
numbers: plain PyTorch 1.42B/b8 412 TFLOP/s, DeepSpeed ZeRO-3 + CPU offload 67 TFLOP/s).
In one run of the script:

1. pinned host↔device bandwidth (CUDA events, 256 MiB copies, median of repeats);
2. GPT 1.4B (h2048, L24, 16 heads, vocab 50304, seq 1024, untied head), micro-batch 8:
   * plain PyTorch: fp32 params on the GPU, bf16 autocast, ``AdamW(fused=True)``;
   * ``parallel4d.hetero`` with everything resident and with a device budget smaller
     than the model data (host offload): bf16 chunks (the compute copy and its gradients), the
     fp32 master and Adam moments on the host, stepped there by torch's fused CPU AdamW;
   * DeepSpeed ZeRO-3 + CPU offload (params and optimizer, pinned) if ``deepspeed`` imports;
   TFLOP/s by the Megatron convention ``6·P_nonemb·T + 12·L·s·h·T`` (P_nonemb includes
   the LM head, excludes the embedding tables);
3. copy bandwidth achieved during chunk moves (bytes / CUDA-event time of the copies) as a
   fraction of the measured pinned bandwidth;
4. the largest GPT (h4096, growing depth, activation checkpointing per block) that trains
   two steps with host offload, each size in a fresh subprocess, with host RSS per parameter.

``--dry-run`` runs every path on the CPU with a tiny model (no GPU numbers: the JSON says
so and goes to a temporary file unless ``--out`` is given). Nothing here invents numbers:
a path that cannot run is reported as skipped with the reason.

Usage: ``python benchmarks/hetero_gpu.py [--dry-run] [--skip-largest] [--budget-frac 0.5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.hetero import wrap  # noqa: E402
from parallel4d.models.gpt2.model import GPTShape, build_gpt  # noqa: E402
from parallel4d.models.stages import cross_entropy  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GB = 1e9


# --- helpers -------------------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def flops_per_step(shape: GPTShape, tokens: int) -> float:
    h, L, s = shape.hidden, shape.layers, shape.seq_len
    per_layer = 4 * h * h + 4 * h + 2 * shape.mlp_ratio * h * h + (shape.mlp_ratio + 1) * h + 4 * h
    p_nonemb = L * per_layer + shape.vocab_size * h + 2 * h  # blocks + LM head + final LayerNorm
    return 6 * p_nonemb * tokens + 12 * L * s * h * tokens


def param_count(shape: GPTShape) -> int:
    h = shape.hidden
    per_layer = 4 * h * h + 4 * h + 2 * shape.mlp_ratio * h * h + (shape.mlp_ratio + 1) * h + 4 * h
    emb = shape.vocab_size * h + shape.seq_len * h
    head = 0 if shape.tie_embeddings else shape.vocab_size * h
    return shape.layers * per_layer + emb + head + 2 * h


def pinned_bandwidth(device, mib=256, repeats=10) -> dict:
    """Median GB/s of pinned H2D and D2H copies of ``mib`` MiB."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    n = mib * 2 ** 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[f"{name}_GBps"] = n / statistics.median(times) / GB
    return out


def batches(shape, batch, device, n):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randint(0, shape.vocab_size, (batch, shape.seq_len), generator=g).to(device)
        yield x, torch.roll(x, -1, dims=1)


def timed_training(step, shape, batch, device, warmup, iters) -> dict:
    times = []
    for i, (x, y) in enumerate(batches(shape, batch, device, warmup + iters)):
        sync(device)
        t = time.perf_counter()
        loss = step(x, y)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    tokens = batch * shape.seq_len
    out = {"step_s_median": med, "step_s_min": min(times), "step_s_max": max(times),
           "tokens_per_s": tokens / med, "TFLOPs": flops_per_step(shape, tokens) / med / 1e12,
           "final_loss": float(loss)}
    if device.type == "cuda":
        out["peak_gpu_alloc_GB"] = torch.cuda.max_memory_allocated(device) / GB
    out["host_rss_peak_GB"] = host_rss_bytes() / GB
    return out


def amp(device, cache: bool = True):
    """bf16 autocast; ``cache=False`` under hetero (its parameters are bf16 already: as the engine runs it)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)


def build_on(shape, device):
    with torch.device(device):
        return build_gpt(shape, seed=0)


# --- the three contenders -------------------------------------------------------------------
def run_plain(shape, batch, device, warmup, iters) -> dict:
    model = build_on(shape, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x, y):
        with amp(device):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out = timed_training(step, shape, batch, device, warmup, iters)
    model = opt = None  # free them before the next contender (the step closure holds them too)
    return out


def run_hetero(shape, batch, device, warmup, iters, budget_bytes, policy="belady", ckpt=False) -> dict:
    model = build_on(shape, device)  # built on the GPU, copied into pinned host chunks by wrap
    if ckpt:  # activation checkpointing per block (the largest models need it for activations)
        from torch.utils.checkpoint import checkpoint
        for blk in model.blocks:
            blk.forward = (lambda f: (lambda x: checkpoint(f, x, use_reentrant=False)))(blk.forward)
    model, opt = wrap(model, dict(name="adamw", lr=1e-4),
                      dict(compute_device=str(device), device_budget_bytes=budget_bytes, policy=policy),
                      compute_dtype=torch.bfloat16)
    mgr = model._hetero_runtime.mgr
    mgr.transfers.profile = device.type == "cuda"

    def step(x, y):
        with amp(device, cache=False):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    out = timed_training(step, shape, batch, device, warmup, iters)
    st = opt.stats()
    last = st["last_iteration"]
    out.update({k: st[k] for k in ("model_data_bytes", "device_budget_bytes", "peak_resident_bytes", "chunk_bytes",
                                   "chunks", "pinned_host", "trace_divergences", "min_feasible_budget_bytes")})
    out["host_optimizer_rows"] = st["host_optimizer_rows"]
    out["prefetches_per_step"] = last["prefetches"]
    out["moved_bytes_per_step"] = last["moved_bytes"]
    out["load_bytes_per_step"] = last["load_bytes"]
    out["writeback_bytes_per_step"] = last["writeback_bytes"]
    if last["copy_seconds"] > 0:
        out["copy_seconds_per_step"] = last["copy_seconds"]
        out["copy_GBps"] = last["moved_bytes"] / last["copy_seconds"] / GB
    out["host_bytes_per_param"] = host_rss_bytes() / param_count(shape)
    model = opt = None  # free them before the next contender (the step closure holds them too)
    return out


def deepspeed_config(batch: int, offload: bool = True) -> dict:
    """ZeRO-3 with parameters and optimizer offloaded to pinned host memory (``offload``), bf16."""
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7, "sub_group_size": 1e9}
    if offload:
        zero.update(offload_param={"device": "cpu", "pin_memory": True},
                    offload_optimizer={"device": "cpu", "pin_memory": True})
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}


def deepspeed_engine(shape, cfg: dict, optimizer=None):
    """DeepSpeed's engine over the GPT with its own seeded initialisation (``build_gpt``, on the host),
    which ZeRO-3 partitions inside ``initialize``. Built under ``deepspeed.zero.Init`` instead, each
    module's parameters are partitioned as soon as it is constructed, so the GPT's initialisation
    writes into empty shards and the weights keep torch's defaults (or garbage: a NaN LM head).
    ``optimizer``: a callable of the parameters (else ``cfg``'s)."""
    import deepspeed

    model = build_gpt(shape, seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                           config=cfg)
    return engine


def run_deepspeed(shape, batch, device, warmup, iters) -> dict:
    try:
        import deepspeed
    except Exception as e:  # not installed here (the GPU machine has no DeepSpeed): say so, never guess a number
        return {"skipped": f"deepspeed not importable: {type(e).__name__}: {e}"}
    if device.type != "cuda":
        return {"skipped": "DeepSpeed ZeRO-3 offload is measured on CUDA only"}
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    deepspeed.init_distributed(dist_backend="nccl")
    engine = deepspeed_engine(shape, deepspeed_config(batch))

    def step(x, y):
        loss = cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    torch.cuda.reset_peak_memory_stats(device)
    out = timed_training(step, shape, batch, device, warmup, iters)
    out["host_bytes_per_param"] = host_rss_bytes() / param_count(shape)
    return out


# --- largest model with host offload ------------------------------------------------------------
def largest(args, device) -> dict:
    """Grow the depth at fixed width; each size trains 2 steps in a fresh process."""
    ladder = [(int(h), int(L)) for h, L in (x.split("x") for x in args.ladder.split(","))]
    tried = []
    for hidden, layers in ladder:
        cmd = [sys.executable, os.path.abspath(__file__), "--single", f"{hidden}x{layers}",
               "--budget-gb", str(args.largest_budget_gb), "--seq", str(args.seq), "--vocab", str(args.vocab),
               "--batch", str(args.largest_batch)] + (["--dry-run"] if args.dry_run else [])
        t = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.single_timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("SINGLE ")]
            # A size the host cannot hold is killed by the kernel (exit -9) before it can say anything.
            res = json.loads(lines[-1][7:]) if lines else {
                "ok": False, "error": f"exit {p.returncode}" + (" (killed: likely host memory)" if p.returncode == -9
                                                                else "") + f"; {(p.stderr or '')[-600:]}"}
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": f"timed out after {args.single_timeout}s"}
        res.update({"hidden": hidden, "layers": layers, "wall_s": time.time() - t})
        tried.append(res)
        print(f"  largest: h{hidden} L{layers}: {'ok' if res.get('ok') else 'FAILED'} "
              f"{res.get('params', 0) / 1e9:.2f}B {res.get('step_s', '')}", flush=True)
        if not res.get("ok"):
            break
    ok = [r for r in tried if r.get("ok")]
    return {"tried": tried, "largest_params": max((r["params"] for r in ok), default=0)}


def single(args, device):
    hidden, layers = (int(v) for v in args.single.split("x"))
    shape = GPTShape(vocab_size=args.vocab, seq_len=args.seq, hidden=hidden, heads=max(1, hidden // 128),
                     layers=layers, tie_embeddings=False)
    budget = int(args.budget_gb * GB) if args.budget_gb > 0 else None
    try:
        r = run_hetero(shape, args.batch, device, warmup=1, iters=1, budget_bytes=budget, ckpt=True)
        print("SINGLE " + json.dumps({"ok": True, "params": param_count(shape), "step_s": r["step_s_median"],
                                      "TFLOPs": r["TFLOPs"], "host_bytes_per_param": r["host_bytes_per_param"],
                                      "peak_gpu_alloc_GB": r.get("peak_gpu_alloc_GB"),
                                      "model_data_bytes": r["model_data_bytes"]}), flush=True)
    except Exception as e:
        print("SINGLE " + json.dumps({"ok": False, "params": param_count(shape),
                                      "error": f"{type(e).__name__}: {str(e)[:400]}"}), flush=True)


# --- main -------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: exercise every path, no GPU numbers")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-frac", type=float, default=0.5, help="offload run: budget = frac · model data")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--skip-largest", action="store_true")
    ap.add_argument("--ladder", default="4096x16,4096x24,4096x32,4096x34,4096x36,4096x40",
                    help="hidden x layers to try in order (h4096: L32 ≈ 6.9B, L34 ≈ 7.3B, L36 ≈ 7.7B)")
    ap.add_argument("--largest-budget-gb", type=float, default=40.0)
    ap.add_argument("--largest-batch", type=int, default=8)
    ap.add_argument("--single-timeout", type=int, default=900)
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget-gb", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    if args.dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        if args.single is None:
            args.hidden, args.layers, args.heads, args.vocab, args.seq, args.batch = 64, 2, 4, 256, 32, 2
            args.warmup, args.iters = 1, 2
            args.ladder, args.largest_budget_gb, args.largest_batch = "64x2,64x4", 0.002, 2
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run on the GPU machine, or use --dry-run to check the script on the CPU")
        device = torch.device("cuda", torch.cuda.current_device())
    if args.single is not None:
        return single(args, device)

    shape = GPTShape(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden, heads=args.heads,
                     layers=args.layers, tie_embeddings=False)
    n_params = param_count(shape)
    res = {"benchmark": "hetero_gpu", "dry_run": args.dry_run,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run, not GPU numbers)",
           "torch": torch.__version__, "python": platform.python_version(), "config": vars(args),
           "params": n_params, "flops_per_step": flops_per_step(shape, args.batch * args.seq)}
    print(f"GPT h{args.hidden} L{args.layers} vocab {args.vocab} seq {args.seq}: {n_params / 1e9:.3f}B params, "
          f"batch {args.batch} on {res['device']}", flush=True)

    res["pinned_bandwidth"] = pinned_bandwidth(device)
    print("pinned bandwidth:", res["pinned_bandwidth"], flush=True)

    def attempt(name, fn, *a, **k):
        try:
            r = fn(*a, **k)
        except Exception as e:
            r = {"failed": f"{type(e).__name__}: {str(e)[:500]}", "trace": traceback.format_exc()[-1500:]}
        res[name] = r
        if device.type == "cuda":
            torch.cuda.empty_cache()
        line = (f"{name:>16}: {r['step_s_median']:.3f} s/step  {r['TFLOPs']:.1f} TFLOP/s" if "TFLOPs" in r
                else f"{name:>16}: {r.get('skipped') or r.get('failed')}")
        print(line, flush=True)

    attempt("plain", run_plain, shape, args.batch, device, args.warmup, args.iters)
    attempt("hetero_resident", run_hetero, shape, args.batch, device, args.warmup, args.iters, None)
    model_data = res.get("hetero_resident", {}).get("model_data_bytes") or 16 * n_params
    budget = int(args.budget_frac * model_data)
    attempt("hetero_offload", run_hetero, shape, args.batch, device, args.warmup, args.iters, budget)
    off = res["hetero_offload"]
    bw = res["pinned_bandwidth"]
    if "copy_GBps" in off and "h2d_GBps" in bw:
        off["copy_fraction_of_pinned"] = off["copy_GBps"] / min(bw["h2d_GBps"], bw["d2h_GBps"])
        print(f"chunk copies: {off['copy_GBps']:.1f} GB/s = {100 * off['copy_fraction_of_pinned']:.0f}% of pinned",
              flush=True)
    if not args.skip_deepspeed:
        attempt("deepspeed_zero3_offload", run_deepspeed, shape, args.batch, device, args.warmup, args.iters)
    if not args.skip_largest:
        res["largest"] = largest(args, device)
        print(f"largest trained with host offload: {res['largest']['largest_params'] / 1e9:.2f}B", flush=True)

    out = args.out or (os.path.join(tempfile.gettempdir(), "hetero_gpu_dryrun.json") if args.dry_run
                       else os.path.join(RESULTS, "hetero_gpu.json"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
