"""Ring attention against dense softmax attention (float64), on 2/3/4 gloo ranks.

One spawn per ring size runs every case; the dense reference is computed on each
worker from the same seeded full tensors (gathered ring results are compared to it).
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import run_workers
from parallel4d.distributed.comm import CommStats
from parallel4d.distributed.mesh import init_mesh
from parallel4d.sequence import (LAYOUTS, causal_balance, gather_sequence, local_positions, make_ring_attention_fn,
                                 positions_for, ring_attention, ring_bytes, split_sequence, step_plan)
from parallel4d.sequence.emulate import ring_backward, ring_forward, shard, unshard
from parallel4d.sequence.ring import FWD_KV

TOL = dict(rtol=1e-10, atol=1e-10)


def dense_attention(q, k, v, causal, scale=None):
    """Independent reference: explicit scores over the whole sequence, K/V repeated for GQA."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def _inputs(seed, b, h, hkv, s, d):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return mk(b, h, s, d), mk(b, hkv, s, d), mk(b, hkv, s, d), mk(b, h, s, d)


class _Largest(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _run_case(group, n, layout, causal, b, h, hkv, s, d, backend="math", scale=None, seed=0, record=False):
    """One ring forward+backward vs dense; returns max errors, byte checks, recorded shapes."""
    q, k, v, dout = _inputs(seed, b, h, hkv, s, d)
    ql, kl, vl = (split_sequence(x, group, 2, layout).requires_grad_() for x in (q, k, v))
    dl = split_sequence(dout, group, 2, layout)
    stats = CommStats()
    mode = _Largest() if record else None
    if mode:
        mode.__enter__()
    try:
        out = ring_attention(ql, kl, vl, group, causal=causal, layout=layout, scale=scale, stats=stats,
                             timeout_s=60, backend=backend)
        fwd_sent = dict(stats.sent)
        n_fwd = len(mode.shapes) if mode else 0
        out.backward(dl)
    finally:
        if mode:
            mode.__exit__(None, None, None)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = dense_attention(qr, kr, vr, causal, scale)
    ref.backward(dout)
    got = [gather_sequence(x, group, 2, layout) for x in (out.detach(), ql.grad, kl.grad, vl.grad)]
    errs = [float((a - r).abs().max()) for a, r in zip(got, (ref.detach(), qr.grad, kr.grad, vr.grad))]
    want = ring_bytes(n, b, hkv, s // n, d, q.dtype)
    bytes_ok = (fwd_sent.get(FWD_KV, 0) == want[FWD_KV] and set(fwd_sent) <= {FWD_KV}
                and all(stats.sent.get(lbl, 0) == want[lbl] and stats.received.get(lbl, 0) == want[lbl]
                        for lbl in want)
                and set(stats.sent) <= set(want))
    return dict(case=(layout, causal, h, hkv, s, backend), errs=errs, bytes_ok=bytes_ok,
                sent=dict(stats.sent), want=want, shapes=mode.shapes if mode else None, n_fwd=n_fwd,
                out_shape=tuple(out.shape))


def _event_order(group, n):
    """Order of posts, waits and block computes in one forward+backward (non-causal)."""
    import parallel4d.distributed.comm as C
    import parallel4d.sequence.kernels as K

    events = []
    orig = (C.p2p, C.wait, K.block_forward, K.block_backward)

    def p2p(ops, *a, **kw):
        events.append("P" + kw["label"].split(".")[-1])
        return orig[0](ops, *a, **kw)

    def wait(works, timeout_s=None, what="", deadlines=None):
        events.append("W" + ("dkv" if "dK/dV" in what else "kv"))
        return orig[1](works, timeout_s, what, deadlines)

    def fwd(*a, **kw):
        events.append("C")
        return orig[2](*a, **kw)

    def bwd(*a, **kw):
        events.append("C")
        return orig[3](*a, **kw)

    C.p2p, C.wait, K.block_forward, K.block_backward = p2p, wait, fwd, bwd
    try:
        q, k, v, dout = (split_sequence(x, group, 2, "zigzag") for x in _inputs(0, 1, 2, 2, 4 * n, 4))
        q.requires_grad_()
        out = ring_attention(q, k, v, group, causal=False, layout="zigzag")
        n_fwd = len(events)
        out.backward(dout)
    finally:
        C.p2p, C.wait, K.block_forward, K.block_backward = orig
    return events[:n_fwd], events[n_fwd:]


def _ring_job(n, sp_world):
    """All exactness/bytes/memory cases for ring size ``n`` (run on every worker)."""
    if sp_world == n:
        group = dist.group.WORLD
    else:  # embed the ring in a larger mesh so group-local ≠ global ranks
        group = init_mesh(dp=sp_world // n, sp=n).group("sp")
    b, d = 2, 8
    results = []
    for layout in LAYOUTS:
        for causal in (False, True):
            for h, hkv in ((4, 4), (4, 2)):
                results.append(_run_case(group, n, layout, causal, b, h, hkv, 6 * n, d))
            # the fused CPU kernel (same LSE/backward protocol as the CUDA kernels), GQA
            results.append(_run_case(group, n, layout, causal, b, 4, 1, 4 * n, d, backend="cpu_flash"))
    # one token per rank, explicit scale
    for causal in (False, True):
        results.append(_run_case(group, n, "contiguous", causal, 1, 2, 1, n, 4, scale=0.7))
    # memory: record every tensor created in forward+backward (L = s/N = 16 > 2d)
    mem = [_run_case(group, n, layout, True, 2, 4, hkv, 16 * n, 4, record=True, seed=1)
           for layout, hkv in (("contiguous", 4), ("zigzag", 2))]
    for m in mem:
        s = m["case"][4]
        L, bh = s // n, 2 * 4
        m["largest"] = max(math.prod(shape) for _, shape in m["shapes"])
        m["largest_dim"] = max((max(shape) if shape else 0) for _, shape in m["shapes"])
        m["n_backward_ops"] = len(m["shapes"]) - m["n_fwd"]
        m["bound"] = bh * L * L
        m["full_row"] = bh * L * s
        m["shapes"] = None
    return dict(rank=dist.get_rank(), results=results, mem=mem, order=_event_order(group, n))


def _check_job(out, n):
    for worker in out:
        for r in worker["results"] + worker["mem"]:
            assert max(r["errs"]) <= 1e-10, (n, r["case"], r["errs"])
            assert r["bytes_ok"], (n, r["case"], r["sent"], r["want"])
        for m in worker["mem"]:
            # Nothing of [s/N, s] or larger: the largest tensor is one block pair's scores.
            assert m["largest"] <= m["bound"] < m["full_row"], (n, m["case"], m["largest"], m["bound"])
            assert m["largest_dim"] < m["case"][4], (n, m["case"], m["largest_dim"])
            assert m["n_backward_ops"] > 0  # the mode really saw the backward
        # Overlap: the next block's transfer is posted before this block's compute; the
        # dK/dV accumulator is waited for only after this step's compute.
        fwd, bwd = worker["order"]
        want_f, want_b = [], []
        for t in range(n):
            want_f += (["Wkv"] if t else []) + (["Pkv"] if t < n - 1 else []) + ["C"]
            want_b += (["Wkv"] if t else []) + (["Pkv"] if t < n - 1 else []) + ["C"] + (["Wdkv"] if t else [])
            want_b += ["Pdkv"]
        assert fwd == want_f and bwd == want_b + ["Wdkv"], (n, fwd, bwd)


@pytest.mark.parametrize("n,world", [(2, 4), (3, 3), (4, 4)])
def test_ring_attention_matches_dense(n, world):
    out = run_workers(_ring_job, world, n, world, timeout_s=300)
    _check_job(out, n)


# --------------------------------------------------------------------------- adapter in the GPT


def _gpt_job(n):
    """The ring adapter in the reference GPT, causal and bidirectional (``GPTShape.causal``, which
    the engine sets from ``sequence.causal``), against the dense model: logit and gradient errors."""
    from parallel4d.models.gpt2.model import GPTShape, build_gpt
    from parallel4d.models.stages import cross_entropy

    group = dist.group.WORLD
    res = {}
    for causal in (True, False):
        shape = GPTShape(vocab_size=32, seq_len=8 * n, hidden=16, heads=4, layers=2, causal=causal)
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 32, (2, shape.seq_len), generator=g)
        targets = torch.randint(0, 32, (2, shape.seq_len), generator=g)
        ref = build_gpt(shape, seed=0).double()
        ref_logits = ref(tokens)
        cross_entropy(ref_logits, targets).backward()
        res[("ref", causal)] = ref_logits.detach()
        for layout in LAYOUTS:
            model = build_gpt(shape, seed=0).double()
            fn = make_ring_attention_fn(group, layout)
            for blk in model.blocks:
                blk.attn.attention_fn = fn
            tl, yl = (split_sequence(x, group, 1, layout) for x in (tokens, targets))
            x = model.embed(tl, positions_for(shape.seq_len, group, layout))
            for blk in model.blocks:
                x = blk(x)
            logits = model.head(x)
            (cross_entropy(logits, yl) / n).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            full = gather_sequence(logits.detach().unsqueeze(1), group, 2, layout).squeeze(1)
            res[(layout, causal)] = (
                float((full - ref_logits.detach()).abs().max()),
                max(float((p.grad - pr.grad).abs().max()) for p, pr in zip(model.parameters(), ref.parameters())))
    # the two dense references differ: the bidirectional cases check something the causal ones do not
    res["ref_gap"] = float((res.pop(("ref", True)) - res.pop(("ref", False))).abs().max())
    return res


def test_adapter_in_reference_gpt():
    out = run_workers(_gpt_job, 2, 2, timeout_s=300, preload=())
    for res in out:
        assert res.pop("ref_gap") > 1e-3
        assert len(res) == 2 * len(LAYOUTS)
        for case, (logit_err, grad_err) in res.items():
            assert logit_err <= 1e-10 and grad_err <= 1e-10, (case, logit_err, grad_err)


# --------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_step_plan_covers_exactly_the_causal_mask(n, layout):
    """Every visible (query, key) pair of every rank is computed exactly once, no other."""
    s = (2 * n) * 3
    L = s // n
    for r in range(n):
        pq = torch.tensor(local_positions(s, r, n, layout))
        for src in range(n):
            pk = torch.tensor(local_positions(s, src, n, layout))
            for causal in (False, True):
                cover = torch.zeros(L, L, dtype=torch.long)
                for c in step_plan(r, src, n, layout, causal, L):
                    blk = torch.ones(c.q_hi - c.q_lo, c.k_hi - c.k_lo, dtype=torch.long)
                    if c.causal:
                        # the kernel's diagonal mask is only right where local order = global order
                        assert torch.equal(pq[c.q_lo:c.q_hi], pk[c.k_lo:c.k_hi])
                        blk = blk.tril()
                    cover[c.q_lo:c.q_hi, c.k_lo:c.k_hi] += blk
                want = (pk[None, :] <= pq[:, None]).long() if causal else torch.ones(L, L, dtype=torch.long)
                assert torch.equal(cover, want), (n, layout, r, src, causal)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_causal_balance(n):
    s = 2 * n * 8
    zig, con = causal_balance(n, "zigzag", s), causal_balance(n, "contiguous", s)
    for bal in (zig, con):  # exact pair counts from the positions alone
        for r in range(n):
            assert bal.pairs[r] == sum(p + 1 for p in local_positions(s, r, n, bal.layout))
        assert sum(bal.work) == pytest.approx(2 * n * n)  # total area s²/2 in (s/2N)² units
    assert max(zig.work) - min(zig.work) <= 1 and zig.imbalance == pytest.approx(1.0)
    assert all(c == n for c in zig.calls)  # one kernel call per zigzag ring step
    # contiguous: rank r does 4r+2 half-block pairs; the last rank sets the pace
    assert con.work == pytest.approx(tuple(4 * r + 2 for r in range(n)))
    assert con.imbalance == pytest.approx((2 * n - 1) / n)


@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
def test_single_device_emulation_matches_dense(backend):
    """The benchmark's all-ranks-on-one-device path, incl. the fused CPU kernel."""
    for layout in LAYOUTS:
        for causal in (False, True):
            q, k, v, do = _inputs(5, 2, 4, 2, 48, 8)
            qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
            ref = dense_attention(qr, kr, vr, causal)
            ref.backward(do)
            n = 4
            qs, ks, vs = shard(q, n, layout), shard(k, n, layout), shard(v, n, layout)
            outs, lses = ring_forward(qs, ks, vs, layout, causal, backend=backend)
            dqs, dks, dvs = ring_backward(shard(do, n, layout), qs, ks, vs, outs, lses, layout, causal,
                                          backend=backend)
            for got, want in ((outs, ref), (dqs, qr.grad), (dks, kr.grad), (dvs, vr.grad)):
                torch.testing.assert_close(unshard(got, layout), want.detach(), **TOL)


def test_merge_is_stable_for_far_apart_lse():
    from parallel4d.sequence import merge_

    out = torch.tensor([[[[1.0, 2.0]]]], dtype=torch.float64)
    lse = torch.tensor([[[800.0]]], dtype=torch.float64)
    merge_(out, lse, torch.tensor([[[[3.0, 5.0]]]], dtype=torch.float64), torch.tensor([[[-800.0]]],
                                                                                        dtype=torch.float64))
    assert torch.isfinite(out).all() and torch.allclose(out, torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert lse.item() == 800.0
    empty_out = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    empty_lse = torch.full((1, 1, 1), float("-inf"), dtype=torch.float64)
    merge_(empty_out, empty_lse, torch.tensor([[[[3.0, 5.0]]]], dtype=torch.float64),
           torch.tensor([[[2.5]]], dtype=torch.float64))
    assert empty_out.flatten().tolist() == [3.0, 5.0] and empty_lse.item() == 2.5


def _merge_cases(dtype_blk=torch.float64):
    """Accumulators ``[2, 3, 8, 4]`` (float64) and a block for rows 4..7 (a view, as a zigzag step's second
    piece): ordinary rows, far-apart LSEs, accumulator rows with nothing yet (-inf) and block rows that
    attend nothing (-inf, as a document mask leaves them), one of them both."""
    g = torch.Generator().manual_seed(7)
    out = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    lse = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    lse[0, 0, 5], out[0, 0, 5] = float("-inf"), 0.0  # nothing yet: takes the block's row
    lse[0, 1, 7], out[0, 1, 7] = float("-inf"), 0.0  # nothing yet, and the block's row attends nothing either
    out_blk = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64).to(dtype_blk)
    lse_blk = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    lse_blk[1, 2, 0], lse_blk[0, 1, 3] = -900.0, float("-inf")
    lse_blk[0, 0, 1] = 700.0
    return out, lse, out_blk, lse_blk


@pytest.mark.parametrize("dtype_blk", [torch.float64, torch.bfloat16])
def test_the_fused_merge_equals_the_eager_one_on_row_views(dtype_blk):
    """The merge the ring compiles for CUDA (``fused_merge``: one pass) is captured whole by ``torch.compile``
    and writes the same accumulators as the eager ``merge_``, in place through row views, empty and far-apart
    rows included (float64 accumulators; a bf16 block as the GPU's). ``aot_eager`` replays the captured
    graph on CPU: Triton's code for it is the gpu-marked test's."""
    from parallel4d.sequence.kernels import fused_merge, merge_

    want_out, want_lse, out_blk, lse_blk = _merge_cases(dtype_blk)
    got_out, got_lse = want_out.clone(), want_lse.clone()
    merge_(want_out[:, :, 4:], want_lse[:, :, 4:], out_blk, lse_blk)
    fused_merge("aot_eager")(got_out[:, :, 4:], got_lse[:, :, 4:], out_blk, lse_blk)
    assert torch.isfinite(want_out).all() and want_lse[0, 1, 7] == float("-inf")
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=1e-15)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-15)


