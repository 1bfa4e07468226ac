"""A rank's share of the global batch: rows block ``dp``, then rows block ``tp_row``, then
sequence shard ``sp`` (in ``sequence.layout``): ``[B, S]`` → ``[B/(dp·q), S/sp]``."""

from __future__ import annotations

import torch

from parallel4d.distributed.mesh import Mesh
from parallel4d.sequence.ulysses import hybrid_position_tensor


def local_rows(mesh: Mesh, batch_size: int) -> range:
    """The rows of a global batch this rank trains on: block ``dp`` of the batch, then block
    ``tp_row`` of that (the sequence shard is taken from those rows)."""
    dp, q = mesh.size("dp"), mesh.size("tp_row")
    if batch_size % (dp * q):
        raise ValueError(f"a batch of {batch_size} rows does not split into dp·q = {dp}·{q} equal parts")
    per = batch_size // (dp * q)
    start = (mesh.rank("dp") * q + mesh.rank("tp_row")) * per
    return range(start, start + per)


def local_batch(mesh: Mesh, x: torch.Tensor, layout: str = "zigzag", ulysses: int = 1) -> torch.Tensor:
    """This rank's share of a global ``[B, S]`` tensor (tokens or targets): its rows
    (:func:`local_rows`), then sequence shard sp in ``layout`` (``sequence.layout``; with ``ulysses > 1``
    the hybrid layout, :func:`~parallel4d.sequence.ulysses.hybrid_positions`)
    → ``[B/(dp·q), S/sp]`` on ``mesh.device``. A host tensor is page-locked and copied without
    making the host wait (a plain copy from pageable memory would wait for the device's queue)."""
    rows = local_rows(mesh, x.shape[0])
    x = x[rows.start:rows.stop]
    if mesh.size("sp") > 1:  # the ring's layout is the hybrid one with ulysses = 1
        x = x.index_select(1, hybrid_position_tensor(x.shape[1], mesh.rank("sp"), mesh.size("sp"), ulysses, layout,
                                                     device=x.device))
    x = x.contiguous()
    if x.device == mesh.device:
        return x
    if x.device.type == "cpu":
        x = x.pin_memory()
    return x.to(mesh.device, non_blocking=True)
