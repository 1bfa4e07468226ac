"""Dynamic loss scaling for float16 autocast: the rule, as plain state.

float16 gradients underflow below ~6e-8; the loss is multiplied by ``scale`` before the backward
and the gradients divided by it before the optimizer. A step whose gradients hold an inf or NaN
(the scale was too large) is skipped and the scale halved; after ``window`` steps in a row without
one the scale doubles. The engine decides "overflow" once for the whole mesh (every rank skips the
same step); this class only keeps the scale.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScale:
    scale: float = 65536.0
    window: int = 1000
    good_steps: int = 0  # steps in a row without an overflow
    skipped: int = 0  # steps skipped so far

    def update(self, overflow: bool) -> None:
        """After a step: halve on ``overflow`` (never below 1), double after ``window`` good steps."""
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.window:
            self.scale *= 2
            self.good_steps = 0
