"""Expert parallelism in the engine (``parallel.ep``): each MoE layer's experts split over ``ep`` of the
``dp·sp`` data-replica ranks, and what that changes for gradients.

The ranks (:meth:`~parallel4d.distributed.mesh.Mesh.ep_split`): the ``dp·sp`` data replicas, sp innermost,
cut into ep groups of ``ep`` consecutive ones; rank ``r`` of a group holds experts
``[r·E/ep, (r+1)·E/ep)`` of every MoE layer, and the ranks at the same place in the other groups — the
expert replicas, ``dp·sp/ep`` of them — hold the same experts.

Gradients. Every rank's loss is the mean over its own tokens, and the data replicas' gradients are
averaged (divided by ``dp·sp``). A dense parameter's gradient is each replica's own and is summed over
all ``dp·sp``. An expert's gradient on its rank already sums what every rank of its ep group sent it
(the all-to-all's backward, :mod:`parallel4d.experts.dispatch`): it is summed over its replicas only and
divided by the same ``dp·sp`` (:func:`~parallel4d.engine.grads.gradient_buckets`). Its squared norm is
counted on one rank of each ep group — each expert element once — and summed over the ep group
(:func:`~parallel4d.engine.grads.global_grad_norm`). Clipping and AdamW are elementwise: unchanged.

Under hetero (:func:`by_expert_under_hetero`) every MoE layer's experts become one module each, so that an
expert no token chose is not moved, and its dispatcher agrees on the experts that run over the data replicas
(:class:`~parallel4d.experts.Agreement` over dp·sp, hetero's ZeRO group): whether a replica touches a chunk
decides its evictions, and so its ZeRO gathers and reduce-scatters, of every row — the dense ones too, which
all dp·sp ranks share —, so every rank of that group must touch the same experts' chunks, by position,
whichever experts it holds. An expert that no rank of the group routed to runs nowhere; hetero still steps
its weights with a zero gradient, as the stacked tensor's zero row would be (``wrap``'s ``zero_grad_steps``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
import torch.nn as nn

from parallel4d.config.schema import Config
from parallel4d.distributed.mesh import Mesh
from parallel4d.experts import Agreement, ExpertParallel
from parallel4d.models.moe.layer import Experts, SparseMoE
from parallel4d.models.moe.tp2d import SparseMoE2D


class ExpertShards(NamedTuple):
    """This rank's share of the experts: ``ep`` (the ranks that split them), ``replicas`` (the ranks holding
    the same ones: an expert's gradient is summed over these) and ``params`` (this rank's expert slices)."""

    ep: dist.ProcessGroup
    replicas: dist.ProcessGroup
    params: list[nn.Parameter]


def place_experts(cfg: Config, mesh: Mesh, stages: dict[int, nn.Module]) -> ExpertShards | None:
    """With ``parallel.ep > 1``: every MoE layer of ``stages`` dispatches over this rank's ep group and keeps
    only its experts (:meth:`~parallel4d.models.moe.layer.SparseMoE.place_experts`: each stage was built
    whole from the seed, so every layout starts from the same experts); None at ep = 1 (every expert on
    every data replica, reduced as a dense parameter). Collective (the mesh's groups on first use)."""
    if cfg.parallel.ep == 1:
        by_expert_under_hetero(cfg, mesh, stages)
        return None
    ep, replicas = mesh.ep_split(cfg.parallel.ep)
    for layer in _moe_layers(stages):
        layer.place_experts(ExpertParallel(layer.moe.num_experts, ep, mesh.comm_stats))
    by_expert_under_hetero(cfg, mesh, stages)  # before the slices are listed: they are its modules' then
    return ExpertShards(ep, replicas, expert_slices(stages))


def expert_slices(stages: dict[int, nn.Module]) -> list[nn.Parameter]:
    """Every parameter of the MoE layers' experts in ``stages``: their weights and, with ``model.lora``, their
    adapters (:class:`~parallel4d.models.lora.ExpertsLora`, each expert's with its expert) — listed again once
    the adapters are added (:func:`~parallel4d.engine.compose.local_model`)."""
    return [p for layer in _moe_layers(stages) for p in layer.experts.parameters()]


def _moe_layers(stages: dict[int, nn.Module]):
    """Every MoE layer (:class:`SparseMoE`, its 2D twin included) of ``stages``, in order."""
    return (module for stage in stages.values() for module in stage.modules() if isinstance(module, SparseMoE))


def by_expert_under_hetero(cfg: Config, mesh: Mesh, stages: dict[int, nn.Module]) -> None:
    """With ``hetero.enabled``: every MoE layer's held experts (but a 2D tp layer's) one module each (:meth:`Experts.by_expert`), its
    dispatcher agreeing on the experts that run over the data replicas (module docstring). Collective (the
    data replicas' group on first use)."""
    if not cfg.hetero.enabled:
        return
    group = mesh.group_over("dp", "sp") if mesh.size("dp") * mesh.size("sp") > 1 else None
    for layer in _moe_layers(stages):
        # (a 2D tp layer's stay stacked, moved whole: one module each, the grid's ranks would have to agree
        # on the experts that run, for their gradient sums over the grid)
        if not isinstance(layer, SparseMoE2D):
            layer.experts.by_expert()
            layer.dispatcher.agreement = Agreement(group, mesh.comm_stats)


def zero_grad_steps(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights held one module each (:func:`by_expert_under_hetero`): stepped by the optimizer
    with a zero gradient when no token chose them, as the stacked tensor's rows are."""
    return [p for module in model.modules() if isinstance(module, Experts) and module.each is not None
            for p in module.parameters()]
