"""SUMMA ops against the dense product (q=2 on 4 workers, q=3 on 9), shape checks."""

import math

import pytest
import torch

from conftest import run_workers
from parallel4d.distributed.mesh import init_mesh
from parallel4d.tensor2d import check_tensor2d, summa_ab, summa_abt, summa_atb
from parallel4d.tensor2d.grid import Grid

TOL = dict(rtol=1e-10, atol=1e-10)


def _blk(x, q, i, j):
    """Block (i, j): rows (dim 0) block i, last-dim block j."""
    return x.chunk(q, 0)[i].chunk(q, -1)[j].contiguous()


def _check_ops(mesh, dtype=torch.float64, overlap=True):
    """All three ops, forward and both gradients, on 3-D activations and 2-D weights."""
    q, i, j = mesh.q, mesh.rank("tp_row"), mesh.rank("tp_col")
    g = torch.Generator().manual_seed(1234)
    b, s, k, n, m = 2 * q, 3, 3 * q, 2 * q, 5 * q  # non-square everywhere

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    cases = {
        # name: (dense a, dense b, dense fn, local a, local b)
        "ab": (rnd(b, s, k), rnd(k, n), lambda a, w: a @ w, summa_ab),
        "abt": (rnd(b, s, k), rnd(n, k), lambda a, w: a @ w.t(), summa_abt),
        "atb": (rnd(b, s, m), rnd(b, s, n), lambda a, y: a.reshape(-1, m).t() @ y.reshape(-1, n), summa_atb),
    }
    for name, (A, B, dense_fn, op) in cases.items():
        A.requires_grad_(True)
        B.requires_grad_(True)
        C = dense_fn(A, B)
        G = rnd(*C.shape)
        (C * G).sum().backward()
        a = _blk(A.detach(), q, i, j).requires_grad_(True)
        bb = _blk(B.detach(), q, i, j).requires_grad_(True)
        c = op(a, bb, mesh, overlap=overlap)
        assert c.dtype == dtype
        torch.testing.assert_close(c, _blk(C.detach(), q, i, j), **TOL, msg=f"{name} forward")
        (c * _blk(G, q, i, j)).sum().backward()
        torch.testing.assert_close(a.grad, _blk(A.grad, q, i, j), **TOL, msg=f"{name} dA")
        torch.testing.assert_close(bb.grad, _blk(B.grad, q, i, j), **TOL, msg=f"{name} dB")


def _check_bytes(mesh):
    """Counted bytes per rank equal the analytic SUMMA volumes."""
    q = mesh.q
    ab = torch.randn(4, 3, dtype=torch.float64)  # local block [M/q, K/q] of A [4q, 3q]
    bb = torch.randn(3, 2, dtype=torch.float64)  # local block [K/q, N/q] of B [3q, 2q]
    eb = 8
    st = mesh.comm_stats
    st.reset()
    summa_ab(ab, bb, mesh, name="x")
    assert st.sent["x:summa_ab/bcast_a"] == ab.numel() * eb
    assert st.received["x:summa_ab/bcast_a"] == (q - 1) * ab.numel() * eb
    assert st.sent["x:summa_ab/bcast_b"] == bb.numel() * eb
    assert st.received["x:summa_ab/bcast_b"] == (q - 1) * bb.numel() * eb
    assert st.calls["x:summa_ab/bcast_a"] == q
    st.reset()
    bt = torch.randn(5, 3, dtype=torch.float64)  # block of B [5q, 3q]
    summa_abt(ab, bt, mesh, name="y")
    cblk = ab.shape[0] * bt.shape[0] * eb
    assert st.sent["y:summa_abt/bcast_b"] == bt.numel() * eb
    assert st.received["y:summa_abt/bcast_b"] == (q - 1) * bt.numel() * eb
    assert st.sent["y:summa_abt/reduce_c"] == (q - 1) * cblk  # q-1 steps as a non-root
    assert st.received["y:summa_abt/reduce_c"] == (q - 1) * cblk  # once root, q-1 contributions
    st.reset()


