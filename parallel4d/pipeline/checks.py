"""Argument checks for a pipeline job, usable before any process group exists.

The rules themselves live in :mod:`parallel4d.config.rules.pipeline` (the config validates a
YAML file with them); this is the raising form for callers of the pipeline API.
"""

from __future__ import annotations

from parallel4d.config.rules.pipeline import pipeline_arg_problems


def check_pipeline_args(
    layers: int,
    pp: int,
    microbatches: int,
    schedule: str = "1f1b",
    waves: int = 1,
    chunks_per_rank: int = 2,
    batch: int | None = None,
    batch_divisor: int = 1,
) -> None:
    """Raise ``ValueError`` listing every problem of :func:`~parallel4d.config.rules.pipeline.pipeline_arg_problems`.

    Micro-batch rules: ≥ 1, dividing the batch (per data replica), and for
    ``interleaved`` ≤ pp or a multiple of pp. GPipe, 1F1B and Hanayo (greedy
    order) take any count.
    """
    problems = pipeline_arg_problems(layers, pp, microbatches, schedule, waves, chunks_per_rank, batch, batch_divisor)
    if problems:
        raise ValueError("\n".join(problems))
