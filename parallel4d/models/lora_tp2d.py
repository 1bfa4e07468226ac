"""The 2D twin of :class:`~parallel4d.models.lora.LoraLinear`: a low-rank adapter on a converted
:class:`~parallel4d.tensor2d.layers.Linear2D` (``parallel.tp = q²``).

On grid rank (i, j) the input ``x`` is ``[b/q, s, in/q]`` (batch block i, input features block j) and the
base's output ``[b/q, s, out/q]`` (batch block i, output features block j). The adapter is split so that
no activation wider than ``r`` crosses ranks:

* ``lora_A`` ``[r, in]``: input-feature block j, ``[r, in/q]``, held by every rank of grid column j
  (replicated over the rows, as a bias is); ``u = x · A_jᵀ`` is a partial sum, all-reduced over my grid
  row (``along_j``: the other input blocks of the same tokens) into ``[b/q, s, r]``;
* ``lora_B`` ``[out, r]``: output-feature block j, ``[out/q, r]``, replicated over the rows the same way
  (with the base's ``out_perm`` applied first: GPT-2's fused ``c_attn`` keeps one adapter over q, k, v, its
  rows reordered as the base's are); ``u · B_jᵀ · scaling`` is exactly block (i, j) of the dense adapter's
  output, added to the base's.

Backward: the all-reduce's backward sums ``du`` over the grid row (each column's ``B_j`` contributes to it),
so ``dx = du · A_j`` is the dense gradient's block; each rank's ``lora_A`` / ``lora_B`` gradient covers
its batch block only and is summed over the grid column (:func:`~parallel4d.tensor2d.grid.replicated_over_rows`),
so the optimizer sees on every replica the dense gradient of its slice. The extra traffic per adapted
layer: one all-reduce of ``[b/q, s, r]`` over the row forward, one backward, and the two adapter
gradients' sums over the column.

The dense views (``dense_state_dict``, ``dense_grads``, ``dense_layout``: checkpoints, export) name the
adapter as the dense model does (``….lora_A`` ``[r, in]``, ``….lora_B`` ``[out, r]``, whole) beside the
base's ``….weight`` / ``….bias``. Dropout on the adapter's input is not drawn here: the config refuses
``model.lora.dropout`` above 0 with ``parallel.tp`` above 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.distributed import comm
from parallel4d.tensor2d.grid import all_reduce_sum, block_of, gather_columns
from parallel4d.tensor2d.layer_base import DenseLayout, box_at, new_param
from parallel4d.tensor2d.layers import Linear2D

if TYPE_CHECKING:  # annotations only: models/lora.py imports this module
    from parallel4d.models.lora import LoraShape


class LoraLinear2D(Linear2D):
    """A converted linear (the same ``weight`` / ``bias`` Parameters, so their names stay) plus the
    adapter's slices: ``lora_A`` ``[r, in/q]`` and ``lora_B`` ``[out/q, r]`` (see the module doc)."""

    def __init__(self, base: Linear2D, lora: LoraShape, lora_A: torch.Tensor, lora_B: torch.Tensor):
        """``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``: the dense adapter (every rank the same),
        sliced here with no communication."""
        super().__init__(base.in_features, base.out_features, base.mesh, name=base.name, overlap=base.overlap,
                         of=base)
        if lora.dropout:
            raise ValueError(f"{base.name}: model.lora.dropout={lora.dropout} is not drawn on the 2D grid yet; "
                             "set model.lora.dropout=0 or parallel.tp=1")
        if tuple(lora_A.shape) != (lora.rank, self.in_features) or tuple(lora_B.shape) != (self.out_features,
                                                                                           lora.rank):
            raise ValueError(f"{base.name}: adapter shapes {tuple(lora_A.shape)}, {tuple(lora_B.shape)} are not "
                             f"[r, in] = [{lora.rank}, {self.in_features}] and [out, r] = "
                             f"[{self.out_features}, {lora.rank}]")
        g, kw = self.grid, dict(dtype=base.weight.dtype, device=base.weight.device)
        rows = lora_B if self.out_perm is None else lora_B[self.out_perm.to(lora_B.device)]
        self.lora = lora
        self.scaling = lora.scaling
        self.lora_A = new_param(block_of(lora_A.detach(), g.j, g.q, 1).to(**kw), ("tp_row",))
        self.lora_B = new_param(block_of(rows.detach(), g.j, g.q, 0).to(**kw), ("tp_row",))

    @comm.eager  # the base's SUMMA, then the adapter's collectives: labels stay out of traced code
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b/q, s, in/q]`` → ``[b/q, s, out/q]``: the base's output plus the scaled adapter's."""
        g = self.grid
        partial = F.linear(x, self.replicated("lora_A"))  # [b/q, s, r]: my input block's share
        u = all_reduce_sum(partial, g.along_j, g.stats, f"{self.name}.lora_A.sum", g.comm)
        return super().forward(x) + F.linear(u, self.replicated("lora_B")) * self.scaling

    def _by_output(self, get) -> dict[str, torch.Tensor]:
        return {**super()._by_output(get), "lora_B": gather_columns(get(self.lora_B), self.grid, dim=0)}

    def _dense(self, get):
        return {**super()._dense(get), "lora_A": gather_columns(get(self.lora_A), self.grid, dim=1).contiguous()}

    def dense_layout(self) -> dict[str, DenseLayout]:
        g, runs = self.grid, self.output_runs()
        return {**super().dense_layout(),
                "lora_A": ((self.lora.rank, self.in_features), box_at(0, g.j * (self.in_features // g.q))),
                "lora_B": ((self.out_features, self.lora.rank), lambda t: [((d, 0), t[k:k + n]) for d, k, n in runs])}

    def to_dense(self) -> nn.Module:
        """The dense :class:`~parallel4d.models.lora.LoraLinear` (collective: every grid rank calls it)."""
        from parallel4d.models.lora import LoraLinear  # that module imports this one

        sd = self.dense_state_dict()
        base = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                         dtype=self.weight.dtype, device=self.weight.device)
        base.load_state_dict({k: sd[k] for k in ("weight", "bias") if k in sd})
        dense = LoraLinear(base, self.lora, torch.Generator())  # its draw replaced at once
        with torch.no_grad():
            dense.lora_A.copy_(sd["lora_A"])
            dense.lora_B.copy_(sd["lora_B"])
        return dense

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.lora.rank}, scaling={self.scaling}"
