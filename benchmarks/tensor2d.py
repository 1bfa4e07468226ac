"""One transformer layer at q=2 on 4 CPU workers: SUMMA bytes vs the analytic formula,
and per-rank parameter + activation memory of Optimus 2D vs a Megatron-style 1D split
vs no split. With ``--blocks``: the compute of every rank's 2D block on one device against the dense
block, per FLOP (see "Every rank's block on one device" below).

Usage: ``python benchmarks/tensor2d.py [--batch 8 --seq 64 --hidden 128 --heads 8]``.
Prints tables and writes ``benchmarks/results/tensor2d.json``.
``python benchmarks/tensor2d.py --blocks [--quick] [--device cuda]``: writes
``benchmarks/results/tensor2d_blocks_cpu.json`` (``gpu_tensor2d_blocks.json`` on a GPU).

Bytes are the comm helpers' counts (payload handed to / received from each
collective by this rank, see ``parallel4d.comm``), not wire bytes of a given
algorithm. The analytic per-rank volumes for a block size ``S`` (bytes) are:
broadcast: source sends S, the q-1 others receive S; reduce: q-1 non-roots send S,
the root receives (q-1)·S. Hence, with blocks ``A_blk, B_blk, C_blk`` (= matrix
bytes / q²):

* ``summa_ab``:  sent = A_blk + B_blk,            received = (q-1)(A_blk + B_blk)
* ``summa_abt``: sent = B_blk + (q-1)·C_blk,      received = (q-1)(B_blk + C_blk)
* ``summa_atb``: sent = A_blk + (q-1)·C_blk,      received = (q-1)(A_blk + C_blk)

Activation memory = bytes of the distinct tensors autograd saves for backward during
one forward of the layer (``saved_tensors_hooks``, de-duplicated by storage), plus the
layer's output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.distributed import comm  # noqa: E402
from parallel4d.distributed.mesh import init_mesh  # noqa: E402
from parallel4d.models.gpt2.model import Block, GPTShape  # noqa: E402
from parallel4d.models.gpt2.tp2d import Block2D  # noqa: E402
from parallel4d.models.llama.model import Block as LlamaBlock, LlamaShape  # noqa: E402
from parallel4d.models.llama.tp2d import LlamaBlock2D  # noqa: E402
from parallel4d.tensor2d.emulate import grid_ranks  # noqa: E402
from parallel4d.tensor2d import scatter_2d  # noqa: E402
from parallel4d.launcher.spawn import spawn  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# --- measurement helpers -------------------------------------------------------------


def saved_bytes(fn):
    """Run ``fn()``; return (output, bytes of distinct storages saved for backward)."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


def timed(step, iters):
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- Megatron-style 1D baseline (column-parallel then row-parallel) ------------------


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, stats):
        ctx.stats = stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        comm.all_reduce(g, None, stats=ctx.stats, label="megatron:all_reduce.bwd")
        return g, None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, stats):
        y = x.clone()
        comm.all_reduce(y, None, stats=stats, label="megatron:all_reduce.fwd")
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


