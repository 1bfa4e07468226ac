"""A rank's share of the global batch, micro-batch by micro-batch: the batch is cut into the
``pipeline.microbatches`` micro-batches one process runs (rows ``[i·B/m, (i+1)·B/m)``), each micro-batch
into ``dp·q`` blocks of rows (rank (dp d, tp_row r) takes block ``d·q + r`` of every micro-batch), then
sequence shard ``sp`` (in ``sequence.layout``): ``[B, S]`` → ``[B/(dp·q), S/sp]``; with packed
documents (``data.packing: documents``) also each micro-batch's documents and positions, and the
targets that never cross a boundary (:func:`packed_step`); where the ranks hold different numbers of
valid targets (packed documents, a loss mask) what each one's summed loss weighs (:func:`loss_weight`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from parallel4d.config.rules.data import batch_problem
from parallel4d.data.packing import IGNORE, boundary_targets, document_positions, document_starts
from parallel4d.distributed.mesh import Mesh, to_device
from parallel4d.models.context import Packed
from parallel4d.sequence.documents import Documents
from parallel4d.sequence.ulysses import hybrid_position_tensor


def microbatch_rows(mesh: Mesh, batch_size: int, microbatches: int = 1) -> list[range]:
    """This rank's rows of each micro-batch of a global batch, in order: micro-batch ``i`` is rows
    ``[i·B/m, (i+1)·B/m)`` (one process's micro-batch ``i``, in every layout: what a micro-batch's statistics,
    the MoE load-balancing loss, need), cut into ``dp·q`` equal blocks, of which this rank takes block
    ``k = dp rank · q + tp_row rank``: rows ``i·B/m + k·B/(m·dp·q)`` onwards, ``B/(m·dp·q)`` of them
    (contiguous: a dropout draw names its first). At ``m = 1``: block ``k`` of the batch."""
    dp, q = mesh.size("dp"), mesh.size("tp_row")
    problem = batch_problem(batch_size, microbatches, [("parallel.dp", dp), ("q", q)])
    if problem:
        raise ValueError(problem)
    per_microbatch = batch_size // microbatches
    per = per_microbatch // (dp * q)
    first = (mesh.rank("dp") * q + mesh.rank("tp_row")) * per
    return [range(i * per_microbatch + first, i * per_microbatch + first + per) for i in range(microbatches)]


def local_rows(mesh: Mesh, batch_size: int, microbatches: int = 1) -> list[int]:
    """The rows of a global batch this rank trains on (the sequence shard is taken from those rows), in the
    order it runs them: :func:`microbatch_rows` one micro-batch after the other, ``B/(dp·q)`` rows."""
    return [row for rows in microbatch_rows(mesh, batch_size, microbatches) for row in rows]


def local_batch(mesh: Mesh, x: torch.Tensor, layout: str = "zigzag", ulysses: int = 1,
                microbatches: int = 1) -> torch.Tensor:
    """This rank's share of a global ``[B, S]`` tensor (tokens or targets): its rows of each of the
    ``microbatches`` micro-batches (:func:`local_rows`: ``chunk(microbatches)`` of the result gives them),
    then sequence shard sp in ``layout`` (``sequence.layout``; with ``ulysses > 1`` the hybrid layout,
    :func:`~parallel4d.sequence.ulysses.hybrid_positions`) → ``[B/(dp·q), S/sp]`` on ``mesh.device``. A host
    tensor is page-locked and copied without making the host wait (a plain copy from pageable memory would
    wait for the device's queue)."""
    spans = microbatch_rows(mesh, x.shape[0], microbatches)  # slices, not an index tensor: no copy to a device
    x = x[spans[0].start:spans[0].stop] if len(spans) == 1 else torch.cat([x[r.start:r.stop] for r in spans])
    if mesh.size("sp") > 1:  # the ring's layout is the hybrid one with ulysses = 1
        x = x.index_select(1, hybrid_position_tensor(x.shape[1], mesh.rank("sp"), mesh.size("sp"), ulysses, layout,
                                                     device=x.device))
    return to_device(x.contiguous(), mesh.device)


def loss_weight(mesh: Mesh, targets: torch.Tensor, microbatches: int) -> float:
    """What each forward's summed token loss is multiplied by where the ranks' and micro-batches' shares of
    the step's valid targets differ (packed documents, chat data's loss mask): ``dp·sp·m / N``, ``N`` the
    valid targets (not :data:`~parallel4d.data.packing.IGNORE`) of the whole global batch ``targets``
    ``[B, S]``, counted here on the host (every row of it read: :meth:`Engine.data_rows`). The gradient
    averaging over the ``dp·sp`` data replicas and the ``1/m`` of each micro-batch then leave exactly the
    batch's mean over its valid tokens — what one process computes, however unevenly the grid rows, sequence
    shards and micro-batches hold them, and whatever ``m`` is (the Hugging Face Trainer's count over its
    accumulated micro-batches too). A batch without a valid target weighs 0: loss 0, no gradient, not 0/0.
    Counted for real even inside a fake-tensor dry run (``parallel4d plan``: pass it real host tensors)."""
    with unset_fake_temporarily():
        if targets.device.type != "cpu":  # the count is the host's (a device batch would be read back)
            targets = targets.cpu()
        valid = int((targets != IGNORE).sum())
    return mesh.size("dp") * mesh.size("sp") * microbatches / valid if valid else 0.0


class PackedStep(NamedTuple):
    """One step's packed documents (:func:`packed_step`)."""

    targets: torch.Tensor  # [B, S]: the step's targets, IGNORE where a token ends its document
    microbatches: list[Packed]  # this rank's, in order


def packed_step(mesh: Mesh, tokens: torch.Tensor, targets: torch.Tensor, eod: int, microbatches: int,
                layout: str = "zigzag", ulysses: int = 1, masked: bool = False) -> PackedStep:
    """A step of packed documents from the global batch's host ``tokens`` and ``targets`` ``[B, S]``:
    documents end after each ``eod`` token (:mod:`parallel4d.data.packing`), whose target is ignored.
    The loss then weighs each rank's summed token loss by :func:`loss_weight` of the returned targets.
    ``masked``: the data has a loss mask (chat data), so a batch of prompts only is data, not a wrong
    ``eod`` (refused without one). The documents are data, computed for real even inside a fake-tensor
    dry run (``parallel4d plan``: pass it real host tensors)."""
    with unset_fake_temporarily():
        return _packed_step(mesh, tokens, targets, eod, microbatches, layout, ulysses, masked)


def _packed_step(mesh, tokens, targets, eod, microbatches, layout, ulysses, masked) -> PackedStep:
    if tokens.device.type != "cpu":  # the documents are the host's (a device batch would be read back)
        tokens, targets = tokens.cpu(), targets.cpu()
    targets = boundary_targets(tokens, targets, eod)
    if not masked and not bool((targets != IGNORE).any()):
        raise ValueError(f"data.eod_token={eod}: every target of the batch follows an end-of-document token, so "
                         "no token is left to learn from; check data.eod_token (or the token file's eos_token_id)")
    starts = document_starts(tokens[local_rows(mesh, tokens.shape[0], microbatches)], eod)  # micro-batch-major
    positions = document_positions(starts)  # [b, S]
    if mesh.size("sp") > 1:
        positions = positions.index_select(1, hybrid_position_tensor(tokens.shape[1], mesh.rank("sp"),
                                                                     mesh.size("sp"), ulysses, layout))
    packs = [Packed(Documents.from_starts(s.contiguous(), mesh.device), to_device(p.contiguous(), mesh.device))
             for s, p in zip(starts.chunk(microbatches), positions.chunk(microbatches))]
    return PackedStep(targets, packs)
