"""Layout-free checkpoint tensors: every rank saves its pieces of the *dense* tensors.

A parameter (or an optimizer moment shaped like it) is stored under its dense name
with the dense shape, as the boxes of the dense tensor this rank holds: a 2D weight
block, three boxes for a fused qkv block whose rows come from q, k and v, the whole
tensor on a rank that holds all of it. ``torch.distributed.checkpoint`` records every
box's offsets (replicas of a box are written once) and on load reads the parts of the
saved boxes that overlap the boxes a rank asks for — so a checkpoint written under one
layout (pp×dp×sp×tp, any schedule, hetero or not) loads under any other.

:class:`DenseShards` speaks DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``); :func:`save_planner` and
:func:`load_planner` find its pieces, which DCP's default planners only look up in
``torch.Tensor`` values.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

Pieces = Callable[[torch.Tensor], list[tuple[tuple[int, ...], torch.Tensor]]]


def whole(t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Pieces of a tensor that is all of its dense tensor."""
    return [((0,) * t.dim(), t)]


class DenseShards:
    """This rank's part of one dense tensor of shape ``shape``.

    ``tensor`` is the local tensor (a parameter, or an optimizer moment shaped like it);
    ``pieces(tensor)`` gives ``[(offsets in the dense tensor, view of tensor)]``: disjoint views that
    cover it, but for rows no dense tensor has (a vocabulary padded to the 2D grid: in no piece, never
    saved, untouched by a load). Loading writes through the views into ``tensor``.
    """

    def __init__(self, shape, tensor: torch.Tensor, pieces: Pieces = whole, name: str | None = None):
        self.shape = torch.Size(shape)
        self.tensor = tensor
        self.pieces: list[tuple[torch.Size, torch.Tensor]] = []
        self._tensors: dict[str, torch.Tensor] = {}
        self.add(name, tensor, pieces)

    def add(self, name: str | None, tensor: torch.Tensor, pieces: Pieces = whole) -> None:
        """Another local tensor ``name``'s pieces of the same dense tensor (e.g. one expert, a row of a stacked
        tensor); a tensor whose pieces are here already (an alias: a tied weight's) adds nothing."""
        mine = [(torch.Size(off), view) for off, view in pieces(tensor)]
        if sum(view.numel() for _, view in mine) > tensor.numel():
            raise ValueError(f"the pieces of a {list(tensor.shape)} tensor hold more than it")
        for off, view in mine:
            if len(off) != len(self.shape) or any(o + n > s for o, n, s in zip(off, view.shape, self.shape)):
                raise ValueError(f"a piece {list(view.shape)} at {list(off)} lies outside the dense "
                                 f"{list(self.shape)}")
        held = {off for off, _ in self.pieces}
        if mine and all(off in held for off, _ in mine):
            return
        self.pieces += mine
        if name is not None:
            self._tensors[name] = tensor

    def tensor_of(self, name: str) -> torch.Tensor:
        """The local tensor ``name`` added (:meth:`add`); :attr:`tensor` (the first) for any other name."""
        return self._tensors.get(name, self.tensor)

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list:
        d = _dcp()
        properties = d.TensorProperties.create_from_tensor(self.tensor)
        return [d.WriteItem(index=d.MetadataIndex(fqn, off), type=d.WriteItemType.SHARD,
                            tensor_data=d.TensorWriteData(chunk=d.ChunkStorageMetadata(off, view.shape),
                                                          properties=properties, size=self.shape))
                for off, view in self.pieces]

    def __create_chunk_list__(self) -> list:
        return [_dcp().ChunkStorageMetadata(off, view.shape) for off, view in self.pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for off, view in self.pieces:
            if off == index.offset:
                return view
        raise ValueError(f"{index.fqn}: no piece at {index.offset}")


@functools.cache
def _dcp():
    """DCP's types, imported on first use: the import costs ~0.9 s (it loads DTensor), which
    every worker of a job that never saves would pay."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, DenseShards):  # a transposed block is written as its values
                return obj.__get_tensor_shard__(index).contiguous()
            return super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # DCP's set-up replaces values of types it does not know by None, in place;
            # the state dict is flat, so its keys are the flattened ones
            kept = {k: v for k, v in state_dict.items() if isinstance(v, DenseShards)}
            super().set_up_planner(state_dict, metadata, is_coordinator)
            state_dict.update(kept)
            self.state_dict.update(kept)

        def lookup_tensor(self, index):
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, DenseShards):
                return obj.__get_tensor_shard__(index)
            return super().lookup_tensor(index)

    return SimpleNamespace(**locals())


def save_planner():
    """A DCP save planner that writes :class:`DenseShards` values."""
    return _dcp().SavePlanner()


def load_planner():
    """A DCP load planner that reads into :class:`DenseShards` values."""
    return _dcp().LoadPlanner()