class Megatron1DBlock(torch.nn.Module):
    """The dense block split 1D over all p ranks: qkv/fc1 by output columns (whole heads),
    proj/fc2 by input rows; LayerNorms and the residual stream replicated ``[b, s, h]``."""

    def __init__(self, dense: Block, p: int, r: int, stats):
        super().__init__()
        h = dense.attn.qkv.weight.shape[1]
        self.heads, self.p, self.stats = dense.attn.heads // p, p, stats
        w = h // p
        qkv_rows = torch.cat([torch.arange(part * h + r * w, part * h + (r + 1) * w) for part in range(3)])
        f = dense.mlp.fc1.weight.shape[0] // p
        P = torch.nn.Parameter
        self.ln1, self.ln2 = dense.ln1, dense.ln2  # replicated (shared objects: this is a benchmark)
        self.qkv_w = P(dense.attn.qkv.weight.detach()[qkv_rows].clone())
        self.qkv_b = P(dense.attn.qkv.bias.detach()[qkv_rows].clone())
        self.proj_w = P(dense.attn.proj.weight.detach()[:, r * w:(r + 1) * w].clone())
        self.proj_b = dense.attn.proj.bias  # added once, after the all-reduce
        self.fc1_w = P(dense.mlp.fc1.weight.detach()[r * f:(r + 1) * f].clone())
        self.fc1_b = P(dense.mlp.fc1.bias.detach()[r * f:(r + 1) * f].clone())
        self.fc2_w = P(dense.mlp.fc2.weight.detach()[:, r * f:(r + 1) * f].clone())
        self.fc2_b = dense.mlp.fc2.bias

    def forward(self, x):
        b, s, h = x.shape
        y = _CopyToGroup.apply(self.ln1(x), self.stats)
        qkv = F.linear(y, self.qkv_w, self.qkv_b).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        a = F.linear(a.transpose(1, 2).reshape(b, s, -1), self.proj_w)
        x = x + _ReduceFromGroup.apply(a, self.stats) + self.proj_b
        y = _CopyToGroup.apply(self.ln2(x), self.stats)
        m = F.linear(F.gelu(F.linear(y, self.fc1_w, self.fc1_b)), self.fc2_w)
        return x + _ReduceFromGroup.apply(m, self.stats) + self.fc2_b


# --- the worker -----------------------------------------------------------------------


def analytic_block_bytes(b, s, h, q, e, mlp=4):
    """Per-rank (sent, received) bytes of each SUMMA op of one block, keyed like the labels."""
    T = b * s
    linears = {"attn.qkv": (h, 3 * h), "attn.proj": (h, h), "mlp.fc1": (h, mlp * h), "mlp.fc2": (mlp * h, h)}
    out = {}
    for name, (fi, fo) in linears.items():
        x_blk, w_blk, y_blk = T * fi * e / q**2, fi * fo * e / q**2, T * fo * e / q**2
        out[f"{name}:summa_ab"] = (x_blk + w_blk, (q - 1) * (x_blk + w_blk))  # Y = X·W
        # dX = dY·Wᵀ: abt, broadcast W blocks, reduce dX blocks
        out[f"{name}.bwd:summa_abt"] = (w_blk + (q - 1) * x_blk, (q - 1) * (w_blk + x_blk))
        # dW = Xᵀ·dY: atb, broadcast X blocks, reduce dW blocks
        out[f"{name}.bwd:summa_atb"] = (x_blk + (q - 1) * w_blk, (q - 1) * (x_blk + w_blk))
    return out


