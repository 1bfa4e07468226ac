"""ConfigError: a configuration that cannot run (its message names the field and the fix)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which field to change and how."""


def _short(text: Any, width: int = 80) -> str:
    """``repr(text)`` cut to ``width`` characters: a message must not echo a 5,000-digit value."""
    shown = repr(text)
    return shown if len(shown) <= width else shown[:width - 3] + "..."
