"""parallel4d: Optimus 2D tensor, Hanayo pipeline, ring sequence and chunked
heterogeneous-memory parallelism for transformers, composed over one mesh.

Public API: :func:`launch`, :func:`load_config`, :func:`init_mesh`, :func:`compose`,
:func:`local_batch`, :class:`Config`, :class:`Mesh`; with the ``deepspeed`` extra,
:func:`build_model` (this rank's model for a DeepSpeed loop) and
``parallel4d.integrations.deepspeed.initialize`` (a job file with a ``deepspeed:`` section →
DeepSpeed engine, optimizer, scheduler).
"""

from .config import Config, ConfigError, load_config
from .engine import compose, local_batch
from .launch import launch
from .mesh import Mesh, init_mesh

__all__ = ["launch", "load_config", "init_mesh", "compose", "local_batch", "build_model", "Config", "ConfigError",
           "Mesh"]


def __getattr__(name: str):
    # DeepSpeed is an optional extra (and ~1 s to import): loaded when build_model is asked for
    if name == "build_model":
        from .integrations.deepspeed import build_model

        return build_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
__version__ = "0.1.0"
