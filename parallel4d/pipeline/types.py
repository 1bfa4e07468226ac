"""The data a pipeline schedule is made of: :class:`Action` and :class:`Schedule`.

A :class:`Schedule` is a placement (pp rank → the model chunks it holds, in model
order) and, per rank, the ordered list of :class:`Action` it runs in one optimizer
step. Everything else in the package (generators, validator, simulator, executor,
plot) builds or reads these, with the simple placements; this module imports nothing from it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Action:
    """One compute step of micro-batch ``microbatch`` through model chunk ``chunk``: ``kind``
    ``"F"`` (forward), ``"B"`` (backward) or ``"W"`` (weight gradient). In a schedule that splits
    the backward (it has W actions), B computes and sends only the input gradient and keeps what
    its W needs; W later accumulates the weight gradients."""

    kind: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.c{self.chunk}"

    def describe(self) -> str:
        word = {"F": "forward", "B": "backward", "W": "weight gradient"}.get(self.kind, self.kind)
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}) [{word}]"


@dataclass(frozen=True)
class Schedule:
    """Placement + per-rank action order for one optimizer step.

    ``placement[r]``: chunk ids held by pp rank ``r``, ascending (model order).
    ``actions[r]``: the order rank ``r`` runs its actions.
    """

    name: str
    pp: int
    microbatches: int
    num_chunks: int
    placement: dict[int, list[int]]
    actions: dict[int, list[Action]]

    def owner(self, chunk: int) -> int:
        """The pp rank that holds ``chunk``."""
        return self.owners()[chunk]

    def owners(self) -> dict[int, int]:
        """``{chunk: the pp rank that holds it}``; do not edit it."""
        # Cached on the (frozen) instance: owner() is called per action by the executor and the simulator.
        cache = self.__dict__.get("_owner_cache")
        if cache is None:
            cache = {c: r for r, cs in self.placement.items() for c in cs}
            object.__setattr__(self, "_owner_cache", cache)
        return cache

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.kind == "W" for acts in self.actions.values() for a in acts)

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.pp

    def table(self, width: int | None = None) -> str:
        """Per-rank action lists as text, one line per rank."""
        lines = []
        for r in range(self.pp):
            chunks = ",".join(str(c) for c in self.placement[r])
            acts = " ".join(str(a) for a in self.actions[r])
            lines.append(f"rank {r} [chunks {chunks}]: {acts}")
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """A short hash of placement + orders (ranks compare it before running)."""
        text = repr((self.pp, self.microbatches, self.num_chunks,
                     sorted((r, tuple(c)) for r, c in self.placement.items()),
                     sorted((r, tuple((a.kind, a.microbatch, a.chunk) for a in acts))
                            for r, acts in self.actions.items())))
        return hashlib.sha1(text.encode()).hexdigest()[:16]


# --- placements ------------------------------------------------------------------


def linear_placement(pp: int) -> dict[int, list[int]]:
    """One chunk per rank: chunk ``r`` on rank ``r``."""
    return {r: [r] for r in range(pp)}


def looped_placement(pp: int, chunks_per_rank: int) -> dict[int, list[int]]:
    """Interleaved placement: chunk ``c`` on rank ``c mod P``."""
    return {r: [k * pp + r for k in range(chunks_per_rank)] for r in range(pp)}
