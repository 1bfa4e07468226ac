"""``parallel4d plot RUN_DIR``: a run's curves in one PNG (loss, validation loss, learning rate,
gradient norm, throughput), from its ``summary.json`` (the loss of every step) and
``metrics.jsonl`` (the logged steps). Works on a run still training or one that crashed: both
files are rewritten as it goes."""

from __future__ import annotations

import json
from pathlib import Path

from parallel4d.config.errors import ConfigError
from parallel4d.training.metrics import METRICS_FILE, read_records

PLOT_FILE = "curves.png"


def _losses(run_dir: Path, records: list[dict]) -> list[tuple[int, float]]:
    """``(step, loss)`` of every step from summary.json, else of the logged steps."""
    try:
        losses = json.loads((run_dir / "summary.json").read_text()).get("losses") or []
    except (OSError, ValueError):
        losses = []
    if losses:
        return list(enumerate(losses, start=1))
    return [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in rows], [v for _, v in rows]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir``'s curves into ``out`` (default ``run_dir/curves.png``); returns its path."""
    run_dir = Path(run_dir)
    records = read_records(run_dir / METRICS_FILE)
    losses = _losses(run_dir, records)
    if not losses:
        raise ConfigError(f"{run_dir} has no losses to plot: neither summary.json nor {METRICS_FILE} holds any "
                          "(is it a run directory, train.out_dir?)")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("parallel4d plot needs matplotlib: pip install 'parallel4d[viz]' (make installs it)") from None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(*zip(*losses), label="train", linewidth=1)
    steps, val = _series(records, "val_loss")
    if val:
        ax.plot(steps, val, "o-", label="validation")
    ax.set(title="loss", xlabel="step")
    ax.legend()
    for ax, key, title in ((axes[0][1], "lr", "learning rate"), (axes[1][0], "grad_norm", "gradient norm"),
                           (axes[1][1], "tokens_per_second", "tokens / s")):
        steps, values = _series(records, key)
        ax.plot(steps, values, ".-")
        ax.set(title=title, xlabel="step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / PLOT_FILE
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