def _check_overlap_order(mesh):
    """On gloo too, step t+1's broadcast is posted before step t's local product (ab and abt), as the
    grid's trace sees it (test_tensor2d_overlap.py checks a layer's forward and backward in one process)."""
    from test_tensor2d_overlap import Steps, check_summa_order
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    for op in (summa_ab, summa_abt):
        grid = Grid(mesh)
        grid.trace = steps = Steps()
        op(a, b if op is summa_ab else b.t().contiguous(), grid, name="o")
        check_summa_order(steps.of(f"o:{op.__name__}"), mesh.q, overlap=True, what=op.__name__)


def _check_autocast_bf16(mesh):
    """Under CPU autocast the ops compute and communicate in bf16 (never fp16)."""
    q, i, j = mesh.q, mesh.rank("tp_row"), mesh.rank("tp_col")
    g = torch.Generator().manual_seed(7)
    A = torch.randn(2 * q, 3, 4 * q, generator=g)
    W = torch.randn(4 * q, 6 * q, generator=g)
    Ad, Wd = A.clone().requires_grad_(True), W.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Cd = Ad @ Wd
    assert Cd.dtype == torch.bfloat16
    Cd.float().sum().backward()
    a, w = _blk(A, q, i, j).requires_grad_(True), _blk(W, q, i, j).requires_grad_(True)
    mesh.comm_stats.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = summa_ab(a, w, mesh, name="amp")
    assert c.dtype == torch.bfloat16
    # bytes prove the transfer was in a 2-byte dtype
    assert mesh.comm_stats.sent["amp:summa_ab/bcast_a"] == a.numel() * 2
    torch.testing.assert_close(c.float(), _blk(Cd.detach().float(), q, i, j), rtol=2e-2, atol=5e-2)
    c.float().sum().backward()
    assert a.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(a.grad, _blk(Ad.grad, q, i, j), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(w.grad, _blk(Wd.grad, q, i, j), rtol=2e-2, atol=1e-1)
    # and the backward ops ran in bf16 as well
    assert mesh.comm_stats.sent["amp.bwd:summa_abt/bcast_b"] == w.numel() * 2


def _uneven(rows: int, cols: int, q: int, seed: int) -> torch.Tensor:
    """A float32 ``[rows, cols]`` whose rows' and columns' largest magnitudes sit in different grid blocks: some
    rows ×2¹⁴ in their first column block, some columns ×2¹⁴ in their last row block. Scales are powers of two, so
    a scale from one block alone changes only the elements that fall below e4m3's normal range (2⁻⁶) under the
    whole row's or column's scale: here the rest of those rows and columns, which one process rounds coarsely."""
    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    t[::2, : cols // q] *= 2.0 ** 14
    t[rows - rows // q:, 1::2] *= 2.0 ** 14
    return t


def check_fp8_summa(mesh, overlap=True):
    """FP8 SUMMA (``fp8=RowwiseFP8()``, train.fp8: rowwise under 2D tp) equals one process's FP8 products on the
    whole operands — the forward X·W and both gradients (dX = G·Wᵀ by summa_abt, dW = Xᵀ·G by summa_atb) — to
    float32's reordering of the sums (each element within 1e-6 of Σ|a·b| over its terms), so every operand was
    scaled as one process scales it (each amax reduced over the grid row or column holding the rest of its row
    or column; :func:`_uneven` makes a block's own amax wrong); and the panels travel in one byte per element,
    with 4 bytes per scale where the receiver lacks them, each amax reduction counted (8 bytes per row or
    column)."""
    from parallel4d.fp8.rowwise import rowwise_mm
    from parallel4d.tensor2d import RowwiseFP8

    q, i, j = mesh.q, mesh.rank("tp_row"), mesh.rank("tp_col")
    b, s, k, n = 2 * q, 3, 8 * q, 6 * q
    X, W = _uneven(b * s, k, q, 1).view(b, s, k), _uneven(k, n, q, 2)
    G = _uneven(b * s, n, q, 3).view(b, s, n)
    x2, g2 = X.reshape(-1, k), G.reshape(-1, n)
    products = {"y": (x2, W), "dX": (g2, W.t()), "dW": (x2.t(), g2)}
    want = {what: rowwise_mm(l, r, torch.float32) for what, (l, r) in products.items()}
    bound = {what: 1e-6 * (l.double().abs() @ r.double().abs()) for what, (l, r) in products.items()}
    shapes = {"y": (b, s, n), "dX": (b, s, k), "dW": (k, n)}
    x, w = _blk(X, q, i, j).requires_grad_(True), _blk(W, q, i, j).requires_grad_(True)
    st = mesh.comm_stats
    st.reset()
    y = summa_ab(x, w, mesh, name="f8", overlap=overlap, fp8=RowwiseFP8())
    y.backward(_blk(G, q, i, j))
    for what, got in (("y", y), ("dX", x.grad), ("dW", w.grad)):
        assert got.dtype == torch.float32
        expect, allowed = (_blk(t.view(shapes[what]), q, i, j) for t in (want[what], bound[what]))
        worst = float(((got.double() - expect.double()).abs() / allowed).max())
        assert worst <= 1, f"FP8 SUMMA {what}: {worst:.3g} × float32's reordering bound"
    rows = x.numel() // x.shape[-1]
    assert st.sent["f8:summa_ab/bcast_a"] == x.numel()  # one byte per element, no scales: my row holds them
    assert st.sent["f8:summa_ab/bcast_b"] == w.numel()
    assert st.sent["f8:summa_ab/amax_a"] == rows * 8 and st.sent["f8:summa_ab/amax_b"] == w.shape[1] * 8
    assert st.sent["f8.bwd:summa_abt/bcast_b"] == w.numel() + 4 * w.shape[0]  # W's rows' scales travel
    assert st.sent["f8.bwd:summa_atb/bcast_a"] == x.numel() + 4 * x.shape[-1]  # X's columns' scales travel
    assert st.sent["f8.bwd:summa_atb/amax_a"] == x.shape[-1] * 8
    st.reset()


def check_fp8_weight_gradient_over_data_replicas(mesh, synced=True):
    """dW = Xᵀ·G contracts over the micro-batch's tokens, which the data replicas (dp·sp) split too:
    ``RowwiseFP8.token_sync`` (the engine's MAX all-reduce over them) extends each column's amax over their
    tokens, so this replica's dW is its share of one process's FP8 product — its tokens quantized with the
    scales of all of them. Another replica's tokens (×2¹⁴: this replica's columns then fall below e4m3's
    normal range under one process's scales) stand in through the callable. ``synced=False``: no callable."""
    from parallel4d.fp8.rowwise import amax, quantize, scaled_mm, scales
    from parallel4d.tensor2d import RowwiseFP8

    q, i, j = mesh.q, mesh.rank("tp_row"), mesh.rank("tp_col")
    g = torch.Generator().manual_seed(50)
    T, k, n = 6 * q, 8 * q, 6 * q
    X, G = torch.randn(T, k, generator=g), torch.randn(T, n, generator=g)  # this replica's tokens
    Xo, Go = (torch.randn(T, c, generator=g) * 2.0 ** 14 for c in (k, n))  # another replica's
    others = {k // q: amax(Xo.chunk(q, 1)[j], 0), n // q: amax(Go.chunk(q, 1)[j], 0)}  # by column count

    def other_replicas(largest):  # what the MAX over the replicas brings: their tokens' column amaxes
        return torch.maximum(largest, others[largest.shape[1]])

    fp8 = RowwiseFP8(token_sync=other_replicas if synced else None)
    got = summa_atb(_blk(X, q, i, j), _blk(G, q, i, j), mesh, name="replicas", fp8=fp8)
    sx, sg = scales(torch.cat([X, Xo]), 0), scales(torch.cat([G, Go]), 0)
    want = scaled_mm(quantize(X, sx).t(), quantize(G, sg), sx.t(), sg, torch.float32)
    allowed = 1e-6 * (X.double().abs().t() @ G.double().abs())
    worst = float(((got.double() - _blk(want, q, i, j).double()).abs() / _blk(allowed, q, i, j)).max())
    assert worst <= 1, f"FP8 dW over data replicas: {worst:.3g} × float32's reordering bound"


def _q2_job():
    mesh = init_mesh(tp=4)
    _check_ops(mesh)
    _check_ops(mesh, overlap=False)
    _check_bytes(mesh)
    _check_overlap_order(mesh)
    _check_autocast_bf16(mesh)
    check_fp8_summa(mesh)
    check_fp8_weight_gradient_over_data_replicas(mesh)
    return mesh.coords


def _q3_job():
    mesh = init_mesh(tp=9)
    _check_ops(mesh)
    _check_bytes(mesh)
    _check_overlap_order(mesh)
    # layers and a whole block at q=3 (non-power-of-two grid)
    from test_tensor2d_layers import check_block, check_layers, check_padded_vocab
    check_layers(mesh)
    check_block(mesh, hidden=18, heads=6)
    check_padded_vocab(mesh, vocab=13, ties=(True,))  # padded to 15: the last block's last 2 rows
    check_padded_vocab(mesh, vocab=4, ties=(False,))  # padded to 6: vocab block 2 is all padding
    return mesh.coords


def test_summa_ops_q2():
    coords = run_workers(_q2_job, 4, timeout_s=300, preload=())
    assert {(c["tp_row"], c["tp_col"]) for c in coords} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_summa_ops_and_layers_q3():
    coords = run_workers(_q3_job, 9, timeout_s=300)
    assert len({(c["tp_row"], c["tp_col"]) for c in coords}) == 9


@pytest.mark.parametrize("kw, field, hint", [
    (dict(tp=5, hidden=64, heads=4, vocab=64), "parallel.tp=5", "use parallel.tp=4 or 9"),
    (dict(tp=16, hidden=70, heads=4, vocab=64), "model.hidden=70", "use model.hidden=68 or 72"),
    (dict(tp=4, hidden=72, heads=3, vocab=64), "model.heads=3", "use model.heads=2 or 4"),
    (dict(tp=4, hidden=64, heads=4, vocab=256, batch=10, dp=2), "data.batch_size=10", "use data.batch_size=8 or 12"),
    (dict(tp=9, hidden=48, heads=4, vocab=99), "model.heads=4 is not divisible by q=3", "use model.heads=3 or 6"),
    (dict(tp=4, hidden=64, heads=5, vocab=64), "model.hidden=64 is not divisible by model.heads=5", "model.heads=4 or 8"),
])
def test_check_tensor2d_messages(kw, field, hint):
    with pytest.raises(ValueError) as e:
        check_tensor2d(**kw)
    assert field in str(e.value) and hint in str(e.value), str(e.value)


def test_check_tensor2d_ok_and_pure():
    assert check_tensor2d(4, 64, 4, 256, 8, dp=2) == 2
    assert check_tensor2d(9, 36, 6, 99, 9) == 3


@pytest.mark.parametrize("tp", [4, 9, 25, 49])
def test_any_vocabulary_splits_over_the_grid_padded(tp):
    """A vocabulary the grid side does not divide (Qwen's 151,936 at q=3, 5, 7; 255 at q=2) is padded by
    the layers, not refused: padded_vocab is the least multiple of q at or above it."""
    q = math.isqrt(tp)
    for vocab in (151936, 255, 13):
        assert check_tensor2d(tp, 420, 210, vocab) == q  # 420 and 210: multiples of 2, 3, 5 and 7
    from parallel4d.config.rules.tensor2d import padded_vocab

    for vocab in (151936, 255, 13):
        padded = padded_vocab(vocab, q)
        assert padded % q == 0 and vocab <= padded < vocab + q
    # importable without torch side effects: the module has no torch import
    import parallel4d.tensor2d.checks as checks
    assert "torch" not in vars(checks)
