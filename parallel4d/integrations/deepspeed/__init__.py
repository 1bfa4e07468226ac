"""parallel4d inside DeepSpeed (the ``deepspeed`` extra): 2D tensor, ring sequence and wave
pipeline parallelism under a user's DeepSpeed script, ds_config and ZeRO.

Two ways in:

* :func:`initialize` (a job YAML / dict / Config with a ``deepspeed:`` section) →
  ``(engine, optimizer, scheduler)``; ``engine.train_batch(tokens, targets)`` on the global
  batch, for every layout (:mod:`.engines`). ``parallel4d launch`` uses it for such a config.
* Your own loop: ``parallel4d.build_model(cfg, mesh)`` (pp = 1) and
  ``deepspeed.initialize(model=..., mpu=as_mpu(mesh))`` (:mod:`.model`, :mod:`.mpu`).

:mod:`.ds_config` checks the section against DeepSpeed before any process starts.
"""

from parallel4d.integrations.deepspeed.ds_config import resolve
from parallel4d.integrations.deepspeed.engines import DeepSpeedPipeline, Parallel4DEngine
from parallel4d.integrations.deepspeed.initialize import build_engine, initialize
from parallel4d.integrations.deepspeed.mpu import MeshMPU, as_mpu
from parallel4d.integrations.deepspeed.model import RankModel, avoid_compiled_ops, build_model, global_mean, tag_parameters
from parallel4d.integrations.deepspeed.trainer import DeepSpeedTrainer

__all__ = ["initialize", "build_engine", "build_model", "as_mpu", "MeshMPU", "resolve", "tag_parameters", "avoid_compiled_ops",
           "global_mean", "RankModel", "Parallel4DEngine", "DeepSpeedPipeline", "DeepSpeedTrainer"]
