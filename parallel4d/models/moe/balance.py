"""The load-balancing auxiliary loss, as transformers defines it (``load_balancing_loss_func`` of its
Qwen3-MoE, Qwen2-MoE and Mixtral models), over every MoE layer of one forward and its whole batch.

Definition. Over the ``L`` MoE layers of a forward and its ``T`` tokens, with ``E`` experts and top-``k``
routing: ``C_e`` = the (token, layer) pairs whose top-k holds expert ``e`` (summed over layers),
``P_e`` = the router's softmax probability of ``e`` summed over tokens and layers, ``N = L·T``; then

    aux = E · Σ_e (C_e / N) · (P_e / N)

and the training loss is ``cross entropy + router_aux_loss_coef · aux`` when ``output_router_logits``
(transformers' switch; without it transformers adds nothing, and neither does this). The counts carry
no gradient; the gradient flows through ``P``.

Design for a parallel layout. Each MoE layer records its statistics as separate tensors
(:class:`LayerLoad`: counts ``[E]``, probability sums ``[E]``, tokens) in the forward's
:class:`~parallel4d.models.context.State` (``routing``, keyed by layer, so a recomputation overwrites
rather than adds). :func:`load_balancing_loss` is the one place they are combined, and its
``sum_over_ranks`` argument is where a collective plugs in: it is applied to one small vector
``[C_1 … C_E, N]`` (no gradient). Since ``aux`` is linear in ``P`` once ``C`` and ``N`` are the global
sums, each rank's term ``E · Σ_e C_e · P_e(local) / N²`` has exactly the gradient of the global loss
with respect to that rank's probabilities, and the ranks' terms sum to the global ``aux``: the
probability sums never cross ranks, only ``E + 1`` numbers per forward do (ranks holding different
tokens of one micro-batch: data, sequence and expert ranks). A layer of another pipeline stage adds
its ``C`` and ``N`` to the same vector (carried with the activations or in that collective).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from parallel4d.models.moe.spec import MoeShape


class LayerLoad(NamedTuple):
    """One MoE layer's routing statistics over its ``T`` tokens: ``counts`` ``[E]`` (top-k picks of each
    expert, no gradient, in the probabilities' dtype), ``prob_sums`` ``[E]`` (the softmax summed over
    tokens, with its gradient), ``tokens`` (``T``)."""

    counts: torch.Tensor
    prob_sums: torch.Tensor
    tokens: int


def layer_load(probs: torch.Tensor, counts: torch.Tensor) -> LayerLoad:
    """:class:`LayerLoad` of router probabilities ``[T, E]`` and the top-k picks of each expert ``[E]`` (the
    dispatch's row counts)."""
    return LayerLoad(counts.detach().to(probs.dtype), probs.sum(dim=0), probs.shape[0])


def load_balancing_loss(loads: list[LayerLoad], num_experts: int,
                        sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``E · Σ_e C_e · P_e / N²`` over ``loads`` (every MoE layer of one forward), ``[]``.
    ``sum_over_ranks``: sums the vector ``[C_1 … C_E, N]`` over the ranks that share the micro-batch
    (None: this process holds all of it); see the module doc for why that alone makes it exact."""
    counts = torch.stack([load.counts for load in loads]).sum(dim=0)
    probs = torch.stack([load.prob_sums for load in loads]).sum(dim=0)
    tokens = counts.new_tensor(float(sum(load.tokens for load in loads)))
    totals = torch.cat([counts, tokens.reshape(1)])
    if sum_over_ranks is not None:
        totals = sum_over_ranks(totals)
    counts, tokens = totals[:-1], totals[-1]
    return num_experts * (counts * probs).sum() / (tokens * tokens)


def auxiliary_loss(moe: MoeShape | None, routing: dict,
                   sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
    """What a family adds to one forward's token loss: ``router_aux_loss_coef · aux`` over the layers in
    ``routing`` (the forward State's ``{layer: LayerLoad}``), or None (no MoE layers, or
    ``output_router_logits`` off, or nothing recorded). ``sum_over_ranks``: as :func:`load_balancing_loss`'s."""
    if moe is None or not moe.output_router_logits or not routing:
        return None
    loads = [routing[layer] for layer in sorted(routing)]
    return moe.aux_loss_coef * load_balancing_loss(loads, moe.num_experts, sum_over_ranks)


class StepLoad:
    """What one training step's MoE layers report (``metrics.jsonl``'s ``aux_loss`` and ``expert_load``), kept
    on the device and never read here.

    Each training forward (a micro-batch) adds the picks of every expert summed over its MoE layers — the
    ``C`` of :func:`load_balancing_loss`, after its sum over the ranks that share the micro-batch: the whole
    micro-batch's — and its auxiliary-loss term as the loss holds it (``router_aux_loss_coef · aux``, a data
    replica's share scaled so the replicas' mean is the whole micro-batch's: the engine averages it with the
    loss, in the same all-reduce). Forwards without gradients (evaluation) add nothing. ``num_experts``:
    ``E``; ``microbatches``: the forwards of one step (their terms are averaged, as their losses)."""

    def __init__(self, num_experts: int, microbatches: int, device):
        self.picks = torch.zeros(num_experts, dtype=torch.float64, device=device)
        self.aux = torch.zeros((), dtype=torch.float64, device=device)
        self.microbatches = microbatches

    def start_step(self) -> None:
        self.picks.zero_()
        self.aux.zero_()

    def add_totals(self, totals: torch.Tensor) -> None:
        """A forward's summed ``[C_1 … C_E, N]``."""
        if torch.is_grad_enabled():
            self.picks += totals[:-1].detach().to(torch.float64)

    def add_term(self, term: torch.Tensor) -> None:
        """A forward's auxiliary-loss term ``[]``."""
        if torch.is_grad_enabled():
            self.aux += term.detach().to(torch.float64) / self.microbatches

    def expert_load(self) -> torch.Tensor:
        """``[E]``: each expert's share of the step's picks (sums to 1; the ideal is ``1/E`` each)."""
        return self.picks / self.picks.sum().clamp(min=1.0)
