"""ZeRO over the ``dp`` group at chunk granularity (shard within chunk, Gemini-style).

Every chunk of ``C`` elements is split into ``dp`` equal shards of ``S = C/dp``;
dp rank ``r`` owns elements ``[r·S, (r+1)·S)`` of every row's parameter, gradient,
exp_avg and exp_avg_sq chunks (host backing of ``S`` elements each). Parameters are
all-gathered into a full device slot before use; gradient chunks are reduce-scattered
(summed, then divided by dp — the per-rank loss is the mean over that rank's slice,
like DDP) as soon as all their tensors' gradients are written, or when evicted before
(the full gradient chunk has no host copy), and each rank updates only its shard.

All dp ranks run the same program on the same budget and policy, so their chunk
accesses and eviction decisions are identical and every collective is matched.
:class:`ZeroShards` does this rank's part: gathers a row's parameters, reduce-scatters its gradients.

Parameters only some of the data replicas hold (expert parallelism: an expert's slices live on its ep rank
and the ranks at the same place of the other ep groups) have rows of their own, sharded over that smaller
:class:`ReplicaSet` (``row.replicas``): gathered and reduce-scattered over it — the ranks that hold the same
values — and divided by the whole dp all the same (each rank's loss is the mean over its own tokens; the
expert's gradient on its rank already sums what its ep group sent it). Summed over every data replica,
each rank's squared shards count every element once (:meth:`ZeroShards.all_reduce`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel4d.distributed import comm
from parallel4d.hetero.chunk import TensorInfo, TensorState


def window(rank: int, shard: int) -> tuple[int, int]:
    """Element range ``[lo, hi)`` of a chunk owned by dp ``rank``."""
    return rank * shard, (rank + 1) * shard


def segment(t: TensorInfo, lo: int, hi: int) -> tuple[int, int] | None:
    """``t``'s elements inside ``[lo, hi)`` as chunk offsets, or ``None``."""
    a, b = max(t.offset, lo), min(t.end, hi)
    return (a, b) if a < b else None


GATHER, REDUCE = "hetero ZeRO parameter all-gather", "hetero ZeRO gradient reduce-scatter"
IN_FLIGHT = 2  # reduce-scatters posted and not yet added into GS: each pins its gradient chunk


