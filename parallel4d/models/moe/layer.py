"""The MoE modules a block holds in place of its dense MLP: ``[b, s, h]`` → ``[b, s, h]``.

Names are transformers' (``mlp.gate.weight`` the router, ``mlp.shared_expert``, ``mlp.shared_expert_gate``)
but for the experts, stored stacked — ``experts.gate_proj`` and ``experts.up_proj`` ``[E, I, h]``,
``experts.down_proj`` ``[E, h, I]`` — so that expert parallelism can shard them along ``E`` and a
grouped matrix product can read them as they are; :func:`from_transformers_experts` maps transformers
5's fused ``gate_up_proj [E, 2I, h]`` onto them.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.experts import Dispatcher, OneRank, count_per_expert
from parallel4d.models.context import ReadsContext
from parallel4d.models.moe.balance import layer_load
from parallel4d.models.moe.routing import expert_ffn, route
from parallel4d.models.moe.spec import MoeShape


class Router(nn.Module):
    """``weight`` ``[E, h]``: each token's logits over the experts (transformers' ``mlp.gate``)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x):
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """``E`` SwiGLU experts of width ``I``, each weight stacked along its first dimension ``E`` (under
    expert parallelism, this rank's experts only: :attr:`held`, after :meth:`keep`): an
    :class:`~parallel4d.experts.ExpertFn`."""

    NAMES = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden: int, width: int, num_experts: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.num_experts, self.held = num_experts, range(num_experts)

    def forward(self, x, counts):
        """Rows ``x`` ``[N, h]`` sorted by expert (``counts`` ``[E_held]`` each) → ``[N, h]``."""
        return expert_ffn(x, counts, self.gate_proj, self.up_proj, self.down_proj)

    def keep(self, experts: range) -> None:
        """Keep only ``experts`` (a contiguous range of the ``E``, from the whole stacked weights this
        module was built with, e.g. from the seed): new parameters of their rows, the rest freed."""
        for name in self.NAMES:
            whole = getattr(self, name)
            kept = nn.Parameter(whole.detach()[experts.start:experts.stop].clone(), requires_grad=whole.requires_grad)
            kept.__dict__.update(whole.__dict__)  # the parameter's tags (a 2D layout's tensor2d_replicated_over)
            setattr(self, name, kept)
        self.held = range(self.held.start + experts.start, self.held.start + experts.stop)

    def dense_layout(self) -> dict[str, tuple[tuple[int, ...], Callable]]:
        """``{name: (the stacked shape of all E experts, pieces)}``: this rank's experts are one box of
        each dense tensor, at row :attr:`held`'s start along ``E`` (the checkpoints' layout-free format)."""
        return {name: ((self.num_experts, *getattr(self, name).shape[1:]),
                       functools.partial(_rows_from, self.held.start)) for name in self.NAMES}


def _rows_from(first: int, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Pieces of a tensor that is rows ``first..`` of its dense tensor (along dim 0)."""
    return [((first,) + (0,) * (t.dim() - 1), t)]


class SparseMoE(ReadsContext):
    """Dropless top-k mixture of experts of ``moe`` (:class:`~.spec.MoeShape`), layer ``layer`` (from 0)
    of its model, plus Qwen2-MoE's shared expert (``shared_expert``, a dense MLP module the family
    builds; None without one) behind its sigmoid gate. With ``output_router_logits`` the layer records
    its :class:`~.balance.LayerLoad` in the forward's state (``context.state.routing[layer]``) for the
    load-balancing loss. ``dispatcher``: where the experts are (:class:`~parallel4d.experts.OneRank`
    until a layout puts them elsewhere)."""

    def __init__(self, moe: MoeShape, hidden: int, layer: int, shared_expert: nn.Module | None = None):
        super().__init__()
        self.moe, self.layer = moe, layer
        self.dispatcher: Dispatcher = OneRank(moe.num_experts)
        self.gate = Router(hidden, moe.num_experts)
        self.experts = Experts(hidden, moe.expert_width, moe.num_experts)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.has_shared = shared_expert is not None

    def place_experts(self, dispatcher: Dispatcher) -> None:
        """Dispatch through ``dispatcher`` and keep only its experts (``dispatcher.experts``) of the whole
        stacked weights built here (:meth:`Experts.keep`)."""
        self.dispatcher = dispatcher
        self.experts.keep(dispatcher.experts)

    def forward(self, x):
        shape = x.shape
        return self.mix(x.reshape(-1, shape[-1])).reshape(shape)

    def mix(self, flat: torch.Tensor) -> torch.Tensor:
        """The layer on tokens ``flat`` ``[T, h]`` → ``[T, h]``: routed (its :class:`~.balance.LayerLoad`
        recorded), dispatched to the experts, plus the gated shared expert. Each part runs through
        :meth:`part`."""
        routing = route(self.part("gate", flat), self.moe.top_k, self.moe.norm_topk_prob)
        picks = count_per_expert(routing.experts, self.moe.num_experts)  # once: the dispatch's and the aux loss's
        if self.moe.output_router_logits and self.context is not None:
            self.context.state.routing[self.layer] = layer_load(routing.probs, picks)
        out = self.dispatcher(flat, routing.experts, routing.weights, functools.partial(self.part, "experts"), picks)
        if self.has_shared:
            out = out + torch.sigmoid(self.part("shared_expert_gate", flat)) * self.part("shared_expert", flat)
        return out

    def part(self, name: str, *args) -> torch.Tensor:
        """Submodule ``name`` (``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``) on ``args``;
        a layout whose copies of the parameters need their gradients summed overrides it (the 2D twin)."""
        return getattr(self, name)(*args)


def from_transformers(tensor: torch.Tensor, how: str) -> torch.Tensor:
    """Our tensor from transformers' one by the transform of the name map
    (:func:`~.spec.hf_layer_names`): ``"copy"``; ``"gate_half"`` / ``"up_half"``: the first / second half of
    a fused ``gate_up_proj`` ``[E, 2I, h]`` along its rows (a view)."""
    if how == "copy":
        return tensor
    width = tensor.shape[1] // 2
    if how == "gate_half":
        return tensor[:, :width]
    if how == "up_half":
        return tensor[:, width:]
    raise ValueError(f"unknown transform {how!r} (copy, gate_half, up_half)")


def from_transformers_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts (``gate_up_proj`` ``[E, 2I, h]``: the gate's ``I`` rows, then the
    up projection's; ``down_proj`` ``[E, h, I]``) → :class:`Experts`' tensors by name."""
    return {"gate_proj": from_transformers(gate_up_proj, "gate_half"),
            "up_proj": from_transformers(gate_up_proj, "up_half"), "down_proj": down_proj}
