"""``parallel4d plot RUN_DIR``: a run's curves in one PNG (loss, validation loss, learning rate,
gradient norm, throughput; a mixture of experts' auxiliary loss and busiest expert), from its ``summary.json`` (the loss of every step, the resolved config)
and ``metrics.jsonl`` (the logged steps, and its events: checkpoint saves, resumes). Every panel marks
where the run resumed (and what changed: the layout, the learning rate, ...); the throughput panel
marks each save and the logged point whose interval holds it (a save's seconds count in that
interval's tokens/s: the dip is the save). Works on a run still training or one that crashed: both
files are rewritten as it goes. The image follows :mod:`parallel4d.checkpoint.outputs`' rules: never
onto those two files or into a checkpoint, written under a temporary name and renamed once complete."""

from __future__ import annotations

import json
from pathlib import Path

from parallel4d.checkpoint.outputs import check_output, new_file, user_path
from parallel4d.checkpoint.resume import describe_changes
from parallel4d.config.errors import ConfigError
from parallel4d.config.schema import OptimizerConfig
from parallel4d.optim.optimizer import lr_at
from parallel4d.training.metrics import METRICS_FILE, read_log

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


def marks(log: list[dict]) -> dict:
    """What the curves mark, from metrics.jsonl's records and events in order (:func:`.metrics.read_log`):
    ``saves`` ``[(step, seconds)]``; ``resumes`` ``[(step, label, what changed)]`` (the label says
    whether the layout changed; what changed is one line, the layout last, "" for nothing); ``slowed`` ``[(step, tokens/s, seconds saving)]``: the logged points whose interval
    holds a save — the first record after it, unless the run resumed in between (its interval began then)."""
    saves, resumes, slowed, pending = [], [], [], 0.0
    for r in log:
        kind = r.get("event")
        if kind == "save":
            saves.append((r["step"], r.get("seconds", 0.0)))
            pending += r.get("seconds", 0.0)
        elif kind == "resume":
            changes = r.get("changes") or []
            label = "resumed, new layout" if any(c.get("layout") for c in changes) else "resumed"
            resumes.append((r["step"], label, describe_changes(changes)))
            pending = 0.0
        elif kind is None and r.get("tokens_per_second") is not None:
            if saves and pending:
                slowed.append((r["step"], r["tokens_per_second"], pending))
            pending = 0.0
    return {"saves": saves, "resumes": resumes, "slowed": slowed}


_FOOTER_LINES = 4  # resumes whose changes the figure's footer lists (the last ones)


def _draw_resumes(fig, axes, resumes: list[tuple[int, str, str]]) -> float:
    """A dashed line at each resume on every panel, labelled on the first; what each changed in the
    figure's footer. Returns the footer's height (a share of the figure) to keep free."""
    for k, ax in enumerate(axes):
        for step, label, _ in resumes:
            ax.axvline(step, color="tab:purple", linestyle="--", linewidth=1)
            if k == 0:
                ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), xytext=(3, -4),
                            textcoords="offset points", va="top", fontsize=8, color="tab:purple")
    lines = [f"resumed at step {step}: {changed}" for step, _, changed in resumes if changed][-_FOOTER_LINES:]
    if lines:
        fig.text(0.01, 0.005, "\n".join(lines), fontsize=8, color="tab:purple", va="bottom", wrap=True)
    return 0.025 * len(lines)


def _draw_saves(ax, found: dict) -> None:
    """Dotted lines at the saves, and the logged points whose throughput includes one."""
    for k, (step, _) in enumerate(found["saves"]):
        ax.axvline(step, color="tab:gray", linestyle=":", linewidth=0.8, label="checkpoint saved" if k == 0 else None)
    if found["slowed"]:
        steps, values, seconds = zip(*found["slowed"])
        ax.plot(steps, values, "o", markerfacecolor="none", color="tab:red", markersize=8,
                label=f"interval with a save ({max(seconds):.1f} s at most)")
    if found["saves"]:
        ax.legend(loc="lower right", fontsize=8)


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


def _draw_router(row, records: list[dict]) -> None:
    """MoE: the auxiliary (load-balancing) loss, and the busiest expert's share of the picks over the mean
    share (1: every expert equally loaded; E: one expert takes every token)."""
    steps, aux = _series(records, "aux_loss")
    row[0].plot(steps, aux, ".-")
    row[0].set(title="auxiliary loss (router_aux_loss_coef × load balancing)", xlabel="step")
    loaded = [(r["step"], max(r["expert_load"]) * len(r["expert_load"])) for r in records if "expert_load" in r]
    row[1].plot(*zip(*loaded), ".-")
    row[1].axhline(1.0, color="grey", linewidth=0.5)
    row[1].set(title="busiest expert's load / mean load", xlabel="step")


def image_format(out: Path, flag: str = "-o") -> str:
    """The format ``out``'s suffix names (none: png); ``ConfigError`` for one matplotlib does not write."""
    from matplotlib.backend_bases import FigureCanvasBase

    kind = out.suffix[1:].lower() or "png"
    known = FigureCanvasBase.get_supported_filetypes()
    if kind not in known:
        raise ConfigError(f"{flag} {out}: matplotlib writes no .{kind} image; give one of the suffixes "
                          f"{', '.join('.' + k for k in sorted(known))}")
    return kind


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir``'s curves into ``out`` (default ``run_dir/curves.png``); returns its path (``~``
    expanded). ``ConfigError`` for an ``out`` :func:`~parallel4d.checkpoint.outputs.check_output` refuses."""
    run_dir = user_path(run_dir)
    out = check_output(run_dir / PLOT_FILE if out is None else out, "-o",
                       [(run_dir / "summary.json", "the run's summary.json"), (run_dir / METRICS_FILE,
                                                                               f"the run's {METRICS_FILE}")])
    log = read_log(run_dir / METRICS_FILE)
    records = [r for r in log if "event" not in r]
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
    kind = image_format(out)
    moe = any("expert_load" in r for r in records)  # mixture of experts: a third row, its router
    fig, axes = plt.subplots(3 if moe else 2, 2, figsize=(12, 12 if moe else 8))
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
    if moe:
        _draw_router(axes[2], records)
    found = marks(log)
    _draw_saves(axes[1][1], found)
    footer = _draw_resumes(fig, [ax for row in axes for ax in row], found["resumes"])
    fig.suptitle(str(run_dir))
    fig.tight_layout(rect=(0, footer, 1, 1))
    try:
        with new_file(out, "-o") as tmp:
            fig.savefig(tmp, dpi=100, format=kind)
    finally:
        plt.close(fig)
    return out
