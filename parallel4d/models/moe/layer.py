"""The MoE modules a block holds in place of its dense MLP: ``[b, s, h]`` → ``[b, s, h]``.

Names are transformers' (``mlp.gate.weight`` the router, ``mlp.shared_expert``, ``mlp.shared_expert_gate``)
but for the experts, stored stacked — ``experts.gate_proj`` and ``experts.up_proj`` ``[E, I, h]``,
``experts.down_proj`` ``[E, h, I]`` — so that expert parallelism can shard them along ``E`` and a
grouped matrix product can read them as they are; :func:`from_transformers_experts` maps transformers
5's fused ``gate_up_proj [E, 2I, h]`` onto them.

Under hetero the experts are one module each (:meth:`Experts.by_expert`: ``experts.each.<e>.gate_proj``
``[I, h]``, …): hetero moves whole parameters, by the hooks of the module whose ``forward`` uses them, so
an expert no token chose stays where it is only if it is a module of its own that is not called. Stacked
weights stay the default: the grouped product (:func:`~.routing.grouped_ffn`) reads them as they are, where
stacking per-expert weights at each call would copy every expert's weights forward and their gradients
back. Under hetero the experts that run are called one by one instead of grouped: each one's weights
arrive by a host-to-device copy or a ZeRO gather, far costlier than the launches a grouped product saves,
and grouping them would add a device copy of what just arrived (a GPU figure is not yet measured).
Checkpoints, Hugging Face loading and export see the stacked names and shapes either way
(:meth:`Experts.dense_layout`: each expert one row of its stacked tensor). LoRA adapters on the experts
(``models/lora.py``'s ExpertsLora, :func:`adapted_weights`) are stacked the same way: :attr:`Experts.adapters`,
or under hetero each :class:`Expert`'s own rows (``each.<j>.adapters.…``, a stack of one).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.experts import Dispatcher, HostCounts, OneRank, count_per_expert
from parallel4d.models.context import ReadsContext
from parallel4d.models.moe.balance import layer_load
from parallel4d.models.moe.routing import expert_ffn, no_rows, route
from parallel4d.models.moe.spec import MoeShape


class Router(nn.Module):
    """``weight`` ``[E, h]``: each token's logits over the experts (transformers' ``mlp.gate``)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x):
        return F.linear(x, self.weight)


def adapted_weights(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, adapters: nn.ModuleDict | None):
    """Stacked expert weights ``gate``, ``up`` ``[E, I, h]`` and ``down`` ``[E, h, I]``, each plus its adapter's
    scaled product where ``adapters`` (``models/lora.py``'s ExpertsLora by fused parameter) has one — as peft's
    ``ParamWrapper`` adapts a fused expert parameter: one adapter over the gate and up projections' rows together
    (``gate_up_proj``)."""
    if adapters is None:
        return gate, up, down
    if "gate_up_proj" in adapters:
        gate_up = adapters["gate_up_proj"](torch.cat([gate, up], dim=1))
        gate, up = gate_up.split(gate.shape[1], dim=1)
    if "down_proj" in adapters:
        down = adapters["down_proj"](down)
    return gate, up, down