def _job(b, s, h, heads, iters):
    mesh = init_mesh(tp=4)
    q, p, r = mesh.q, dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    dense = Block(GPTShape(hidden=h, heads=heads, seq_len=s))
    X = torch.randn(b, s, h)
    G = torch.randn(b, s, h)
    e = X.element_size()
    res = {}

    # no split (every rank computes the whole layer; measured on its own)
    out, act = saved_bytes(lambda: dense(X.clone().requires_grad_(True)))
    ref_out = out.detach()
    res["dense"] = dict(param_bytes=param_bytes(dense), activation_bytes=act + out.numel() * e,
                        step_s=timed(lambda: (dense(X.requires_grad_(False)) * G).sum().backward(), iters),
                        bytes_sent=0, bytes_received=0)

    # Optimus 2D
    blk = Block2D.from_dense(dense, mesh, name="block")
    x = scatter_2d(X, mesh).requires_grad_(True)
    g = scatter_2d(G, mesh)
    mesh.comm_stats.reset()
    y, act = saved_bytes(lambda: blk(x))
    torch.testing.assert_close(y, scatter_2d(ref_out, mesh), rtol=1e-4, atol=1e-5)
    (y * g).sum().backward()
    st = mesh.comm_stats
    ops = {}
    for label in st.calls:
        if ":summa_" not in label:
            continue
        key = label.split("/")[0].replace("block.", "", 1)
        s0, r0 = ops.get(key, (0, 0))
        ops[key] = (s0 + st.sent[label], r0 + st.received[label])
    other = {k: (st.sent[k], st.received[k]) for k in st.calls if ":summa_" not in k}
    res["optimus_2d"] = dict(param_bytes=param_bytes(blk), activation_bytes=act + y.numel() * e,
                             bytes_sent=st.total_sent(), bytes_received=st.total_received(),
                             summa_ops=ops, other_comm=other,
                             step_s=timed(lambda: (blk(x) * g).sum().backward(), iters))

    # Megatron 1D over the same 4 ranks
    stats = comm.CommStats()
    meg = Megatron1DBlock(dense, p, r, stats)
    xm = X.clone().requires_grad_(True)
    ym, act = saved_bytes(lambda: meg(xm))
    torch.testing.assert_close(ym, ref_out, rtol=1e-4, atol=1e-5)
    (ym * G).sum().backward()
    res["megatron_1d"] = dict(param_bytes=param_bytes(meg), activation_bytes=act + ym.numel() * e,
                              bytes_sent=stats.total_sent(), bytes_received=stats.total_received(),
                              comm=stats.as_dict(),
                              step_s=timed(lambda: (meg(xm) * G).sum().backward(), iters))
    return dict(rank=r, coords=mesh.coords, results=res, analytic=analytic_block_bytes(b, s, h, q, e))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None, help="the JSON written (default: under benchmarks/results/)")
    ap.add_argument("--blocks", action="store_true", help="every rank's Llama block on one device vs the dense block")
    ap.add_argument("--device", default=None, help="--blocks: cuda (the 8B block) or cpu (default: cuda if there is one)")
    ap.add_argument("--quick", action="store_true", help="--blocks on the CPU: the tiny block the tests run")
    ap.add_argument("--threads", type=int, default=1, help="--blocks on the CPU: torch's intra-op threads")
    a = ap.parse_args(argv)
    if a.blocks:
        return blocks_main(a)
    a.out = a.out or os.path.join(RESULTS, "tensor2d.json")
    world, q = 4, 2
    per_rank = spawn(_job, world, (a.batch, a.seq, a.hidden, a.heads, a.iters), timeout_s=600)

    r0 = per_rank[0]
    analytic = r0["analytic"]
    print(f"\nOne transformer layer, b={a.batch} s={a.seq} h={a.hidden} heads={a.heads}, q={q} "
          f"(4 CPU workers, fp32). SUMMA bytes per rank: counted vs analytic")
    print(f"{'op':34s} {'sent':>10s} {'analytic':>10s} {'recv':>10s} {'analytic':>10s}  match")
    ops_table, all_match = [], True
    for key, (sa, ra) in analytic.items():
        match = all(tuple(rr["results"]["optimus_2d"]["summa_ops"][key]) == (sa, ra) for rr in per_rank)
        all_match &= match
        sm, rm = r0["results"]["optimus_2d"]["summa_ops"][key]
        ops_table.append(dict(op=key, sent=sm, received=rm, analytic_sent=sa, analytic_received=ra, match_all_ranks=match))
        print(f"{key:34s} {sm:10d} {int(sa):10d} {rm:10d} {int(ra):10d}  {match}")
    summa_total = sum(sa + ra for sa, ra in analytic.values())
    print(f"{'SUMMA total per rank (sent+recv)':34s} {int(summa_total):10d} bytes "
          f"= {summa_total / (a.batch * a.seq * a.hidden * 4):.2f} × b·s·h·4")

    print("\nPer-rank memory and communication for one layer (forward + backward)")
    hdr = f"{'variant':14s} {'params':>10s} {'activations':>12s} {'act/dense':>9s} {'comm sent+recv':>15s} {'step s':>7s}"
    print(hdr)
    mem_table = {}
    dense_act = r0["results"]["dense"]["activation_bytes"]
    for name in ("dense", "megatron_1d", "optimus_2d"):
        vals = [rr["results"][name] for rr in per_rank]
        pb = max(v["param_bytes"] for v in vals)
        ab = max(v["activation_bytes"] for v in vals)
        cb = max(v["bytes_sent"] + v["bytes_received"] for v in vals)
        ts = max(v["step_s"] for v in vals)
        mem_table[name] = dict(param_bytes=pb, activation_bytes=ab, activation_ratio=ab / dense_act,
                               comm_bytes=cb, step_s=ts)
        print(f"{name:14s} {pb:10d} {ab:12d} {ab / dense_act:9.3f} {cb:15d} {ts:7.3f}")
    print(f"\n1/q² = {1 / q**2:.3f}; SUMMA bytes equal the analytic formula on every rank: {all_match}")

    result = dict(
        benchmark="tensor2d", device=f"cpu ({platform.processor() or platform.machine()}), gloo, 4 processes",
        torch=torch.__version__, python=platform.python_version(),
        config=dict(batch=a.batch, seq=a.seq, hidden=a.hidden, heads=a.heads, q=q, world=world, dtype="float32",
                    mlp_ratio=4, iters=a.iters),
        summa_ops=ops_table, summa_bytes_match_analytic=all_match, summa_total_bytes_per_rank=summa_total,
        per_rank=mem_table,
        optimus_other_comm=r0["results"]["optimus_2d"]["other_comm"],
        megatron_comm=r0["results"]["megatron_1d"]["comm"],
        notes=("bytes are per-rank payload counts of the comm helpers; activation bytes are distinct storages "
               "saved for backward plus the layer output; step_s is the median fwd+bwd wall time on a shared "
               "2-core CPU (indicative only)"),
    )
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")
    return result


