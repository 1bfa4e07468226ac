"""LoRA against full fine-tuning of the same model: tokens/s and memory, plain and under hetero.

One process (a one-rank gloo group), the engine (``engine.compose``) on one llama model trained four ways:
full fine-tuning and ``model.lora`` (rank 16 on all seven linears of each block, peft's ``target_modules``),
each with the plain store (parameters, gradients and AdamW state on the device) and with hetero's chunks
(``hetero.enabled``; the LoRA base frozen in its chunks alone: no gradient, master or moments). Each run:
one warm-up step, then ``--steps`` timed steps (CUDA events on a GPU, the wall clock on a CPU), the median.

Reported per run: tokens/s, the step, the trained parameters; memory — on a GPU the device's peak
(``torch.cuda.max_memory_allocated``), everywhere the model state the store keeps (plain: parameters,
gradients, optimizer state; hetero: its device arena and host bytes, host bytes per parameter and per frozen
parameter: 2 under bfloat16 chunks, the LoRA base's only cost).

Default: a tiny llama on the CPU (float32: no 16-bit chunks there, so the frozen base's host bytes are 4 a
parameter); on a GPU (``--gpu``, ``make gpu-check PART=lora``) the Llama-3.2-1B shape in bfloat16, seq 1024.
No GPU figure is recorded until a GPU runs it. Writes ``benchmarks/results/lora_<cpu|gpu>.json`` (device,
torch, the config, every run) and prints a table.

Usage: ``python benchmarks/lora.py [--gpu] [--steps 3] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.data.batches import build_dataset  # noqa: E402
from parallel4d.distributed.mesh import init_mesh  # noqa: E402
from parallel4d.engine.compose import compose  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 16, "alpha": 32, "targets": TARGETS}
TINY = {"model": {"arch": "llama", "vocab_size": 256, "seq_len": 64, "hidden": 128, "heads": 4, "kv_heads": 2,
                  "layers": 4, "intermediate_size": 256},
        "data": {"source": "synthetic", "batch_size": 4}, "train": {"dtype": "float32", "device": "cpu"}}
LLAMA_1B = {"model": {"arch": "llama", "vocab_size": 32000, "seq_len": 1024, "hidden": 2048, "heads": 32,
                      "kv_heads": 8, "layers": 16, "intermediate_size": 8192},
            "data": {"source": "synthetic", "batch_size": 4},
            "train": {"dtype": "bfloat16", "device": "cuda", "activation_checkpointing": "blocks"}}
WAYS = {"full, plain": (False, False), "LoRA, plain": (True, False),
        "full, hetero": (False, True), "LoRA, hetero": (True, True)}


def job(base: dict, lora: bool, hetero: bool, steps: int) -> dict:
    """``base`` with adapters or not, hetero's chunks or not, ``1 + steps`` steps, nothing written."""
    model = {**base["model"], **({"lora": LORA} if lora else {})}
    return {**base, "model": model, "hetero": {"enabled": hetero},
            "train": {**base["train"], "steps": 1 + steps, "grad_clip": 1.0}, "checkpoint": {"enabled": False}}


