"""Named process-group mesh over ``torch.distributed.device_mesh.DeviceMesh``.

Axes, outermost first: ``pp, dp, sp, tp_row, tp_col`` with ``tp = q²`` and
``tp_row = tp_col = q``. Global rank layout (row-major over the axes)::

    rank = (((p·dp + d)·sp + r)·q + i)·q + j

``group(axis)`` is the group of ranks whose coordinate along ``axis`` varies
while every other coordinate equals this rank's (so ``group("tp_col")`` holds
the q ranks of one grid *row* i, indexed by column j). Strategies resolve
peers only through :meth:`Mesh.global_rank` / :meth:`Mesh.group`: no rank
arithmetic over a fixed layout elsewhere, and no process-global mesh.

Every group the mesh creates (the five axes, :meth:`Mesh.group_over`,
:meth:`Mesh.new_group`) carries the job's collective timeout: torch would give
sub-groups its 30-minute default, and one stopped rank would then hang its
tensor-parallel peers for half an hour instead of ``train.timeout_s``.
"""

from __future__ import annotations

import itertools
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel4d.distributed import comm
from parallel4d.distributed.comm import CommStats
from parallel4d.distributed.deadlines import Deadlines, group_timeout_s
from parallel4d.config.rules.tensor2d import grid_side
from parallel4d.distributed.startup import init_process_group_from_env

AXES = ("pp", "dp", "sp", "tp_row", "tp_col")


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """``x`` on ``device``; a host tensor is page-locked and copied without making the host wait (a
    plain copy from pageable memory would wait for the device's queue)."""
    device = torch.device(device)
    if x.device == device:
        return x
    if x.device.type == "cpu":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def mesh_shape(pp: int = 1, dp: int = 1, sp: int = 1, tp: int = 1) -> tuple[int, ...]:
    """The 5-D shape ``(pp, dp, sp, q, q)`` of the mesh for these sizes."""
    for name, v in (("pp", pp), ("dp", dp), ("sp", sp)):
        if int(v) != v or v < 1:
            raise ValueError(f"parallel.{name}={v} must be an integer ≥ 1")
    q = grid_side(tp)
    return (pp, dp, sp, q, q)


def group_options(backend: str, timeout_s: float):
    """``(backend, options)`` that create a group of ``backend`` with ``timeout_s`` as its limit
    (``fake``: torch's stand-in process group of ``parallel4d plan``'s dry run, which never waits)."""
    if backend == "fake":
        return backend, None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        raise ValueError(f"backend {backend!r}: parallel4d builds meshes over 'nccl' or 'gloo'")
    options._timeout = timedelta(seconds=group_timeout_s(backend, timeout_s))
    return backend, options


def _own(group) -> bool:
    """Whether ``group`` is one of this rank's own, not the default group (nor a non-member's marker)."""
    return group is not None and group != dist.GroupMember.NON_GROUP_MEMBER and group != dist.group.WORLD