# --- every rank's block on one device (#47.3) ------------------------------------------
#
# The 2D block's compute, measured: the q² ranks of a q×q grid are built in this one process
# (parallel4d.tensor2d.emulate.LocalRank, a stand-in for the mesh: the layers run their own code — the
# SUMMA loops and block products, the fp32 accumulation of bf16 products, the norms and the attention on
# the local blocks) and run forward + backward one after another on the device, every collective a local
# copy or add of a stand-in block (what a peer would send). Against the dense block on the same device:
#
#     efficiency per FLOP = (dense time / dense FLOPs) / (2D time of all q² ranks / their FLOPs)
#
# (per round, then the median of the rounds)
# FLOPs counted by torch's FlopCounterMode over one step of each (matrix products and attention, forward
# and backward): the q² ranks' FLOPs equal the dense block's (SUMMA splits the same products), so the
# figure is the dense time over the grid's summed time. 1.0: the blocks compute as fast as the whole; what
# the grid loses to smaller products, to their extra passes (fp32 accumulation, casts, copies) and to the
# copies standing for received blocks, is below it. Timing: CUDA events around `iters` steps, after a
# warm-up, the variants alternating in `rounds` (median of the rounds); no host sync inside the events
# (torch's sync debug mode counts any: `host_syncs`).


@dataclass(frozen=True)
class BlockSize:
    """One Llama-style block (attention with grouped-query heads + SwiGLU MLP) and its input."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    seq: int
    batch: int


# Llama 3 8B's block. Batch 4: Optimus cuts the batch over the grid's rows, so it is a multiple of q
# (4 serves q = 2 and q = 4 with one dense baseline); every rank then holds 4/q sequences of 4096 tokens.
GPU_BLOCK = BlockSize(hidden=4096, intermediate=14336, heads=32, kv_heads=8, seq=4096, batch=4)
CPU_BLOCK = BlockSize(hidden=512, intermediate=1792, heads=8, kv_heads=4, seq=256, batch=4)
TINY_BLOCK = BlockSize(hidden=64, intermediate=224, heads=8, kv_heads=4, seq=32, batch=4)
TARGET_Q2 = 0.85  # efficiency per FLOP wanted at q = 2 (#47.3)


def llama_block(size: BlockSize, device, dtype) -> LlamaBlock:
    """The dense block, seeded, built on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    shape = LlamaShape(hidden=size.hidden, heads=size.heads, kv_heads=size.kv_heads, intermediate_size=size.intermediate,
                       seq_len=size.seq, rope_theta=500000.0)
    with torch.device(device):
        return LlamaBlock(shape).to(dtype)


def _runs(modules, xs, gs):
    """One step: every (module, input, output gradient) in turn, forward then backward (gradients
    set to None first: no accumulation kernels)."""

    def step():
        for m, x, g in zip(modules, xs, gs):
            m.zero_grad(set_to_none=True)
            x.grad = None
            m(x).backward(g)

    return step


