"""Rowwise-scaled FP8 products, as torchao's ``rowwise`` float8 training recipe defines them.

A product ``A·B`` (``A`` ``[M, K]``, ``B`` ``[K, N]``, any float dtype) runs as
``torch._scaled_mm(A8, B8, 1/sA, 1/sB)``: each operand rounded to ``float8_e4m3fn`` after scaling along
the contracted dimension K — one scale per row of ``A`` (``sA`` ``[M, 1]``) and one per column of ``B``
(``sB`` ``[1, N]``) —, the product accumulated in float32 and unscaled by ``1/(sA·sB)``.

A scale (:func:`scales`) is ``448 / amax`` (448 is e4m3's largest finite value; ``amax`` the largest
magnitude of the row or column, floored at :data:`AMAX_FLOOR` so a zero row gets a finite scale),
computed in float64, rounded to float32, then *down* to a power of two (torchao's rowwise recipe sets
``round_scales_to_power_of_2``): scaling and unscaling are then exact, the only rounding is e4m3's
(3 mantissa bits: a relative error of at most 2⁻⁴ per element) and the float32 sums. The largest
magnitude lands in ``(224, 448]``; values beyond ±448 cannot occur but are saturated all the same.

``_scaled_mm``'s layout rules: ``A8`` row-major, ``B8`` column-major, both contiguous in that sense.
CUDA's rowwise kernel writes bfloat16 only: a float32 or float16 result is then computed in bfloat16 and
cast (torchao does the same); on the CPU it is written in the asked dtype. CUDA's kernels also want M, K
and N multiples of 16: :func:`scaled_mm` pads the quantized operands there with zeros (torchao pads K and N
under ``pad_inner_dim``) and slices the result — a zero adds nothing to a sum, and the scales are taken
from the operands before padding, so the product is the unpadded one.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

#: the operands' dtype and its largest finite value
E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
#: the least amax a scale is computed from (a row of zeros gets 448 / 1e-12, rounded down to 2^48)
AMAX_FLOOR = 1e-12


#: An amax's reduction over the ranks that hold the rest of its rows or columns: ``amax`` (float64, the
#: local ``[M, 1]`` or ``[1, N]``) → the all-reduced MAX over the group, same shape (in place is fine). A
#: layout that splits a product's contracted dimension over ranks passes one so that every rank computes
#: the scale one process would (None: the dimension is whole on this rank).
AmaxSync = Optional[Callable[[torch.Tensor], torch.Tensor]]


@torch.no_grad()
def amax(t: torch.Tensor, dim: int) -> torch.Tensor:
    """float64 largest magnitudes of ``t`` (2-D) along ``dim`` (``dim=1``: per row ``[M, 1]``; ``0``: per column
    ``[1, N]``)."""
    return t.abs().amax(dim=dim, keepdim=True).to(torch.float64)


@torch.no_grad()
def scales_of_amax(largest: torch.Tensor) -> torch.Tensor:
    """float32 scales for float64 ``largest`` magnitudes: the largest power of two ≤ ``448 / max(amax, 1e-12)``."""
    scale = (E4M3_MAX / largest.clamp(min=AMAX_FLOOR)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale)))


@torch.no_grad()
def scales(t: torch.Tensor, dim: int, sync: AmaxSync = None) -> torch.Tensor:
    """float32 scales of ``t`` (2-D), one per slice along ``dim`` reduced (``dim=1``: one per row, ``[M, 1]``;
    ``dim=0``: one per column, ``[1, N]``): the largest power of two ≤ ``448 / max(amax, 1e-12)``, the amax
    reduced by ``sync`` first where the slices continue on other ranks."""
    largest = amax(t, dim)
    return scales_of_amax(largest if sync is None else sync(largest))


@torch.no_grad()
def quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t · scale`` (in float32) rounded to e4m3, saturated at ±448; ``scale`` broadcasts over ``t``."""
    return (t.to(torch.float32) * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def result_dtype(device: torch.device, out_dtype: torch.dtype) -> torch.dtype:
    """What ``_scaled_mm`` writes for a wanted ``out_dtype``: CUDA's rowwise kernel bfloat16 only."""
    return torch.bfloat16 if device.type == "cuda" else out_dtype


#: what CUDA's ``_scaled_mm`` wants each of M, K and N to be a multiple of
CUDA_MULTIPLE = 16


def padded_size(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def _padded(t: torch.Tensor, rows: int, cols: int, fill: float = 0.0) -> torch.Tensor:
    """``t`` (2-D) in the top-left corner of a ``[rows, cols]`` tensor of ``fill`` (``t`` itself where it fits)."""
    if t.shape == (rows, cols):
        return t
    out = t.new_full((rows, cols), fill)
    out[: t.shape[0], : t.shape[1]] = t
    return out


@torch.no_grad()
def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype, *, pad_to: int | None = None) -> torch.Tensor:
    """``(a8/sa)·(b8/sb)`` (e4m3 ``a8`` ``[M, K]`` with ``sa`` ``[M, 1]``, ``b8`` ``[K, N]`` with ``sb`` ``[1, N]``),
    accumulated in float32, ``[M, N]`` in ``out_dtype``; the operands laid out as ``_scaled_mm`` wants here.
    ``pad_to``: M, K and N padded with zeros to multiples of it (the padded rows' and columns' scales 1)
    and the result sliced back; None: :data:`CUDA_MULTIPLE` on a GPU, no padding elsewhere."""
    multiple = (CUDA_MULTIPLE if a8.device.type == "cuda" else 1) if pad_to is None else pad_to
    (m, k), n = a8.shape, b8.shape[1]
    mp, kp, np_ = (padded_size(d, multiple) for d in (m, k, n))
    a = _padded(a8.contiguous(), mp, kp)
    b = _padded(b8.t().contiguous(), np_, kp).t()  # column-major [K', N']
    out = torch._scaled_mm(a, b, scale_a=_padded(sa, mp, 1, 1.0).reciprocal(),
                           scale_b=_padded(sb, 1, np_, 1.0).reciprocal(),
                           out_dtype=result_dtype(a8.device, out_dtype), use_fast_accum=False)
    return out[:m, :n].contiguous().to(out_dtype)


@torch.no_grad()
def rowwise_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *, sync_a: AmaxSync = None,
               sync_b: AmaxSync = None) -> torch.Tensor:
    """``a·b`` (``a`` ``[M, K]``, ``b`` ``[K, N]``) in FP8 with dynamic rowwise scales (the module doc):
    ``[M, N]`` in ``out_dtype``. ``sync_a`` / ``sync_b``: where K is split over ranks (each holds a slice of
    the sum), the reduction of ``a``'s row and ``b``'s column amaxes over them."""
    sa, sb = scales(a, 1, sync_a), scales(b, 0, sync_b)
    return scaled_mm(quantize(a, sa), quantize(b, sb), sa, sb, out_dtype)


def dequantized(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as :func:`rowwise_mm` sees it, in float64: rounded to e4m3 with :func:`scales` along ``dim``
    and scaled back (the reference the products are tested against)."""
    s = scales(t, dim)
    return quantize(t, s).to(torch.float64) / s.to(torch.float64)


def device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot run FP8 products (None: it can): a CUDA GPU needs compute capability 8.9 or
    later (Ada, Hopper, Blackwell) for ``_scaled_mm``; the CPU runs them (slowly, for checking)."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= (8, 9):
        return None
    return (f"train.fp8=rowwise needs FP8 products, which {torch.cuda.get_device_name(device)} (compute capability "
            f"{capability[0]}.{capability[1]}) lacks: they need 8.9 or later (Ada, Hopper, Blackwell); set "
            "train.fp8=none on this GPU")
