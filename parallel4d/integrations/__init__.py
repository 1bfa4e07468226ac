"""Ways into parallel4d from other training stacks (DeepSpeed).

Each integration needs its optional extra; :func:`deepspeed_integration` imports it on use, so that
importing this package costs nothing and needs neither torch nor DeepSpeed."""

from __future__ import annotations

import importlib
from types import ModuleType

from parallel4d.config.errors import ConfigError


def deepspeed_integration() -> ModuleType:
    """``parallel4d.integrations.deepspeed``, imported on use: DeepSpeed is an optional extra
    (and seconds to import); ConfigError saying how to install it when it is missing."""
    try:
        importlib.import_module("deepspeed")  # here: the package's own names are imported on first use
        return importlib.import_module("parallel4d.integrations.deepspeed")
    except ImportError as e:
        if e.name is None or not e.name.startswith("deepspeed"):
            raise
        raise ConfigError("the deepspeed: section needs DeepSpeed: pip install 'parallel4d[deepspeed]' (make "
                          "installs it), or remove the section to train with parallel4d's own engine") from None
