"""Rotary position embeddings of the Llama family, plain or scaled (``model.rope_scaling``).

One home for the rotary arithmetic: :func:`frequencies` gives the inverse frequencies ``[d/2]`` and
the factor cos/sin are multiplied by, from the head size, the base ``theta``, the scaling, the
model's ``max_positions`` and — for ``dynamic`` only — the length of the sequence at hand;
:class:`Rotary` applies them. The dense attention, the 2D block (each grid column's heads), ring
attention (each shard at its global positions, with the *global* sequence's length) and KV-cached
decoding all call :meth:`Rotary.table` and :func:`rotate`, so every layout rotates alike.

The formulas are those of transformers 5 (``modeling_rope_utils``), written out here:

* ``linear``: every frequency divided by ``factor``.
* ``dynamic`` (NTK): ``theta · (factor · L / P − (factor − 1)) ^ (d / (d − 2))`` for the base, with
  ``L = max(length, P)`` and ``P = max_positions`` (``max_position_embeddings``): plain rotary up to
  ``P`` tokens. ``length`` is the whole sequence's (``max(position) + 1``): as transformers computes it
  for a model that has not seen a longer sequence before (its cache of the longest length seen is
  state this function does not keep); in decoding, the length so far, as transformers' ``generate``.
* ``yarn``: a ramp between interpolated (``/ factor``) and original frequencies over the dimensions
  whose wavelength lies between ``beta_fast`` and ``beta_slow`` rotations in
  ``original_max_position_embeddings`` (the bounds rounded out unless ``truncate: false``); cos and
  sin scaled by ``attention_factor`` (default ``0.1·ln(factor) + 1``, or DeepSeek's
  ``mscale`` / ``mscale_all_dim`` ratio).
* ``llama3``: wavelengths above ``original / low_freq_factor`` divided by ``factor``, below
  ``original / high_freq_factor`` kept, smoothly interpolated between.

Shapes: q and k ``[b, heads, s, d]``, positions ``[s]``, cos and sin ``[s, d]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from parallel4d.config.schema import RopeScaling


@dataclass(frozen=True)
class Scaling:
    """``model.rope_scaling`` as plain values (hashable, torch-free): the type and its parameters
    (the validated config guarantees the ones each type needs)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: Optional[int] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: Optional[bool] = None

    @classmethod
    def of(cls, rs: RopeScaling | None) -> Scaling | None:
        return None if rs is None else cls(**rs.model_dump())


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(s: Scaling) -> float:
    """The factor yarn multiplies cos and sin by."""
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def _yarn(inv: torch.Tensor, d: int, theta: float, s: Scaling) -> torch.Tensor:
    """Yarn's blend of ``inv / factor`` (interpolated) and ``inv`` (extrapolated) along the dimensions."""
    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits ``rotations`` times in the context
        return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast or 32), dim_of(s.beta_slow or 1)
    if s.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no division by zero (transformers' choice)
    ramp = ((torch.arange(d // 2, dtype=inv.dtype, device=inv.device) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv / s.factor * (1 - extrapolated) + inv * extrapolated


def _llama3(inv: torch.Tensor, s: Scaling) -> torch.Tensor:
    """Llama 3's: long wavelengths interpolated, short ones kept, a smooth blend between."""
    old, lo, hi = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > old / lo, inv / s.factor, inv)
    smooth = (old / wavelength - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelength >= old / hi) & (wavelength <= old / lo)
    return torch.where(medium, blended, scaled)


def frequencies(head_size: int, theta: float, scaling: Scaling | None, max_positions: int, length: int, *,
                dtype: torch.dtype, device=None) -> tuple[torch.Tensor, float]:
    """``(inverse frequencies [head_size/2] in dtype, the factor of cos and sin)`` (module doc);
    ``length``: the sequence's length, read by ``dynamic`` only."""
    kind = scaling.rope_type if scaling else "default"
    if kind == "dynamic":
        grown = max(length, max_positions)
        theta = theta * (scaling.factor * grown / max_positions - (scaling.factor - 1)) ** (head_size / (head_size - 2))
    inv = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64, device=device).to(dtype) / head_size))
    if kind == "linear":
        return inv / scaling.factor, 1.0
    if kind == "yarn":
        return _yarn(inv, head_size, theta, scaling), yarn_attention_factor(scaling)
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    return inv, 1.0


@dataclass(frozen=True)
class Rotary:
    """The rotary of one model: head size, base, scaling, ``max_positions``."""

    head_size: int
    theta: float
    scaling: Scaling | None = None
    max_positions: int = 2048

    def table(self, positions: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin in ``dtype`` for ``positions`` of a ``length``-token sequence: ``[s, d]`` for
        positions ``[s]`` (shared by the batch), ``[b, 1, s, d]`` for per-sample positions ``[b, s]``
        (packed documents; broadcast over the heads). Computed in the wider of ``dtype`` and float32
        (Hugging Face's half-split layout: dimension ``i`` pairs with ``i + d/2``)."""
        wide = torch.promote_types(dtype, torch.float32)
        inv, scale = frequencies(self.head_size, self.theta, self.scaling, self.max_positions, length, dtype=wide,
                                 device=positions.device)
        angles = positions.to(wide)[..., None] * inv  # [..., s, d/2]
        emb = torch.cat((angles, angles), dim=-1)
        if positions.dim() == 2:
            emb = emb.unsqueeze(1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, heads, s, d]`` rotated by the table ``cos``, ``sin`` (``[s, d]`` or ``[b, 1, s, d]``)."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
