"""Gradient norms in a constant number of kernels: torch's foreach norm over all of a dtype's tensors
at once (one launch on CUDA, not one fp64 kernel per tensor), then the per-tensor results — one scalar
each — squared, weighted and summed in float64."""

from __future__ import annotations

import torch

#: foreach norms of these dtypes accumulate and return in float32 (a bf16 norm keeps ~3 digits)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def tensor_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """‖t‖₂ of each tensor (any shapes), ``[]`` each, in order: one ``_foreach_norm`` per dtype,
    accumulated in the tensors' dtype (float32 for float16/bfloat16)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for dtype, idx in by_dtype.items():
        acc = torch.float32 if dtype in _LOW_PRECISION else None
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], 2, dtype=acc)):
            out[i] = n
    return out


def weighted_sq_sum(norms: list[torch.Tensor], weights: list[float], device) -> torch.Tensor:
    """Σ weights[i] · norms[i]² in float64 ``[]`` on ``device`` (zero without norms): one stack per
    distinct weight and dtype (a handful: 1, 1/q, 1/2 …), never one kernel per tensor. ``norms``: ``[]`` each."""
    groups: dict[tuple[float, torch.dtype], list[torch.Tensor]] = {}
    for n, w in zip(norms, weights, strict=True):
        groups.setdefault((w, n.dtype), []).append(n)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for (w, _), ns in groups.items():
        sq = sq + torch.stack(ns).to(torch.float64).square().sum() * w
    return sq


def weighted_sq_norm(tensors: list[torch.Tensor], weights: list[float], device) -> torch.Tensor:
    """Σ weights[i] · ‖tensors[i]‖² in float64 ``[]`` (see :func:`tensor_norms`, :func:`weighted_sq_sum`)."""
    return weighted_sq_sum(tensor_norms(tensors), weights, device)
