"""What a benchmark writes besides its table: its figures with the device, the torch version, the date
and the configuration, as JSON under ``benchmarks/results/``."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def save(path: str, benchmark: str, device: str, config: dict, **figures) -> dict:
    """Write ``figures`` (e.g. ``rows=[...]``) under their ``benchmark`` name, ``device`` and ``config``
    to ``path``; returns what was written."""
    result = {"benchmark": benchmark, "device": device, "torch": torch.__version__,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "config": config, **figures}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return result
