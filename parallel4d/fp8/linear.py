"""A linear layer ``y = x·Wᵀ + b`` whose three products run in FP8 with dynamic rowwise scales
(:func:`~parallel4d.fp8.rowwise.rowwise_mm`), as torchao's ``Float8Linear`` computes them under its
``rowwise`` recipe:

* forward ``y = x·Wᵀ``: ``x`` scaled per row (over ``in``), ``Wᵀ`` per column (each row of ``W``, over ``in``);
* ``dX = dY·W``: ``dY`` per row (over ``out``), ``W`` per column (over ``out``);
* ``dW = dYᵀ·X``: ``dYᵀ`` per row (each column of ``dY``, over the tokens), ``X`` per column (over the tokens).

Each operand is scaled along the dimension its product contracts, from the high-precision tensor
(the forward keeps ``x`` and ``W`` unquantized for the backward). The parameters stay what they are (the
master weights, in float32); the bias is added after the product, in the product's dtype. Under autocast
the input is cast to the autocast dtype first (what ``F.linear`` would compute in), and the forward's
result and ``dX``, ``dW`` are written in the dtype of ``x`` and of ``dY`` respectively (``dW`` then cast
to the weight's dtype by autograd, as autocast's bf16 ``F.linear`` gradient is).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel4d.fp8.rowwise import rowwise_mm


class RowwiseLinearFunction(torch.autograd.Function):
    """``x`` ``[..., in]``, ``weight`` ``[out, in]`` → ``x·weightᵀ`` ``[..., out]`` in ``x``'s dtype; both
    gradients in FP8 products too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        rows = x.reshape(-1, x.shape[-1])
        return rowwise_mm(rows, weight.t(), x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        rows, drows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = rowwise_mm(drows, weight, dy.dtype).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = rowwise_mm(drows.t(), rows, dy.dtype).to(weight.dtype)
        return dx, dw


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its products in FP8 (:class:`RowwiseLinearFunction`); under
    autocast ``x`` computes in the autocast dtype, as ``F.linear`` would."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    with torch.autocast(device, enabled=False):  # the products pick their own dtypes
        y = RowwiseLinearFunction.apply(x, weight)
    return y if bias is None else y + bias.to(y.dtype)


class RowwiseLinear(nn.Linear):
    """An ``nn.Linear`` computing in FP8 (:func:`rowwise_linear`): the same parameters, names and
    initialisation; :meth:`of` wraps an existing linear's parameters (shared, not copied)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise_linear(x, self.weight, self.bias)

    @classmethod
    def of(cls, linear: nn.Linear) -> "RowwiseLinear":
        """A :class:`RowwiseLinear` holding ``linear``'s own weight and bias (a swap, not a copy)."""
        with torch.device("meta"):
            out = cls(linear.in_features, linear.out_features, bias=False)
        out.weight, out.bias = linear.weight, linear.bias
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=rowwise"
