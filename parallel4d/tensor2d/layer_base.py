"""What every 2D-parallel layer shares: its grid, parameters tagged with the grid axis they are
replicated over, gathering its dense tensors, and :data:`DenseLayout` — where each local parameter
sits in its dense tensor (no communication: what layout-free checkpoints are written from)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from parallel4d.config.rules.tensor2d import padded_vocab
from parallel4d.distributed import comm
from parallel4d.tensor2d.grid import Grid, all_reduce_sum, replicated_over_rows

# computed in float32 when activations are half (statistics, the loss)
HALF = (torch.float16, torch.bfloat16)


# A tensor shaped like a local parameter (the parameter, its gradient, an optimizer
# moment) → [(offsets in the dense tensor, view of it)]: boxes that tile the local tensor.
Pieces = Callable[[torch.Tensor], list[tuple[tuple[int, ...], torch.Tensor]]]
# (dense shape, pieces) of one local parameter.
DenseLayout = tuple[tuple[int, ...], Pieces]


def box_at(*offsets: int) -> Pieces:
    """The local tensor is one box of the dense tensor, at ``offsets``."""
    return lambda t: [(offsets, t)]


def index_runs(index: list[int]) -> list[tuple[int, int, int]]:
    """``(dense start, local start, length)`` of the consecutive runs in ``index``
    (local element k is dense element ``index[k]``)."""
    runs: list[list[int]] = []
    for k, d in enumerate(index):
        if runs and runs[-1][0] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([d, k, 1])
    return [tuple(r) for r in runs]


def new_param(t: torch.Tensor, replicated_over: tuple[str, ...] = ()) -> nn.Parameter:
    """A parameter holding a copy of ``t``, tagged ``tensor2d_replicated_over`` (for gradient norms)."""
    p = nn.Parameter(t.detach().clone().contiguous())
    p.tensor2d_replicated_over = replicated_over
    return p


class Layer2D(nn.Module):
    """Base: holds the grid, gathers per-parameter dense tensors."""

    def __init__(self, mesh, name: str):
        super().__init__()
        self.mesh = mesh
        self.grid = Grid(mesh)
        self.name = name

    # Subclasses define ``_dense(get)``: dense tensors keyed like the dense module's
    # state dict, where ``get(param)`` picks the local tensor (data or grad) to gather;
    # and ``dense_layout()``: ``{parameter name: (dense shape, pieces)}``, keyed the same way.

    # A layer's collectives are labelled with its name. Under torch.compile these two run eagerly
    # (comm.eager) and build the label there: a label read in traced code would be guarded, and every
    # layer (its own name) would compile the same code again.

    @comm.eager
    def row_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[.., 1]`` per token) summed over my grid row (``along_j``: the other hidden blocks of the
        same tokens), labelled ``{name}.stats``; the backward sums the gradient the same way."""
        return all_reduce_sum(x, self.grid.along_j, self.grid.stats, f"{self.name}.stats", self.grid.comm)

    @comm.eager
    def replicated(self, param: str) -> torch.Tensor:
        """Parameter ``param`` (replicated over my grid column) as used in the forward: its gradient is
        summed over the column (``{name}.{param}.grad``, :func:`~.grid.replicated_over_rows`)."""
        return replicated_over_rows(getattr(self, param), self.grid, f"{self.name}.{param}.grad")

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        return self._dense(lambda p: p.detach())

    def dense_grads(self) -> dict[str, torch.Tensor]:
        """Gathered gradients (zeros where a gradient is missing), keyed like the dense state dict."""
        return self._dense(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))


def vocab_rows(vocab: int, grid: Grid) -> tuple[int, int]:
    """``(first row, real rows)`` of vocab block i of a ``vocab``-row table padded to the grid
    (:func:`~parallel4d.config.rules.tensor2d.padded_vocab`; block i holds ``padded/q`` rows, the
    rows past ``vocab`` are padding: the last block's tail, and whole blocks only for a vocabulary of
    at most ``q·(q-1)`` rows)."""
    rows = padded_vocab(vocab, grid.q) // grid.q
    start = grid.i * rows
    return start, max(0, min(rows, vocab - start))


def vocab_block_layout(vocab: int, dim: int, grid: Grid) -> DenseLayout:
    """A ``[vocab, dim]`` table stored padded as q×q blocks, block (i, j) here: its real rows are a
    box of the dense ``[vocab, dim]`` table, its padded rows are in none (a block of padding only: no
    piece), so a checkpoint holds the single-process model's shape at any q."""
    start, real = vocab_rows(vocab, grid)
    offsets = (start, grid.j * (dim // grid.q))
    return (vocab, dim), lambda t: [(offsets, t[:real])] if real else []
