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
tokens of one micro-batch: data, sequence and expert ranks).

Under a pipeline the layers of one forward sit in several chunks, on several pp ranks, and only the
last chunk computes the loss. Their statistics travel with the activations: each message between
chunks carries one float64 vector ``[C_1 … C_E, N, P_1 … P_E]`` of everything the chunks before it
recorded (:func:`carried_totals`), ``P`` with its autograd link. A chunk (:class:`CarryingChunk`)
starts its forward's routing from that vector (one entry, :data:`CARRIED`, a :class:`LayerLoad` of the
layers before it), adds its own layers, and sends the sum on; the last chunk's loss then reads every
layer of the forward, as one process does, and sums ``[C, N]`` over the data ranks as above. The
backward returns ``∂aux/∂P = E·C/N²`` through the same vector with the activation's gradient, so each
chunk's router probabilities get the gradient of the one-process loss. Counts and tokens stay float64
whatever dtype the activations travel in (bfloat16 holds integers exactly only up to 256); the vector
is ``2E + 1`` numbers per message. The pipeline executor knows only that a message carries a second
tensor; a collective over pp instead would tie every stage's forward to the last one's.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn

from parallel4d.models.context import ForwardContext
from parallel4d.models.moe.spec import MoeShape

#: the routing key of the statistics a pipeline chunk received from the chunks before it (sorted first)
CARRIED = -1


class LayerLoad(NamedTuple):
    """One MoE layer's routing statistics over its ``T`` tokens: ``counts`` ``[E]`` (top-k picks of each
    expert, no gradient, in the probabilities' dtype), ``prob_sums`` ``[E]`` (the softmax summed over
    tokens, with its gradient), ``tokens`` (``T``; a float64 ``[]`` tensor for the statistics a pipeline
    chunk received, :func:`carried_load`)."""

    counts: torch.Tensor
    prob_sums: torch.Tensor
    tokens: int | torch.Tensor


def layer_load(probs: torch.Tensor, counts: torch.Tensor) -> LayerLoad:
    """:class:`LayerLoad` of router probabilities ``[T, E]`` and the top-k picks of each expert ``[E]`` (the
    dispatch's row counts)."""
    return LayerLoad(counts.detach().to(probs.dtype), probs.sum(dim=0), probs.shape[0])


def load_balancing_loss(loads: list[LayerLoad], num_experts: int,
                        sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``E · Σ_e C_e · P_e / N²`` over ``loads`` (every MoE layer of one forward), ``[]``.
    ``sum_over_ranks``: sums the vector ``[C_1 … C_E, N]`` over the ranks that share the micro-batch
    (None: this process holds all of it); see the module doc for why that alone makes it exact."""
    counts, tokens, probs = _summed(loads)
    totals = torch.cat([counts, tokens.reshape(1)])
    if sum_over_ranks is not None:
        totals = sum_over_ranks(totals)
    counts, tokens = totals[:-1], totals[-1]
    return num_experts * (counts * probs).sum() / (tokens * tokens)


def _summed(loads: list[LayerLoad], dtype: torch.dtype | None = None):
    """``(C, N, P)``: the counts ``[E]``, tokens ``[]`` and probability sums ``[E]`` of ``loads`` summed
    over the layers (in ``dtype``, None: the loads' own); ``P`` keeps its gradient."""
    counts = torch.stack([load.counts.to(dtype or load.counts.dtype) for load in loads]).sum(dim=0)
    probs = torch.stack([load.prob_sums.to(dtype or load.prob_sums.dtype) for load in loads]).sum(dim=0)
    return counts, _tokens(loads, counts), probs


def _tokens(loads: list[LayerLoad], like: torch.Tensor) -> torch.Tensor:
    """``N``, the tokens of ``loads`` summed, ``[]`` in ``like``'s dtype (a carried count is a tensor: no host read)."""
    tokens = sum(load.tokens for load in loads)
    return like.new_tensor(float(tokens)) if isinstance(tokens, int) else tokens.to(like.dtype)


def carried_totals(routing: dict, num_experts: int, device) -> torch.Tensor:
    """What a pipeline chunk sends on beside its activation: ``[C_1 … C_E, N, P_1 … P_E]`` float64 summed
    over every entry of ``routing`` (the statistics it received and its own layers'; zeros when there are
    none); ``P`` keeps its gradient."""
    loads = [routing[layer] for layer in sorted(routing)]
    if not loads:
        return torch.zeros(2 * num_experts + 1, dtype=torch.float64, device=device)
    counts, tokens, probs = _summed(loads, torch.float64)
    return torch.cat([counts, tokens.reshape(1), probs])


def carried_load(totals: torch.Tensor, num_experts: int) -> LayerLoad:
    """The vector :func:`carried_totals` made as one :class:`LayerLoad` (the layers of the chunks before):
    counts and tokens without gradient, the probability sums with theirs."""
    e = num_experts
    return LayerLoad(totals[:e].detach(), totals[e + 1:], totals[e].detach())


class CarryingChunk(nn.Module):
    """A pipeline chunk whose messages carry the load statistics of its forward's MoE layers
    (``forward(x, totals=None)``, ``totals``: what the chunk before sent, None for the first): the
    forward's routing (``context.state.routing``) starts from ``totals`` alone (:data:`CARRIED`), the
    chunk runs (its MoE layers add their entries), and it returns ``(y, carried_totals)``; the ``last``
    chunk returns ``y`` alone and leaves every layer's statistics in the routing for the loss, which the
    executor computes in the same forward state. ``num_experts``: ``E``."""

    def __init__(self, chunk: nn.Module, context: ForwardContext, num_experts: int, last: bool):
        super().__init__()
        self.chunk, self.context, self.num_experts, self.last = chunk, context, num_experts, last

    def forward(self, x, totals: torch.Tensor | None = None):
        routing = self.context.state.routing
        routing.clear()  # this micro-batch's entries up to here are in totals
        if totals is not None:
            routing[CARRIED] = carried_load(totals, self.num_experts)
        y = self.chunk(x)
        return y if self.last else (y, carried_totals(routing, self.num_experts, y.device))

    @staticmethod
    def spec(num_experts: int) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of what a message carries: :func:`carried_totals`'s vector."""
        return (2 * num_experts + 1,), torch.float64


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
        # one buffer [picks_1 … picks_E, aux]: under a pipeline only the last chunk's rank adds to it, and one
        # sum over the pp ranks gives every rank the figures (the engine's)
        self.reported = torch.zeros(num_experts + 1, dtype=torch.float64, device=device)
        self.picks, self.aux = self.reported[:-1], self.reported[-1]
        self.microbatches = microbatches

    def start_step(self) -> None:
        self.reported.zero_()

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
