"""Argument checks for a pipeline job, usable before any process group exists.

No torch.distributed, no side effects: ``parallel4d.config`` calls
:func:`check_pipeline_args` while validating a YAML file. Messages use the
config's field names and propose the nearest values that work.
"""

from __future__ import annotations

import difflib

from .schedule import SCHEDULES

_ALIASES = {"one_f_one_b": "1f1b", "interleaved_1f1b": "interleaved", "wave": "hanayo", "dapple": "1f1b"}


def check_schedule_name(name: str) -> str:
    """The canonical schedule name; ``ValueError`` naming the valid ones otherwise."""
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key in SCHEDULES:
        return key
    close = difflib.get_close_matches(str(name).lower(), SCHEDULES, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ValueError(f"pipeline.schedule={name!r} is unknown; {hint}valid: {', '.join(SCHEDULES)}")


def _near_multiples(value: int, divisor: int) -> str:
    lo = (value // divisor) * divisor
    hi = lo + divisor
    return f"{lo} or {hi}" if lo > 0 else f"{hi}"


def _divisors_near(n: int, target: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    lo = max([d for d in ds if d <= target], default=None)
    hi = min([d for d in ds if d >= target], default=None)
    got = sorted({d for d in (lo, hi) if d is not None})
    return " or ".join(str(d) for d in got)


def num_chunks(schedule: str, pp: int, waves: int = 1, chunks_per_rank: int = 2) -> int:
    """How many model chunks ``schedule`` cuts the model into on ``pp`` ranks."""
    schedule = check_schedule_name(schedule)
    if schedule == "hanayo":
        return 2 * waves * pp
    if schedule == "interleaved":
        return chunks_per_rank * pp
    return pp


def pipeline_arg_problems(
    layers: int,
    pp: int,
    microbatches: int,
    schedule: str = "1f1b",
    waves: int = 1,
    chunks_per_rank: int = 2,
    batch: int | None = None,
    batch_divisor: int = 1,
) -> list[str]:
    """Every broken rule as one readable message (empty list = fine).

    ``layers``: transformer blocks (the model has ``layers + 2`` stages:
    embedding, blocks, head; every chunk needs at least one stage).
    ``batch``: global sequences per step, split over ``batch_divisor`` data
    replicas (dp·q) and then into ``microbatches`` equal micro-batches.
    """
    out: list[str] = []
    try:
        schedule = check_schedule_name(schedule)
    except ValueError as e:
        return [str(e)]
    for field, value in (("parallel.pp", pp), ("pipeline.microbatches", microbatches), ("model.layers", layers)):
        if int(value) != value or value < 1:
            out.append(f"{field}={value} must be an integer ≥ 1; use {field}=1")
    if int(waves) != waves or waves < 1:
        out.append(f"pipeline.waves={waves} must be an integer ≥ 1 (Hanayo runs 2·waves chunks per rank); "
                   f"use pipeline.waves=1")
    if int(chunks_per_rank) != chunks_per_rank or chunks_per_rank < 1:
        out.append(f"pipeline.chunks_per_rank={chunks_per_rank} must be an integer ≥ 1; use 2")
    if out:
        return out
    chunks = num_chunks(schedule, pp, waves, chunks_per_rank)
    stages = layers + 2
    if pp > 1 and stages < chunks:
        fix = f"use model.layers≥{chunks - 2}"
        if schedule == "hanayo":
            w_max = stages // (2 * pp)
            # Fewer waves first; if even one wave is too many chunks, fewer ranks as well.
            fix += (f" or pipeline.waves≤{w_max}" if w_max >= 1
                    else f" or pipeline.waves=1 with parallel.pp≤{max(1, stages // 2)}")
        elif schedule == "interleaved":
            v_max = stages // pp
            fix += f" or pipeline.chunks_per_rank≤{v_max}" if v_max >= 1 else ""
        else:
            fix += f" or parallel.pp≤{stages}"
        out.append(f"{schedule} with parallel.pp={pp} cuts the model into {chunks} chunks but it has only "
                   f"model.layers+2 = {stages} stages (embedding, {layers} layers, head); {fix}")
    if schedule == "interleaved" and chunks_per_rank > 1 and microbatches > pp and microbatches % pp:
        from .schedule import interleaved_microbatch_message

        out.append(interleaved_microbatch_message(pp, microbatches))
    if batch is not None:
        per = batch_divisor * microbatches
        if batch < 1 or batch % per:
            what = "pipeline.microbatches" if batch_divisor == 1 else f"{batch_divisor}·pipeline.microbatches"
            fix = f"use data.batch_size={_near_multiples(max(batch, 1), per)}"
            if batch >= batch_divisor and batch % batch_divisor == 0:
                fix += f" or pipeline.microbatches={_divisors_near(batch // batch_divisor, microbatches)}"
            out.append(f"data.batch_size={batch} is not divisible by {what} = {per}; {fix}")
    return out


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
    """Raise ``ValueError`` listing every problem of :func:`pipeline_arg_problems`.

    Micro-batch rules: ≥ 1, dividing the batch (per data replica), and for
    ``interleaved`` ≤ pp or a multiple of pp. GPipe, 1F1B and Hanayo (greedy
    order) take any count.
    """
    problems = pipeline_arg_problems(layers, pp, microbatches, schedule, waves, chunks_per_rank, batch, batch_divisor)
    if problems:
        raise ValueError("\n".join(problems))
