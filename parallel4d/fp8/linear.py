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

Where the tokens of a micro-batch are split over ranks (data replicas, sequence shards), ``dW``'s
contracted dimension is split too: each rank sums its tokens' share of ``dW`` and the data-parallel
reduction adds the shares. The scales of ``dW``'s operands must then be the whole micro-batch's, not the
rank's: ``token_sync`` (an :data:`~parallel4d.fp8.rowwise.AmaxSync` the layout passes) reduces ``dY``'s
column amaxes ``[1, out]`` and ``X``'s ``[1, in]`` by MAX over those ranks, concatenated in one
``[1, out + in]`` float64 vector: one collective per linear per backward. The forward and ``dX``
contract over features, whole on every rank: they need none.

Under ``torch.compile`` (``train.compile: blocks``) the function traces whole, forward and backward: the
amaxes, scales and quantization fuse around ``_scaled_mm`` (the point of compiling FP8, on a GPU). A
``token_sync`` that runs inside compiled code traces its collective too (a functional all-reduce: no graph
break) and, since no Python runs there to count it, offers ``count_traced(nbytes)``: the compiled block
calls it once per backward of each linear (:func:`traced_token_syncs`).

A pipeline that splits the backward (zero-bubble's B and W passes, ``pipeline/split_grad.py``) asks for
``dX`` and ``dW`` in two passes: the backward computes only the gradient the engine will use
(:func:`wanted`), so each product (and ``dW``'s reduction) runs once.
"""

from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from parallel4d.fp8.rowwise import AmaxSync, amax, quantize, rowwise_mm, scaled_mm, scales_of_amax


def wanted(ctx, k: int) -> bool:
    """Whether this backward pass uses input ``k``'s gradient: a split backward (pipeline/split_grad.py) runs
    the engine towards the activations and the weights in two passes, each executing only some of a node's
    next nodes (``torch._C._will_engine_execute_node``; tensor2d/summa.py asks the same for its products)."""
    if not ctx.needs_input_grad[k]:
        return False
    if torch.compiler.is_compiling():  # traced ahead of the backward: no engine to ask (compile refuses a split one)
        return True
    nxt = ctx.next_functions[k][0]
    try:
        return nxt is None or torch._C._will_engine_execute_node(nxt)
    except RuntimeError:  # torch.autograd.grad cannot be asked about leaves: compute it
        return True


@torch.no_grad()
def weight_gradient(drows: torch.Tensor, rows: torch.Tensor, out_dtype: torch.dtype,
                    token_sync: AmaxSync = None) -> torch.Tensor:
    """``dW = dYᵀ·X`` ``[out, in]`` in FP8 (``drows`` ``[T, out]``, ``rows`` ``[T, in]``: this rank's tokens),
    each operand scaled over the tokens: ``dYᵀ`` per row, ``X`` per column. ``token_sync``: the MAX of both
    amaxes over the ranks holding the micro-batch's other tokens, in one call on ``[1, out + in]`` (None: the
    tokens are all here, exactly :func:`~parallel4d.fp8.rowwise.rowwise_mm`)."""
    if token_sync is None:
        return rowwise_mm(drows.t(), rows, out_dtype)
    out = drows.shape[1]
    largest = token_sync(torch.cat([amax(drows, 0), amax(rows, 0)], dim=1))
    sa, sb = scales_of_amax(largest[:, :out].t()), scales_of_amax(largest[:, out:])
    return scaled_mm(quantize(drows.t(), sa), quantize(rows, sb), sa, sb, out_dtype)


class RowwiseLinearFunction(torch.autograd.Function):
    """``x`` ``[..., in]``, ``weight`` ``[out, in]`` → ``x·weightᵀ`` ``[..., out]`` in ``x``'s dtype; both
    gradients in FP8 products too, ``dW``'s token amaxes reduced by ``token_sync`` (None: not split)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, token_sync: AmaxSync = None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.token_sync = token_sync
        rows = x.reshape(-1, x.shape[-1])
        return rowwise_mm(rows, weight.t(), x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        rows, drows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if wanted(ctx, 0):
            dx = rowwise_mm(drows, weight, dy.dtype).reshape(x.shape).to(x.dtype)
        if wanted(ctx, 1):
            dw = weight_gradient(drows, rows, dy.dtype, ctx.token_sync).to(weight.dtype)
        return dx, dw, None


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   token_sync: AmaxSync = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its products in FP8 (:class:`RowwiseLinearFunction`); under
    autocast ``x`` computes in the autocast dtype, as ``F.linear`` would. ``token_sync``: where other ranks
    hold the rest of the micro-batch's tokens, the reduction of ``dW``'s amaxes over them."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    with torch.autocast(device, enabled=False):  # the products pick their own dtypes
        y = RowwiseLinearFunction.apply(x, weight, token_sync)
    return y if bias is None else y + bias.to(y.dtype)


class RowwiseLinear(nn.Linear):
    """An ``nn.Linear`` computing in FP8 (:func:`rowwise_linear`): the same parameters, names and
    initialisation; :meth:`of` wraps an existing linear's parameters (shared, not copied). ``token_sync``:
    the layout's reduction of ``dW``'s token amaxes (None: this rank holds its micro-batches whole)."""

    token_sync: AmaxSync = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise_linear(x, self.weight, self.bias, self.token_sync)

    @classmethod
    def of(cls, linear: nn.Linear, token_sync: AmaxSync = None) -> "RowwiseLinear":
        """A :class:`RowwiseLinear` holding ``linear``'s own weight and bias (a swap, not a copy)."""
        with torch.device("meta"):
            out = cls(linear.in_features, linear.out_features, bias=False)
        out.weight, out.bias, out.token_sync = linear.weight, linear.bias, token_sync
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=rowwise"


@runtime_checkable
class TracedAmaxSync(Protocol):
    """A ``token_sync`` whose collective can run inside compiled code (a traced functional all-reduce), which
    no Python runs there to count: the compiled block counts it (engine/compose.py ``ReplicaAmaxSync``)."""

    def __call__(self, largest: torch.Tensor) -> torch.Tensor: ...

    def count_traced(self, nbytes: int) -> None: ...


def traced_token_syncs(modules) -> list:
    """For each :class:`RowwiseLinear` among ``modules`` whose ``token_sync`` can run in compiled code (a
    :class:`TracedAmaxSync`), a callable counting one backward's reduction (``[1, out + in]`` float64) — what a
    compiled block calls when its backward runs (engine/compile.py)."""
    return [functools.partial(m.token_sync.count_traced, 8 * (m.in_features + m.out_features))
            for m in modules if isinstance(m, RowwiseLinear) and isinstance(m.token_sync, TracedAmaxSync)]