def dense_step(dense, X, G):
    return _runs([dense], [X.detach().requires_grad_(True)], [G])


def grid_blocks(dense, X, G, q: int) -> tuple[list, list, list]:
    """The q² ranks of a q×q grid built from ``dense``: their 2D blocks and each one's block of ``X`` / ``G``
    (``[b/q, s, h/q]``)."""
    ranks = grid_ranks(q, X.device)
    blocks = [LlamaBlock2D.from_dense(dense, r, name="block") for r in ranks]
    xs = [X.chunk(q, 0)[r.rank("tp_row")].chunk(q, -1)[r.rank("tp_col")].contiguous().requires_grad_(True) for r in ranks]
    gs = [G.chunk(q, 0)[r.rank("tp_row")].chunk(q, -1)[r.rank("tp_col")].contiguous() for r in ranks]
    return blocks, xs, gs


def grid_step(dense, X, G, q: int):
    """The step of all q² ranks of a q×q grid built from ``dense``, each on its block of ``X`` / ``G``."""
    return _runs(*grid_blocks(dense, X, G, q))


def step_flops(step) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops()


@contextmanager
def _syncs_counted(device, into: list):
    """On CUDA, torch's sync debug mode warns at each operation that makes the host wait; counted into ``into``."""
    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    into.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())


