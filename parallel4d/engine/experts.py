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
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
import torch.nn as nn

from parallel4d.config.schema import Config
from parallel4d.distributed.mesh import Mesh
from parallel4d.experts import ExpertParallel
from parallel4d.models.moe.layer import SparseMoE


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
        return None
    ep, replicas = mesh.ep_split(cfg.parallel.ep)
    params: list[nn.Parameter] = []
    for stage in stages.values():
        for module in stage.modules():
            if isinstance(module, SparseMoE):
                module.place_experts(ExpertParallel(module.moe.num_experts, ep, mesh.comm_stats))
                params.extend(module.experts.parameters())
    return ExpertShards(ep, replicas, params)
