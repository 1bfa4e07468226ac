"""parallel4d inside DeepSpeed (the ``deepspeed`` extra): 2D tensor, ring sequence and wave
pipeline parallelism under a user's DeepSpeed script, ds_config and ZeRO.

Two ways in:

* :func:`initialize` (a job YAML / dict / Config with a ``deepspeed:`` section) →
  ``(engine, optimizer, scheduler)``; ``engine.train_batch(tokens, targets)`` on the global
  batch, for every layout (:mod:`.engines`). ``parallel4d launch`` uses it for such a config.
* Your own loop: ``parallel4d.build_model(cfg, mesh)`` (pp = 1) and
  ``deepspeed.initialize(model=..., mpu=as_mpu(mesh))`` (:mod:`.model`, :mod:`.mpu`).

:mod:`.ds_config` checks the section against DeepSpeed before any process starts.

Each name is imported on first use: :func:`build_model` and :func:`as_mpu` import no DeepSpeed (which
prints its accelerator warnings when imported), the checks and the engines do.
"""

from parallel4d.config.lazy import lazy_names

# public name → the module that defines it
_HOMES = {
    "initialize": "parallel4d.integrations.deepspeed.initialize",
    "build_engine": "parallel4d.integrations.deepspeed.initialize",
    "build_model": "parallel4d.integrations.deepspeed.model",
    "as_mpu": "parallel4d.integrations.deepspeed.mpu",
    "MeshMPU": "parallel4d.integrations.deepspeed.mpu",
    "resolve": "parallel4d.integrations.deepspeed.ds_config",
    "tag_parameters": "parallel4d.integrations.deepspeed.model",
    "avoid_compiled_ops": "parallel4d.integrations.deepspeed.model",
    "global_mean": "parallel4d.integrations.deepspeed.model",
    "RankModel": "parallel4d.integrations.deepspeed.model",
    "Parallel4DEngine": "parallel4d.integrations.deepspeed.engines",
    "DeepSpeedPipeline": "parallel4d.integrations.deepspeed.engines",
    "DeepSpeedTrainer": "parallel4d.integrations.deepspeed.trainer",
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
