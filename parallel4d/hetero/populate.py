"""Create every row's chunks in the manager and move the model's data into them.

After :func:`move_params_into_chunks` each parameter's ``.data`` is a NaN placeholder of its
shape (expanded from one element: stray reads show NaN, writes fail) until a hook points it
at its chunk's device slot; the original storage is freed row by row.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from parallel4d.hetero.chunk import Chunk, TensorInfo, TensorState
from parallel4d.hetero.layout import Layout, Row, shard_pool
from parallel4d.hetero.manager import ChunkManager
from parallel4d.hetero.master import DEVICE, HOST, MasterState
from parallel4d.hetero.zero import ZeroShards

S = TensorState


def add_chunks(layout: Layout, mgr: ChunkManager, zero: ZeroShards, master_state: Optional[MasterState] = None) -> None:
    """P (and G, M, V for trainable rows) per row; under ZeRO also the shards PS, GS, with M
    and V only as shards, and P a cache-only chunk filled by all-gathering PS. With a ``master``
    (16-bit chunks) a trainable row has no M, V and PS chunks: P is filled from the master's ``W``; a
    frozen row has no master (nothing updates it): its P (or PS) holds it in the chunks' dtype, host
    backing included — a frozen parameter's only copy."""
    zero_mode = layout.dp > 1
    for row in layout.rows:
        master = master_of(row, master_state)
        row.P = _chunk(row, mgr, zero, "param", S.HOLD, backing=not zero_mode and master is None)
        if row.trainable:  # under ZeRO G is staging only: evicted, it is reduced into GS (zero.reduce_row)
            row.G = _chunk(row, mgr, zero, "grad", S.FREE, backing=not zero_mode)
            if zero_mode:
                row.G.meta["spill"] = lambda row=row: zero.reduce_row(row, "on_eviction")
        if row.trainable and master is None:
            pool = shard_pool(row.replicas) if zero_mode else "main"
            row.M = _chunk(row, mgr, zero, "exp_avg", S.FREE, pool=pool)
            row.V = _chunk(row, mgr, zero, "exp_avg_sq", S.FREE, pool=pool)
        if zero_mode and master is None:
            row.PS = _chunk(row, mgr, zero, "param_shard", S.HOLD, pool=shard_pool(row.replicas))
        if zero_mode and row.trainable:
            row.GS = _chunk(row, mgr, zero, "grad_shard", S.FREE, pool=shard_pool(row.replicas))
        if zero_mode:
            row.P.loader = zero.loader(row, master)
            row.P.meta["gathers"] = True
        elif master is not None:
            row.P.loader = (lambda dst, row=row, master=master: master.upload(row, dst))
        if master is not None:  # the host update reads the gradient's backing
            for c in (row.G, row.GS):
                if c is not None:
                    c.meta["before_host_write"] = lambda row=row, master=master: master.updates.wait(row.index)


def master_of(row: Row, master: Optional[MasterState]) -> Optional[MasterState]:
    """The master state behind ``row``'s chunks: ``master`` for a trainable row, None for a frozen one
    (16-bit chunks hold a frozen parameter alone: no master copy, no moments)."""
    return master if row.trainable else None


def _chunk(row: Row, mgr: ChunkManager, zero: ZeroShards, kind: str, state: TensorState, pool: str = "main",
           backing: bool = True) -> Chunk:
    cap = zero.C if pool == "main" else zero.shard_elems(row)
    tensors = [TensorInfo(f"{kind}:{r.name}", r.shape, r.offset, r.param.numel(), state) for r in row.records]
    base = zero.window_of(row)[0] if pool != "main" else 0
    return mgr.add(Chunk(-1, kind, row.index, cap, tensors, pool=pool, base=base), backing=backing)


@torch.no_grad()
def move_params_into_chunks(layout: Layout, mgr: ChunkManager, zero: ZeroShards, device: torch.device,
                            master: Optional[MasterState] = None, on_device: frozenset = frozenset()) -> None:
    """Each row's ``[C]`` parameter values (this rank's shard under ZeRO) into its host backing, or
    into the ``master``'s ``W`` (on the device for the rows in ``on_device``; the parameters then compute
    in the chunks' dtype). Row by row: a row's backings and master state are allocated as its parameters'
    storage is freed, so hetero's host memory grows as the model's shrinks."""
    for rec in layout.records:
        rec.placeholder = torch.full((1,), float("nan"), dtype=layout.cdtype, device=device).expand(rec.shape)
    for row in layout.rows:
        lo, hi = zero.window_of(row)
        mgr.allocate_backings([row.P, row.G, row.M, row.V, row.PS, row.GS])
        full = torch.zeros(layout.C, dtype=layout.dtype)
        for rec in row.records:
            full.narrow(0, rec.offset, rec.param.numel()).copy_(rec.param.detach().reshape(-1))
            rec.param.data = rec.placeholder  # free the original storage row by row
            rec.param.grad = None
        if master_of(row, master) is not None:
            master.allocate(row, DEVICE if row.index in on_device else HOST)
            master.W[row.index].copy_(full[lo:hi])
        elif layout.dp > 1:  # rounded to the chunks' dtype as they are written (a frozen row's only copy)
            row.PS.backing.copy_(full[lo:hi])
        else:
            row.P.backing.copy_(full)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (not managed by chunks) go to the compute device once."""
    for mod in model.modules():
        for bn, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[bn] = b.to(device)
