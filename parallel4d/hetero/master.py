"""The master copy behind 16-bit chunks: parameters and Adam moments in the parameters' dtype, on the host.

When the device chunks hold a narrower compute copy (``Layout.mixed``: bfloat16 or float16 chunks
for float32 parameters, as PatrickStar and ZeRO-Offload keep them), this rank's window of every row
has its master parameters ``W`` and Adam moments ``M``, ``V`` here and never on the device. The
optimizer updates them on the host from the gradient chunks (their 16-bit host backings), and a
parameter chunk is filled by rounding ``W`` down on the host, so only 16-bit bytes cross the link.
Host bytes per parameter (float32 master, 16-bit chunks, dp = 1): 4 (W) + 4 (M) + 4 (V) + 2 (the
gradient's backing) = 14.
"""

from __future__ import annotations

import torch

from parallel4d.hetero.layout import Layout, Row
from parallel4d.hetero.optim import adam_update, fused_adam_update
from parallel4d.hetero.transfers import Transfers


class MasterState:
    """``W``, ``M``, ``V``: per row index, this rank's ``[hi − lo]`` window in the parameters' dtype
    (frozen rows have ``W`` only); one host buffer for all of them, zeros until written."""

    def __init__(self, layout: Layout, window: tuple[int, int], transfers: Transfers):
        self.layout, self.window, self.transfers = layout, window, transfers
        n = window[1] - window[0]
        per_row = [3 if row.trainable else 1 for row in layout.rows]
        self.buffer = torch.zeros(sum(per_row) * n, dtype=layout.dtype)
        self.W, self.M, self.V = {}, {}, {}
        off = 0
        for row, k in zip(layout.rows, per_row):
            for store in (self.W, self.M, self.V)[:k]:
                store[row.index] = self.buffer.narrow(0, off, n)
                off += n

    @property
    def bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def upload(self, row: Row, dst: torch.Tensor) -> None:
        """``dst`` (``[hi − lo]`` on the compute device, the chunks' dtype) ← ``W`` of ``row``, rounded."""
        self.transfers.upload_cast(dst, self.W[row.index])

    @torch.no_grad()
    def update(self, row: Row, grad: torch.Tensor, spans: list[tuple], grad_scale, fused: bool) -> None:
        """Adam(W) on ``row``'s master window from ``grad`` (its host ``[hi − lo]`` gradient in the
        chunks' dtype); ``spans``: ``(start, end, (step, hyperparameters))`` within the window."""
        w, m, v = self.W[row.index], self.M[row.index], self.V[row.index]
        update = fused_adam_update if fused else adam_update
        for a, b, (st, hp) in spans:
            if b > a:
                g = grad[a:b].to(self.layout.dtype)  # the master's gradient, as torch's master.grad = grad.float()
                if grad_scale is not None:
                    g.mul_(grad_scale)
                update(w[a:b], g, m[a:b], v[a:b], step=st, **hp)
