"""The job's configuration, torch-free: the pydantic schema and its hardened YAML reader, the
cross-field rules, every refusal's fix, and the Hugging Face fields a pretrained model fills in.
Importing it never imports torch (``parallel4d validate`` runs without it).

The public names are imported on first use: the model families' specs (``models/<family>/spec.py``)
import :mod:`.rules`, and the schema imports their registry, so importing this package must not
import the schema.
"""

from parallel4d.config.lazy import lazy_names

# public name → the module that defines it
_HOMES = {
    "Config": "parallel4d.config.schema",
    "ConfigError": "parallel4d.config.errors",
    "load_config": "parallel4d.config.load",
    "save_config": "parallel4d.config.load",
}

__all__ = list(_HOMES)


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
