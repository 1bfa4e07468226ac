"""Timeline PNG of a schedule: one row per rank, one box per action.

matplotlib is imported lazily (only when plotting), so the package works
without it. Box colour = micro-batch (B hatched //, W ..), text = chunk id.
A long timeline wraps onto several panels (about 40 actions of the busiest
rank each) so that every box keeps room for its label. The figure is drawn on
its own Agg canvas, not through pyplot, so plotting leaves the caller's backend
and pyplot's figures alone.
"""

from __future__ import annotations

import math
from typing import Callable

from parallel4d.pipeline.analysis import simulate
from parallel4d.pipeline.types import Action, Schedule

WIDTH_IN = 16.0  # inches at DPI: 1600 px, whatever the schedule's length
DPI = 100
ACTIONS_PER_PANEL = 40  # of the busiest rank: a forward box stays ≥ ~25 px wide
HATCH = {"B": "//", "W": ".."}


def plot(schedule: Schedule, path: str, *, forward_cost: float = 1.0, backward_cost: float = 2.0,
         p2p_cost: float = 0.0, weight_cost: float | None = None, timings: dict[int, list[tuple]] | None = None,
         title: str | None = None, image_format: str | None = None) -> str:
    """Write a timeline PNG of ``schedule`` to ``path`` and return ``path`` (``image_format``: matplotlib's
    name for it, where ``path``'s suffix does not say: a temporary name).

    Times come from :func:`~.analysis.simulate` with the given costs, or from
    ``timings`` (rank → ``[(action, start_s, end_s), ...]``, e.g. measured by the
    executor) when given. ``weight_cost``: a split schedule's W (default half the backward).
    """
    if timings is None:
        rows, makespan, bubble = _simulated(schedule, forward_cost, backward_cost, p2p_cost, weight_cost)
        unit = "time (forward of one chunk = 1)"
    else:
        rows, makespan, bubble = _measured(timings)
        unit = "seconds (measured)"
    busiest = max(len(acts) for acts in rows.values())
    panels = max(1, math.ceil(busiest / ACTIONS_PER_PANEL))
    span = makespan / panels
    fig = _figure(WIDTH_IN, panels * (0.45 * schedule.pp + 0.9) + 1.6)
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    for k, ax in enumerate(axes):
        _draw(ax, schedule, rows, (k * span, (k + 1) * span if k < panels - 1 else makespan * 1.01))
    axes[-1].set_xlabel(unit, fontsize=11)
    fig.suptitle(title or f"{schedule.name}: P={schedule.pp}, m={schedule.microbatches}, {schedule.num_chunks} "
                          f"chunks — makespan {makespan:.4g}, bubble {bubble:.1%}", fontsize=14)
    _legend(fig, schedule)
    fig.tight_layout(rect=(0, 0.06 if panels > 1 else 0.1, 1, 1))
    fig.savefig(path, dpi=DPI, format=image_format)
    return path


def _figure(width: float, height: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - matplotlib is an optional extra
        raise ImportError("plot() needs matplotlib: pip install 'parallel4d[viz]'") from e
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)  # attaches itself to fig; no pyplot, no global backend
    return fig


def _legend(fig, schedule: Schedule) -> None:
    """Below the panels: the micro-batch colours, then what hatching means and what the text is."""
    from matplotlib.patches import Patch

    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    handles = [Patch(facecolor=cmap(i % 20), edgecolor="black", label=f"mb {i}")
               for i in range(min(schedule.microbatches, 20))]
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    names = {"F": "F forward", "B": "B backward" + (" (input grad)" if schedule.split_backward else ""),
             "W": "W weight grad"}
    handles += [Patch(facecolor="white", edgecolor="black", hatch=HATCH.get(k), label=names[k]) for k in kinds]
    note = "colour = micro-batch, number in a box = chunk" if schedule.num_chunks > 1 else "colour = micro-batch"
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 12), fontsize=10, frameon=False,
               title=note, title_fontsize=10)


def plot_against_simulation(schedule: Schedule, path: str, timings: dict[int, list[tuple]], *, p2p_cost: float,
                            action_cost: Callable[[Action], float], title: str = "") -> str:
    """Two timelines on one time axis (seconds): ``timings`` as measured (rank → ``[(action,
    start_s, end_s)]``) above, :func:`~.analysis.simulate` with ``action_cost`` and ``p2p_cost``
    below. Writes ``path`` and returns it."""
    measured, m_span, m_bubble = _measured(timings)
    simulated, s_span, s_bubble = _simulated(schedule, 1.0, 2.0, p2p_cost, None, action_cost)
    span = max(m_span, s_span)
    fig = _figure(min(60.0, max(10.0, 4.0 * span + 2.0)), 1.2 * schedule.pp + 2.2)
    for k, (rows, makespan, bubble, what) in enumerate(((measured, m_span, m_bubble, "measured"),
                                                        (simulated, s_span, s_bubble, "simulated"))):
        ax = fig.add_subplot(2, 1, k + 1)
        _draw(ax, schedule, rows, (0.0, span * 1.01))
        ax.set_title(f"{what}: step {makespan:.3f} s, bubble {bubble:.1%}", fontsize=11)
    ax.set_xlabel("seconds")
    fig.suptitle(title or f"{schedule.name}: P={schedule.pp}, m={schedule.microbatches}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _simulated(schedule: Schedule, forward_cost: float, backward_cost: float, p2p_cost: float,
               weight_cost: float | None, action_cost: Callable[[Action], float] | None = None):
    sim = simulate(schedule, forward_cost, backward_cost, p2p_cost, weight_cost=weight_cost, action_cost=action_cost)
    rows = {r: [(a, sim.start[(r, i)], sim.end[(r, i)]) for i, a in enumerate(schedule.actions[r])]
            for r in range(schedule.pp)}
    return rows, sim.makespan, sim.bubble_ratio


def _measured(timings: dict[int, list[tuple]]):
    t0 = min(s for acts in timings.values() for (_, s, _) in acts)
    rows = {r: [(a, s - t0, e - t0) for (a, s, e) in acts] for r, acts in timings.items()}
    makespan = max(e for acts in rows.values() for (_, _, e) in acts)
    busy = sum(e - s for acts in rows.values() for (_, s, e) in acts)
    bubble = 1.0 - busy / (len(rows) * makespan) if makespan else 0.0
    return rows, makespan, bubble


def _draw(ax, schedule: Schedule, rows: dict[int, list[tuple]], window: tuple[float, float]) -> None:
    """The boxes of ``rows`` between the times ``window`` (a box crossing an edge is cut there; its
    chunk number is written in the panel that holds its middle)."""
    import matplotlib

    lo, hi = window
    cmap = matplotlib.colormaps["tab20"]
    for r, acts in rows.items():
        for (a, s, e) in acts:
            if e <= lo or s >= hi:
                continue
            ax.barh(r, e - s, left=s, height=0.8, color=cmap(a.microbatch % 20), edgecolor="black", linewidth=0.5,
                    hatch=HATCH.get(a.kind))
            middle = s + (e - s) / 2
            if schedule.num_chunks > 1 and lo <= middle < hi and (e - s) > 0.008 * (hi - lo):
                ax.text(middle, r, str(a.chunk), ha="center", va="center", fontsize=9,
                        bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "alpha": 0.7, "linewidth": 0})
    ax.set_yticks(range(schedule.pp))
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.pp)], fontsize=11)
    ax.tick_params(axis="x", labelsize=10)
    ax.set_xlim(lo, hi)
    ax.set_ylim(schedule.pp - 0.5, -0.5)  # rank 0 on top
