"""Dynamic loss scaling for float16 autocast: the rule, as state on the compute device.

float16 gradients underflow below ~6e-8; the loss is multiplied by ``scale`` before the backward
and the gradients divided by it before the optimizer. A step whose gradients hold an inf or NaN
(the scale was too large) is skipped and the scale halved; after ``window`` steps in a row without
one the scale doubles. The engine decides "overflow" once for the whole mesh (every rank skips the
same step); this class only keeps the scale.

The state lives in 0-dim tensors on the device and :meth:`LossScale.update` is a few device ops on
them, so a step never waits for the GPU to learn whether it overflowed (torch's ``GradScaler``
does the same with ``_amp_update_scale_``); the training loop reads ``scale`` and ``skipped`` with
the loss, once per log interval.
"""

from __future__ import annotations

import torch


class LossScale:
    """``scale`` (float64 ``[]``: powers of two, exact), ``good_steps`` (steps in a row without an
    overflow) and ``skipped`` (steps skipped so far; both int64 ``[]``), on ``device``."""

    def __init__(self, scale: float = 65536.0, window: int = 1000, device: torch.device | str | None = None):
        self.window = int(window)
        # full(), not tensor(): a fill on the device, no blocking copy from the host
        self.scale = torch.full((), float(scale), dtype=torch.float64, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, overflow: torch.Tensor) -> None:
        """After a step, on the device: on ``overflow`` (``[]``, nonzero where the step overflowed)
        halve the scale (never below 1) and count a skipped step, else count a good step and double
        the scale after ``window`` of them in a row."""
        bad = overflow.reshape(()).to(torch.bool)
        self.skipped.add_(bad.to(torch.int64))
        good = torch.where(bad, 0, self.good_steps + 1)
        grow = good == self.window
        self.scale.copy_(torch.where(bad, (self.scale / 2).clamp(min=1.0),
                                     torch.where(grow, self.scale * 2, self.scale)))
        self.good_steps.copy_(torch.where(grow, 0, good))
