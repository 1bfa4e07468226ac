"""One transformer layer at q=2 on 4 CPU workers: SUMMA bytes vs the analytic formula,
and per-rank parameter + activation memory of Optimus 2D vs a Megatron-style 1D split
vs no split.

Usage: ``python benchmarks/tensor2d.py [--batch 8 --seq 64 --hidden 128 --heads 8]``.
Prints tables and writes ``benchmarks/results/tensor2d.json``.

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

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.distributed import comm  # noqa: E402
from parallel4d.distributed.mesh import init_mesh  # noqa: E402
from parallel4d.models.gpt2.model import Block, GPTShape  # noqa: E402
from parallel4d.models.gpt2.tp2d import Block2D  # noqa: E402
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
    ap.add_argument("--out", default=os.path.join(RESULTS, "tensor2d.json"))
    a = ap.parse_args(argv)
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


if __name__ == "__main__":
    main()
