"""FP8 (``train.fp8: rowwise``) against bfloat16, side by side in one run (issue 50, point 5): an 8B-shaped
llama block forward + backward, dense and as 2D blocks, and the engine's Llama-3.2-1B launch.

**The block.** Llama 3 8B's block (hidden 4096, intermediate 14336, 32 heads over 8 kv heads, seq 4096,
batch 1), parameters and activations in bfloat16, built once and copied: as it is, and with
``parallel4d.models.fp8.use_fp8`` (its seven linears' three products each in FP8 with rowwise scales,
torchao's ``rowwise`` recipe; attention, norms and SwiGLU as they are). Forward + backward of a fixed input
and output gradient; the variants take turns over ``rounds`` (each its median), CUDA events around
``iters`` steps on a GPU. As 2D blocks: the q² = 4 ranks of a 2×2 grid (tp = 4) built in this process
(``parallel4d.tensor2d.emulate``: every rank's products on the one device, each collective a local copy,
as ``benchmarks/tensor2d.py --blocks`` runs them) on batch q (Optimus splits the batch over the grid's rows),
in bfloat16 and — once the 2D layers compute in FP8 under ``use_fp8`` — in FP8; until then the FP8-2D row
says "not yet". FP8 is observed, not assumed: torch's ``FlopCounterMode`` counts one step of each variant,
and an FP8 variant's share of FLOPs in ``_scaled_mm`` is reported (0: nothing ran in FP8).

**Compiled.** On a GPU (``--compiled`` on the CPU) the dense block also runs compiled, in bfloat16 and in FP8,
as ``train.compile: blocks`` compiles a block (``parallel4d.engine.compile.compile_block``, inductor) and as
torchtitan measures FP8: compiled, an FP8 linear's amaxes, scales and quantization fuse into a few kernels
around ``_scaled_mm``; eager, each is a pass of its own over the operand. The compiled pair is the figure to
hold against the target; the eager pair stays beside it (what FP8 costs without compiling).

Speed-up = bfloat16's step / FP8's step (per round, then the median). Target (issue 50): **≥ 1.3× for the
dense block on one H100/H200**. FP8 pays on large products only: each of its products first reads its two
operands for their amaxes and writes them in e4m3, passes a bfloat16 product does not make.

**The engine.** ``benchmarks/engine_vs_plain.py``'s Llama-3.2-1B shape (seq 2048, bfloat16 autocast over float32
master weights, fused AdamW, clipping) trained by the engine in one process with ``train.fp8: rowwise`` and with
``none``, the same seed and batches, rounds alternating: tokens/s and MFU counted against both dense peaks of an
H100/H200 (bfloat16 989 TFLOP/s, FP8 1979 TFLOP/s; the FLOPs are the model's, ``engine.flops``, the LM head's
bfloat16 product included). GPU only (``--engine-on-cpu``: its small CPU model, to exercise the path).

Sizes: on a GPU the full shape; on the CPU ``--small`` (hidden 512) by default, in bfloat16 too — torch's CPU
``_scaled_mm`` is a reference kernel many times slower than a bfloat16 product there, so CPU ratios say
nothing of a GPU's. No GPU figure is recorded until a GPU runs it (``make gpu-check PART=fp8``). Writes
``benchmarks/results/fp8_<cpu|gpu>.json`` (device, torch, the sizes, every variant) and prints a table.

Usage: ``python benchmarks/fp8.py [--small | --full | --tiny] [--engine-on-cpu] [--compiled] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tensor2d  # noqa: E402  (benchmarks/tensor2d.py: the block, its 2D ranks, the timed steps)
from parallel4d.engine.compile import compile_block  # noqa: E402
from parallel4d.fp8.linear import RowwiseLinear  # noqa: E402
from parallel4d.models.fp8 import use_fp8  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FULL_BLOCK = replace(tensor2d.GPU_BLOCK, batch=1)  # Llama 3 8B's block, one sequence of 4096 tokens
SMALL_BLOCK = replace(tensor2d.CPU_BLOCK, batch=1)  # hidden 512, intermediate 1792, seq 256
TINY_BLOCK = replace(tensor2d.TINY_BLOCK, batch=1)  # hidden 64: the dry run's and the test's
Q = 2  # the 2D grid: q×q = 4 ranks (tp = 4)
TARGET_DENSE = 1.3  # FP8 step over bfloat16's, the dense block on one H100/H200 (issue 50)
# H100/H200 SXM dense peaks (NVIDIA's datasheets, without sparsity), FLOP/s
PEAKS = {"bf16": 989e12, "fp8": 1979e12}
DTYPE = torch.bfloat16


# --- the block -----------------------------------------------------------------------------------------------
class _Blocks(nn.Module):
    """A holder ``use_fp8`` reads (``.blocks``): the blocks of one variant."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)


