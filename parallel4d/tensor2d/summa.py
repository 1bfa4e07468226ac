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

Bytes are counted in ``mesh.comm_stats`` under ``"{name}:summa_ab/bcast_a"`` etc.
(``name`` defaults to the op; a layer passes its own name, and its backward ops are
labelled ``"{name}.bwd:summa_abt/..."``).
"""

from __future__ import annotations

import torch

from parallel4d.distributed import comm
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


def _product(grid, x, y, label, step):
    """The local block product of one SUMMA step."""
    p = torch.mm(x, y)
    if grid.trace is not None:
        grid.trace("product", label, step)
    return p


def _ab(a, b, grid: Grid, name: str, overlap: bool = True):
    """C_ij = Σ_t A_it·B_tj for 2-D contiguous blocks a ``[m, k]``, b ``[k, n]``."""
    q = grid.q
    bc_a = _Broadcasts(a, grid.j, grid.row_ranks, grid.along_j, grid, _label(name, "summa_ab", "bcast_a"))
    bc_b = _Broadcasts(b, grid.i, grid.col_ranks, grid.along_i, grid, _label(name, "summa_ab", "bcast_b"))
    product = _label(name, "summa_ab", "product")
    acc = torch.float32 if a.dtype in _HALF else a.dtype
    c = torch.zeros(a.shape[0], b.shape[1], dtype=acc, device=a.device)
    nxt = (bc_a.post(0), bc_b.post(0))
    for t in range(q):
        (ab, wa), (bb, wb) = nxt
        if overlap and t + 1 < q:
            nxt = (bc_a.post(t + 1), bc_b.post(t + 1))
        _wait(grid, [wa, wb], f"{name} summa_ab step {t}", bc_a.label, t)
        c += _product(grid, ab, bb, product, t).to(acc)
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


def _abt(a, b, grid: Grid, name: str, overlap: bool = True):
    """C_it = Σ_j A_ij·B_tjᵀ for a ``[m, k]``, b ``[n, k]`` (blocks of A[M,K], B[N,K])."""
    op = "summa_abt"
    bc = _Broadcasts(b, grid.i, grid.col_ranks, grid.along_i, grid, _label(name, op, "bcast_b"))
    return _reduced(lambda bt, label, t: _product(grid, a, bt.t(), label, t), bc, grid.j, grid.row_ranks,
                    grid.along_j, grid, _label(name, op, "reduce_c"), f"{name} {op}", overlap)


def _atb(a, b, grid: Grid, name: str, overlap: bool = True):
    """C_tj = Σ_i A_itᵀ·B_ij for a ``[k, m]``, b ``[k, n]`` (blocks of A[K,M], B[K,N])."""
    op = "summa_atb"
    bc = _Broadcasts(a, grid.j, grid.row_ranks, grid.along_j, grid, _label(name, op, "bcast_a"))
    return _reduced(lambda at, label, t: _product(grid, at.t(), b, label, t), bc, grid.i, grid.col_ranks,
                    grid.along_i, grid, _label(name, op, "reduce_c"), f"{name} {op}", overlap)


def _flat(t):
    return t.reshape(-1, t.shape[-1]).contiguous()


def _wanted(ctx, k: int) -> bool:
    """Whether this backward pass uses input ``k``'s gradient. A pipeline that splits the backward
    asks for the activation gradients and the weight gradients in two passes (pipeline/split_grad):
    the engine then runs only some of this node's next nodes, and the other product and its
    collectives are skipped. Every grid rank makes the same passes, so the collectives still match."""
    if not ctx.needs_input_grad[k]:
        return False
    nxt = ctx.next_functions[k][0]
    try:
        return nxt is None or torch._C._will_engine_execute_node(nxt)
    except RuntimeError:  # torch.autograd.grad cannot be asked about leaves: compute it
        return True


class _Op(torch.autograd.Function):
    """Common forward plumbing: cast to the compute dtype once, run without autocast."""

    @staticmethod
    def _prepare(ctx, a, b, grid, name, overlap):
        dtype = _compute_dtype(a, b)
        ctx.grid, ctx.name, ctx.overlap = grid, name, overlap
        ctx.in_dtypes = (a.dtype, b.dtype)
        ctx.shapes = (a.shape, b.shape)
        return a.to(dtype), b.to(dtype)


class _SummaAB(_Op):
    @staticmethod
    def forward(ctx, a, b, grid, name, overlap):
        a, b = _Op._prepare(ctx, a, b, grid, name, overlap)
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            c = _ab(_flat(a), b.contiguous(), grid, name, overlap)
        return c.view(*a.shape[:-1], b.shape[-1])

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        g, n, o = ctx.grid, ctx.name + ".bwd", ctx.overlap
        dc = _flat(dc.to(a.dtype))
        da = db = None
        if _wanted(ctx, 0):  # dA = dC·Bᵀ
            da = _abt(dc, b.contiguous(), g, n, o).view(ctx.shapes[0]).to(ctx.in_dtypes[0])
        if _wanted(ctx, 1):  # dB = Aᵀ·dC
            db = _atb(_flat(a), dc, g, n, o).view(ctx.shapes[1]).to(ctx.in_dtypes[1])
        return da, db, None, None, None


class _SummaABT(_Op):
    @staticmethod
    def forward(ctx, a, b, grid, name, overlap):
        a, b = _Op._prepare(ctx, a, b, grid, name, overlap)
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            c = _abt(_flat(a), _flat(b), grid, name, overlap)
        return c.view(*a.shape[:-1], c.shape[-1])

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        g, n, o = ctx.grid, ctx.name + ".bwd", ctx.overlap
        dc = _flat(dc.to(a.dtype))
        da = db = None
        if _wanted(ctx, 0):  # dA = dC·B
            da = _ab(dc, _flat(b), g, n, o).view(ctx.shapes[0]).to(ctx.in_dtypes[0])
        if _wanted(ctx, 1):  # dB = dCᵀ·A
            db = _atb(dc, _flat(a), g, n, o).view(ctx.shapes[1]).to(ctx.in_dtypes[1])
        return da, db, None, None, None


class _SummaATB(_Op):
    @staticmethod
    def forward(ctx, a, b, grid, name, overlap):
        a, b = _Op._prepare(ctx, a, b, grid, name, overlap)
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            return _atb(_flat(a), _flat(b), grid, name, overlap)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        g, n, o = ctx.grid, ctx.name + ".bwd", ctx.overlap
        dc = dc.to(a.dtype).contiguous()
        da = db = None
        if _wanted(ctx, 0):  # dA = B·dCᵀ
            da = _abt(_flat(b), dc, g, n, o).view(ctx.shapes[0]).to(ctx.in_dtypes[0])
        if _wanted(ctx, 1):  # dB = A·dC
            db = _ab(_flat(a), dc, g, n, o).view(ctx.shapes[1]).to(ctx.in_dtypes[1])
        return da, db, None, None, None


def _grid_of(mesh_or_grid) -> Grid:
    return mesh_or_grid if isinstance(mesh_or_grid, Grid) else Grid(mesh_or_grid)


def _check_inner(op: str, a, b, dim_a: int, dim_b: int):
    if a.shape[dim_a] != b.shape[dim_b]:
        raise ValueError(f"{op}: local blocks do not match: a{tuple(a.shape)} dim {dim_a} vs b{tuple(b.shape)} dim {dim_b}")


@comm.eager
def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh, *, name: str = "summa_ab", overlap: bool = True) -> torch.Tensor:
    """C = A·B. Local a ``[..., K/q]`` (rows = flattened leading dims), b ``[K/q, N/q]``
    → c ``[..., N/q]`` (block (i, j) of C)."""
    if b.dim() != 2:
        raise ValueError(f"summa_ab: b must be a 2-D block [K/q, N/q], got shape {tuple(b.shape)}")
    _check_inner("summa_ab", a, b, -1, 0)
    return _SummaAB.apply(a, b, _grid_of(mesh), name, overlap)


@comm.eager
def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh, *, name: str = "summa_abt", overlap: bool = True) -> torch.Tensor:
    """C = A·Bᵀ. Local a ``[..., K/q]``, b ``[..., K/q]`` (block of B ``[N, K]``)
    → c ``[..., N/q]`` with a's leading dims."""
    _check_inner("summa_abt", a, b, -1, -1)
    return _SummaABT.apply(a, b, _grid_of(mesh), name, overlap)


@comm.eager
def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh, *, name: str = "summa_atb", overlap: bool = True) -> torch.Tensor:
    """C = Aᵀ·B. Local a ``[..., M/q]`` (block of A ``[K, M]``), b ``[..., N/q]`` (block of
    B ``[K, N]``, same leading dims) → c ``[M/q, N/q]``."""
    if a.shape[:-1].numel() != b.shape[:-1].numel():
        raise ValueError(f"summa_atb: a{tuple(a.shape)} and b{tuple(b.shape)} need the same number of rows")
    return _SummaATB.apply(a, b, _grid_of(mesh), name, overlap)
