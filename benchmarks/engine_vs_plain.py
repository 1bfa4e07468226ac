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
``flops_per_token``), memory, and the ratios engine / plain with their targets (speed ≥ 0.97× eager,
≥ 1.0× with ``--compile``; memory ≤ 1.05×). Memory per mode, though both live in one process: what it
keeps between steps (parameters, optimizer state, gradients at their size) plus, on CUDA, its rounds'
largest rise of ``memory_allocated`` over that (the device's peak for it); on a CPU, plus the bytes
autograd saves for the backward (the activations). Prints a table and writes
``benchmarks/results/engine_vs_plain[_cpu].json``.

Sizes: on a GPU a Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192,
vocabulary 128256, seq 2048, bf16 autocast over float32 parameters) at the largest batch the plain loop
fits with the engine's state resident beside it (doubling, then bisection; ``--batch`` sets one instead);
on the CPU a small llama (``--quick``: smaller still), float32, batch 4.

:func:`paired_ratio` (one step of each in turn, the median of the pairs' ratios) is what
``tests/test_engine_vs_plain.py`` holds to 0.97 on the CPU.

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


class Mode:
    """One way of training: ``step(x, y)`` (returns the loss, not read back) and the tensors it keeps
    between steps (``resident()``: parameters, optimizer state; gradients count as the parameters' size,
    held from the backward to the update)."""

    def __init__(self, step, params, optimizer):
        self.step, self.params, self.optimizer = step, list(params), optimizer

    def resident(self) -> int:
        seen: set[int] = set()
        tensors = self.params + [t for st in self.optimizer.state.values() for t in st.values()
                                 if isinstance(t, torch.Tensor)]
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total + sum(p.numel() * p.element_size() for p in self.params if p.requires_grad)


def engine_mode(cfg) -> Mode:
    """The engine on a one-rank mesh (the process group made here unless one is: gloo or NCCL)."""
    import torch.distributed as dist

    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    if not dist.is_initialized():
        path = os.path.join("/tmp", f"engine_vs_plain_{os.getpid()}")
        dist.init_process_group("nccl" if cfg.train.device == "cuda" else "gloo", init_method=f"file://{path}",
                                rank=0, world_size=1)
    engine = compose(cfg, init_mesh())
    return Mode(lambda x, y: engine.train_step(x, y), engine.store.params, engine.optimizer)


def plain_mode(cfg, device) -> Mode:
    """The plain loop over the same dense model (same seed: the same weights)."""
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

    return Mode(step, model.parameters(), opt)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_bytes(mode: Mode, x, y) -> int:
    """Bytes autograd saves for the backward in one step of ``mode`` beyond its parameters (unique
    storages): the activations, the CPU's stand-in for the device's peak."""
    own = {p.untyped_storage().data_ptr() for p in mode.params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own and s.device.type != "meta":
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mode.step(x, y)
    return sum(seen.values())


def run_round(mode: Mode, data, steps: int, device) -> tuple[float, int | None]:
    """Seconds per step over ``steps`` steps after one untimed (the step's result read at the end only),
    and on CUDA the round's peak of the memory this mode adds over what is resident between steps."""
    x, y = data[0]
    float(mode.step(x, y))
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        idle = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = data[(i + 1) % len(data)]
        loss = mode.step(x, y)
    float(loss)
    sync(device)
    took = (time.perf_counter() - t0) / steps
    return took, (torch.cuda.max_memory_allocated(device) - idle if device.type == "cuda" else None)


def fits(mode: Mode, cfg, device, batch: int) -> bool:
    """Whether two steps of ``mode`` at ``batch`` run without running out of device memory."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len), generator=g).to(device)
    try:
        for _ in range(2):
            float(mode.step(x, x))
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        for p in mode.params:
            p.grad = None
        del x
        torch.cuda.empty_cache()


def largest_batch(mode: Mode, cfg, device, cap: int = 256) -> int:
    """The largest batch ``mode`` fits on the device (doubling, then bisection), with everything else
    this process holds resident (the other mode's state: the size the alternating run can use)."""
    good, bad = 0, None
    b = 1
    while b <= cap and fits(mode, cfg, device, b):
        good, b = b, 2 * b
    bad = b if b <= cap else None
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mode, cfg, device, mid) else (good, mid)
    if good == 0:
        raise SystemExit(f"the plain loop does not fit one sequence of {cfg.model.seq_len} tokens on {device}")
    return good


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


def build(cfg, device) -> dict[str, Mode]:
    return {"plain": plain_mode(cfg, device), "engine": engine_mode(cfg)}


def paired_ratio(modes: dict[str, Mode], data, pairs: int) -> float:
    """The median over ``pairs`` of plain's step time over the engine's, one step of each in turn
    (the order reversed every other pair): engine speed / plain speed, robust to drift (CPU: the
    step's work is done when it returns)."""
    ratios = []
    for i in range(pairs):
        took = {}
        for m in (("plain", "engine") if i % 2 == 0 else ("engine", "plain")):
            x, y = data[i % len(data)]
            t0 = time.perf_counter()
            float(modes[m].step(x, y))
            took[m] = time.perf_counter() - t0
        ratios.append(took["plain"] / took["engine"])
    return statistics.median(ratios)


def measure(args) -> dict:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = GPU_MODEL if cuda else QUICK_MODEL if args.quick else CPU_MODEL
    cfg = make_config(job(model, args.batch or 4, cuda, args.compile))
    modes = build(cfg, device)
    data = batches(cfg, device)
    # the same weights and batch: the first step's losses agree (float32 on a CPU: to rounding)
    first = {m: float(mode.step(*data[0])) for m, mode in modes.items()}
    searched = None
    if cuda and args.batch is None:
        searched = largest_batch(modes["plain"], cfg, device)
        cfg = make_config(job(model, searched, cuda, args.compile))
        data = batches(cfg, device)
    times = {m: [] for m in modes}
    transient = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            took, peak = run_round(modes[m], data, args.steps, device)
            times[m].append(took)
            transient[m].append(peak)
            print(f"  round {r} {m:<7} {took:.4f} s/step", flush=True)
    tokens = cfg.data.batch_size * cfg.model.seq_len
    peak = peak_flops(cfg, device)
    out = {}
    for m, ts in times.items():
        s = statistics.median(ts)
        resident = modes[m].resident()
        # CUDA: what is resident between steps plus the round's largest rise over it; CPU: the same
        # resident bytes plus what autograd saves for the backward (the activations)
        rise = max(transient[m]) if cuda else saved_bytes(modes[m], *data[0])
        out[m] = {"step_s": s, "tokens_per_s": tokens / s, "steps_s": ts, "resident_bytes": resident,
                  "peak_memory_bytes" if cuda else "resident_plus_saved_bytes": resident + rise,
                  "mfu": tokens / s * flops_per_token(cfg) / peak if peak else None}
    key = "peak_memory_bytes" if cuda else "resident_plus_saved_bytes"
    out["ratio_engine_over_plain"] = out["engine"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    out["memory_engine_over_plain"] = out["engine"][key] / out["plain"][key]
    out["targets"] = {"ratio_at_least": 1.0 if args.compile else 0.97, "memory_at_most": 1.05}
    return {"benchmark": "engine_vs_plain", "device": torch.cuda.get_device_name(device) if cuda else platform.processor()
            or "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(), "config": cfg.model_dump(mode="json"),
            "batch_searched": searched, "rounds": args.rounds, "steps_per_round": args.steps, "first_loss": first,
            "results": out}


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
    t = r["targets"]
    print(f"engine / plain: {r['ratio_engine_over_plain']:.3f}× (target ≥ {t['ratio_at_least']}), memory "
          f"{r['memory_engine_over_plain']:.3f}× (target ≤ {t['memory_at_most']}); batch {res['config']['data']['batch_size']}"
          f"{' (the largest plain fits)' if res['batch_searched'] else ''}")
    print(f"(first losses: plain {res['first_loss']['plain']:.6f}, "
          f"engine {res['first_loss']['engine']:.6f})")
    name = "engine_vs_plain" + ("" if "cuda" in str(res["config"]["train"]["device"]) else "_cpu") + ".json"
    path = args.out or os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
