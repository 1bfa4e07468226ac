"""``parallel4d plot RUN_DIR``: a run's curves in one PNG (loss, validation loss, learning rate,
gradient norm, throughput), from its ``summary.json`` (the loss of every step, the resolved config)
and ``metrics.jsonl`` (the logged steps). Works on a run still training or one that crashed: both
files are rewritten as it goes. The image follows :mod:`parallel4d.checkpoint.outputs`' rules: never
onto those two files or into a checkpoint, written under a temporary name and renamed once complete."""

from __future__ import annotations

import json
from pathlib import Path

from parallel4d.checkpoint.outputs import check_output, new_file, user_path
from parallel4d.config.errors import ConfigError
from parallel4d.config.schema import OptimizerConfig
from parallel4d.optim.optimizer import lr_at
from parallel4d.training.metrics import METRICS_FILE, read_records

PLOT_FILE = "curves.png"
# A warm-up shorter than this share of the run gets an inset of its own (else it is a few pixels).
_INSET_BELOW = 0.125


def _summary(run_dir: Path) -> dict:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _losses(summary: dict, records: list[dict]) -> list[tuple[int, float]]:
    """``(step, loss)`` of every step from summary.json, else of the logged steps."""
    losses = summary.get("losses") or []
    if losses:
        return list(enumerate(losses, start=1))
    return [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in rows], [v for _, v in rows]


def _lr_schedule(summary: dict, logged: list[tuple[int, float]]) -> tuple[list[float], OptimizerConfig | None]:
    """The learning rate of steps 1..train.steps from the run's ``optimizer`` section, and that
    section; ``([], None)`` when the config does not tell it (a DeepSpeed ds_config with its own
    optimizer or scheduler, no config) or when it disagrees with a logged value (the log is what ran)."""
    config = summary.get("config") or {}
    if any(k in (config.get("deepspeed") or {}) for k in ("optimizer", "scheduler")):
        return [], None
    try:
        opt, steps = OptimizerConfig.model_validate(config["optimizer"]), int(config["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return [], None
    lrs = [lr_at(step, opt, steps) for step in range(steps)]
    if any(not 1 <= s <= steps or abs(lrs[s - 1] - v) > 1e-6 * max(abs(v), 1e-12) for s, v in logged):
        return [], None
    return lrs, opt


def _draw_lr(ax, summary: dict, records: list[dict]) -> None:
    """Every step's learning rate (line) with the logged ones (dots), from 0 so that the warm-up
    shows; a short warm-up is also drawn magnified in an inset."""
    steps, values = _series(records, "lr")
    lrs, opt = _lr_schedule(summary, list(zip(steps, values)))
    # Where the curve is not: above a constant rate's plateau is taken, under a decay the lower left is free.
    decays = opt is not None and opt.schedule != "constant"
    if lrs:
        ax.plot(range(1, len(lrs) + 1), lrs, "-", linewidth=1.5, label="schedule (from the config)")
    ax.plot(steps, values, "o", markersize=4, label="logged")
    ax.set_ylim(bottom=0)
    ax.set(title="learning rate", xlabel="step")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.legend(loc="upper right" if decays else "lower right")
    warmup = opt.warmup_steps if opt is not None else 0
    if lrs and 0 < warmup < _INSET_BELOW * len(lrs):
        end = min(len(lrs), 2 * warmup + 1)
        inset = ax.inset_axes([0.16, 0.15, 0.34, 0.34] if decays else [0.42, 0.3, 0.5, 0.4])
        inset.plot(range(1, end + 1), lrs[:end], "-", linewidth=1.5)
        inset.plot([s for s in steps if s <= end], [v for s, v in zip(steps, values) if s <= end], "o", markersize=4)
        inset.set_ylim(bottom=0)
        inset.set_title(f"the warm-up: steps 1–{warmup}", fontsize=9)
        inset.tick_params(labelsize=8, labelleft=False)  # the shape; the values are on the panel's axis


def _image_format(out: Path) -> str:
    """The format ``out``'s suffix names (none: png); ``ConfigError`` for one matplotlib does not write."""
    from matplotlib.backend_bases import FigureCanvasBase

    kind = out.suffix[1:].lower() or "png"
    known = FigureCanvasBase.get_supported_filetypes()
    if kind not in known:
        raise ConfigError(f"-o {out}: matplotlib writes no .{kind} image; give one of the suffixes "
                          f"{', '.join('.' + k for k in sorted(known))}")
    return kind


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir``'s curves into ``out`` (default ``run_dir/curves.png``); returns its path (``~``
    expanded). ``ConfigError`` for an ``out`` :func:`~parallel4d.checkpoint.outputs.check_output` refuses."""
    run_dir = user_path(run_dir)
    out = check_output(run_dir / PLOT_FILE if out is None else out, "-o",
                       [(run_dir / "summary.json", "the run's summary.json"), (run_dir / METRICS_FILE,
                                                                               f"the run's {METRICS_FILE}")])
    records = read_records(run_dir / METRICS_FILE)
    summary = _summary(run_dir)
    losses = _losses(summary, records)
    if not losses:
        raise ConfigError(f"{run_dir} has no losses to plot: neither summary.json nor {METRICS_FILE} holds any "
                          "(is it a run directory, train.out_dir?)")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("parallel4d plot needs matplotlib: pip install 'parallel4d[viz]' (make installs it)") from None
    kind = _image_format(out)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    ax.plot(*zip(*losses), label="train", linewidth=1)
    steps, val = _series(records, "val_loss")
    if val:
        ax.plot(steps, val, "o-", label="validation")
    ax.set(title="loss", xlabel="step")
    ax.legend()
    _draw_lr(axes[0][1], summary, records)
    for ax, key, title in ((axes[1][0], "grad_norm", "gradient norm (before clipping)"),
                           (axes[1][1], "tokens_per_second", "tokens / s")):
        steps, values = _series(records, key)
        ax.plot(steps, values, ".-")
        ax.set(title=title, xlabel="step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    try:
        with new_file(out, "-o") as tmp:
            fig.savefig(tmp, dpi=100, format=kind)
    finally:
        plt.close(fig)
    return out