def timed(engine, batch, cuda: bool) -> tuple[float, float]:
    """``(seconds, loss)`` of one training step."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = engine.train_step(*batch)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, float(loss)
    t0 = time.perf_counter()
    loss = float(engine.train_step(*batch))  # the read waits for the step
    return time.perf_counter() - t0, loss


def state_bytes(engine) -> dict:
    """What the store keeps of the model: plain — parameters, gradients (the trained ones'), optimizer state;
    hetero — its device arena and host bytes."""
    st = engine.hetero_stats()
    if st is not None:
        return {"hetero_device_bytes": st["arena_bytes"], "hetero_host_bytes": st["host_bytes"],
                "hetero_host_bytes_per_param": st["host_bytes_per_param"],
                "frozen_host_bytes_per_param": st["frozen_host_bytes_per_param"]}
    params = list(engine.store.model.parameters())
    return {"parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
            "optimizer_state_bytes": engine.store.optimizer_state_bytes()}


def run(base: dict, lora: bool, hetero: bool, steps: int) -> dict:
    cfg = make_config(job(base, lora, hetero, steps))
    cuda = cfg.train.device == "cuda"
    mesh = init_mesh(timeout_s=600)
    engine, data = compose(cfg, mesh), build_dataset(cfg)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(1 + steps):
        s, loss = timed(engine, data.batch(step), cuda)
        times.append(s)
        losses.append(loss)
    tokens = cfg.data.batch_size * cfg.model.seq_len
    model = engine.store.model
    out = {"step_s": statistics.median(times[1:]), "tokens_per_s": tokens / statistics.median(times[1:]),
           "steps_s": times, "losses": losses,
           "params": sum(p.numel() for p in model.parameters()),
           "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad)
           if not hetero else sum(r.param.numel() for r in model._hetero_runtime.records if r.trainable),
           "device_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None, **state_bytes(engine)}
    engine.close()
    mesh.close()
    return out


def measure(gpu: bool, steps: int) -> dict:
    base = LLAMA_1B if gpu else TINY
    dist.init_process_group("gloo" if not gpu else "nccl", init_method=f"file://{tempfile.mkdtemp()}/rendezvous",
                            rank=0, world_size=1)
    try:
        runs = {name: run(base, lora, hetero, steps) for name, (lora, hetero) in WAYS.items()}
    finally:
        dist.destroy_process_group()
    return {"benchmark": "lora", "device": torch.cuda.get_device_name(0) if gpu else platform.processor() or "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "config": base, "lora": LORA,
            "steps": steps, "runs": runs,
            "lora_over_full_tokens_per_s": {s: runs[f"LoRA, {s}"]["tokens_per_s"] / runs[f"full, {s}"]["tokens_per_s"]
                                            for s in ("plain", "hetero")}}


def table(res: dict) -> list[str]:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lines = [f"LoRA vs full fine-tuning on {res['device']} (torch {res['torch']}), "
             f"{res['config']['model']['layers']}×{res['config']['model']['hidden']} llama, "
             f"{res['config']['train']['dtype']}, median of {res['steps']} steps",
             f"{'run':14s}{'trained':>12s}{'tokens/s':>11s}{'dev peak MiB':>14s}{'state MiB':>11s}"
             f"{'host MiB':>10s}{'host B/param':>13s}{'frozen B/p':>11s}"]
    for name, r in res["runs"].items():
        plain = r.get("parameter_bytes")
        state = (plain + r["gradient_bytes"] + (r["optimizer_state_bytes"] or 0)) if plain is not None \
            else r["hetero_device_bytes"]
        hb, per = r.get("hetero_host_bytes"), r.get("hetero_host_bytes_per_param")
        frozen = r.get("frozen_host_bytes_per_param")
        lines.append(f"{name:14s}{r['trained_params']:12d}{r['tokens_per_s']:11.0f}{mib(r['device_peak_bytes']):>14s}"
                     f"{mib(state):>11s}{mib(hb):>10s}{'-' if per is None else f'{per:.2f}':>13s}"
                     f"{'-' if frozen is None else f'{frozen:.2f}':>11s}")
    return lines


def gpu_lora(tiny: bool, out: str) -> dict:
    """``make gpu-check PART=lora``'s entry: the GPU shape (``tiny``: the CPU one); writes ``out``, returns the
    result with a one-line ``headline``."""
    res = measure(gpu=not tiny, steps=2 if tiny else 3)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    r = res["lora_over_full_tokens_per_s"]
    return {**res, "headline": f"LoRA {r['plain']:.2f}× full fine-tuning's tokens/s plain, {r['hetero']:.2f}× "
                               "under hetero"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the Llama-3.2-1B shape on the GPU (bfloat16)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = measure(a.gpu, a.steps)
    print("\n".join(table(res)))
    out = a.out or os.path.join(RESULTS, f"lora_{'gpu' if a.gpu else 'cpu'}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