def test_a_merge_that_does_not_compile_falls_back_to_the_eager_one_with_a_warning():
    """Where torch cannot compile the fused merge (a machine without a compiler for Triton), the ring still
    merges, eagerly, and says so once."""
    from torch._dynamo.exc import TorchDynamoException  # what torch.compile raises when a backend fails

    from parallel4d.sequence.kernels import FusedOrEager, merge_

    calls = []

    def broken(*args):
        calls.append(args)
        raise TorchDynamoException("backend='inductor' raised: no C compiler")

    merge = FusedOrEager(broken)
    want_out, want_lse, out_blk, lse_blk = _merge_cases()
    got_out, got_lse = want_out.clone(), want_lse.clone()
    merge_(want_out[:, :, 4:], want_lse[:, :, 4:], out_blk, lse_blk)
    with pytest.warns(RuntimeWarning, match="merging eagerly"):
        merge(got_out[:, :, 4:], got_lse[:, :, 4:], out_blk, lse_blk)
    merge(got_out[:, :, :4], got_lse[:, :, :4], out_blk, lse_blk)  # the second call goes straight to merge_
    merge_(want_out[:, :, :4], want_lse[:, :, :4], out_blk, lse_blk)
    assert len(calls) == 1 and torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_blk", [torch.float64, torch.bfloat16])
