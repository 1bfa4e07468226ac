"""This rank's model for DeepSpeed: parameters tagged for its gradient norm, and no JIT-built op.

DeepSpeed counts a parameter's squared gradient norm on every rank if it is tagged
``tensor_model_parallel``, otherwise only on tensor-parallel rank 0, then sums over the
ZeRO group and the model-parallel group (pp × grid). That binary rule cannot say "one copy
per grid column" — what a 2D bias or norm (replicated over ``tp_row``) needs — so the tag is
set per rank: a parameter is tagged where its copy is the one to count (everywhere for a
unique block, on grid row 0 for a row-replicated one) and untagged elsewhere, where
DeepSpeed skips it (those ranks have a tensor-parallel rank ≠ 0). Under tp = 1 every
rank has tensor-parallel rank 0 and counts its own stages. The copy of a tied table on the
last pipeline stage is ``ds_pipe_replicated`` (skipped: the first stage counts it).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from parallel4d.distributed import comm
from parallel4d.config.errors import ConfigError
from parallel4d.config.rules.deepspeed import dropout_problem
from parallel4d.config.schema import Config
from parallel4d.engine.compose import build_stages, local_model
from parallel4d.distributed.mesh import Mesh


def tag_parameters(model: nn.Module, mesh: Mesh, tied_copies=()) -> None:
    """Set ``tensor_model_parallel`` (and ``ds_pipe_replicated`` on ``tied_copies``, the
    pipeline's second copies of tied tables) so DeepSpeed counts every dense element once."""
    first = {"tp_row": mesh.rank("tp_row") == 0, "tp_col": mesh.rank("tp_col") == 0}
    copies = {id(p) for p in tied_copies}
    for p in model.parameters():  # a grid replica counts on the first row (and column) of what it spans
        p.tensor_model_parallel = all(first[a] for a in getattr(p, "tensor2d_replicated_over", ()))
        p.ds_pipe_replicated = id(p) in copies


def refuse_dropout(cfg: Config) -> None:
    """ConfigError when ``cfg``'s model has dropout (:func:`~parallel4d.config.rules.deepspeed.dropout_problem`)."""
    problem = dropout_problem(cfg)
    if problem:
        raise ConfigError(problem)


def avoid_compiled_ops() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory all-reduce op (g++ and ninja, ~45 s
    on first use): it serves only inference all-reduces on one host; training uses the
    process groups. Call before ``deepspeed.initialize``; idempotent. DeepSpeed is imported here, not
    with this module: :func:`build_model` needs none (and importing it prints its accelerator warning)."""
    # `import deepspeed.comm.torch as m` would bind the package attribute `torch`: the torch library
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class RankModel(nn.Module):
    """This rank's model for a DeepSpeed loop (pp = 1): 2D layers when ``tp > 1``, ring
    attention when ``sp > 1``, parameters tagged by :func:`tag_parameters`.

    ``forward(tokens, targets)`` takes this rank's shards ``[B/(dp·q), S/sp]``
    (:func:`parallel4d.engine.local_batch`) and returns a scalar whose *value* is the mean
    loss over the whole global batch (one all-reduce of a scalar over the data replicas,
    so a DeepSpeed loop prints what a single process would) and whose *gradient* is the
    one DeepSpeed's reduction expects: DeepSpeed averages gradients over dp and *sums* them
    over sp, so the differentiated part is this rank's token mean divided by sp.
    """

    def __init__(self, cfg: Config, mesh: Mesh):
        super().__init__()
        if cfg.parallel.pp > 1:
            raise ConfigError("build_model: parallel.pp > 1 needs parallel4d's pipeline executor around DeepSpeed; "
                              "build it with parallel4d.integrations.deepspeed.initialize(config) and train with "
                              "engine.train_batch(tokens, targets), or use parallel.pp=1")
        refuse_dropout(cfg)
        stages, self.loss_fn = build_stages(cfg, mesh)
        self.local = local_model(cfg, stages)  # model.pretrained's weights loaded
        self._order = list(self.local.stages().values())
        self.mesh, self.sp = mesh, mesh.size("sp")
        self.timeout_s = cfg.train.timeout_s
        tag_parameters(self.local, mesh)
        self._checked = False

    def dense_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(dense name, parameter)`` pairs, for ``parallel4d.optim.build_optimizer``'s groups."""
        return self.local.dense_named_parameters()

    def _refuse_zero3(self) -> None:
        """ZeRO-3 partitions parameters over DeepSpeed's data-parallel group, not the dp·sp
        replicas, and gathers 2D blocks as if they were whole: wrong under tp or sp. Refused at
        the first forward (before any step), where the partitioned parameters (``ds_id``) show."""
        self._checked = True
        if (self.mesh.size("tp_row") > 1 or self.sp > 1) and any(hasattr(p, "ds_id") for p in self.parameters()):
            raise ConfigError("DeepSpeed ZeRO stage 3 is not supported with parallel.tp > 1 or parallel.sp > 1 "
                              "(parameters would be partitioned over the wrong group); set "
                              "zero_optimization.stage to 1 or 2, which match parallel4d exactly")

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self._checked:
            self._refuse_zero3()
        h = tokens
        for stage in self._order:
            h = stage(h)
        share = self.loss_fn(h, targets) / self.sp
        mean = global_mean(share.detach(), self.mesh, self.timeout_s)
        return share + (mean - share.detach())  # the value of the mean, the gradient of the share


def global_mean(share: torch.Tensor, mesh: Mesh, timeout_s: float) -> torch.Tensor:
    """The global batch's mean loss from each data replica's ``share`` (its token mean / sp):
    summed over the replicas ``dp·sp`` (one scalar all-reduce), divided by dp."""
    total = share.detach().clone()
    work = comm.all_reduce(total, mesh.group_over("dp", "sp"), stats=mesh.comm_stats, label="loss", async_op=True)
    comm.wait(work, timeout_s, "loss all-reduce over the data replicas (dp·sp)", mesh.deadlines)
    return total / mesh.size("dp")


def build_model(cfg: Config, mesh: Mesh) -> RankModel:
    """This rank's model of ``cfg`` on ``mesh`` for ``deepspeed.initialize(model=..., mpu=as_mpu(mesh))`` (:func:`.mpu.as_mpu`)."""
    return RankModel(cfg, mesh)