def alternating_times(steps: dict, warmup: int, rounds: int, iters: int, device) -> tuple[dict, list]:
    """``({name: [seconds per step, one per round]}, host syncs seen)`` of ``steps`` (name → a step), warmed up
    ``warmup`` times each, then timed in ``rounds`` rounds that run every variant in turn: a drift of the
    clock or the load falls on every variant alike. On a GPU the peak-memory counter starts after the warmup."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    syncs: list = []
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(timed_steps(step, iters, device, syncs))
    return times, syncs


def timed_steps(step, iters: int, device, syncs: list) -> float:
    """Seconds per step over ``iters`` steps: CUDA events on a GPU (the host waits only after the last)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with _syncs_counted(device, syncs):
            start.record()
            for _ in range(iters):
                step()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def measure_blocks(size: BlockSize = GPU_BLOCK, qs=(2, 4), device="cuda", dtype=torch.bfloat16, warmup: int = 2,
                   iters: int = 3, rounds: int = 3) -> dict:
    """The dense block and every rank's 2D block at each q in ``qs``, forward + backward on ``device``:
    seconds per step, FLOPs, TFLOP/s and the efficiency per FLOP of each q (the section's comment)."""
    device = torch.device(device)
    for q in qs:
        for what, n in (("batch", size.batch), ("hidden", size.hidden), ("heads", size.heads),
                        ("kv_heads", size.kv_heads), ("intermediate", size.intermediate)):
            if n % q:
                raise ValueError(f"{what}={n} is not a multiple of q={q}: pick sizes every q divides")
    dense = llama_block(size, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    X = torch.randn(size.batch, size.seq, size.hidden, generator=g).to(device, dtype)
    G = torch.randn(size.batch, size.seq, size.hidden, generator=g).to(device, dtype)
    steps = {"dense": dense_step(dense, X, G), **{f"q{q}": grid_step(dense, X, G, q) for q in qs}}
    flops = {name: step_flops(step) for name, step in steps.items()}
    times, syncs = alternating_times(steps, warmup, rounds, iters, device)
    out = {}
    for name in steps:
        t = statistics.median(times[name])
        out[name] = dict(step_s=t, best_s=min(times[name]), rounds_s=times[name], flops=flops[name],
                         tflops_per_s=flops[name] / t / 1e12)
    for q in qs:
        r, d = out[f"q{q}"], out["dense"]
        # per round (the variants ran back to back there), then the median: a load that changes between
        # rounds moves both times of a round alike
        per_round = [(r["flops"] / t2d) / (d["flops"] / td) for t2d, td in zip(r["rounds_s"], d["rounds_s"])]
        r.update(q=q, ranks=q * q, per_rank_step_s=r["step_s"] / q**2, flops_over_dense=r["flops"] / d["flops"],
                 efficiency_per_flop=statistics.median(per_round), efficiency_rounds=per_round)
    return dict(
        benchmark="tensor2d_blocks",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads",
        torch=torch.__version__, python=platform.python_version(), dtype=str(dtype).replace("torch.", ""),
        block=asdict(size), qs=list(qs), warmup=warmup, iters=iters, rounds=rounds,
        host_syncs=len(syncs), host_sync_messages=sorted(set(syncs))[:5],
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        target_efficiency_q2=TARGET_Q2, results=out,
        emulated=("every rank of the q x q grid built in one process (parallel4d.tensor2d.emulate.LocalRank) and run "
                  "forward + backward in turn on the one device; collectives are local copies/adds of stand-in blocks"),
    )


def blocks_on_gpu() -> dict:
    """For ``benchmarks/gpu_check.py``: the 8B-shaped block at q = 2 and 4 on ``cuda``, bf16 (~20-40 s on
    one H100/H200, CUDA start-up included)."""
    return measure_blocks(GPU_BLOCK, (2, 4), "cuda", torch.bfloat16, warmup=2, iters=3, rounds=3)


def gpu_block(tiny: bool, out: str) -> dict:
    """``make gpu-check``'s entry (benchmarks/gpu_check_steps.py): :func:`blocks_on_gpu`, or with ``tiny`` (its
    CPU dry run) the tiny block on the CPU; writes ``out`` and returns the result with a one-line ``headline``."""
    if tiny:
        res = measure_blocks(TINY_BLOCK, (2, 4), torch.device("cpu"), torch.float32, warmup=1, iters=1, rounds=1)
    else:
        res = blocks_on_gpu()
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    effs = ", ".join(f"q={q}: {res['results'][f'q{q}']['efficiency_per_flop']:.2f}" for q in res["qs"])
    return {**res, "headline": f"2D block efficiency per FLOP {effs} (target >= {res['target_efficiency_q2']} at q = 2)"}


def print_blocks(res: dict) -> None:
    b, dense = res["block"], res["results"]["dense"]
    print(f"\nOne Llama block (h={b['hidden']}, I={b['intermediate']}, heads {b['heads']}/{b['kv_heads']}, "
          f"s={b['seq']}, batch {b['batch']}, {res['dtype']}) forward + backward on {res['device']}")
    print(f"{'variant':10s} {'step s':>9s} {'per rank s':>10s} {'GFLOP':>10s} {'TFLOP/s':>8s} {'eff/FLOP':>9s}")
    print(f"{'dense':10s} {dense['step_s']:9.4f} {'':>10s} {dense['flops'] / 1e9:10.2f} {dense['tflops_per_s']:8.3f}")
    for q in res["qs"]:
        r = res["results"][f"q{q}"]
        target = f"  (target >= {res['target_efficiency_q2']} at q = 2)" if q == 2 else ""
        print(f"{f'2D q={q}':10s} {r['step_s']:9.4f} {r['per_rank_step_s']:10.4f} {r['flops'] / 1e9:10.2f} "
              f"{r['tflops_per_s']:8.3f} {r['efficiency_per_flop']:9.3f}{target}")
    print(f"host syncs inside the timed steps: {res['host_syncs']}")


def blocks_main(a) -> dict:
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        res = blocks_on_gpu()
        out = a.out or os.path.join(RESULTS, "gpu_tensor2d_blocks.json")
    else:  # one thread by default: on a shared machine idle-spinning intra-op threads slow small products 10-100x
        size, threads = TINY_BLOCK if a.quick else CPU_BLOCK, torch.get_num_threads()
        torch.set_num_threads(a.threads)
        try:
            res = measure_blocks(size, (2, 4), device, torch.float32, warmup=1, iters=1 if a.quick else 2,
                                 rounds=1 if a.quick else 5)
        finally:
            torch.set_num_threads(threads)
        out = a.out or os.path.join(RESULTS, "tensor2d_blocks_cpu.json")
    print_blocks(res)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
