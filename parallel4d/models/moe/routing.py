"""The router's arithmetic and the experts' SwiGLU; the tokens' trip to their experts and back is the
dispatcher's (:mod:`parallel4d.experts`: sorted by expert without a loop over tokens, on this rank or
over the ep ranks).

Shapes: ``T`` tokens (a micro-batch's ``b·s``, flattened), ``h`` hidden, ``E`` experts, ``k`` experts per
token, ``I`` an expert's SwiGLU width.

* :func:`route`: router logits ``[T, E]`` → softmax probabilities ``[T, E]``, each token's top ``k``
  experts ``[T, k]`` and their weights ``[T, k]`` (the top-k probabilities, renormalised to sum to 1
  with ``norm_topk_prob`` — which is Mixtral's softmax over the top-k logits, the same numbers);
* :func:`expert_ffn`: each expert's SwiGLU over its contiguous rows of the sorted tokens. The one
  place the experts compute: a loop over experts here, a grouped matrix product later (issue 48,
  fourth part) with the same arguments.

Dropless: every token reaches its ``k`` experts (no capacity, nothing dropped or padded).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Routing(NamedTuple):
    """One layer's routing of ``T`` tokens: ``probs`` ``[T, E]`` (the softmax, what the load-balancing
    loss reads), ``experts`` ``[T, k]`` (indices), ``weights`` ``[T, k]`` (what each expert's output is
    multiplied by)."""

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


def route(logits: torch.Tensor, k: int, norm_topk_prob: bool) -> Routing:
    """Softmax over the ``E`` experts of ``logits`` ``[T, E]`` (at least float32, as transformers
    computes it; wider inputs stay wide), the top ``k`` of each token, their probabilities as weights —
    renormalised to sum to 1 when ``norm_topk_prob``. Weights come back in ``logits``' dtype."""
    probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    top, experts = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routing(probs, experts, top.to(logits.dtype))


def expert_ffn(x: torch.Tensor, counts: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
               down_proj: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU ``down(silu(gate x) · up x)`` over its rows of ``x`` ``[N, h]`` (sorted by
    expert: ``counts[e]`` rows each, ``counts`` ``[E]``), weights stacked ``gate_proj``, ``up_proj``
    ``[E, I, h]`` and ``down_proj`` ``[E, h, I]`` (nn.Linear's ``[out, in]`` per expert) → ``[N, h]``.

    Grouped matrix products (:func:`grouped_ffn`: three calls, whatever ``E``; ``counts`` stays on the
    device) where :func:`grouped_usable` says torch has them for these tensors (bfloat16), else a loop
    over the experts (:func:`looped_ffn`: one host read of ``counts``, one product per expert with rows).
    Both compute the same products; float32 and float64 (the exactness tests) loop."""
    if x.shape[0] == 0:  # (the grouped product's backward refuses empty operands)
        return no_rows(x, down_proj)
    if grouped_usable(x, gate_proj, down_proj):
        return grouped_ffn(x, counts, gate_proj, up_proj, down_proj)
    return looped_ffn(x, counts, gate_proj, up_proj, down_proj)


def looped_ffn(x, counts, gate_proj, up_proj, down_proj) -> torch.Tensor:
    """:func:`expert_ffn` as a loop over the experts that have rows (``counts`` read on the host once)."""
    out, start = [], 0
    # unbound once: the backward stacks the experts' gradients in one tensor (indexing the stacked weight
    # per expert would make each expert's backward write a zero-filled gradient of all E experts)
    gates, ups, downs = gate_proj.unbind(0), up_proj.unbind(0), down_proj.unbind(0)
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = x[start:start + n]
            out.append(F.linear(F.silu(F.linear(rows, gates[e])) * F.linear(rows, ups[e]), downs[e]))
            start += n
    return torch.cat(out) if out else no_rows(x, down_proj)


def no_rows(x: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """``[0, h]`` for a rank whose experts got no row, still computed from ``x``: a backward through ``x``
    (an expert-parallel rank's all-to-alls, which its peers run too) must reach this rank as well."""
    return F.linear(x, x.new_zeros(down_proj.shape[1], x.shape[1]))


def grouped_ffn(x, counts, gate_proj, up_proj, down_proj) -> torch.Tensor:
    """:func:`expert_ffn` as three ``torch._grouped_mm`` calls over the row blocks ``counts`` delimits (their
    ends, int32, on the device: no host read). Under autocast the operands are cast to its dtype, as
    ``F.linear`` would be (torch's autocast lists do not cover the grouped product)."""
    dtype = _compute_dtype(x)
    x = x.to(dtype)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)

    def product(rows, weight):  # rows [N, in] @ weight[e].T for each expert's block: weight [E, out, in]
        return _DenseGrad.apply(torch._grouped_mm(rows, weight.to(dtype).transpose(-2, -1), offs=ends))

    return product(F.silu(product(x, gate_proj)) * product(x, up_proj), down_proj)


class _DenseGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: the grouped product's backward
    refuses a broadcast one (strides 0, as ``y.sum()``'s), which any loss may send."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


#: the dtypes torch's grouped matrix product takes everywhere (its CUDA kernels and its shape checks on fake
#: tensors, a plan's dry run, take bfloat16 alone; its CPU kernel float32 too)
GROUPED_DTYPES = (torch.bfloat16,)


def grouped_usable(x: torch.Tensor, gate_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether :func:`grouped_ffn` runs for these tensors: torch has ``_grouped_mm``, the compute dtype is
    bfloat16 (:data:`GROUPED_DTYPES`; autocast's counts), every row is a multiple of 16 bytes (its
    alignment), and on CUDA the device is a Hopper or newer (compute capability 9: its grouped GEMM
    kernels)."""
    dtype = _compute_dtype(x)
    if not hasattr(torch, "_grouped_mm") or dtype not in GROUPED_DTYPES:
        return False
    size = torch.finfo(dtype).bits // 8
    if (gate_proj.shape[-1] * size) % 16 or (down_proj.shape[-1] * size) % 16 or (down_proj.shape[1] * size) % 16:
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product of ``x`` runs in: autocast's where it is on for ``x``'s device, else ``x``'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