class Expert(nn.Module):
    """One SwiGLU expert, a row of :class:`Experts`' stacked weights as a module of its own (under hetero):
    ``gate_proj``, ``up_proj`` ``[I, h]``, ``down_proj`` ``[h, I]``; with LoRA (:attr:`adapters`) its rows of the
    experts' adapters (``[1, r, in]`` / ``[1, out, r]``: a stack of one)."""

    def __init__(self, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, requires_grad: bool):
        super().__init__()
        self.gate_proj = nn.Parameter(gate_proj, requires_grad=requires_grad)
        self.up_proj = nn.Parameter(up_proj, requires_grad=requires_grad)
        self.down_proj = nn.Parameter(down_proj, requires_grad=requires_grad)
        self.adapters: nn.ModuleDict | None = None

    def forward(self, rows):
        """``rows`` ``[n, h]`` → ``[n, h]`` (:func:`~.routing.looped_ffn`'s arithmetic for one expert)."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if self.adapters is not None:
            gate, up, down = (w[0] for w in adapted_weights(gate[None], up[None], down[None], self.adapters))
        return F.linear(F.silu(F.linear(rows, gate)) * F.linear(rows, up), down)


class Experts(nn.Module):
    """``E`` SwiGLU experts of width ``I``, each weight stacked along its first dimension ``E`` (under
    expert parallelism, this rank's experts only: :attr:`held`, after :meth:`keep`), or one :class:`Expert`
    module each (:attr:`each`, after :meth:`by_expert`): an :class:`~parallel4d.experts.ExpertFn`."""

    NAMES = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden: int, width: int, num_experts: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.num_experts, self.held = num_experts, range(num_experts)
        self.each: nn.ModuleList | None = None
        # low-rank adapters on the stacked weights (model.lora; models/lora.py's add_adapters): None, or
        # {"gate_up_proj": …, "down_proj": …} modules whose call ``(weight)`` adds their product to a weight
        self.adapters: nn.ModuleDict | None = None

    def forward(self, x, counts, host: HostCounts | None = None):
        """Rows ``x`` ``[N, h]`` sorted by expert (``counts`` ``[E_held]`` each) → ``[N, h]``; one module per
        expert: exactly the ``host.used`` experts run (an :class:`~parallel4d.experts.Agreement`'s; without
        one, those with rows, ``counts`` read here)."""
        if self.each is None:
            return expert_ffn(x, counts, *self.adapted())
        if host is None:
            rows = counts.tolist()
            host = HostCounts(rows, [n > 0 for n in rows])
        out, start = [], 0
        for expert, n, used in zip(self.each, host.rows, host.used):
            if used:  # on zero rows too where another rank of the agreement has some: the same chunks move
                out.append(expert(x[start:start + n]))
            start += n
        return torch.cat(out) if out else no_rows(x, x.new_empty(0, x.shape[1]))

    def adapted(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked ``gate_proj``, ``up_proj`` ``[E, I, h]`` and ``down_proj`` ``[E, h, I]``, each plus its
        adapter's scaled product where :attr:`adapters` has one — as peft's ``ParamWrapper`` adapts a fused
        expert parameter: one adapter over the gate and up projections' rows together (``gate_up_proj``)."""
        return adapted_weights(self.gate_proj, self.up_proj, self.down_proj, self.adapters)

    def keep(self, experts: range) -> None:
        """Keep only ``experts`` (a contiguous range of the ``E``, from the whole stacked weights this
        module was built with, e.g. from the seed): new parameters of their rows — the adapters' too —, the
        rest freed."""
        if self.each is not None:
            raise RuntimeError("Experts.keep: choose the experts before making them one module each (by_expert)")
        for name, whole in list(self.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            kept = nn.Parameter(whole.detach()[experts.start:experts.stop].clone(), requires_grad=whole.requires_grad)
            kept.__dict__.update(whole.__dict__)  # the parameter's tags (a 2D layout's tensor2d_replicated_over)
            setattr(self.get_submodule(owner) if owner else self, leaf, kept)
        self.held = range(self.held.start + experts.start, self.held.start + experts.stop)

    def by_expert(self) -> None:
        """The held experts as one :class:`Expert` module each (:attr:`each`), the stacked parameters freed:
        a module's hooks then see only its expert's weights (hetero moves the experts that run)."""
        if self.each is not None:
            return
        if self.adapters is not None:
            raise RuntimeError("Experts.by_expert: make the experts one module each before adding their adapters "
                               "(models/lora.py's add_expert_adapters gives each its rows)")
        whole = {name: getattr(self, name) for name in self.NAMES}
        grad = whole["gate_proj"].requires_grad
        for name in self.NAMES:
            delattr(self, name)
        self.each = nn.ModuleList(Expert(*(whole[name].detach()[e].clone() for name in self.NAMES), grad)
                                  for e in range(len(self.held)))
        for expert in self.each:  # the parameters' tags, as keep() carries them
            for name in self.NAMES:
                getattr(expert, name).__dict__.update(whole[name].__dict__)

    def dense_layout(self) -> dict[str, tuple[tuple[int, ...], Callable]]:
        """``{name: (the stacked shape of all E experts, pieces)}``: this rank's experts are one box of each
        stacked tensor, at row :attr:`held`'s start along ``E`` — one module per expert, each of its weights
        (``each.<j>.<name>``, of the stacked tensor :meth:`dense_name`) one row (the checkpoints' layout-free
        format either way)."""
        if self.each is None:  # (the adapters' stacked tensors too: each row an expert's)
            return {name: ((self.num_experts, *p.shape[1:]), functools.partial(_rows_from, self.held.start))
                    for name, p in self.named_parameters()}
        out = {}
        for j, expert in enumerate(self.each):
            out.update({f"each.{j}.{name}": ((self.num_experts, *getattr(expert, name).shape),
                                             functools.partial(_row_at, self.held.start + j)) for name in self.NAMES})
            out.update({f"each.{j}.{name}": ((self.num_experts, *p.shape[1:]),  # a stack of one: row held + j
                                             functools.partial(_rows_from, self.held.start + j))
                        for name, p in expert.named_parameters() if name not in self.NAMES})
        return out

    @staticmethod
    def dense_name(name: str) -> str:
        """The stacked tensor a parameter of this module is part of: ``gate_proj`` itself (an adapter's
        ``adapters.gate_up_proj.lora_A`` too), ``each.<j>.gate_proj``'s (``each.<j>.adapters.…``'s)."""
        return name.split(".", 2)[2] if name.startswith("each.") else name


def _rows_from(first: int, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Pieces of a tensor that is rows ``first..`` of its dense tensor (along dim 0)."""
    return [((first,) + (0,) * (t.dim() - 1), t)]


def _row_at(row: int, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Pieces of a tensor that is row ``row`` of its dense tensor (along a dim 0 it lacks)."""
    return [((row,) + (0,) * t.dim(), t.unsqueeze(0))]


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
        recorded), dispatched to the experts, plus the gated shared expert. Each part is its submodule's call
        (the 2D twin's submodules sum their parameters' gradients over the grid in their own forward)."""
        routing = route(self.gate(flat), self.moe.top_k, self.moe.norm_topk_prob)
        picks = count_per_expert(routing.experts, self.moe.num_experts)  # once: the dispatch's and the aux loss's
        if self.moe.output_router_logits and self.context is not None:
            self.context.state.routing[self.layer] = layer_load(routing.probs, picks)
        out = self.dispatcher(flat, routing.experts, routing.weights, self.experts, picks)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out


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
