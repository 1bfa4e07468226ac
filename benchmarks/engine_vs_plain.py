"""parallel4d's engine against the plain PyTorch loop it replaces, on one device, alternating in one run.

The same model — the llama family's dense reference from the same seed (``train.seed``), so both start
from the same weights — trained on the same batches by:

* ``engine``: what a ``parallel4d launch`` worker runs, every parallel size 1 (``engine.compose`` over a
  one-rank mesh, ``Engine.train_step``), with the job's precision, fused AdamW, clipping and batch;
* ``plain``: ``DenseModel`` and a hand-written loop — autocast in the job's half dtype, ``cross_entropy``,
  ``loss.backward()``, ``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)`` over the job's two parameter
  groups (weight decay but on norms and embeddings), the same learning rate, betas and eps, no schedule.

Rounds of ``--steps`` steps take turns (the order reversed every other round so drift falls on both); a
round's first step is left out of its time (a warm-up of the caches). Reported per mode: the median step,
tokens/s, MFU where the device's peak is known (``parallel4d.planning.profiles``: the Megatron count of
``flops_per_token``), peak device memory (CUDA: ``max_memory_allocated``), and the ratio engine / plain.
Prints a table and writes ``benchmarks/results/engine_vs_plain[_cpu].json``.

Sizes: on a GPU a Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192,
vocabulary 128256, seq 2048, bf16 autocast over float32 parameters) at ``--batch`` (4 by default: the
search for the largest batch the plain loop fits is still to come); on the CPU a small llama (``--quick``:
smaller still), float32.

Usage: ``python benchmarks/engine_vs_plain.py [--rounds 6] [--steps 4] [--quick] [--compile]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.engine.flops import flops_per_token  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GPU_MODEL = {"arch": "llama", "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate_size": 8192,
             "vocab_size": 128256, "seq_len": 2048, "rope_theta": 500000.0, "norm_eps": 1e-5}
CPU_MODEL = {"arch": "llama", "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate_size": 704,
             "vocab_size": 4096, "seq_len": 256, "rope_theta": 10000.0, "norm_eps": 1e-5}
QUICK_MODEL = {**CPU_MODEL, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate_size": 352,
               "vocab_size": 1024, "seq_len": 128}
OPT = {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
CLIP = 1.0


def job(model: dict, batch: int, cuda: bool, compile_blocks: bool) -> dict:
    """The job both modes train: one rank, the model, the batch, the precision, the optimizer, clipping."""
    return {"model": model, "data": {"source": "synthetic", "batch_size": batch},
            "optimizer": OPT, "parallel": {"pp": 1, "dp": 1, "sp": 1, "tp": 1},
            "train": {"steps": 10**6, "dtype": "bfloat16" if cuda else "float32", "grad_clip": CLIP,
                      "device": "cuda" if cuda else "cpu", "fused": "torch" if cuda else "auto",
                      "compile": "blocks" if compile_blocks else "none", "log_every": 10**6}}


def batches(cfg, device, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed batches of random tokens (the same for both modes)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.model.seq_len), generator=g)
        out.append((x.to(device), torch.roll(x, -1, dims=1).to(device)))
    return out


def engine_mode(cfg):
    """``step(x, y)`` of the engine on a one-rank mesh (the process group made here, gloo or NCCL)."""
    import torch.distributed as dist

    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    if not dist.is_initialized():
        path = os.path.join("/tmp", f"engine_vs_plain_{os.getpid()}")
        dist.init_process_group("nccl" if cfg.train.device == "cuda" else "gloo", init_method=f"file://{path}",
                                rank=0, world_size=1)
    engine = compose(cfg, init_mesh())
    return lambda x, y: engine.train_step(x, y)


def plain_mode(cfg, device):
    """``step(x, y)`` of the plain loop over the same dense model (same seed: the same weights)."""
    from parallel4d.models.build import build_dense, shape_from_config
    from parallel4d.optim.optimizer import param_groups

    model = build_dense(shape_from_config(cfg.model), seed=cfg.train.seed).to(device)
    if cfg.train.compile == "blocks":
        for block in model.blocks:
            block.compile()
    fused = device.type == "cuda" or hasattr(torch, "_fused_adamw_")
    # the job's groups (no decay on norms and embeddings, as a torchtitan or nanoGPT loop sets them)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), cfg.optimizer), lr=OPT["lr"],
                            betas=tuple(OPT["betas"]), eps=OPT["eps"], fused=fused)
    half = torch.bfloat16 if device.type == "cuda" else None

    def step(x, y):
        with torch.autocast(device.type, dtype=half, enabled=half is not None):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_round(step, data, steps: int, device) -> float:
    """Seconds per step over ``steps`` steps after one untimed (the step's result read at the end only)."""
    x, y = data[0]
    float(step(x, y))
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = data[(i + 1) % len(data)]
        loss = step(x, y)
    float(loss)
    sync(device)
    return (time.perf_counter() - t0) / steps


def peak_flops(cfg, device) -> float | None:
    """The device's peak for the job's dtype from the planner's profiles (None on a CPU or unknown GPU)."""
    if device.type != "cuda":
        return None
    from parallel4d.planning import profiles

    name = torch.cuda.get_device_name(device).lower()
    key = "h200" if "h200" in name else "h100" if "h100" in name else None
    if key is None:
        return None
    peak = profiles.load(key).rates["matmul"].peak
    return peak.get(cfg.train.autocast) if isinstance(peak, dict) else peak


def measure(args) -> dict:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = GPU_MODEL if cuda else QUICK_MODEL if args.quick else CPU_MODEL
    cfg = make_config(job(model, args.batch or 4, cuda, args.compile))
    data = batches(cfg, device)
    modes = {"plain": plain_mode(cfg, device), "engine": engine_mode(cfg)}
    # the same weights and batch: the first step's losses agree (float32 on a CPU: to rounding)
    first = {m: float(step(*data[0])) for m, step in modes.items()}
    times = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            times[m].append(run_round(modes[m], data, args.steps, device))
            print(f"  round {r} {m:<7} {times[m][-1]:.4f} s/step", flush=True)
    tokens = cfg.data.batch_size * cfg.model.seq_len
    peak = peak_flops(cfg, device)
    out = {}
    for m, ts in times.items():
        s = statistics.median(ts)
        out[m] = {"step_s": s, "tokens_per_s": tokens / s, "steps_s": ts,
                  "mfu": tokens / s * flops_per_token(cfg) / peak if peak else None}
    if cuda:
        out["peak_memory_bytes_both"] = torch.cuda.max_memory_allocated(device)
    out["ratio_engine_over_plain"] = out["engine"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return {"benchmark": "engine_vs_plain", "device": torch.cuda.get_device_name(device) if cuda else platform.processor()
            or "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(), "config": cfg.model_dump(mode="json"),
            "rounds": args.rounds, "steps_per_round": args.steps, "first_loss": first, "results": out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a smaller CPU model")
    ap.add_argument("--cpu", action="store_true", help="on the CPU even where a GPU is")
    ap.add_argument("--compile", action="store_true", help="train.compile: blocks, and the plain blocks compiled")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = measure(args)
    r = res["results"]
    print(f"{'mode':<8}{'s/step':>10}{'tokens/s':>12}{'MFU':>8}")
    for m in ("plain", "engine"):
        mfu = r[m]["mfu"]
        print(f"{m:<8}{r[m]['step_s']:>10.4f}{r[m]['tokens_per_s']:>12.0f}{'' if mfu is None else f'{mfu:.1%}':>8}")
    print(f"engine / plain: {r['ratio_engine_over_plain']:.3f}× (first losses: plain {res['first_loss']['plain']:.6f}, "
          f"engine {res['first_loss']['engine']:.6f})")
    name = "engine_vs_plain" + ("" if "cuda" in str(res["config"]["train"]["device"]) else "_cpu") + ".json"
    path = args.out or os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
