"""SUMMA matrix products on the q×q grid (Optimus), as autograd functions.

A matrix ``X[R, C]`` is cut into q×q blocks; rank (i, j) holds ``X_ij`` of shape
``[R/q, C/q]``. An activation ``x[b, s, h]`` stored as ``[b/q, s, h/q]`` is the block
(i, j) of ``X = x.reshape(b·s, h)``: the leading dims of a local operand are
flattened into its row dim. Weights are plain 2-D blocks.

=================  =====================================  ==========================================
op                 local operands → result                 step t = 0..q-1 on rank (i, j)
=================  =====================================  ==========================================
``summa_ab``       A ``[.., K/q]``, B ``[K/q, N/q]``       broadcast A_it along my row (``along_j``),
                   → C = AB ``[.., N/q]``                  B_tj along my column (``along_i``);
                                                           C_ij += A_it·B_tj
``summa_abt``      A ``[.., K/q]``, B ``[.., K/q]``        broadcast B_tj along my column; partial
                   (B is ``[N, K]``) → C = ABᵀ            A_ij·B_tjᵀ reduced along my row to (i, t)
                   ``[.., N/q]``
``summa_atb``      A ``[.., M/q]``, B ``[.., N/q]``        broadcast A_it along my row; partial
                   (A ``[K, M]``, B ``[K, N]``) →         A_itᵀ·B_ij reduced along my column to (t, j)
                   C = AᵀB ``[M/q, N/q]``
=================  =====================================  ==========================================

Backward, each expressed with the other two:
``AB``: dA = dC·Bᵀ (abt), dB = Aᵀ·dC (atb). ``ABᵀ``: dA = dC·B (ab), dB = dCᵀ·A (atb(dC, A)).
``AᵀB``: dA = B·dCᵀ (abt(B, dC)), dB = A·dC (ab).

Overlap: the broadcast of step t+1 is posted (async) before step t's local
matmul; the reduce of step t is posted async right after it and waited at the end.
Without it (``overlap=False``) each step posts, waits, multiplies (and reduces and waits)
before the next step's broadcast is posted. A grid's ``trace`` (:class:`~.grid.SummaTrace`)
is told of each post, wait, product and reduce in that order (``tests/test_tensor2d_overlap.py``).

Collectives go through ``grid.comm`` (:mod:`parallel4d.distributed.comm`, or the local stand-ins
of :mod:`.emulate`, which runs every rank's products on one device).

Precision: under ``torch.autocast`` the operands are cast once to the autocast
dtype (bf16 or fp16, whatever autocast says; float64 is left alone, like autocast
does), communicated and multiplied in it. ``summa_ab`` accumulates its q partial
products in fp32 for 16-bit dtypes; the reduce-based ops reduce in the compute dtype.

FP8 (``fp8=`` a :class:`RowwiseFP8`, ``train.fp8: rowwise``): each op's product runs on e4m3 operands with
rowwise scales over the contracted dimension, exactly the scales one process would compute for the whole
product (:mod:`parallel4d.fp8.rowwise`). The contracted dimension is split over the grid, so each operand's
float64 amax is first MAX-reduced over the q ranks holding the rest of it (one small all-reduce per operand,
counted as ``".../amax_a"``, ``".../amax_b"``); a contraction over the tokens (``summa_atb``'s: a weight
gradient) also over the data replicas holding the micro-batch's other tokens (``RowwiseFP8.token_sync``).
Each rank then quantizes its own block once and the broadcasts carry it in eight bits (a ``uint8`` view:
gloo has no float8), with its scales where the receiver lacks them (``summa_abt``'s B rows and
``summa_atb``'s A columns come from another grid row or column; ``summa_ab``'s receivers hold the same
scales already): ``k + 4`` bytes per row of k elements against 2k in bfloat16. Each step's partial product
is ``_scaled_mm``'s, accumulated in float32; ``summa_ab`` sums the q partials in float32, the reduce-based
ops reduce them in the compute dtype. Under autocast only the left operand (the activation, as ``F.linear``
casts its input) is cast to the autocast dtype; the right one (a weight) is quantized from its own dtype, as
the dense FP8 linear does.

Bytes are counted in ``mesh.comm_stats`` under ``"{name}:summa_ab/bcast_a"`` etc.
(``name`` defaults to the op; a layer passes its own name, and its backward ops are
labelled ``"{name}.bwd:summa_abt/..."``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel4d.distributed import comm
# wanted(ctx, k): whether this backward pass uses input k's gradient (a split backward asks for the activation
# and weight gradients in two passes; the other product and its collectives are skipped — every grid rank
# makes the same passes, so the collectives still match)
from parallel4d.fp8.linear import wanted
from parallel4d.fp8.rowwise import E4M3, AmaxSync, amax, quantize, scaled_mm, scales_of_amax
from parallel4d.tensor2d.grid import Grid

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    dev = ts[0].device.type
    if torch.is_autocast_enabled(dev) and dtype != torch.float64 and dtype.is_floating_point:
        return torch.get_autocast_dtype(dev)
    return dtype


def _label(name: str, op: str, part: str) -> str:
    return f"{name}:{op}/{part}"


@dataclass(frozen=True)
class RowwiseFP8:
    """``train.fp8: rowwise`` for a SUMMA op (the module doc). ``token_sync``: the MAX reduction of a float64
    amax over the ranks outside the grid that hold the other tokens of this micro-batch (the data replicas
    dp·sp; None: the grid holds them all) — used where an op contracts over the tokens."""

    token_sync: AmaxSync = None


class _Panel:
    """One rank's 2-D operand block ``t`` in FP8, scaled along ``dim`` (what the op contracts: ``1`` one scale per
    row, ``[m, 1]``; ``0`` per column, ``[1, n]``) from its amax reduced by ``sync``. ``own``: ``(e4m3 block,
    float32 scales)``, what this rank multiplies; ``bytes``: what its broadcast carries, the e4m3 block as
    ``uint8`` (gloo has no float8), after the scales' bytes when ``with_scales`` (the receivers lack them)."""

    def __init__(self, t: torch.Tensor, dim: int, sync, with_scales: bool):
        self.shape, self.with_scales = t.shape, with_scales
        self.scale = scales_of_amax(sync(amax(t, dim)))
        self.own = quantize(t, self.scale).contiguous(), self.scale
        q8 = self.own[0].view(torch.uint8).reshape(-1)
        self.bytes = torch.cat([self.scale.reshape(-1).view(torch.uint8), q8]) if with_scales else q8

    def unpack(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(e4m3 block, its scales)`` of a received ``buf`` (another rank's block of the same shape)."""
        if not self.with_scales:
            return buf.view(E4M3).view(self.shape), self.scale
        n = self.scale.numel() * 4
        return buf[n:].view(E4M3).view(self.shape), buf[:n].view(torch.float32).view(self.scale.shape)


def _amax_sync(grid: Grid, group, label: str, also: AmaxSync = None):
    """An amax's MAX reduction over ``group`` (the grid ranks holding the rest of its rows or columns;
    counted under ``label``), then over ``also``'s ranks."""
    def sync(largest: torch.Tensor) -> torch.Tensor:
        grid.comm.all_reduce(largest, group, op=dist.ReduceOp.MAX, stats=grid.stats, label=label)
        return largest if also is None else also(largest)
    return sync


class _Broadcasts:
    """Posts the broadcast of step t's operand block; the local rank sends ``mine``."""

    def __init__(self, mine, me, ranks, group, grid, label):
        self.mine, self.me, self.ranks, self.group, self.grid, self.label = mine, me, ranks, group, grid, label

    def post(self, t):
        buf = self.mine if self.me == t else torch.empty_like(self.mine)
        work = self.grid.comm.broadcast(buf, self.ranks[t], self.group, stats=self.grid.stats, label=self.label,
                                        async_op=True)
        if self.grid.trace is not None:
            self.grid.trace("post", self.label, t)
        return buf, work


def _wait(grid, works, what, label, step, event="wait"):
    """Wait for ``works`` (stream-ordered on NCCL: the host goes on), then tell the trace."""
    grid.comm.wait(works, what=what, deadlines=grid.mesh.deadlines)
    if grid.trace is not None:
        grid.trace(event, label, step)


def _product(grid, x, y, label, step, out_dtype=None):
    """The local block product of one SUMMA step: ``x·y``, or on FP8 panels (``(e4m3, scales)`` pairs, a
    row-scaled ``x`` and a column-scaled ``y``) ``_scaled_mm``'s, accumulated in float32, in ``out_dtype``."""
    p = torch.mm(x, y) if out_dtype is None else scaled_mm(x[0], y[0], x[1], y[1], out_dtype)
    if grid.trace is not None:
        grid.trace("product", label, step)
    return p


def _ab(a, b, grid: Grid, name: str, overlap: bool = True, fp8: RowwiseFP8 | None = None):
    """C_ij = Σ_t A_it·B_tj for 2-D contiguous blocks a ``[m, k]``, b ``[k, n]``. FP8: A's rows and B's
    columns scaled over K (split over my grid row and column: their amaxes reduced there); every rank of my
    row holds my rows' scales, of my column my columns': the panels travel without them."""
    q, op = grid.q, "summa_ab"
    acc = torch.float32 if a.dtype in _HALF or fp8 is not None else a.dtype
    if fp8 is not None:
        pa = _Panel(a, 1, _amax_sync(grid, grid.along_j, _label(name, op, "amax_a")), with_scales=False)
        pb = _Panel(b, 0, _amax_sync(grid, grid.along_i, _label(name, op, "amax_b")), with_scales=False)
        a_sent, b_sent, out = pa.bytes, pb.bytes, acc
    else:
        a_sent, b_sent, out = a, b, None
    bc_a = _Broadcasts(a_sent, grid.j, grid.row_ranks, grid.along_j, grid, _label(name, op, "bcast_a"))
    bc_b = _Broadcasts(b_sent, grid.i, grid.col_ranks, grid.along_i, grid, _label(name, op, "bcast_b"))
    product = _label(name, op, "product")
    c = torch.zeros(a.shape[0], b.shape[1], dtype=acc, device=a.device)
    nxt = (bc_a.post(0), bc_b.post(0))
    for t in range(q):
        (ab, wa), (bb, wb) = nxt
        if overlap and t + 1 < q:
            nxt = (bc_a.post(t + 1), bc_b.post(t + 1))
        _wait(grid, [wa, wb], f"{name} summa_ab step {t}", bc_a.label, t)
        if fp8 is not None:
            ab, bb = pa.unpack(ab), pb.unpack(bb)
        c += _product(grid, ab, bb, product, t, out).to(acc)
        if not overlap and t + 1 < q:
            nxt = (bc_a.post(t + 1), bc_b.post(t + 1))
    return c.to(a.dtype)


def _reduced(partial_fn, bcast: _Broadcasts, keep_at: int, dst_ranks, group, grid, label, what, overlap):
    """Shared loop of ABᵀ / AᵀB: broadcast an operand, reduce each step's partial to t."""
    q = grid.q
    product = label.rsplit("/", 1)[0] + "/product"
    works, kept = [], None
    nxt = bcast.post(0)
    for t in range(q):
        buf, w = nxt
        if overlap and t + 1 < q:
            nxt = bcast.post(t + 1)
        _wait(grid, w, f"{what} step {t} broadcast", bcast.label, t)
        p = partial_fn(buf, product, t).contiguous()
        works.append(grid.comm.reduce(p, dst_ranks[t], group, stats=grid.stats, label=label, async_op=True))
        if grid.trace is not None:
            grid.trace("reduce", label, t)
        if t == keep_at:
            kept = p
        if not overlap:
            _wait(grid, works[-1], f"{what} step {t} reduce", label, t, "reduce_wait")
            if t + 1 < q:
                nxt = bcast.post(t + 1)
    _wait(grid, works, f"{what} reduces", label, -1, "reduce_wait")
    return kept


def _abt(a, b, grid: Grid, name: str, overlap: bool = True, fp8: RowwiseFP8 | None = None):
    """C_it = Σ_j A_ij·B_tjᵀ for a ``[m, k]``, b ``[n, k]`` (blocks of A[M,K], B[N,K]). FP8: A's and B's rows
    scaled over K (split over my grid row); B_tj's row scales are grid row t's: they travel with its panel."""
    op = "summa_abt"
    if fp8 is None:
        bc = _Broadcasts(b, grid.i, grid.col_ranks, grid.along_i, grid, _label(name, op, "bcast_b"))

        def partial(bt, label, t):
            return _product(grid, a, bt.t(), label, t)
    else:
        pa = _Panel(a, 1, _amax_sync(grid, grid.along_j, _label(name, op, "amax_a")), with_scales=False)
        pb = _Panel(b, 1, _amax_sync(grid, grid.along_j, _label(name, op, "amax_b")), with_scales=True)
        bc = _Broadcasts(pb.bytes, grid.i, grid.col_ranks, grid.along_i, grid, _label(name, op, "bcast_b"))

        def partial(buf, label, t):
            b8, sb = pb.unpack(buf)
            return _product(grid, pa.own, (b8.t(), sb.t()), label, t, a.dtype)
    return _reduced(partial, bc, grid.j, grid.row_ranks, grid.along_j, grid, _label(name, op, "reduce_c"),
                    f"{name} {op}", overlap)


def _atb(a, b, grid: Grid, name: str, overlap: bool = True, fp8: RowwiseFP8 | None = None):
    """C_tj = Σ_i A_itᵀ·B_ij for a ``[k, m]``, b ``[k, n]`` (blocks of A[K,M], B[K,N]). FP8: A's and B's
    columns scaled over K — the tokens, split over my grid column and ``fp8.token_sync``'s data replicas;
    A_it's column scales are grid column t's: they travel with its panel."""
    op = "summa_atb"
    if fp8 is None:
        bc = _Broadcasts(a, grid.j, grid.row_ranks, grid.along_j, grid, _label(name, op, "bcast_a"))

        def partial(at, label, t):
            return _product(grid, at.t(), b, label, t)
    else:
        tokens = fp8.token_sync  # K is the tokens: the data replicas hold the rest of them
        pa = _Panel(a, 0, _amax_sync(grid, grid.along_i, _label(name, op, "amax_a"), tokens), with_scales=True)
        pb = _Panel(b, 0, _amax_sync(grid, grid.along_i, _label(name, op, "amax_b"), tokens), with_scales=False)
        bc = _Broadcasts(pa.bytes, grid.j, grid.row_ranks, grid.along_j, grid, _label(name, op, "bcast_a"))

        def partial(buf, label, t):
            a8, sa = pa.unpack(buf)
            return _product(grid, (a8.t(), sa.t()), pb.own, label, t, a.dtype)
    return _reduced(partial, bc, grid.i, grid.col_ranks, grid.along_i, grid, _label(name, op, "reduce_c"),
                    f"{name} {op}", overlap)


def _flat(t):
    return t.reshape(-1, t.shape[-1]).contiguous()


class _Op(torch.autograd.Function):
    """Common forward plumbing: cast to the compute dtype once, run without autocast."""

    @staticmethod
    def _prepare(ctx, a, b, grid, name, overlap, fp8):
        dtype = _compute_dtype(a, b)
        ctx.grid, ctx.name, ctx.overlap, ctx.fp8 = grid, name, overlap, fp8
        ctx.in_dtypes = (a.dtype, b.dtype)
        ctx.shapes = (a.shape, b.shape)
        if fp8 is not None:  # the right operand quantized from its own dtype, as the dense FP8 linear's weight
            return a.to(_compute_dtype(a)), b
        return a.to(dtype), b.to(dtype)

    @staticmethod
    def _args(ctx):
        """What the backward's ops take after their operands: grid, name, overlap, fp8."""
        return ctx.grid, ctx.name + ".bwd", ctx.overlap, ctx.fp8


class _SummaAB(_Op):
    @staticmethod
    def forward(ctx, a, b, grid, name, overlap, fp8):
        a, b = _Op._prepare(ctx, a, b, grid, name, overlap, fp8)
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            c = _ab(_flat(a), b.contiguous(), grid, name, overlap, fp8)
        return c.view(*a.shape[:-1], b.shape[-1])

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        args = _Op._args(ctx)
        dc = _flat(dc.to(a.dtype))
        da = db = None
        if wanted(ctx, 0):  # dA = dC·Bᵀ
            da = _abt(dc, b.contiguous(), *args).view(ctx.shapes[0]).to(ctx.in_dtypes[0])
        if wanted(ctx, 1):  # dB = Aᵀ·dC
            db = _atb(_flat(a), dc, *args).view(ctx.shapes[1]).to(ctx.in_dtypes[1])
        return da, db, None, None, None, None


class _SummaABT(_Op):
    @staticmethod
    def forward(ctx, a, b, grid, name, overlap, fp8):
        a, b = _Op._prepare(ctx, a, b, grid, name, overlap, fp8)
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            c = _abt(_flat(a), _flat(b), grid, name, overlap, fp8)
        return c.view(*a.shape[:-1], c.shape[-1])

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        args = _Op._args(ctx)
        dc = _flat(dc.to(a.dtype))
        da = db = None
        if wanted(ctx, 0):  # dA = dC·B
            da = _ab(dc, _flat(b), *args).view(ctx.shapes[0]).to(ctx.in_dtypes[0])
        if wanted(ctx, 1):  # dB = dCᵀ·A
            db = _atb(dc, _flat(a), *args).view(ctx.shapes[1]).to(ctx.in_dtypes[1])
        return da, db, None, None, None, None


class _SummaATB(_Op):
    @staticmethod
    def forward(ctx, a, b, grid, name, overlap, fp8):
        a, b = _Op._prepare(ctx, a, b, grid, name, overlap, fp8)
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            return _atb(_flat(a), _flat(b), grid, name, overlap, fp8)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        args = _Op._args(ctx)
        dc = dc.to(a.dtype).contiguous()
        da = db = None
        if wanted(ctx, 0):  # dA = B·dCᵀ
            da = _abt(_flat(b), dc, *args).view(ctx.shapes[0]).to(ctx.in_dtypes[0])
        if wanted(ctx, 1):  # dB = A·dC
            db = _ab(_flat(a), dc, *args).view(ctx.shapes[1]).to(ctx.in_dtypes[1])
        return da, db, None, None, None, None


def _grid_of(mesh_or_grid) -> Grid:
    return mesh_or_grid if isinstance(mesh_or_grid, Grid) else Grid(mesh_or_grid)


def _check_inner(op: str, a, b, dim_a: int, dim_b: int):
    if a.shape[dim_a] != b.shape[dim_b]:
        raise ValueError(f"{op}: local blocks do not match: a{tuple(a.shape)} dim {dim_a} vs b{tuple(b.shape)} dim {dim_b}")


@comm.eager
def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh, *, name: str = "summa_ab", overlap: bool = True,
             fp8: RowwiseFP8 | None = None) -> torch.Tensor:
    """C = A·B. Local a ``[..., K/q]`` (rows = flattened leading dims), b ``[K/q, N/q]``
    → c ``[..., N/q]`` (block (i, j) of C); ``fp8``: its products (and the backward's) in FP8."""
    if b.dim() != 2:
        raise ValueError(f"summa_ab: b must be a 2-D block [K/q, N/q], got shape {tuple(b.shape)}")
    _check_inner("summa_ab", a, b, -1, 0)
    return _SummaAB.apply(a, b, _grid_of(mesh), name, overlap, fp8)


@comm.eager
def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh, *, name: str = "summa_abt", overlap: bool = True,
              fp8: RowwiseFP8 | None = None) -> torch.Tensor:
    """C = A·Bᵀ. Local a ``[..., K/q]``, b ``[..., K/q]`` (block of B ``[N, K]``)
    → c ``[..., N/q]`` with a's leading dims; ``fp8``: its products (and the backward's) in FP8."""
    _check_inner("summa_abt", a, b, -1, -1)
    return _SummaABT.apply(a, b, _grid_of(mesh), name, overlap, fp8)


@comm.eager
def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh, *, name: str = "summa_atb", overlap: bool = True,
              fp8: RowwiseFP8 | None = None) -> torch.Tensor:
    """C = Aᵀ·B. Local a ``[..., M/q]`` (block of A ``[K, M]``), b ``[..., N/q]`` (block of
    B ``[K, N]``, same leading dims) → c ``[M/q, N/q]``; ``fp8``: its products (and the backward's) in FP8."""
    if a.shape[:-1].numel() != b.shape[:-1].numel():
        raise ValueError(f"summa_atb: a{tuple(a.shape)} and b{tuple(b.shape)} need the same number of rows")
    return _SummaATB.apply(a, b, _grid_of(mesh), name, overlap, fp8)