def all_gather_into(full: torch.Tensor, local: torch.Tensor, group, async_op: bool = False):
    """``full[C]`` ← concatenation of every rank's ``local[S]`` (rank order of ``group``); the work
    when ``async_op``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with comm.named(GATHER, group):
        return fn(full, local.contiguous(), group=group, async_op=async_op)


def reduce_scatter_sum(full: torch.Tensor, group, dp: int):
    """``(out[S], work)``: the sum of ``full[C]`` over the group, this rank's shard, once ``work`` is done."""
    out = torch.empty(full.numel() // dp, dtype=full.dtype, device=full.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with comm.named(REDUCE, group):
        return out, fn(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)


@dataclass(frozen=True)
class ReplicaSet:
    """Data replicas holding the same values of some rows: ``size`` ranks, this one ``rank`` of them,
    their process ``group`` (None at size 1). ZeRO shards those rows over them."""

    size: int
    rank: int
    group: object = None


class ZeroShards:
    """This rank's share ``[lo, hi)`` of every row (the whole row at dp = 1) and the ZeRO
    collectives between full ``[C]`` chunks and ``[C/n]`` shards — ``n`` the size of the row's
    replica set (``sets[row.replicas]``; set 0 is every data replica, ``dp``) — counted in the manager's
    stats and the mesh's byte counters. ``window``, ``Sz``: set 0's."""

    def __init__(self, mgr, C: int, dp: int, rank: int, group, mesh, partial: ReplicaSet | None = None):
        self.mgr, self.C, self.dp, self.rank, self.group, self.mesh = mgr, C, dp, rank, group, mesh
        self.sets = [ReplicaSet(dp, rank, group)] + ([partial] if partial is not None else [])
        self.Sz = C // dp
        self.window = window(rank, self.Sz)
        self.reduce_scatters = {"on_completion": 0, "end_of_backward": 0, "on_eviction": 0}
        self.in_flight: list[tuple] = []  # reduce-scatters posted, not yet added into GS (see drain)
        mgr.release_lent_pins = self._release_pins

    def _wait(self, work, what: str) -> None:
        """Wait for a ZeRO collective within the mesh's limit (stream-ordered on NCCL)."""
        comm.wait(work, self.mesh.timeout_s, what, self.mesh.deadlines)

    def set_of(self, row) -> ReplicaSet:
        return self.sets[row.replicas]

    def shard_elems(self, row) -> int:
        """``C`` over the size of ``row``'s replica set."""
        return self.C // self.set_of(row).size

    def window_of(self, row) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of ``row``."""
        return window(self.set_of(row).rank, self.shard_elems(row))

    def opt_chunks(self, row):
        """``(P, G, M, V, (lo, hi))`` the optimizer updates: under ZeRO the shards."""
        if self.dp > 1:
            return row.PS, row.GS, row.M, row.V, self.window_of(row)
        return row.P, row.G, row.M, row.V, self.window

    def loader(self, row, master=None):
        """``load(dst[C])``: the row's full parameters, all-gathered from every rank's shard (``PS``, or
        the ``master``'s window rounded to the chunks' dtype under 16-bit chunks)."""
        replicas, (lo, hi) = self.set_of(row), self.window_of(row)

        def load(dst: torch.Tensor):
            """Posts the gather; returns what waits for it."""
            local = dst.narrow(0, lo, hi - lo)
            ps, nbytes = row.PS, (hi - lo) * self.mgr.esize
            if master is None and ps.slot is not None:
                local.copy_(self.mgr.read(ps))
            else:
                if master is None:
                    self.mgr.transfers.run(lambda: local.copy_(ps.backing, non_blocking=self.mgr.cuda), "h2d", ps.cid)
                    crossed = True
                else:
                    crossed = master.upload(row, local)
                self.mgr.transfers.compute_waits()
                self.mgr.count(**(dict(load_bytes=nbytes, loads=1) if crossed else dict(device_fills=1)))
            if replicas.size == 1:  # the whole row is this rank's
                return lambda: None
            work = all_gather_into(dst, local.clone(), replicas.group, async_op=True)
            got = (replicas.size - 1) * nbytes
            self.mgr.count(gather_bytes=got)
            self.mesh.comm_stats.add("hetero.all_gather", nbytes, got, replicas.group)
            return lambda: self._wait(work, GATHER)
        return load

    def reduce_row(self, row, when: str) -> None:
        """Reduce-scatter the row's gradient chunk ``G[C]`` into this rank's ``GS[C/dp]``
        (``when``: ``on_completion``, ``end_of_backward`` or ``on_eviction``, for the stats).

        ``on_eviction`` is the eviction of a ``G`` still collecting gradients: ``G`` has no host
        backing (the staging is sharded: a rank keeps only its ``GS``), so what it holds so far is
        reduced now, from its slot, and the rest of the row's gradients come in a fresh ``G``. Every dp
        rank evicts at the same moment (same program, budget and policy), so the collective matches."""
        self.reduce_scatters[when] += 1
        got = [k for k, t in enumerate(row.G.tensors) if t.state == TensorState.HOLD_AFTER_BWD]
        evicting = when == "on_eviction"
        if not evicting:  # pinned until its reduction is added into GS (drain), unless room is short
            self.mgr.pin(row.G, lent=True)
        self.in_flight.append((row, got, *self._reduce_scatter(row, got), not evicting))
        if evicting:  # its slot is given up now; nothing inside an eviction may fill or prefetch
            self.drain(record=False)
        else:
            self.drain(keep=IN_FLIGHT - 1)

    def _release_pins(self) -> bool:
        """A fill found no room: finish the reductions in flight (their gradient chunks are pinned)."""
        held = any(pinned for *_, pinned in self.in_flight)
        self.drain(record=False)  # inside a fill: nothing may be prefetched
        return held

    def drain(self, keep: int = 0, record: bool = True) -> None:
        """Wait for the oldest reduce-scatters in flight until ``keep`` are left, adding each into its
        ``GS`` (``record``: as a moment of the chunk trace). A reduction overlaps with the backward of
        the next row; the backward's end drains all."""
        while len(self.in_flight) > keep:
            row, got, shard, work, pinned = self.in_flight.pop(0)
            if work is not None:
                self._wait(work, REDUCE)
            self._accumulate(row, got, shard.div_(self.dp), record)
            if pinned:
                self.mgr.unpin(row.G, lent=True)

    @torch.no_grad()
    def _reduce_scatter(self, row, got: list[int]) -> tuple:
        """Post the sum over the row's replica set of its resident ``G``'s content, this rank's ``[C/n]``
        part: ``(shard, work)`` (work None: a set of one rank, nothing to sum); ``G``'s tensors → FREE."""
        G, replicas = row.G, self.set_of(row)
        full = self.mgr.slot_view(G)
        for t in G.tensors:  # content of FREE tensors is stale: contribute zeros
            if t.state == TensorState.FREE:
                full.narrow(0, t.offset, t.numel).zero_()
        self.mgr.transfers.note("reduce_scatter", G.cid)
        if replicas.size == 1:
            shard, work = full.clone(), None
        else:
            shard, work = reduce_scatter_sum(full, replicas.group, replicas.size)
            sent = (replicas.size - 1) * self.shard_elems(row) * self.mgr.esize
            self.mgr.count(reduce_scatter_bytes=sent)
            self.mesh.comm_stats.add("hetero.reduce_scatter", sent, sent, replicas.group)
        for k in got:
            G.tensors[k].set_state(TensorState.FREE)
        return shard, work

    @torch.no_grad()
    def _accumulate(self, row, got: list[int], shard: torch.Tensor, record: bool = True) -> None:
        """``row.GS`` += ``shard`` for tensors ``got`` (copy where ``GS`` held no gradient yet)."""
        GS, (lo, hi) = row.GS, self.window_of(row)
        first = {k: GS.tensors[k].state == TensorState.FREE for k in got}
        ts = [GS.tensors[k] for k in got]
        self.mgr.acquire(GS, ts, write=True, zero_free=False, record=record)
        dst = self.mgr.slot_view(GS)
        for k in got:
            seg = segment(GS.tensors[k], lo, hi)
            if seg is None:
                continue
            a, b = seg[0] - lo, seg[1] - lo
            if first[k]:
                dst[a:b].copy_(shard[a:b])
            else:
                dst[a:b].add_(shard[a:b])
        self.mgr.release(GS, ts, TensorState.HOLD_AFTER_BWD)

    def full_row(self, row, chunk, shard) -> torch.Tensor:
        """``row``'s whole ``[C]`` content of ``chunk`` on the CPU (all-gathered from the ``shard`` s under ZeRO)."""
        return self.full_window(row, self.mgr.read(chunk if self.dp == 1 else shard))

    def full_window(self, row, local: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """``row``'s whole ``[C]`` on the CPU from every rank of its replica set's ``[C/n]`` window ``local``
        (any dtype; gathered on the compute device, where the group communicates). At one rank a copy, or with
        ``copy`` False ``local`` itself (the caller's: a host tensor it lends as ``nn.Module.state_dict``
        lends the live parameters)."""
        replicas = self.set_of(row) if self.dp > 1 else self.sets[0]
        if replicas.size == 1:
            return local.detach() if not copy else local.detach().to("cpu", copy=True)
        full = torch.empty(self.C, dtype=local.dtype, device=self.mgr.device)
        all_gather_into(full, local.to(self.mgr.device), replicas.group)
        return full.cpu()

    def all_reduce(self, t: torch.Tensor, what: str) -> None:
        """Sum ``t`` over the data replicas (nothing at dp = 1)."""
        if self.dp > 1:
            with comm.named(what, self.group):
                self._wait(dist.all_reduce(t, group=self.group, async_op=True), what)