def in_fp8(blocks: list[nn.Module]) -> list[str]:
    """``blocks``' linears swapped in place for FP8 ones (``use_fp8``); the names swapped."""
    return use_fp8(_Blocks(blocks))


def flops_of(step) -> tuple[int, int]:
    """One step of ``step`` under torch's FlopCounterMode: ``(all FLOPs, those of _scaled_mm)``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    by_op = counter.get_flop_counts().get("Global", {})
    return counter.get_total_flops(), sum(n for op, n in by_op.items() if "_scaled_mm" in str(op))


def block_variants(size, device, compiled: bool = False) -> tuple[dict, dict]:
    """The four steps (dense and 2D, bf16 and FP8) and why a variant is left out (FP8-2D where the 2D layers
    do not compute in FP8 yet); ``compiled``: the dense block in bf16 and FP8 compiled too, as
    ``train.compile: blocks`` compiles it (``compile_block``: inductor), as torchtitan measures FP8."""
    dense = tensor2d.llama_block(size, device, DTYPE)
    g = torch.Generator(device="cpu").manual_seed(1)
    X, G = (torch.randn(size.batch, size.seq, size.hidden, generator=g).to(device, DTYPE) for _ in range(2))
    X2, G2 = (torch.randn(Q * size.batch, size.seq, size.hidden, generator=g).to(device, DTYPE) for _ in range(2))
    dense8 = copy.deepcopy(dense)
    in_fp8([dense8])
    steps = {"dense bf16": tensor2d.dense_step(dense, X, G), "dense fp8": tensor2d.dense_step(dense8, X, G)}
    if compiled:  # copies, compiled on their first (warm-up) step
        for name, block in (("dense bf16 compiled", dense), ("dense fp8 compiled", dense8)):
            steps[name] = tensor2d.dense_step(compile_block(copy.deepcopy(block)), X, G)
    steps["2D bf16"] = tensor2d.grid_step(dense, X2, G2, Q)
    blocks, xs, gs = tensor2d.grid_blocks(dense, X2, G2, Q)
    left_out = {}
    try:
        swapped = in_fp8(blocks)
    except Exception as e:  # noqa: BLE001 — the 2D layers' FP8 may not exist yet on this branch
        left_out["2D fp8"] = f"not yet: use_fp8 on the 2D blocks raised {type(e).__name__}: {str(e)[:200]}"
    else:
        steps["2D fp8"] = tensor2d._runs(blocks, xs, gs)
        if not swapped:
            left_out["2D fp8"] = ("not yet: use_fp8 swaps no linear of the 2D blocks (Linear2D's FP8 SUMMA panels, "
                                  "issue 50 point 4, are not on this branch)")
    return steps, left_out


def measure_blocks(size, device, warmup: int, iters: int, rounds: int, compiled: bool | None = None) -> dict:
    """Every variant's step, FLOPs and FP8 share; the speed-ups of FP8 over bf16, dense and 2D, and dense
    compiled (``compiled``: the compiled variants too; None: on a GPU only, where they are the figure that
    counts — FP8's amaxes and quantization fused around ``_scaled_mm``)."""
    device = torch.device(device)
    compiled = device.type == "cuda" if compiled is None else compiled
    steps, left_out = block_variants(size, device, compiled)
    flops = {}
    for name in list(steps):  # a compiled variant: its eager twin's count (the same products; the counter's
        eager = name.removesuffix(" compiled")  # dispatch mode would see no ops inside compiled kernels)
        flops[name] = flops[eager] if eager != name else flops_of(steps[name])
        if name.endswith("fp8") and flops[name][1] == 0:  # nothing ran in FP8: not a measure of FP8
            left_out.setdefault(name, "not yet: no product of this variant ran in _scaled_mm")
            del steps[name]
    times, syncs = tensor2d.alternating_times(steps, warmup, rounds, iters, device)
    results = {}
    for name, ts in times.items():
        t, (total, scaled) = statistics.median(ts), flops[name]
        results[name] = {"step_s": t, "rounds_s": ts, "flops": total, "scaled_mm_share": scaled / total,
                         "tflops_per_s": total / t / 1e12}
    speedups = {}
    for layout in ("dense", "2D", "dense compiled"):
        kind = layout.split()
        bf16, fp8 = (results.get(" ".join([kind[0], dtype, *kind[1:]])) for dtype in ("bf16", "fp8"))
        speedups[layout] = None if fp8 is None or bf16 is None else statistics.median(
            b / f for b, f in zip(bf16["rounds_s"], fp8["rounds_s"]))  # per round, then the median
    return {"block": asdict(size), "q": Q, "batch_2d": Q * size.batch, "warmup": warmup, "iters": iters,
            "rounds": rounds, "results": results, "left_out": left_out, "speedup_fp8_over_bf16": speedups,
            "target_dense_speedup": TARGET_DENSE, "host_syncs": len(syncs),
            "host_sync_messages": sorted(set(syncs))[:5],
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "emulated_2d": "the q x q ranks built in one process (parallel4d.tensor2d.emulate) and run in turn on "
                           "the one device; collectives are local copies/adds of stand-in blocks"}


# --- the engine ------------------------------------------------------------------------------------------------
def peak_of(device: torch.device) -> dict | None:
    """The dense peaks of an H100/H200 (None elsewhere: no MFU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return PEAKS if ("h100" in name or "h200" in name) else None


def fp8_job(job: dict, fp8: str) -> dict:
    """``job`` with ``train.fp8`` set."""
    return {**job, "train": {**job["train"], "fp8": fp8}}


def engine_fp8(cuda: bool, rounds: int, steps: int, batch: int) -> dict:
    """The engine in one process on ``engine_vs_plain``'s model (GPU: Llama-3.2-1B; CPU: its small one) with
    ``train.fp8`` rowwise and none, rounds alternating: tokens/s, MFU in both peaks, the first losses."""
    import torch.distributed as dist

    import engine_vs_plain as evp
    from parallel4d.config.load import make_config
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose
    from parallel4d.engine.flops import flops_per_token

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = evp.GPU_MODEL if cuda else evp.QUICK_MODEL
    cfgs = {fp8: make_config(fp8_job(evp.job(model, batch, cuda, False), fp8)) for fp8 in ("none", "rowwise")}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous",
                            rank=0, world_size=1)
    engines, meshes = {}, []
    try:
        for fp8, cfg in cfgs.items():
            meshes.append(init_mesh())
            engines[fp8] = compose(cfg, meshes[-1])
        modes = {fp8: evp.Mode(engine.train_step, engine.store.params, engine.optimizer)
                 for fp8, engine in engines.items()}
        fp8_linears = {fp8: sum(isinstance(m, RowwiseLinear) for m in engine.store.model.modules())
                       for fp8, engine in engines.items()}  # FP8 observed, not assumed
        data = evp.batches(cfgs["none"], device)
        first = {fp8: float(mode.step(*data[0])) for fp8, mode in modes.items()}  # same weights, same batch
        times = {fp8: [] for fp8 in modes}
        for r in range(rounds):
            for fp8 in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                times[fp8].append(evp.run_round(modes[fp8], data, steps, device)[0])
    finally:
        for engine in engines.values():
            engine.close()
        for mesh in meshes:
            mesh.close()
        dist.destroy_process_group()
    cfg, peaks = cfgs["none"], peak_of(device)
    tokens, per_token = cfg.data.batch_size * cfg.model.seq_len, flops_per_token(cfg)
    runs = {}
    for fp8, ts in times.items():
        s = statistics.median(ts)
        runs[fp8] = {"step_s": s, "steps_s": ts, "tokens_per_s": tokens / s, "first_loss": first[fp8],
                     "fp8_linears": fp8_linears[fp8],
                     "mfu": None if peaks is None else {k: tokens / s * per_token / p for k, p in peaks.items()}}
    return {"config": cfg.model_dump(mode="json"), "rounds": rounds, "steps_per_round": steps, "runs": runs,
            "peaks_flops": peaks, "flops_per_token": per_token,
            "speedup_fp8_over_bf16": runs["none"]["step_s"] / runs["rowwise"]["step_s"]}


# --- the run ---------------------------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    return (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads")


def measure(size, device, *, engine: bool, warmup: int = 2, iters: int = 3, rounds: int = 3,
            engine_rounds: int = 4, engine_steps: int = 4, engine_batch: int = 4, compiled: bool | None = None) -> dict:
    device = torch.device(device)
    res = {"benchmark": "fp8", "device": device_name(device), "torch": torch.__version__,
           "python": platform.python_version(), "dtype": "bfloat16", "recipe": "rowwise (train.fp8: rowwise)",
           "block": measure_blocks(size, device, warmup, iters, rounds, compiled)}
    if engine:
        res["engine"] = engine_fp8(device.type == "cuda", engine_rounds, engine_steps, engine_batch)
    else:
        res["engine"] = {"skipped": "the engine's FP8 launch is measured on a GPU only (--engine-on-cpu: its small "
                                    "CPU model, to exercise the path)"}
    if device.type != "cuda":
        res["note"] = ("CPU: torch's _scaled_mm there is a reference kernel, far slower than a bfloat16 product; "
                       "these ratios say nothing of a GPU's (not measured yet)")
    return res


def _x(v) -> str:
    return "—" if v is None else f"{v:.2f}×"


def table(res: dict) -> list[str]:
    b = res["block"]
    s = b["block"]
    lines = [f"FP8 (rowwise) against bfloat16 on {res['device']} (torch {res['torch']})",
             f"llama block h={s['hidden']} I={s['intermediate']} heads {s['heads']}/{s['kv_heads']} s={s['seq']}, "
             f"batch {s['batch']} dense, {b['batch_2d']} as 2D (q={b['q']}, {b['q'] ** 2} ranks on one device), "
             f"forward + backward, median of {b['rounds']} rounds",
             f"{'variant':21s}{'step ms':>10s}{'TFLOP/s':>9s}{'in FP8':>8s}{'FP8 speed-up':>14s}"]
    for name in ("dense bf16", "dense fp8", "dense bf16 compiled", "dense fp8 compiled", "2D bf16", "2D fp8"):
        r = b["results"].get(name)
        if r is None:
            if "compiled" not in name:  # compiled variants: measured on a GPU only
                lines.append(f"{name:21s}  {b['left_out'].get(name, 'left out')}")
            continue
        layout = name.replace(" bf16", "").replace(" fp8", "")
        up = _x(b["speedup_fp8_over_bf16"][layout]) if " fp8" in name else ""
        target = f"  (target ≥ {b['target_dense_speedup']}× on H100/H200)" if name.startswith("dense fp8") else ""
        lines.append(f"{name:21s}{r['step_s'] * 1e3:10.2f}{r['tflops_per_s']:9.2f}{r['scaled_mm_share']:8.0%}"
                     f"{up:>14s}{target}")
    e = res["engine"]
    if "skipped" in e:
        lines.append(f"engine FP8 launch: skipped ({e['skipped']})")
    else:
        m = e["config"]["model"]
        lines.append(f"engine, llama h={m['hidden']} L={m['layers']} s={m['seq_len']} batch "
                     f"{e['config']['data']['batch_size']}, median of {e['rounds']} rounds of {e['steps_per_round']}")
        lines.append(f"{'train.fp8':12s}{'step s':>10s}{'tokens/s':>11s}{'MFU bf16 peak':>15s}{'MFU FP8 peak':>14s}"
                     f"{'first loss':>12s}")
        for fp8, r in e["runs"].items():
            mfu = r["mfu"] or {}
            pct = lambda k: "—" if k not in mfu else f"{mfu[k]:.1%}"  # noqa: E731
            lines.append(f"{fp8:12s}{r['step_s']:10.4f}{r['tokens_per_s']:11.0f}{pct('bf16'):>15s}{pct('fp8'):>14s}"
                         f"{r['first_loss']:12.4f}")
        lines.append(f"engine FP8 speed-up {_x(e['speedup_fp8_over_bf16'])}")
    if res.get("note"):
        lines.append(f"({res['note']})")
    return lines


def headline(res: dict) -> str:
    """One line for ``make gpu-check``."""
    b, up = res["block"], res["block"]["speedup_fp8_over_bf16"]
    line = (f"block FP8 / bf16: dense {_x(up['dense'])}, compiled {_x(up.get('dense compiled'))} (target ≥ "
            f"{TARGET_DENSE}×), 2D ") + (
        _x(up["2D"]) if up["2D"] is not None else b["left_out"].get("2D fp8", "—")[:40])
    if "runs" in res["engine"]:
        line += f"; engine {_x(res['engine']['speedup_fp8_over_bf16'])}"
    return line


def write(res: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def gpu_fp8_block(tiny: bool, out: str) -> dict:
    """``make gpu-check PART=fp8``'s block step: the full block on the GPU (``tiny``: the dry run's tiny block on
    the CPU); writes ``out``, returns the result with its ``headline``."""
    res = measure(TINY_BLOCK if tiny else FULL_BLOCK, "cpu" if tiny else "cuda", engine=False,
                  **({"warmup": 1, "iters": 1, "rounds": 1} if tiny else {}))
    write(res, out)
    return {**res, "headline": headline(res)}


def gpu_fp8_engine(tiny: bool, out: str) -> dict:
    """``make gpu-check PART=fp8``'s engine step: the 1B launch in FP8 against bf16 (``tiny``: the small CPU
    model, one round of one step)."""
    res = {"benchmark": "fp8_engine", "device": device_name(torch.device("cpu" if tiny else "cuda", 0)),
           "torch": torch.__version__,
           "engine": engine_fp8(not tiny, **({"rounds": 1, "steps": 1, "batch": 2} if tiny
                                            else {"rounds": 4, "steps": 4, "batch": 4}))}
    write(res, out)
    e = res["engine"]
    mfu = e["runs"]["rowwise"]["mfu"]
    return {**res, "headline": f"engine FP8 / bf16 {_x(e['speedup_fp8_over_bf16'])}, "
                               f"{e['runs']['rowwise']['tokens_per_s']:,.0f} tokens/s in FP8"
                               + ("" if mfu is None else f", MFU {mfu['fp8']:.1%} of FP8's peak, {mfu['bf16']:.1%} "
                                                         "of bf16's")}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the 8B block (the default on a GPU)")
    size.add_argument("--small", action="store_true", help="hidden 512, seq 256 (the default on the CPU)")
    size.add_argument("--tiny", action="store_true", help="hidden 64, seq 32: the path only")
    ap.add_argument("--cpu", action="store_true", help="on the CPU even where a GPU is")
    ap.add_argument("--engine-on-cpu", action="store_true", help="the engine part on the CPU (its small model)")
    ap.add_argument("--rounds", type=int, default=None, help="the block's rounds (GPU 3, CPU 5)")
    ap.add_argument("--compiled", action="store_true", help="the compiled dense variants on the CPU too (a GPU "
                                                             "always runs them)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu
    block = TINY_BLOCK if a.tiny else SMALL_BLOCK if a.small or (not cuda and not a.full) else FULL_BLOCK
    t0 = time.perf_counter()
    res = measure(block, "cuda" if cuda else "cpu", engine=cuda or a.engine_on_cpu,
                  rounds=a.rounds or (3 if cuda else 5), compiled=cuda or a.compiled,
                  **({} if cuda else {"warmup": 1, "iters": 2, "engine_rounds": 2, "engine_steps": 1,
                                      "engine_batch": 2}))
    res["wall_s"] = time.perf_counter() - t0
    print("\n".join(table(res)))
    out = a.out or os.path.join(RESULTS, f"fp8_{'gpu' if cuda else 'cpu'}.json")
    write(res, out)
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
