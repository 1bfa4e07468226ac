"""The q×q grid of a :class:`~parallel4d.mesh.Mesh` and the few grid collectives.

Coordinates: ``i = mesh.rank("tp_row")`` (grid row: batch block / first matrix
dim), ``j = mesh.rank("tp_col")`` (grid column: hidden block / second matrix dim).
Groups are named by the axis that *varies* inside them:

* ``along_j = mesh.group("tp_col")`` — the q ranks of my grid **row** i (j varies);
  they hold the other hidden blocks of my batch block (LayerNorm statistics,
  vocab-parallel loss reductions, SUMMA broadcasts of A-blocks).
* ``along_i = mesh.group("tp_row")`` — the q ranks of my grid **column** j (i varies);
  they hold the other batch blocks of my hidden block (gradients of parameters
  replicated over rows, SUMMA broadcasts of B-blocks).

Peers are resolved through :meth:`Mesh.global_rank` only. The grid's collectives go through
``grid.comm``: the mesh's ``collectives`` — :mod:`parallel4d.distributed.comm` itself, or an emulation's
(:class:`~.emulate.LocalRank`'s: one rank of a grid emulated in one process, no peers).
``grid.trace`` (None unless set) hears of each SUMMA step (:class:`SummaTrace`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from parallel4d.distributed import comm
from parallel4d.tensor2d.checks import check_divisible


class SummaTrace(Protocol):
    """Told of each step of a SUMMA op as its code reaches it, in program order: ``event`` is
    ``"post"`` (step ``step``'s broadcast posted), ``"wait"`` (waited for), ``"product"`` (its local
    block product computed), ``"reduce"`` (its partial's reduce posted) or ``"reduce_wait"``
    (``step`` -1: the wait for all of an op's reduces); ``label`` the collective's byte-count label
    (``"{name}:summa_ab/bcast_a"``, ``"{name}:summa_abt/reduce_c"``; a product's
    ``"{name}:summa_ab/product"``)."""

    def __call__(self, event: str, label: str, step: int) -> None: ...


class Grid:
    """This rank's place on the tensor-parallel grid of ``mesh`` (cheap to build). ``comm``: where
    its collectives go (``mesh.collectives``: the comm module, or an emulation's); ``trace``: a :class:`SummaTrace`
    for this grid's SUMMA ops, None (the default: nothing is recorded) or set by whoever watches."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.comm = mesh.collectives
        self.trace: SummaTrace | None = None
        self.stats = mesh.comm_stats
        self.q = mesh.q
        self.i = mesh.rank("tp_row")
        self.j = mesh.rank("tp_col")
        self.along_j = mesh.group("tp_col")
        self.along_i = mesh.group("tp_row")
        # Global ranks of my row (index j) and of my column (index i).
        self.row_ranks = [mesh.global_rank("tp_col", t) for t in range(self.q)]
        self.col_ranks = [mesh.global_rank("tp_row", t) for t in range(self.q)]
        if self.q > 1 and (self.comm.group_rank(self.along_j) != self.j or self.comm.group_rank(self.along_i) != self.i):
            # all_gather / reduce_scatter order their pieces by group rank.
            raise RuntimeError("tensor-parallel group ranks do not follow grid coordinates")


# --- autograd-aware collectives ---------------------------------------------------


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; every member then uses the sum, so the backward is a sum too."""

    @staticmethod
    def forward(ctx, x, group, stats, label, ops):
        ctx.group, ctx.stats, ctx.label, ctx.ops = group, stats, label, ops
        y = x.clone()
        ops.all_reduce(y, group, stats=stats, label=label)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        ctx.ops.all_reduce(g, ctx.group, stats=ctx.stats, label=ctx.label + ".bwd")
        return g, None, None, None, None


@comm.eager
def all_reduce_sum(x, group, stats=None, label="all_reduce", ops=comm):
    """``x`` summed over ``group`` through ``ops`` (a grid's ``comm``); the backward sums too."""
    return _AllReduceSum.apply(x, group, stats, label, ops)


class _SumGradAlong(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group``.

    Used on parameters replicated over a group whose members see different
    tokens: each member's gradient is a partial sum of the dense gradient.
    """

    @staticmethod
    def forward(ctx, p, group, stats, label, ops):
        ctx.group, ctx.stats, ctx.label, ctx.ops = group, stats, label, ops
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        ctx.ops.all_reduce(g, ctx.group, stats=ctx.stats, label=ctx.label)
        return g, None, None, None, None


@comm.eager
def replicated_over_rows(p, grid: Grid, label: str):
    """Use parameter ``p`` (identical on the q ranks of my grid column) so that its
    gradient is the sum over that column (``along_i``, ``tp_row`` varies)."""
    return _SumGradAlong.apply(p, grid.along_i, grid.stats, label, grid.comm)


@comm.eager
def replicated_over_grid(p, grid: Grid, label: str):
    """Use parameter ``p`` (identical on every rank of the grid) so that its gradient is the sum
    over the whole grid: over my column (``along_i``), then my row (``along_j``)."""
    p = _SumGradAlong.apply(p, grid.along_i, grid.stats, label, grid.comm)
    return _SumGradAlong.apply(p, grid.along_j, grid.stats, label, grid.comm)


class _ReduceScatterBatch(torch.autograd.Function):
    """Sum over ``along_i`` and keep batch block i (dim 0); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, grid, label):
        ctx.grid, ctx.label = grid, label
        return grid.comm.reduce_scatter(x, grid.along_i, dim=0, stats=grid.stats, label=label)

    @staticmethod
    def backward(ctx, g):
        g = ctx.grid.comm.all_gather(g.contiguous(), ctx.grid.along_i, dim=0, stats=ctx.grid.stats, label=ctx.label + ".bwd")
        return g, None, None


@comm.eager
def reduce_scatter_batch(x, grid: Grid, label: str):
    return _ReduceScatterBatch.apply(x, grid, label)


class _RowAllToAll(torch.autograd.Function):
    """An all-to-all over my grid row (``along_j``) trading a split of ``scatter`` for one of ``gather``
    (:func:`~parallel4d.distributed.comm.all_to_all`); the backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, grid, label, scatter, gather):
        ctx.grid, ctx.label, ctx.dims = grid, label, (scatter, gather)
        return grid.comm.all_to_all(x.contiguous(), grid.along_j, scatter_dim=scatter, gather_dim=gather,
                                    stats=grid.stats, label=label)

    @staticmethod
    def backward(ctx, g):
        scatter, gather = ctx.dims
        g = ctx.grid.comm.all_to_all(g.contiguous(), ctx.grid.along_j, scatter_dim=gather, gather_dim=scatter,
                                     stats=ctx.grid.stats, label=ctx.label + ".bwd")
        return g, None, None, None, None


@comm.eager
def tokens_to_row_rank(x: torch.Tensor, grid: Grid, label: str) -> torch.Tensor:
    """``[T, h/q]`` (my grid row's ``T`` tokens, hidden block j) → ``[T/q, h]``: token block j of the row's
    tokens, whole (one all-to-all over the row: the q ranks of a row then hold disjoint tokens, the q²
    ranks of the grid disjoint ones). ``T`` divisible by q (the config's rule)."""
    check_divisible(f"{label}: the tokens of a grid row (dim 0 of {tuple(x.shape)})", x.shape[0], grid.q)
    return _RowAllToAll.apply(x, grid, label, 0, 1)


@comm.eager
def tokens_from_row_rank(y: torch.Tensor, grid: Grid, label: str) -> torch.Tensor:
    """The inverse of :func:`tokens_to_row_rank`: ``[T/q, h]`` → ``[T, h/q]``."""
    return _RowAllToAll.apply(y, grid, label, 1, 0)


# --- activations: scatter / gather --------------------------------------------------


def split_batch(t: torch.Tensor, mesh, field: str = "batch") -> torch.Tensor:
    """Full ``[b, ...]`` (same on every grid rank) → batch block i ``[b/q, ...]``.

    Tokens, targets and position ids follow this layout (replicated over j)."""
    grid = Grid(mesh)
    check_divisible(f"{field} (dim 0 of {tuple(t.shape)})", t.shape[0], grid.q)
    return t.chunk(grid.q, dim=0)[grid.i].contiguous()


def scatter_2d(x: torch.Tensor, mesh) -> torch.Tensor:
    """Full ``[b, s, h]`` (same on every grid rank) → my block ``[b/q, s, h/q]``
    (batch block i, hidden block j). No communication."""
    grid = Grid(mesh)
    check_divisible(f"batch (dim 0 of {tuple(x.shape)})", x.shape[0], grid.q)
    check_divisible(f"hidden (last dim of {tuple(x.shape)})", x.shape[-1], grid.q)
    return x.chunk(grid.q, dim=0)[grid.i].chunk(grid.q, dim=-1)[grid.j].contiguous()


def gather_2d(y: torch.Tensor, mesh, label: str = "gather_2d") -> torch.Tensor:
    """Inverse of :func:`scatter_2d`: my ``[b/q, ..., n/q]`` → full ``[b, ..., n]`` on every
    grid rank (all-gather over ``along_j`` on the last dim, then over ``along_i`` on dim 0).
    Not differentiable; for checks, logging and ``to_dense``."""
    grid = Grid(mesh)
    y = grid.comm.all_gather(y.detach().contiguous(), grid.along_j, dim=-1, stats=grid.stats, label=label)
    return grid.comm.all_gather(y.contiguous(), grid.along_i, dim=0, stats=grid.stats, label=label)


def gather_blocks(w: torch.Tensor, grid: Grid, label: str = "to_dense") -> torch.Tensor:
    """A matrix stored as q×q blocks (block (i, j) here) → the full matrix."""
    w = grid.comm.all_gather(w.detach().contiguous(), grid.along_j, dim=1, stats=grid.stats, label=label)
    return grid.comm.all_gather(w.contiguous(), grid.along_i, dim=0, stats=grid.stats, label=label)


def gather_columns(v: torch.Tensor, grid: Grid, dim: int = -1, label: str = "to_dense") -> torch.Tensor:
    """A tensor split into q blocks along ``dim`` by grid column j (replicated over i) → full."""
    return grid.comm.all_gather(v.detach().contiguous(), grid.along_j, dim=dim, stats=grid.stats, label=label)


def block_of(t: torch.Tensor, index: int, q: int, dim: int) -> torch.Tensor:
    """Block ``index`` of ``q`` equal blocks along ``dim`` (a contiguous copy)."""
    return t.chunk(q, dim=dim)[index].contiguous()