def test_the_fused_merge_on_cuda_equals_the_eager_one(dtype_blk):
    """Inductor's Triton code for the fused merge (what ``benchmarks/sequence.py --compile-merge`` times)
    compiles on the GPU and gives the eager merge's accumulators (float64, bf16 blocks as the kernels give)."""
    from parallel4d.sequence.kernels import fused_merge, merge_

    fused = fused_merge()
    want_out, want_lse, out_blk, lse_blk = (x.cuda() for x in _merge_cases(dtype_blk))
    got_out, got_lse = want_out.clone(), want_lse.clone()
    merge_(want_out[:, :, 4:], want_lse[:, :, 4:], out_blk, lse_blk)
    fused(got_out[:, :, 4:], got_lse[:, :, 4:], out_blk, lse_blk)
    assert fused.failed is None
    torch.testing.assert_close(got_out, want_out, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-14, atol=1e-14)


def test_the_ring_launches_few_ops_beside_its_block_kernels():
    """Every rank's steps of a causal zigzag ring of 8 (bf16 blocks, fp32 accumulators: the GPU's path, on
    CPU) dispatch at most 9.5 ops per block call beside the kernel itself, forward and backward together
    (11.0 before the query rows were cut once per pass and the merge's empty-row guard kept to documents):
    on a GPU each is a launch, and small blocks leave the ring waiting on them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sequence import LaunchCount  # benchmarks/sequence.py's count of launches
    n, layout = 8, "zigzag"
    q, k, v, do = (torch.randn(1, 2, 16 * n, 8, dtype=torch.bfloat16) for _ in range(4))
    qs, ks, vs, dos = (shard(x, n, layout) for x in (q, k, v, do))
    with LaunchCount() as fwd:
        outs, lses = ring_forward(qs, ks, vs, layout, True, backend="cpu_flash")
    with LaunchCount() as bwd:
        ring_backward(dos, qs, ks, vs, outs, lses, layout, True, backend="cpu_flash")
    calls = sum(len(step_plan(r, (r - t) % n, n, layout, True, 16)) for r in range(n) for t in range(n))
    kernel_ops = 2 * calls  # one forward and one backward op per call
    assert (fwd.count + bwd.count - kernel_ops) / calls <= 9.5, (fwd.count, bwd.count, calls)


def test_user_errors_are_value_errors():
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, kv, kv, None, layout="striped")
    with pytest.raises(ValueError, match="k/v heads 3"):
        ring_attention(q, torch.zeros(1, 3, 3, 8), torch.zeros(1, 3, 3, 8), None)
    with pytest.raises(ValueError, match="even local length"):
        ring_attention(q, kv, kv, None, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="4-D"):
        ring_attention(q[0], kv, kv, None)
    with pytest.raises(ValueError, match="match q"):
        ring_attention(q, torch.zeros(1, 4, 5, 8), torch.zeros(1, 4, 5, 8), None)
    with pytest.raises(ValueError, match="backend"):
        ring_attention(q, kv, kv, None, backend="cudnn")
    from parallel4d.sequence import check_seq_len

    with pytest.raises(ValueError, match="multiple of 8.*nearest valid values: 96 or 104"):
        check_seq_len(100, 4, "zigzag")


@pytest.mark.gpu
@pytest.mark.parametrize("backend, dtype, tol", [("cudnn", torch.bfloat16, 1e-2), ("flash", torch.bfloat16, 1e-2),
                                                 ("efficient", torch.bfloat16, 1e-2),
                                                 ("efficient", torch.float32, 1e-4)])
def test_fused_cuda_blocks_match_sdpa(backend, dtype, tol):
    """Fused block kernels (bf16, or fp32 for the memory-efficient one) + fp32 merges vs one SDPA call,
    within the inputs' rounding."""
    import torch.nn.functional as F

    from parallel4d.sequence.kernels import resolve_backend

    torch.manual_seed(0)
    b, h, s, d, n = 1, 8, 2048, 128, 4
    if backend == "cudnn" and resolve_backend("auto", torch.empty(1, 1, 8, d, device="cuda", dtype=dtype)) != "cudnn":
        pytest.skip("cuDNN attention does not run on this GPU (auto falls back)")
    for layout in LAYOUTS:
        for causal in (False, True):
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(4))
            qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
            ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
            ref.backward(do.float())
            qs, ks, vs = shard(q, n, layout), shard(k, n, layout), shard(v, n, layout)
            outs, lses = ring_forward(qs, ks, vs, layout, causal, backend=backend)
            dqs, dks, dvs = ring_backward(shard(do, n, layout), qs, ks, vs, outs, lses, layout, causal,
                                          backend=backend)
            for got, want in ((outs, ref), (dqs, qr.grad), (dks, kr.grad), (dvs, vr.grad)):
                got = unshard(got, layout).float()
                rel = float((got - want).norm() / want.norm())
                assert rel < tol, (backend, dtype, layout, causal, rel)


