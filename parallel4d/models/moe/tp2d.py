"""A mixture-of-experts layer under 2D tensor parallelism (``parallel.tp = q² > 1``): the expert layout.

A 2D block's activation on grid rank (i, j) is ``[b/q, s, h/q]`` (batch block i, hidden block j), and its
attention and dense MLPs split their weights over the q×q grid (SUMMA). An MoE layer splits its tokens
instead, as Megatron's "parallel folding" gives MoE layers a layout of their own:

1. one all-to-all over the grid row (:func:`~parallel4d.tensor2d.grid.tokens_to_row_rank`) turns the
   row's ``T = b/q · s`` tokens of hidden block j into token block j of them, whole: ``[T/q, h]``. The
   q² grid ranks then hold disjoint tokens, each a data replica's share as far as the experts go;
2. the layer runs as on one rank (:meth:`SparseMoE.mix`): the router ``[E, h]``, the experts (all ``E``, or
   the ``E/ep`` of this rank's ep group — ranks at the same grid position: the dispatcher is the rank's
   own, :class:`~parallel4d.experts.OneRank` or :class:`~parallel4d.experts.ExpertParallel`) and
   Qwen2-MoE's shared expert and its gate are held whole on every grid rank;
3. the inverse all-to-all gives back ``[T, h/q]``.

Gradients. Every grid rank's parameters are the same and its tokens its own, so each parameter is used
through :func:`~parallel4d.tensor2d.grid.replicated_over_grid` (tagged ``("tp_row", "tp_col")``, as a
per-head norm's weight): its gradient is summed over the grid in the backward, each micro-batch's, and a
gradient norm counts it once. The sum is taken where the parameter is used, inside the forward of the
module that owns it (:func:`_forward_with_grid_sums`), as the per-head norm takes it in its own forward:
after that module's forward pre-hooks ran, so a layout that gives a parameter its data in such a hook
(hetero's chunks) has placed it, and what autograd saves is a view of those data. The engine then sums the experts over their replicas and averages over the
data replicas as without the grid. The load-balancing statistics of a forward are the grid's tokens
together: the engine sums them over the grid ranks too. LoRA adapters added after the conversion (the routed
experts' ``experts.adapters.*``, whose call adds their product to an expert weight, and the shared expert's
linears) join the same sums (:meth:`SparseMoE2D.adopt_parameters`).

Cost (per MoE layer and micro-batch): two all-to-alls of ``T·h/q`` elements over a row (forward and
backward each), and the all-reduce over the grid of every weight's gradient in the backward — the
experts held here whole (``3·E/ep·I·h``), the router and the shared expert. The weights are not split
by the grid: the memory of ``E/ep`` experts on every rank, as at tp = 1.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from parallel4d.experts import Dispatcher
from parallel4d.models.moe.layer import SparseMoE
from parallel4d.tensor2d.grid import Grid, replicated_over_grid, tokens_from_row_rank, tokens_to_row_rank
from parallel4d.tensor2d.layer_base import DenseLayout, box_at

#: the grid axes every parameter of the layer is replicated over (gradient norms count it once)
ON_EVERY_GRID_RANK = ("tp_row", "tp_col")


class SparseMoE2D(SparseMoE):
    """The 2D twin of a :class:`SparseMoE` (module doc): ``[b/q, s, h/q]`` → ``[b/q, s, h/q]``. It adopts the
    dense layer's modules and parameters (no copy): the same names, every one whole on every grid rank
    (the experts: this rank's, after :meth:`place_experts`)."""

    def __init__(self, dense: SparseMoE, mesh, name: str = "mlp"):
        nn.Module.__init__(self)  # not SparseMoE's: the dense layer's modules are taken as they are
        self.moe, self.layer, self.dispatcher, self.has_shared = dense.moe, dense.layer, dense.dispatcher, dense.has_shared
        self.gate, self.experts = dense.gate, dense.experts
        if dense.has_shared:
            self.shared_expert, self.shared_expert_gate = dense.shared_expert, dense.shared_expert_gate
        self.grid, self.name = Grid(mesh), name
        self._tag()
        self._sum_grads_over_grid()

    @classmethod
    def from_dense(cls, dense: SparseMoE, mesh, *, name: str = "mlp") -> "SparseMoE2D":
        return cls(dense, mesh, name)

    def _tag(self) -> None:
        for p in self.parameters():
            p.tensor2d_replicated_over = ON_EVERY_GRID_RANK

    def _sum_grads_over_grid(self) -> None:
        """Every submodule that owns parameters uses them through the grid's gradient sums in its own
        forward (:func:`_forward_with_grid_sums`; the experts' module stays the same one when
        :meth:`place_experts` keeps their rows, and it reads its parameters at each call)."""
        for prefix, module in self.named_modules():
            owns = next(module.parameters(recurse=False), None) is not None
            if module is not self and owns and not hasattr(module, "grid_sums"):
                module.grid_sums = (self.grid, f"{self.name}.{prefix}")
                module.forward = types.MethodType(_forward_with_grid_sums, module)

    def adopt_parameters(self) -> None:
        """Parameters added after the conversion (the routed experts' LoRA adapters, ``experts.adapters.*``:
        modules whose call adds their product to an expert weight) tagged and summed over the grid as the
        layer's own."""
        self._tag()
        self._sum_grads_over_grid()

    def place_experts(self, dispatcher: Dispatcher) -> None:
        super().place_experts(dispatcher)
        self._tag()

    def forward(self, x):
        bq, s, hq = x.shape
        label = f"{self.name}.tokens"
        flat = tokens_to_row_rank(x.reshape(bq * s, hq), self.grid, label)  # [T/q, h]: token block j, whole
        return tokens_from_row_rank(self.mix(flat), self.grid, label).reshape(bq, s, hq)

    # --- the dense views (Composite2D's parts' interface) ---

    def dense_layout(self) -> dict[str, DenseLayout]:
        """``{name: (dense shape, pieces)}``: every parameter one whole box, the experts rows ``held`` of the
        stacked ``[E, ...]`` tensors (:meth:`~parallel4d.models.moe.layer.Experts.dense_layout`)."""
        out = {f"experts.{n}": layout for n, layout in self.experts.dense_layout().items()}
        for n, p in self.named_parameters():
            if not n.startswith("experts."):
                out[n] = (tuple(p.shape), box_at(*(0,) * p.dim()))
        return out

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters by name (no communication: each is whole here; the experts are this rank's)."""
        return {n: p.detach() for n, p in self.named_parameters()}

    def dense_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.named_parameters()}


def _forward_with_grid_sums(module: nn.Module, *args, **kwargs):
    """``module``'s own forward with each of its direct parameters used through
    :func:`~parallel4d.tensor2d.grid.replicated_over_grid` (``module.grid_sums``: the grid, the label's
    prefix): its gradient summed over the grid. Run as ``module.forward``, after the module's forward
    pre-hooks: a parameter whose data such a hook places is used as placed. An output without elements (an
    expert module no row reached on this rank) still takes every weight in (a zero gradient), so that the
    gradient sums over the grid run on this rank as on its peers."""
    grid, label = module.grid_sums
    params = module._parameters  # the aliases stand in for the parameters for this call only
    kept = dict(params)
    used = {n: replicated_over_grid(p, grid, f"{label}.{n}.grad") for n, p in kept.items() if p is not None}
    params.update(used)
    try:
        out = type(module).forward(module, *args, **kwargs)
    finally:
        params.update(kept)
    if isinstance(out, torch.Tensor) and out.numel() == 0:
        out = out + sum(w[:0].sum() for w in used.values())
    return out
