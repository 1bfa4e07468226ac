"""Which files the byte-level text corpus reads (``data.source: text``), in which order.

Standard library only: ``config`` checks the corpus before any worker starts, ``data`` reads it;
both go through :func:`corpus_files`, so the two never disagree.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

SKIPPED_DIRS = ("site-packages", "__pycache__")  # the default walk's: installed packages, bytecode


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | Path | None, patterns: Sequence[str] | None = None) -> Iterator[Path]:
    """The files of the corpus under ``root`` (None: Python's standard library), in reading order.

    ``patterns``: glob patterns relative to ``root`` (``"**/*.md"``, ``"src/*.txt"``): every file
    any of them matches, once, in sorted path order. None: every ``.py`` file, walking the
    directories in sorted order and skipping ``site-packages`` and ``__pycache__``.
    """
    root = Path(root) if root else stdlib_root()
    if patterns:
        found = {p for pattern in patterns for p in root.glob(pattern) if p.is_file()}
        yield from sorted(found)
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def corpus_bytes(root: str | Path | None, patterns: Sequence[str] | None, enough: int) -> int:
    """Bytes of the corpus files, counting until ``enough`` (a check needs no more)."""
    total = 0
    for path in corpus_files(root, patterns):
        try:
            total += path.stat().st_size
        except OSError:
            continue
        if total >= enough:
            break
    return total
