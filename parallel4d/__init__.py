"""parallel4d: Optimus 2D tensor, Hanayo pipeline, ring sequence and chunked
heterogeneous-memory parallelism for transformers, composed over one mesh.

Public API: :func:`launch`, :func:`load_config`, :func:`init_mesh`, :func:`compose`,
:class:`Config`, :class:`Mesh`.
"""

from .config import Config, ConfigError, load_config
from .engine import compose
from .launch import launch
from .mesh import Mesh, init_mesh

__all__ = ["launch", "load_config", "init_mesh", "compose", "Config", "ConfigError", "Mesh"]
__version__ = "0.1.0"
