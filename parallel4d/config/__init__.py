"""The job's configuration, torch-free: the pydantic schema and its hardened YAML reader, the
cross-field rules, every refusal's fix, and the Hugging Face fields a pretrained model fills in.
Importing it never imports torch (``parallel4d validate`` runs without it)."""

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config, save_config
from parallel4d.config.schema import Config

__all__ = ["Config", "ConfigError", "load_config", "save_config"]
