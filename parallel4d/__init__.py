"""parallel4d: Optimus 2D tensor, Hanayo pipeline, ring sequence and chunked
heterogeneous-memory parallelism for transformers, composed over one mesh.

Public API: :func:`launch`, :func:`load_config`, :func:`init_mesh`, :func:`compose`,
:func:`local_batch`, :class:`Config`, :class:`Mesh`; :func:`save_checkpoint` / :func:`load_checkpoint`
(an engine's state as ``launch`` writes it, and back in any layout) and :func:`load_model` (the
dense model of a checkpoint or Hugging Face directory, in one process); with the ``deepspeed`` extra,
:func:`build_model` (this rank's model for a DeepSpeed loop) and
``parallel4d.integrations.deepspeed.initialize`` (a job file with a ``deepspeed:`` section →
DeepSpeed engine, optimizer, scheduler).

Every name is imported on first use, so ``import parallel4d.config`` (and ``parallel4d
validate``) never imports torch, and DeepSpeed (~1 s, and its accelerator warning) is imported only
where a DeepSpeed engine is built or a ``deepspeed:`` section checked, never for ``build_model``.
"""

from parallel4d.config.lazy import lazy_names

# public name → the module that defines it
_HOMES = {
    "launch": "parallel4d.launcher.launch",
    "load_config": "parallel4d.config.load",
    "Config": "parallel4d.config.schema",
    "ConfigError": "parallel4d.config.errors",
    "init_mesh": "parallel4d.distributed.mesh",
    "Mesh": "parallel4d.distributed.mesh",
    "compose": "parallel4d.engine.compose",
    "local_batch": "parallel4d.engine.batch",
    "save_checkpoint": "parallel4d.training.checkpoints",
    "load_checkpoint": "parallel4d.training.checkpoints",
    "load_model": "parallel4d.tools.generate",
    "build_model": "parallel4d.integrations.deepspeed",
}

__all__ = list(_HOMES)
__version__ = "0.1.0"


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
