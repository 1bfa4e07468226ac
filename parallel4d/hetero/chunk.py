"""Chunks, tensor states and the explicit state-transition table.

A *chunk* is a fixed-capacity contiguous 1-D buffer of ``capacity`` elements
holding several tensors back to back (each at an aligned offset). Chunks of one
*row* ``i`` in the mirrored lists (param, grad, exp_avg, exp_avg_sq, and under
ZeRO the param/grad shards) share one layout: the same tensors at the same
offsets, each with its own state.

Tensor states (PatrickStar's, see the module notes):

* ``FREE``          content is dead (never written, or consumed); a load zero-fills it.
* ``COMPUTE``       in use by an operator; the chunk is pinned on the device.
* ``HOLD``          live, movable.
* ``HOLD_AFTER_FWD`` live, used in this forward (backward will want it again).
* ``HOLD_AFTER_BWD`` live, finished in this backward (param) / gradient ready (grad).

Only the transitions in :data:`TRANSITIONS` are legal; anything else raises
:class:`InvalidTransition`. The chunk state is derived from its tensors' states
(COMPUTE > HOLD > HOLD_AFTER_FWD > HOLD_AFTER_BWD > FREE).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch


class TensorState(enum.IntEnum):
    FREE = 0
    COMPUTE = 1
    HOLD = 2
    HOLD_AFTER_FWD = 3
    HOLD_AFTER_BWD = 4


S = TensorState

#: Every legal (from, to) pair. COMPUTE→COMPUTE is not a transition: nested holds
#: of one tensor are counted (``TensorInfo.holds``) and only the first/last change state.
TRANSITIONS: frozenset[tuple[TensorState, TensorState]] = frozenset({
    (S.FREE, S.COMPUTE),            # first write (grad, optimizer states) after zero-fill
    (S.HOLD, S.COMPUTE),            # forward / optimizer access
    (S.HOLD_AFTER_FWD, S.COMPUTE),  # backward or recomputation access, or a 2nd use in forward
    (S.HOLD_AFTER_BWD, S.COMPUTE),  # optimizer access, gradient accumulation
    (S.COMPUTE, S.HOLD),            # after the optimizer update / a no-grad forward
    (S.COMPUTE, S.HOLD_AFTER_FWD),  # module forward done
    (S.COMPUTE, S.HOLD_AFTER_BWD),  # module backward done / gradient written
    (S.COMPUTE, S.FREE),            # gradient consumed by the optimizer
    (S.HOLD_AFTER_FWD, S.HOLD),     # forward without backward (evaluation)
    (S.HOLD_AFTER_BWD, S.HOLD),     # iteration reset
    (S.HOLD_AFTER_BWD, S.FREE),     # zero_grad / reduce-scattered gradient
    (S.HOLD, S.FREE),               # zero_grad of an accumulated gradient
})

#: Precedence for the derived chunk state.
_ORDER = (S.COMPUTE, S.HOLD, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD)


class InvalidTransition(RuntimeError):
    """A tensor was asked to change state along an edge not in :data:`TRANSITIONS`."""


@dataclass(eq=False)
class TensorInfo:
    """One tensor inside a chunk: ``numel`` elements at ``offset``, viewed as ``shape``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    state: TensorState = S.HOLD
    holds: int = 0  # nested COMPUTE holders

    def set_state(self, new: TensorState) -> None:
        if (self.state, new) not in TRANSITIONS:
            raise InvalidTransition(f"tensor {self.name!r}: illegal state transition {self.state.name} → {new.name}")
        self.state = new

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(eq=False)
class Chunk:
    """A contiguous buffer of ``capacity`` elements of one list (``kind``) and row ``index``.

    ``backing`` is the host copy (pinned on CUDA) or ``None`` for a cache-only chunk
    (ZeRO's gathered parameters, refilled by ``loader``). ``slot`` is the device slot
    while resident; ``dirty`` means the slot differs from ``backing``.
    """

    cid: int
    kind: str
    index: int
    capacity: int
    tensors: list[TensorInfo]
    pool: str = "main"
    base: int = 0  # ZeRO shard chunks hold elements [base, base+capacity) of the row's layout
    backing: Optional[torch.Tensor] = None
    slot: Optional[int] = None
    dirty: bool = False
    loader: Optional[object] = None  # callable(dst_view) for cache-only chunks
    last_use: int = 0
    extra_pins: int = 0  # pins without a tensor in COMPUTE (collectives in flight)
    lent_pins: int = 0  # of those, the ones lent to overlap (given back when a fill finds no room)
    meta: dict = field(default_factory=dict)

    @property
    def used(self) -> int:
        """Elements up to the end of the last tensor."""
        return max((t.end for t in self.tensors), default=0)

    def count(self, state: TensorState) -> int:
        return sum(1 for t in self.tensors if t.state == state)

    @property
    def state(self) -> TensorState:
        """Derived: the first state of COMPUTE > HOLD > HOLD_AFTER_FWD > HOLD_AFTER_BWD present, else FREE."""
        for s in _ORDER:
            if any(t.state == s for t in self.tensors):
                return s
        return S.FREE

    @property
    def pinned(self) -> bool:
        return self.extra_pins > 0 or any(t.state == S.COMPUTE for t in self.tensors)

    @property
    def dead(self) -> bool:
        """All content FREE: may be dropped without write-back and zero-filled on load."""
        return all(t.state == S.FREE for t in self.tensors)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack(numels: list[int], capacity: int, align: int) -> list[list[tuple[int, int]]]:
    """Greedy in-order packing: ``[[(tensor_index, offset), ...] per chunk]``.

    Tensors keep their order; a tensor that does not fit opens a new chunk (tensors
    never span chunks, so ``capacity ≥ max(numels)`` is required).
    """
    chunks: list[list[tuple[int, int]]] = []
    fill = capacity + 1
    for i, n in enumerate(numels):
        if n > capacity:
            raise ValueError(f"hetero.chunk_elems={capacity} is smaller than a parameter of {n} elements; "
                             f"use hetero.chunk_elems≥{round_up(n, align)} or leave it unset to search")
        off = round_up(fill, align)
        if not chunks or off + n > capacity:
            chunks.append([])
            off = 0
        chunks[-1].append((i, off))
        fill = off + n
    return chunks


def waste(numels: list[int], capacity: int, align: int) -> int:
    """Unused elements over all chunks when packing ``numels`` at ``capacity``."""
    return len(pack(numels, capacity, align)) * capacity - sum(numels)


def search_chunk_elems(numels: list[int], align: int = 64, multiple_of: int = 1, span: int = 4) -> int:
    """Waste-minimising chunk capacity (Gemini-style search).

    Scans capacities from the largest tensor (rounded up to ``align·multiple_of``)
    to ``span``× that (or to one chunk holding everything, if smaller), in steps of ``align·multiple_of``, and returns the one with the
    fewest unused elements (ties → the smaller capacity: finer-grained offloading).
    ``multiple_of`` = dp size so that ZeRO can split every chunk into equal shards.
    """
    if not numels:
        raise ValueError("hetero: the model has no parameters to manage")
    step = align * multiple_of
    lo = round_up(max(numels), step)
    # beyond "everything in one chunk" (with alignment padding) nothing can improve
    hi = max(lo, min(span * lo, round_up(sum(numels) + align * len(numels), step)))
    n_steps = (hi - lo) // step
    stride = max(1, n_steps // 512)  # bound the search cost for huge models
    best = None
    for cap in range(lo, hi + 1, step * stride):
        w = waste(numels, cap, align)
        if best is None or w < best[0]:
            best = (w, cap)
    return best[1]