def test_ring_of_one_without_process_group():
    """sp = 1 needs no process group: the ring degenerates to one local causal call."""
    assert not dist.is_initialized()
    for layout in LAYOUTS:
        q, k, v, do = _inputs(2, 1, 4, 2, 8, 8)
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        out = ring_attention(ql, kl, vl, None, causal=True, layout=layout)
        out.backward(do)
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        ref = dense_attention(qr, kr, vr, True)
        ref.backward(do)
        for a, r in ((out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)):
            torch.testing.assert_close(a.detach(), r.detach(), **TOL)


@pytest.mark.parametrize("backend, dtype", [("cudnn", torch.bfloat16), ("flash", torch.bfloat16),
                                            ("efficient", torch.float32), ("efficient", torch.bfloat16)])
def test_fused_cuda_protocol_on_meta_tensors(backend, dtype, monkeypatch):
    """The CUDA block path without a GPU: ATen's meta kernels of the cuDNN / flash / memory-efficient
    SDPA forward and backward ops check our calls against the installed torch's schemas and
    give the shapes and dtypes every step, merge and travelling dK/dV sees (GQA, both
    layouts, causal and not; local lengths 12 and 6 rows per block, which the memory-efficient
    kernel's LSE pads to 32). The numbers are checked by the gpu-marked test above."""
    from parallel4d.sequence import emulate

    # resolve_backend rightly refuses non-CUDA tensors; meta tensors stand in for them here.
    monkeypatch.setattr(emulate, "resolve_backend", lambda name, q: name)
    b, h, hkv, s, d, n = 2, 8, 2, 48, 128, 4
    for layout in LAYOUTS:
        for causal in (False, True):
            q, do = (torch.empty(b, h, s, d, device="meta", dtype=dtype) for _ in range(2))
            k, v = (torch.empty(b, hkv, s, d, device="meta", dtype=dtype) for _ in range(2))
            qs, ks, vs = shard(q, n, layout), shard(k, n, layout), shard(v, n, layout)
            outs, lses = ring_forward(qs, ks, vs, layout, causal, backend=backend)
            assert all(o.shape == (b, h, s // n, d) and o.dtype == dtype for o in outs)
            assert all(x.shape == (b, h, s // n) and x.dtype == torch.float32 for x in lses)
            dqs, dks, dvs = ring_backward(shard(do, n, layout), qs, ks, vs, outs, lses, layout, causal,
                                          backend=backend)
            assert all(g.shape == (b, h, s // n, d) and g.dtype == dtype for g in dqs)
            assert all(g.shape == (b, hkv, s // n, d) and g.dtype == dtype for g in dks + dvs)
            assert unshard(outs, layout).shape == q.shape


def _fake_cuda_q(dtype, d=64):
    """What resolve_backend reads of a CUDA ``q [b, h, l, d]`` (its GPU and torch's checks are faked)."""
    import types

    return types.SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda", 0), shape=(1, 4, 8, d))


@pytest.mark.parametrize("dtype, capability, refused, want", [
    (torch.bfloat16, (9, 0), (), "cudnn"),
    (torch.bfloat16, (9, 0), ("cudnn",), "flash"),  # torch's checks refuse cuDNN here: the next one
    (torch.float16, (7, 5), (), "efficient"),  # Turing: neither cuDNN's SDPA nor FlashAttention-2
    (torch.float32, (9, 0), (), "efficient"),  # fp32: the memory-efficient kernel, not the [L, L] math path
    (torch.float32, (9, 0), ("efficient",), "math"),
    (torch.float64, (9, 0), (), "math"),
])
def test_auto_asks_the_gpu_and_torch_which_fused_kernel_runs(dtype, capability, refused, want, monkeypatch):
    from parallel4d.sequence import kernels

    monkeypatch.setattr(kernels, "_capability", lambda q: capability)
    monkeypatch.setattr(kernels, "fused_usable", lambda name, q: name not in refused)
    assert kernels.resolve_backend("auto", _fake_cuda_q(dtype)) == want
    assert kernels.choose_backend(dtype, capability, lambda name: name not in refused) == want


def test_a_fused_kernel_named_where_it_cannot_run_is_refused(monkeypatch):
    from parallel4d.sequence import kernels

    monkeypatch.setattr(kernels, "_capability", lambda q: (7, 5))
    monkeypatch.setattr(kernels, "fused_usable", lambda name, q: True)
    with pytest.raises(ValueError, match=r"backend='cudnn' needs a GPU of compute capability \(8, 0\).*'auto'"):
        kernels.resolve_backend("cudnn", _fake_cuda_q(torch.bfloat16))
    with pytest.raises(ValueError, match="backend='flash' does not take torch.float32"):
        kernels.resolve_backend("flash", _fake_cuda_q(torch.float32))
    assert kernels.resolve_backend("efficient", _fake_cuda_q(torch.float32)) == "efficient"
    monkeypatch.setattr(kernels, "fused_usable", lambda name, q: False)
    with pytest.raises(ValueError, match="backend='efficient' is refused by torch's checks"):
        kernels.resolve_backend("efficient", _fake_cuda_q(torch.float32))


def test_fused_usable_asks_torchs_checks_for_causal_and_full_blocks(monkeypatch):
    from torch.backends import cuda as sdp

    from parallel4d.sequence.kernels import fused_usable

    asked = []

    def can_use(params, debug=False):
        asked.append((tuple(params.query.shape), params.is_causal))
        return True

    monkeypatch.setattr(sdp, "can_use_efficient_attention", can_use)
    q = torch.zeros(1, 4, 8, 64)
    assert fused_usable("efficient", q)
    assert sorted(asked) == [((1, 4, 8, 64), False), ((1, 4, 8, 64), True)]
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(sdp, "can_use_cudnn_attention", lambda params, debug=False: True)
    assert fused_usable("cudnn", q) and not fused_usable("cudnn", torch.zeros(1, 4, 8, 160))  # head dim > 128
