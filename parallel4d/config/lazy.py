"""A package's public names imported on first use (PEP 562): the package root and the config
package name each public name's home module and import nothing until a name is asked for."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``homes`` maps each public name to the module
    defining it; a name is imported once, then kept in the package's namespace."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(homes[name]), name)
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
