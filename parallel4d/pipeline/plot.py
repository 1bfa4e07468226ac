"""Timeline PNG of a schedule: one row per rank, one box per action.

matplotlib is imported lazily (only when plotting), so the package works
without it. Box colour = micro-batch (B hatched //, W ..), text = chunk id.
The figure is drawn on its own Agg canvas, not through pyplot, so plotting
leaves the caller's backend and pyplot's figures alone.
"""

from __future__ import annotations

from typing import Callable

from parallel4d.pipeline.analysis import simulate
from parallel4d.pipeline.types import Action, Schedule


def plot(schedule: Schedule, path: str, *, forward_cost: float = 1.0, backward_cost: float = 2.0,
         p2p_cost: float = 0.0, weight_cost: float | None = None, timings: dict[int, list[tuple]] | None = None,
         title: str | None = None) -> str:
    """Write a timeline PNG of ``schedule`` to ``path`` and return ``path``.

    Times come from :func:`~.analysis.simulate` with the given costs, or from
    ``timings`` (rank → ``[(action, start_s, end_s), ...]``, e.g. measured by the
    executor) when given. ``weight_cost``: a split schedule's W (default half the backward).
    """
    if timings is None:
        rows, makespan, bubble = _simulated(schedule, forward_cost, backward_cost, p2p_cost, weight_cost)
        unit, width = "time (forward of one chunk = 1)", min(60.0, max(8.0, 0.25 * makespan + 2.0))
    else:
        rows, makespan, bubble = _measured(timings)
        unit, width = "seconds (measured)", 14.0
    fig = _figure(width, 0.6 * schedule.pp + 1.4)
    ax = fig.add_subplot()
    _draw(ax, schedule, rows, makespan)
    ax.set_xlabel(unit)
    ax.set_title(title or f"{schedule.name}: P={schedule.pp}, m={schedule.microbatches}, "
                          f"{schedule.num_chunks} chunks — makespan {makespan:.4g}, bubble {bubble:.1%} "
                          f"(colour = micro-batch, hatched = B //, W .., text = chunk)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
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
        _draw(ax, schedule, rows, span)
        ax.set_title(f"{what}: step {makespan:.3f} s, bubble {bubble:.1%}", fontsize=9)
    ax.set_xlabel("seconds")
    fig.suptitle(title or f"{schedule.name}: P={schedule.pp}, m={schedule.microbatches}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
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


def _draw(ax, schedule: Schedule, rows: dict[int, list[tuple]], makespan: float) -> None:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    for r, acts in rows.items():
        for (a, s, e) in acts:
            ax.barh(r, e - s, left=s, height=0.8, color=cmap(a.microbatch % 20), edgecolor="black", linewidth=0.4,
                    hatch={"B": "//", "W": ".."}.get(a.kind))
            if schedule.num_chunks > 1 and (e - s) > 0.005 * makespan:
                ax.text(s + (e - s) / 2, r, str(a.chunk), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(schedule.pp))
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.pp)])
    ax.set_xlim(0, makespan * 1.01)
    ax.invert_yaxis()