class Mesh:
    """Named axes over a :class:`DeviceMesh`; see the module docstring for the layout.

    Also carries this rank's :class:`CommStats` (bytes counted by ``comm``
    helpers) so that strategies need no global counters.
    """

    #: where a technique's collectives go: :mod:`~parallel4d.distributed.comm` (a one-process stand-in
    #: for a rank, such as ``tensor2d.emulate.LocalRank``, carries its own)
    collectives = comm

    def __init__(self, device_mesh: DeviceMesh, timeout_s: float = 300.0):
        if tuple(device_mesh.mesh_dim_names or ()) != AXES:
            raise ValueError(f"DeviceMesh axes must be {AXES}, got {device_mesh.mesh_dim_names}")
        self.device_mesh = device_mesh
        self.timeout_s = float(timeout_s)  # train.timeout_s: every wait's limit
        self.comm_stats = CommStats()
        # NCCL's waits are stream-ordered: their limits wait here for the host's next read (None: gloo's block)
        self.deadlines = Deadlines(self.timeout_s) if device_mesh.device_type == "cuda" else None
        self._coords = tuple(int(c) for c in device_mesh.get_coordinate())
        # {coordinates: global rank} in plain Python: peers resolve without tensor ops (a plan's
        # dry run traces the model under a fake-tensor mode, where tensors hold no values).
        # the sizes, read once: DeviceMesh.mesh rebuilds its rank tensor on every access (~1 ms, and
        # the step asks for sizes hundreds of times)
        self._shape = shape = tuple(int(n) for n in device_mesh.mesh.shape)
        self._rank_at = dict(zip(itertools.product(*map(range, shape)), device_mesh.mesh.flatten().tolist()))
        self._groups: dict[str, dist.ProcessGroup] = {}
        # the groups this mesh made, oldest first (:meth:`close`): its axes' (the default group aside)
        self._made: list[dist.ProcessGroup] = [g for g in device_mesh.get_all_groups() if _own(g)]

    # --- sizes and coordinates -------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(AXES, self._shape))

    @property
    def world_size(self) -> int:
        return math.prod(self._shape)

    @property
    def q(self) -> int:
        """Side of the tensor-parallel grid (``tp = q²``)."""
        return self.size("tp_row")

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every axis."""
        return dict(zip(AXES, self._coords))

    @property
    def device(self) -> torch.device:
        if self.device_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_mesh.device_type)

    def _dim(self, axis: str) -> int:
        try:
            return AXES.index(axis)
        except ValueError:
            raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}") from None

    def size(self, axis: str) -> int:
        return self._shape[self._dim(axis)]

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self._coords[self._dim(axis)]

    def global_rank(self, axis: str, index: int) -> int:
        """Global rank at ``index`` along ``axis``, every other coordinate equal to mine."""
        dim = self._dim(axis)
        n = self.size(axis)
        if not 0 <= index < n:
            raise ValueError(f"index {index} out of range for axis {axis!r} of size {n}")
        where = list(self._coords)
        where[dim] = index
        return self._rank_at[tuple(where)]

    def ranks_along(self, axis: str) -> list[int]:
        """Global ranks of :meth:`group` (``axis`` varies), in coordinate order."""
        return [self.global_rank(axis, i) for i in range(self.size(axis))]

    def group(self, axis: str) -> dist.ProcessGroup:
        """Process group of the ranks along ``axis`` (that coordinate varies, others fixed)."""
        if axis not in self._groups:
            self._groups[axis] = self.device_mesh.get_group(axis)
            self.comm_stats.name_group(self._groups[axis], axis)
        return self._groups[axis]

    group_along = group

    def group_over(self, *axes: str) -> dist.ProcessGroup:
        """Group of the ranks along several axes at once (those coordinates vary,
        the others equal mine), e.g. ``group_over("dp", "sp")``: every data replica.

        Collective on first use: every rank of the world must ask for the same axes
        in the same order (it creates one group per combination of the other axes).
        """
        dims = sorted(self._dim(a) for a in axes)
        key = tuple(AXES[d] for d in dims)
        if len(key) == 1:
            return self.group(key[0])
        if key not in self._groups:
            rows = self.lines_along(*key)
            mine, _ = dist.new_subgroups_by_enumeration(rows, timeout=self._group_timeout())
            self._groups[key] = mine
            self._made.append(mine)
            self.comm_stats.name_group(mine, "+".join(key))
        return self._groups[key]

    def sp_split(self, ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """``(ulysses group, ring group)`` of this rank for ``sp = R × ulysses`` (Ulysses innermost: sp
        index ``i`` is member ``i % ulysses`` of the Ulysses group of the ranks sharing ``i // ulysses``,
        and ring rank ``i // ulysses`` of the ring sharing ``i % ulysses``). Collective on first use."""
        key = ("sp_split", ulysses)
        if key not in self._groups:
            lines = self.lines_along("sp")
            n = self.size("sp")
            self._groups[key] = self._enumerated({
                "sp_ulysses": [line[i:i + ulysses] for line in lines for i in range(0, n, ulysses)],
                "sp_ring": [line[j::ulysses] for line in lines for j in range(ulysses)]})
        return self._groups[key]

    def ep_split(self, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """``(ep group, expert replicas)`` of this rank for expert parallelism over ``ep`` of the data
        replicas' ``dp·sp`` ranks (``ep`` divides it). Data-replica index ``f`` (row-major over dp, sp: sp
        innermost, so an ep group stays within a node where sp does) is member ``f % ep`` of the ep group
        of ``f // ep``, and replica ``f // ep`` of the experts held by the ranks sharing ``f % ep``: the
        group an expert's gradient is summed over. Collective on first use."""
        key = ("ep_split", ep)
        if key not in self._groups:
            lines = self.lines_along("dp", "sp")
            n = len(lines[0])
            if n % ep:
                raise ValueError(f"parallel.ep={ep} does not divide the {n} data-replica ranks (dp·sp): "
                                 "choose parallel.ep dividing parallel.dp × parallel.sp")
            self._groups[key] = self._enumerated({
                "ep": [line[i:i + ep] for line in lines for i in range(0, n, ep)],
                "ep_replicas": [line[j::ep] for line in lines for j in range(ep)]})
        return self._groups[key]

    def _enumerated(self, parts: dict[str, list[list[int]]]) -> tuple[dist.ProcessGroup, ...]:
        """This rank's group of each ``{name: every group's ranks}`` (in order), made with the mesh's timeout
        and counted under ``name``. Collective: every rank makes every group."""
        made = []
        for name, rows in parts.items():
            mine, _ = dist.new_subgroups_by_enumeration(rows, timeout=self._group_timeout())
            self._made.append(mine)
            self.comm_stats.name_group(mine, name)
            made.append(mine)
        return tuple(made)

    def lines_along(self, *axes: str) -> list[list[int]]:
        """Every group of ranks along ``axes`` (those coordinates vary, the others fixed), one per
        combination of the other axes in row-major order; members row-major over ``axes``."""
        dims = sorted(self._dim(a) for a in axes)
        sizes = [self.size(a) for a in AXES]
        others = [d for d in range(len(AXES)) if d not in dims]
        rows = []
        for fixed in itertools.product(*(range(sizes[d]) for d in others)):
            row = []
            for free in itertools.product(*(range(sizes[d]) for d in dims)):
                where = [0] * len(AXES)
                for d, c in zip(others + dims, fixed + free):
                    where[d] = c
                row.append(self._rank_at[tuple(where)])
            rows.append(row)
        return rows

    def new_group(self, ranks: list[int], axis: str = "other") -> dist.ProcessGroup:
        """``dist.new_group(ranks)`` with the mesh's timeout (collective over the whole world);
        its bytes count under ``axis`` in :attr:`comm_stats` (say ``"pp"`` for ranks along pp)."""
        group = dist.new_group(sorted(ranks), timeout=self._group_timeout())
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            self.comm_stats.name_group(group, axis)
            self._made.append(group)
        return group

    def close(self) -> None:
        """Destroy the process groups this mesh made (newest first, the same order on every rank), the
        default group aside; the mesh is not used after. Collective: every rank calls it.

        Why: torch's registry keeps every group, and with it its communication threads, until the
        default group is destroyed; a process that trains again (a notebook, a test job) would pile
        them up, each woken every few milliseconds."""
        if dist.is_initialized():  # else dist.destroy_process_group() already destroyed them all
            for group in reversed(self._made):
                dist.destroy_process_group(group)
        self._made.clear()
        self._groups.clear()

    def rank_over(self, *axes: str) -> int:
        """My index in :meth:`group_over` (row-major over ``axes`` in mesh order)."""
        index = 0
        for d in sorted(self._dim(a) for a in axes):
            index = index * self.size(AXES[d]) + self._coords[d]
        return index

    def _group_timeout(self) -> timedelta:
        return timedelta(seconds=group_timeout_s(dist.get_backend(), self.timeout_s))

    def __repr__(self) -> str:
        dims = ", ".join(f"{a}={self.size(a)}" for a in AXES)
        return f"Mesh({dims}; coords={self.coords})"


def init_mesh(pp: int = 1, dp: int = 1, sp: int = 1, tp: int = 1, *, timeout_s: float = 300.0) -> Mesh:
    """Build the mesh; uses the default process group if one exists, else joins from env.

    Every group of the mesh has ``timeout_s`` as its collective limit.

    Raises ``ValueError`` (before any collective) when ``tp`` is not a square or
    ``pp·dp·sp·tp`` differs from the world size.
    """
    shape = mesh_shape(pp, dp, sp, tp)
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "0") or 0)
        if world and world != math.prod(shape):
            raise ValueError(
                f"pp·dp·sp·tp = {pp}·{dp}·{sp}·{tp} = {math.prod(shape)} but WORLD_SIZE={world}; "
                "change the parallel sizes or the number of processes"
            )
        init_process_group_from_env(timeout_s=timeout_s)
    world = dist.get_world_size()
    if world != math.prod(shape):
        raise ValueError(
            f"pp·dp·sp·tp = {pp}·{dp}·{sp}·{tp} = {math.prod(shape)} but the process group has "
            f"{world} ranks; change the parallel sizes so that their product is {world}"
        )
    backend = dist.get_backend()
    device_type = "cuda" if backend == "nccl" else "cpu"
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES,
                                   backend_override={axis: group_options(backend, timeout_s) for axis in AXES})
    return Mesh(device_mesh, timeout_s)
