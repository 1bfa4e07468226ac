"""Host AdamW: hetero's host update against torch's CPU AdamW and DeepSpeed's CPUAdam, side by side.

hetero keeps the fp32 master parameters, gradients and Adam moments of rows that are not on the
device in host chunks, and steps them there (``RowAdam`` with ``host_optimizer: fused``): one
``fused_adam_update`` over each chunk's window when every tensor in it shares a step and its
hyper-parameters (the usual case), per tensor span otherwise. Every candidate here steps the same
parameters — a GPT's block matrices and vectors (``--hidden``, ``--layers``), fp32 — on the same
cores, taking turns step by step, ``--steps`` timed steps after ``--warmup``:

* ``parallel4d fused (per chunk)``: the tensors packed into flat chunks of ``--chunk-elems`` (as hetero
  lays them out), one ``fused_adam_update`` per chunk;
* ``parallel4d fused (per tensor)``: the same chunks, one call per tensor span (rows whose tensors
  differ in step or weight decay);
* ``parallel4d exact``: ``adam_update``, the bit-exact path the exactness tests use;
* ``torch AdamW fused`` / ``torch AdamW foreach``: ``torch.optim.AdamW`` over the tensors as parameters;
* ``DeepSpeed CPUAdam``: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (its C++ op, built by DeepSpeed's JIT
  where a compiler is present; left out, with the reason, where it cannot be built).

Prints a table (time per step, parameters per second, ratio to the fastest) and writes
``benchmarks/results/host_adam.json`` (device, torch and DeepSpeed versions, threads, config, each figure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from parallel4d.hetero.optim import adam_update, fused_adam_update

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, decoupled=True)


def gpt_shapes(hidden: int, layers: int) -> list[tuple[int, ...]]:
    """A GPT's block parameters, layer by layer: attention and MLP matrices, their biases, two norms."""
    h = hidden
    block = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,), (h,), (h,)]
    return block * layers


def chunk_spans(shapes, chunk_elems: int) -> list[list[tuple[int, int]]]:
    """Per chunk, the ``(start, end)`` of each tensor placed in it (first fit in order, as hetero's rows)."""
    chunks, used = [[]], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        if n > chunk_elems:
            raise ValueError(f"--chunk-elems {chunk_elems} is smaller than a tensor of {n} elements; raise it")
        if used + n > chunk_elems:
            chunks.append([])
            used = 0
        chunks[-1].append((used, used + n))
        used += n
    return chunks


def _filled(n: int, seed: int) -> list[torch.Tensor]:
    """p, g, m, v of ``n`` fp32 elements (m, v as after some steps: v positive)."""
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    return [p, g, m, torch.rand(n, generator=gen) * 1e-3]


def _time_round_robin(steps_by_name: dict, steps: int, warmup: int) -> dict[str, list[float]]:
    """Each candidate's step times, the candidates taking turns step by step (drift and noise from the
    rest of the machine fall on all of them alike)."""
    times = {name: [] for name in steps_by_name}
    for i in range(warmup + steps):
        for name, step_fn in steps_by_name.items():
            t = time.perf_counter()
            step_fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return times


def chunked(spans, chunk_elems: int, update, per_tensor: bool):
    """A step function over chunk buffers, one update per chunk window or per tensor span."""
    bufs = [_filled(chunk_elems, i) for i in range(len(spans))]
    state = {"step": 0}

    def step():
        state["step"] += 1
        for (p, g, m, v), sp in zip(bufs, spans):
            ranges = sp if per_tensor else [(0, sp[-1][1])]
            for a, b in ranges:
                update(p[a:b], g[a:b], m[a:b], v[a:b], step=state["step"], **HP)
    return step


def torch_adamw(shapes, **kind):
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], **kind)
    return opt.step


def deepspeed_adam(shapes):
    """DeepSpeed's CPUAdam step over the same tensors, or the reason it cannot run here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        for q in params:
            q.grad = torch.randn_like(q)
        opt = DeepSpeedCPUAdam(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                               weight_decay=HP["weight_decay"], adamw_mode=True)
    except Exception as e:  # not installed, or its op does not build here: said in the table
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return opt.step, None


def measure(hidden: int, layers: int, chunk_elems: int, steps: int, warmup: int) -> dict:
    shapes = gpt_shapes(hidden, layers)
    n_params = sum(int(torch.Size(s).numel()) for s in shapes)
    spans = chunk_spans(shapes, chunk_elems)
    candidates = {
        "parallel4d fused (per chunk)": lambda: (chunked(spans, chunk_elems, fused_adam_update, False), None),
        "parallel4d fused (per tensor)": lambda: (chunked(spans, chunk_elems, fused_adam_update, True), None),
        "parallel4d exact": lambda: (chunked(spans, chunk_elems, adam_update, False), None),
        "torch AdamW fused": lambda: (torch_adamw(shapes, fused=True), None),
        "torch AdamW foreach": lambda: (torch_adamw(shapes, foreach=True), None),
        "DeepSpeed CPUAdam": lambda: deepspeed_adam(shapes),
    }
    rows, built = {}, {}
    for name, build in candidates.items():
        step, why = build()
        if step is None:
            rows[name] = {"skipped": why}
        else:
            built[name] = step
    for name, times in _time_round_robin(built, steps, warmup).items():
        med = statistics.median(times)
        rows[name] = {"median_step_s": med, "mean_step_s": statistics.fmean(times), "params_per_s": n_params / med}
    best = min(r["median_step_s"] for r in rows.values() if "median_step_s" in r)
    for r in rows.values():
        if "median_step_s" in r:
            r["speed_vs_fastest"] = best / r["median_step_s"]
    config = {"hidden": hidden, "layers": layers, "params": n_params, "chunk_elems": chunk_elems,
              "chunks": len(spans), "timed_steps": steps, "warmup_steps": warmup, "dtype": "float32", **HP}
    return {"config": config, "results": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk-elems", type=int, default=1 << 22, help="elements per chunk (hetero.chunk_elems)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "host_adam.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.hidden, args.layers, args.chunk_elems, args.steps, args.warmup)
    try:
        import deepspeed
        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None
    result = {"benchmark": "host_adam", "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
              "torch": torch.__version__, "deepspeed": ds_version, "python": platform.python_version(),
              "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "load_average_1min": os.getloadavg()[0], **result}
    c = result["config"]
    print(f"host AdamW step: {c['params'] / 1e6:.1f}M fp32 parameters (GPT hidden {c['hidden']}, {c['layers']} layers) "
          f"in {c['chunks']} chunks of {c['chunk_elems']}; {result['device']}, torch {result['torch']}, "
          f"{result['threads']} threads; {c['timed_steps']} timed steps after {c['warmup_steps']}")
    print(f"{'':30} {'median step':>12} {'params/s':>10} {'vs fastest':>10}")
    for name, r in result["results"].items():
        if "skipped" in r:
            print(f"{name:30} skipped: {r['skipped']}")
        else:
            print(f"{name:30} {1e3 * r['median_step_s']:9.1f} ms {r['params_per_s'] / 1e6:8.0f} M {r['speed_vs_fastest']:9.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
