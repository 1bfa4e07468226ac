"""One rank of a q×q grid in a process of its own, with no peers: every rank's work on one device.

:class:`LocalRank` stands where a :class:`~parallel4d.distributed.mesh.Mesh` would for the 2D layers
(``q``, ``rank``, ``group``, ``global_rank``, ``device``, ``comm_stats``): build a layer or a family's
2D block from a dense one with it (``LlamaBlock2D.from_dense(block, LocalRank(q, i, j, device))``) and
the layer runs its own code — the SUMMA loops, their block products, their fp32 accumulation, the
norms and the attention on its blocks — with :class:`LocalCollectives` in place of the collectives.
Building the q² ranks and running them one after another measures, on one device, the compute the
whole grid does (``benchmarks/tensor2d.py --blocks``) and lets a test watch one rank's steps in order
(``grid.trace``).

What is emulated: no rank sees another's data, so what a collective would bring from the other ranks
is a stand-in block of the same shape, dtype and device (random values, made once per shape, scaled
like an initialised weight), written by one local copy or add:

* broadcast: the source keeps its block; every other rank copies the stand-in into its buffer;
* reduce: the destination adds the stand-in (the other ranks' partials, summed); the others keep theirs;
* all-reduce: the stand-in added; all-gather: the local block and stand-ins, concatenated;
  reduce-scatter: the local slice plus the stand-in.

The kernels, shapes and dtypes of each rank's work are those of a real run, and each received block
costs one copy on the compute stream (on a real grid it would arrive on the communication stream);
the values are not the 2D results (the float64 tests on gloo workers check those). Nothing here waits:
``wait`` returns at once, as a stream-ordered wait does for the host. Bytes are counted as
:mod:`parallel4d.distributed.comm` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel4d.distributed.comm import CommStats

_GRID_AXES = ("tp_row", "tp_col")


@dataclass(frozen=True)
class LocalGroup:
    """The q ranks along ``axis`` through this rank (``tp_col``: my grid row; ``tp_row``: my column)."""

    axis: str
    size: int
    my_index: int


class LocalCollectives:
    """:mod:`parallel4d.distributed.comm`'s collectives for one emulated rank (global rank ``me``):
    stand-ins for what the others would send (the module docstring), bytes counted as comm counts them."""

    def __init__(self, me: int, scale: float = 0.02, stand_ins: dict | None = None):
        self.me, self.scale = me, scale
        self._stand_ins: dict[tuple, torch.Tensor] = {} if stand_ins is None else stand_ins  # shared by a grid's ranks

    def _stand_in(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype, like.device)
        if key not in self._stand_ins:
            g = torch.Generator().manual_seed(len(self._stand_ins))
            self._stand_ins[key] = (torch.randn(like.shape, generator=g) * self.scale).to(like.device, like.dtype)
        return self._stand_ins[key]

    @staticmethod
    def _count(stats, label, sent, received, group):
        if stats is not None:
            stats.add(label, sent, received, group)

    def group_rank(self, group: LocalGroup) -> int:
        return group.my_index

    def group_size(self, group: LocalGroup) -> int:
        return group.size

    def broadcast(self, tensor, src: int, group: LocalGroup, *, stats=None, label="broadcast", async_op=False):
        if group.size > 1:
            nb = tensor.numel() * tensor.element_size()
            self._count(stats, label, nb if self.me == src else 0, 0 if self.me == src else nb, group)
            if self.me != src:
                tensor.copy_(self._stand_in(tensor))
        return None

    def reduce(self, tensor, dst: int, group: LocalGroup, *, stats=None, label="reduce", async_op=False):
        if group.size > 1:
            nb = tensor.numel() * tensor.element_size()
            self._count(stats, label, 0 if self.me == dst else nb, nb * (group.size - 1) if self.me == dst else 0,
                        group)
            if self.me == dst:
                tensor.add_(self._stand_in(tensor))
        return None

    def all_reduce(self, tensor, group: LocalGroup, *, op=None, stats=None, label="all_reduce", async_op=False):
        if group.size > 1:
            nb = tensor.numel() * tensor.element_size()
            self._count(stats, label, nb, nb, group)
            tensor.add_(self._stand_in(tensor))
        return None

    def all_gather(self, tensor, group: LocalGroup, *, dim: int = 0, stats=None, label="all_gather"):
        n = group.size
        if n == 1:
            return tensor
        nb = tensor.numel() * tensor.element_size()
        self._count(stats, label, nb, nb * (n - 1), group)
        parts = [self._stand_in(tensor)] * n
        parts[group.my_index] = tensor
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor, group: LocalGroup, *, dim: int = 0, stats=None, label="reduce_scatter"):
        n = group.size
        if n == 1:
            return tensor
        mine = tensor.chunk(n, dim=dim)[group.my_index]
        shard = mine.numel() * mine.element_size()
        self._count(stats, label, shard * (n - 1), shard * (n - 1), group)
        return (mine + self._stand_in(mine)).contiguous()

    def wait(self, works, timeout_s=None, what: str = "communication", deadlines=None) -> None:
        return None


class LocalRank:
    """Rank (i, j) of a q×q grid (``tp = q²``, every other axis of size 1) on ``device``, alone: what
    the 2D layers read of a mesh, with :class:`LocalCollectives` as its ``collectives``. Global rank
    ``i·q + j``. ``stand_ins``: a dict the ranks of one grid share (one stand-in per shape for them all)."""

    def __init__(self, q: int, i: int, j: int, device="cpu", stand_ins: dict | None = None):
        if not (0 <= i < q and 0 <= j < q):
            raise ValueError(f"grid rank ({i}, {j}) is outside a {q}x{q} grid: pick 0 <= i, j < {q}")
        self.q, self._coords, self.device = q, {"tp_row": i, "tp_col": j}, torch.device(device)
        self.comm_stats = CommStats()
        self.deadlines = None
        self.collectives = LocalCollectives(i * q + j, stand_ins=stand_ins)

    @property
    def coords(self) -> dict[str, int]:
        return dict(self._coords)

    def size(self, axis: str) -> int:
        return self.q if axis in _GRID_AXES else 1

    def rank(self, axis: str) -> int:
        return self._coords.get(axis, 0)

    def global_rank(self, axis: str, index: int) -> int:
        """The global rank of the grid rank ``index`` along ``axis`` through this one."""
        i, j = self._coords["tp_row"], self._coords["tp_col"]
        if axis == "tp_row":
            return index * self.q + j
        if axis == "tp_col":
            return i * self.q + index
        return i * self.q + j

    def group(self, axis: str) -> LocalGroup:
        return LocalGroup(axis, self.size(axis), self.rank(axis))


def grid_ranks(q: int, device="cpu") -> list[LocalRank]:
    """The q² ranks of a q×q grid, row by row: ``(0, 0), (0, 1), …, (q-1, q-1)``."""
    stand_ins: dict = {}
    return [LocalRank(q, i, j, device, stand_ins) for i in range(q) for j in range(q)]
