"""A Qwen3-30B-A3B-shaped mixture-of-experts layer: the experts as grouped matrix products against the loop.

One MoE layer of parallel4d's llama family (``models/moe``: the router, top-k, the dispatch of
``parallel4d.experts``, the experts' SwiGLU), forward and backward over the same tokens, the experts
computed two ways — ``grouped``: ``routing.grouped_ffn`` (three ``torch._grouped_mm`` calls, the counts
left on the device) and ``loop``: ``routing.looped_ffn`` (one product per expert with rows, the counts read
once) — alternating, each a median of its steps. Reports each one's step, tokens/s and the ratio, the
largest difference of their outputs, and whether the grouped product was usable here.

Shape: hidden 2048, 128 experts, top-8, expert width 768 (Qwen3-30B-A3B's ``moe_intermediate_size``),
``norm_topk_prob``; bf16 autocast over float32 weights. On a GPU: 8192 tokens (4 × 2048), CUDA events; on
a CPU: 256 tokens (``--quick``: a small layer of 16 experts, the dry run of ``make gpu-check``).

Usage: ``python benchmarks/moe_layer.py [--tokens N] [--steps 5] [--quick] [--cpu] [--out FILE]``; writes
``benchmarks/results/moe_layer[_cpu].json`` and prints a table.
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

from parallel4d.models.moe import routing  # noqa: E402
from parallel4d.models.moe.layer import SparseMoE  # noqa: E402
from parallel4d.models.moe.spec import MoeShape  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QWEN3_30B_A3B = {"hidden": 2048, "experts": 128, "top_k": 8, "width": 768}
QUICK = {"hidden": 128, "experts": 16, "top_k": 4, "width": 64}


def layer(shape: dict, device) -> SparseMoE:
    moe = MoeShape(num_experts=shape["experts"], top_k=shape["top_k"], expert_width=shape["width"],
                   norm_topk_prob=True)
    m = SparseMoE(moe, shape["hidden"], layer=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return m.to(device)


def timed_step(m: SparseMoE, x: torch.Tensor, ffn, half: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one forward and backward with ``ffn`` as the experts' function, and the output."""
    cuda = x.device.type == "cuda"
    try:  # the experts' forward through ``ffn`` for this step (an instance attribute, deleted after)
        m.experts.forward = lambda rows, counts: ffn(rows, counts, m.experts.gate_proj, m.experts.up_proj,
                                                     m.experts.down_proj)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=half):
            y = m(x)
        y.float().square().mean().backward()
        if cuda:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, y.detach()
        return time.perf_counter() - t0, y.detach()
    finally:
        del m.experts.forward
        m.zero_grad(set_to_none=True)


def measure(shape: dict, tokens: int, steps: int, device) -> dict:
    half = True  # bf16 autocast, as MoE models train (the grouped product takes bf16 alone)
    m = layer(shape, device)
    x = torch.randn(1, tokens, shape["hidden"], generator=torch.Generator().manual_seed(1)).to(device)
    usable = routing.grouped_usable(x.reshape(tokens, -1).to(torch.bfloat16), m.experts.gate_proj,
                                    m.experts.down_proj)
    ways = {"loop": routing.looped_ffn, **({"grouped": routing.grouped_ffn} if usable else {})}
    times = {w: [] for w in ways}
    outs = {}
    for w, ffn in ways.items():  # warm-up (allocator, kernels' first launches)
        _, outs[w] = timed_step(m, x, ffn, half)
    for i in range(steps):
        for w in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
            times[w].append(timed_step(m, x, ffn=ways[w], half=half)[0])
    res = {w: {"step_s": statistics.median(ts), "steps_s": ts, "tokens_per_s": tokens / statistics.median(ts)}
           for w, ts in times.items()}
    if usable:
        res["grouped_over_loop_speed"] = res["loop"]["step_s"] / res["grouped"]["step_s"]
        res["max_abs_diff"] = float((outs["grouped"].float() - outs["loop"].float()).abs().max())
    return {"benchmark": "moe_layer", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "shape": shape, "tokens": tokens, "dtype": "bfloat16 autocast",
            "grouped_usable": usable, "results": res}


def gpu_moe(tiny: bool, out: str) -> dict:
    """``make gpu-check``'s entry: the layer on the GPU (``tiny``: the quick layer on the CPU); writes ``out``,
    returns the result with a one-line ``headline``."""
    device = torch.device("cpu") if tiny else torch.device("cuda", 0)
    res = measure(QUICK if tiny else QWEN3_30B_A3B, 64 if tiny else 8192, 1 if tiny else 5, device)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    r = res["results"]
    line = (f"MoE layer grouped {r['grouped_over_loop_speed']:.2f}× the loop's speed" if res["grouped_usable"]
            else "MoE layer: grouped product not usable here, loop only") + \
        f", loop {r['loop']['step_s'] * 1e3:.1f} ms for {res['tokens']} tokens"
    return {**res, "headline": line}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a small layer (16 experts, top-4, hidden 128)")
    ap.add_argument("--cpu", action="store_true", help="on the CPU even where a GPU is")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = QUICK if a.quick else QWEN3_30B_A3B
    res = measure(shape, a.tokens or (8192 if cuda else 256), a.steps, device)
    r = res["results"]
    print(f"MoE layer h={shape['hidden']} E={shape['experts']} top-{shape['top_k']} I={shape['width']}, "
          f"{res['tokens']} tokens, {res['dtype']}, forward + backward on {res['device']}")
    print(f"{'experts':10s}{'ms/step':>10s}{'tokens/s':>12s}")
    for w in ("loop", "grouped"):
        if w in r:
            print(f"{w:10s}{r[w]['step_s'] * 1e3:10.2f}{r[w]['tokens_per_s']:12.0f}")
    if res["grouped_usable"]:
        print(f"grouped / loop speed: {r['grouped_over_loop_speed']:.2f}×, outputs differ by at most {r['max_abs_diff']:.2e}")
    else:
        print("grouped product not usable for these tensors here: loop only")
    out = a.out or os.path.join(RESULTS, "moe_layer" + ("" if cuda else "_cpu") + ".json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
