"""What one forward reads besides its input: dropout's draw and packed documents.

A model's modules that need more than their input — dropout :class:`~.dropout.Site`\\ s, GPT-2's
position embedding, the attentions — are :class:`ReadsContext` modules, and every one of a model (a
rank's stages) reads the same :class:`ForwardContext` (:func:`attach`). Whoever runs a forward sets
what it holds for that forward (:meth:`ForwardContext.entering`: the engine per micro-batch, for the
forward and any recomputation of it; ``DenseModel`` for its ``step=`` and ``documents=``):

* ``draw`` (:class:`Draw`): the step and the global index of the forward's first sample, from which
  dropout's masks are hashed (None: no dropout — evaluation, generation);
* ``packed`` (:class:`Packed`): the forward's packed documents — which document each global position
  of its rows is in, each local token's position in its document — (None: one document per row);
* ``loss_weight``: what the forward's summed token loss is multiplied by (None: the loss is the mean over
  the forward's own tokens);
* ``routing``: what the forward's mixture-of-experts layers record for its load-balancing loss.

Fixed per model: ``seed`` (``train.seed``) and ``positions``, the global sequence positions of the
local tokens (a sequence shard's; None: ``0..s-1``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parallel4d.sequence.documents import Documents


@dataclass(frozen=True)
class Draw:
    """One forward's part of dropout's key: the optimizer ``step`` and the global index of the
    forward's first sample (row) in the step's batch."""

    step: int
    first_row: int = 0


@dataclass(frozen=True)
class Packed:
    """One forward's packed documents. ``documents``: the document of every global position of the
    forward's ``b`` rows (``[b, S]``, the whole sequence); ``positions`` ``[b, s]``: each local token's
    position in its document (what learned positions and rotary read instead of the global one), on
    the compute device."""

    documents: Documents
    positions: torch.Tensor


@dataclass(frozen=True)
class State:
    """What :meth:`ForwardContext.entering` sets (and a recomputation re-enters). ``routing``: what the
    forward's MoE layers record for its loss (``{layer: models.moe.balance.LayerLoad}``), new with each
    State, so each forward (micro-batch) has its own; a recomputation re-enters the same one and
    overwrites its layers' entries. ``loss_weight``: what the forward's summed token loss is multiplied by
    (the engine's, when the step's valid targets differ between ranks — packed documents, a loss mask — so
    each sums and the weight normalises by the whole batch's count: ``engine/batch.py`` loss_weight); None:
    the mean over the forward's own tokens."""

    draw: Draw | None = None
    packed: Packed | None = None
    loss_weight: float | None = None
    routing: dict = field(default_factory=dict, compare=False, hash=False)


class ForwardContext:
    """The holder a model's :class:`ReadsContext` modules read (one per model: a rank's stages).
    ``seed``: dropout's; ``positions`` ``[s]``: the global positions of the local tokens (None: ``0..s-1``)."""

    def __init__(self, seed: int, positions: torch.Tensor | None = None):
        self.seed = seed
        self.positions = positions
        self.state = State()

    @property
    def draw(self) -> Draw | None:
        return self.state.draw

    @property
    def packed(self) -> Packed | None:
        return self.state.packed

    @contextlib.contextmanager
    def entering(self, state: State):
        """Forwards inside read ``state``; the previous state restored after."""
        before, self.state = self.state, state
        try:
            yield
        finally:
            self.state = before

    def drawing(self, draw: Draw | None):
        """:meth:`entering` a state with this dropout ``draw`` and no packed documents."""
        return self.entering(State(draw))

    def seq_positions(self, s: int, device) -> torch.Tensor:
        """Global positions ``[s]`` of the local tokens."""
        return torch.arange(s, device=device) if self.positions is None else self.positions.to(device)


class ReadsContext(nn.Module):
    """A module that reads its model's :class:`ForwardContext` (``context``, set by :func:`attach`;
    None: nothing drawn, nothing packed)."""

    context: ForwardContext | None = None

    def packed(self) -> Packed | None:
        """This forward's packed documents, or None."""
        return None if self.context is None else self.context.packed

    def documents(self) -> Documents | None:
        """This forward's :class:`~parallel4d.sequence.documents.Documents`, or None (one per row)."""
        packed = self.packed()
        return None if packed is None else packed.documents


def attach(module: nn.Module, context: ForwardContext) -> None:
    """Point every :class:`ReadsContext` module under ``module`` at ``context``."""
    for m in module.modules():
        if isinstance(m, ReadsContext):
            m.context = context
