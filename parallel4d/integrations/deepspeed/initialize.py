"""``initialize(config)``: a parallel4d job as DeepSpeed engine, optimizer and scheduler.

The ``deepspeed:`` section is the ds_config (checked and completed by :func:`~.ds_config.resolve`);
everything else is parallel4d's: the mesh from ``parallel``, the model from ``model``, the
optimizer from ``optimizer`` (unless the ds_config has its own), the warm-up as a torch
``LambdaLR`` (unless the ds_config has a ``scheduler``), which DeepSpeed steps and checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import deepspeed
import torch

from parallel4d.config.load import load_config
from parallel4d.config.schema import Config
from parallel4d.engine.compose import build_pipeline, local_model
from parallel4d.engine.model import tf32_allowed, use_tf32
from parallel4d.distributed.mesh import Mesh, init_mesh
from parallel4d.distributed.startup import device_and_backend, init_process_group_from_env
from parallel4d.optim.optimizer import build_optimizer, lr_lambda
from parallel4d.integrations.deepspeed.ds_config import resolve
from parallel4d.integrations.deepspeed.engines import DeepSpeedPipeline, Parallel4DEngine
from parallel4d.integrations.deepspeed.mpu import as_mpu
from parallel4d.integrations.deepspeed.model import RankModel, avoid_compiled_ops, refuse_dropout, tag_parameters


def initialize(config: str | Path | Config | dict, overrides: list[str] | None = None):
    """``(engine, optimizer, scheduler)`` for this process's rank of ``config``'s job.

    Joins the default process group (torchrun's env://) unless one exists, builds the mesh
    from ``parallel``, and returns :func:`build_engine`'s result. ``engine.train_batch(tokens,
    targets)`` trains one step on the global batch and returns the global mean loss."""
    cfg = load_config(config, overrides)
    device_type, backend = device_and_backend(cfg)
    ds_config = resolve(cfg, device_type)  # bad input is refused before any process group
    init_process_group_from_env(backend, cfg.train.timeout_s, cfg.train.join_timeout_s)
    p = cfg.parallel
    mesh = init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=cfg.train.timeout_s)
    use_tf32(tf32_allowed(cfg, mesh.device))
    return build_engine(cfg, mesh, ds_config)


def build_engine(cfg: Config, mesh: Mesh, ds_config: dict | None = None):
    """``(engine, optimizer, scheduler)`` of ``cfg`` on ``mesh``: a :class:`Parallel4DEngine` at
    pp = 1, a :class:`DeepSpeedPipeline` at pp > 1. ``ds_config``: :func:`~.ds_config.resolve`'s
    (resolved here when not given)."""
    ds_config = resolve(cfg, mesh.device.type) if ds_config is None else ds_config
    refuse_dropout(cfg)
    avoid_compiled_ops()
    if cfg.parallel.pp == 1:
        model, parts = RankModel(cfg, mesh), None
    else:
        bf16 = ds_config.get("bf16", {}).get("enabled") is True
        parts = build_pipeline(cfg, mesh, loss_scale=1.0 / mesh.size("sp"),
                               activation_dtype=torch.bfloat16 if bf16 else None)
        model = local_model(cfg, parts.stages)  # model.pretrained's weights loaded
        head_copy = [] if 0 in parts.stages else parts.tied_params  # the last stage's copy of a tied table
        tag_parameters(model, mesh, tied_copies=head_copy)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = scheduler = None
    if "optimizer" not in ds_config:
        optimizer = build_optimizer(model.dense_named_parameters(), cfg.optimizer, cfg.train.fused)
        if "scheduler" not in ds_config:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=params, lr_scheduler=scheduler, mpu=as_mpu(mesh),
        config=ds_config)
    if parts is not None:
        return DeepSpeedPipeline(engine, cfg, mesh, parts), optimizer, scheduler
    engine.__class__ = Parallel4DEngine  # a subclass adding train_batch; DeepSpeed built the engine
    engine.p4d_cfg, engine.p4d_mesh = cfg, mesh
    return engine, optimizer, scheduler
