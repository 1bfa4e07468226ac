"""Pure rules shared by the config and the strategies, each in one place.

Nearest working values for a message, "X is not divisible by Y; use ...", "did you mean", the
tp = q² grid and a GPT's shape on it (heads, hidden, vocab), the batch split, the pipeline's
schedule names, chunk count and argument rules. Each rule returns its message (None or [] when
it holds); the config collects them, the strategies raise the first. The bottom of the import graph: the
standard library only (no torch, nothing from parallel4d), so ``config`` and every
strategy can import it at module top.
"""

from __future__ import annotations

import difflib
import math
from typing import Iterable, Optional

# --- nearest values, for "use X or Y" ------------------------------------------------


def or_list(values: Iterable[int]) -> str:
    """``[68, 72]`` → ``"68 or 72"``."""
    return " or ".join(str(v) for v in values)


def nearest_multiples(value: int, m: int) -> list[int]:
    """The positive multiples of ``m`` nearest ``value``: itself if it is one, else below and above."""
    value = max(value, 1)
    below = (value // m) * m
    if below == value:
        return [value]
    return [v for v in (below, below + m) if v > 0]


def near_multiples(value: int, m: int) -> str:
    """``"68 or 72"``: :func:`nearest_multiples` as message text."""
    return or_list(nearest_multiples(value, m))


_MAX_TRIALS = 10**6  # exact up to n = 10¹²; beyond, a message must not cost a √n loop


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (√n trial divisions); none for ``n < 1``. Above 10¹² only
    those found by 10⁶ trials and their cofactors (all true divisors, for suggestions)."""
    if n < 1:
        return []
    small = [d for d in range(1, min(math.isqrt(n), _MAX_TRIALS) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def closest(candidates: Iterable[int], value: int) -> list[int]:
    """The candidate nearest ``value`` from below and from above (one when equal or one-sided)."""
    candidates = list(candidates)
    below = [c for c in candidates if c <= value]
    above = [c for c in candidates if c >= value]
    return list(dict.fromkeys(([max(below)] if below else []) + ([min(above)] if above else [])))


def nearest_divisor(n: int, target: int, reach: int = 1024) -> Optional[int]:
    """The divisor of ``n`` nearest ``target`` (the smaller on a tie), looked for within ±``reach``
    only, so that an absurd ``n`` cannot turn validation into a loop of ``n`` steps."""
    if target >= n:
        return n
    for k in range(reach + 1):
        for d in (target - k, target + k):
            if d >= 1 and n % d == 0:
                return d
    return None


def not_divisible(field: str, value: int, divisor: int, by: str, options: Optional[list[int]] = None,
                  alt: str = "") -> Optional[str]:
    """The rule ``value % divisor == 0`` (and ``value ≥ 1``): None when it holds, else
    ``"model.hidden=70 is not divisible by q=4; use model.hidden=68 or 72"``. ``by`` names the
    divisor (``"q=4"``), ``options`` are the values to suggest (default: the nearest multiples),
    ``alt`` another fix (``" or a smaller parallel.tp"``)."""
    if value >= 1 and value % divisor == 0:
        return None
    options = nearest_multiples(value, divisor) if options is None else options
    return f"{field}={value} is not divisible by {by}; use {field}={or_list(options)}{alt}"


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """``"did you mean 'steps'? "`` for the choice closest to ``word``, or ``""`` when none is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f"did you mean '{prefix}{close[0]}'? " if close else ""


def positive_int(name: str, value: int) -> int:
    """``value`` as an int; ``ValueError`` unless it is a whole number ≥ 1."""
    if int(value) != value or value < 1:
        raise ValueError(f"{name}={value} must be an integer ≥ 1")
    return int(value)


# --- 2D tensor parallelism --------------------------------------------------------------

#: Field names as spelled in ``parallel4d.config``; messages about a GPT's shape use them.
FIELD_NAMES = {
    "tp": "parallel.tp",
    "dp": "parallel.dp",
    "hidden": "model.hidden",
    "heads": "model.heads",
    "vocab": "model.vocab_size",
    "batch": "data.batch_size",
    "microbatches": "pipeline.microbatches",
}


def grid_side(tp: int, field: str = "parallel.tp") -> int:
    """``q`` with ``tp = q²``; ``ValueError`` naming the nearest perfect squares otherwise."""
    if int(tp) != tp or tp < 1:
        raise ValueError(f"{field}={tp} must be an integer ≥ 1 (a perfect square q²)")
    q = math.isqrt(tp)
    if q * q != tp:
        raise ValueError(f"{field}={tp} is not a perfect square (2D tensor parallelism runs on a q×q "
                         f"SUMMA grid, tp = q²); use {field}={q * q} or {(q + 1) ** 2}")
    return q


def head_counts(hidden: int, q: int) -> list[int]:
    """Head counts that split over q grid columns and divide hidden."""
    return [a for a in divisors(hidden) if a % q == 0]


def heads_problems(heads: int, hidden: int, q: int = 1, heads_field: str = FIELD_NAMES["heads"],
                   hidden_field: str = FIELD_NAMES["hidden"]) -> list[str]:
    """Whole heads, and whole heads per grid column: ``hidden % heads == 0``, ``heads % q == 0``.
    Suggested head counts satisfy both, so a suggestion is usable as is."""
    whole, per_column = heads >= 1 and hidden % heads == 0, heads >= 1 and heads % q == 0
    good = [] if whole and per_column else head_counts(hidden, q)
    out = []
    if not whole:
        fixes = [f"{heads_field}={or_list(closest(good, heads))}"] if good else []
        fixes += [f"{hidden_field}={near_multiples(hidden, heads)}"] if heads >= 1 else []
        fix = f"use {', or '.join(fixes)}" if fixes else f"change {hidden_field}"
        out.append(f"{hidden_field}={hidden} is not divisible by {heads_field}={heads}; {fix}")
    if heads >= 1 and not per_column:
        out.append(not_divisible(heads_field, heads, q, f"q={q} (whole heads per grid column)",
                                 closest(good, heads) if good else None))
    return out


def tensor2d_problems(q: int, hidden: int, heads: int, vocab: int, names: Optional[dict] = None) -> list[str]:
    """A GPT split over a q×q grid: ``hidden`` and ``vocab`` in q blocks (weights, activations
    ``h/q``; vocab-parallel embedding, head and loss), whole heads per grid column."""
    n = {**FIELD_NAMES, **(names or {})}
    by, alt = f"q={q} ({n['tp']}={q * q} is a {q}×{q} grid)", f" or a smaller {n['tp']}"
    out = [not_divisible(n["hidden"], hidden, q, by, alt=alt)]
    out += heads_problems(heads, hidden, q, n["heads"], n["hidden"])
    out.append(not_divisible(n["vocab"], vocab, q, by, alt=alt))
    return [p for p in out if p]


# --- batch ------------------------------------------------------------------------------


def batch_problem(batch: int, microbatches: int, split: Iterable[tuple[str, int]] = (),
                  field: str = FIELD_NAMES["batch"], micro_field: str = FIELD_NAMES["microbatches"]) -> Optional[str]:
    """The global batch is cut into ``split``'s parts (named factors: ``("parallel.dp", 2), ("q", 2)``, or
    a bare number as ``("2", 2)``), each into ``microbatches``: ``batch % (∏split · microbatches) == 0``.
    None when it holds, else the message, with both fixes when changing the micro-batches suffices."""
    split = list(split)
    parts = math.prod(v for _, v in split)
    per = parts * microbatches
    if batch >= 1 and batch % per == 0:
        return None
    what = "·".join([n for n, _ in split] + [micro_field])
    if any(not n.isdigit() for n, _ in split):  # named factors: show their values too
        what += " = " + "·".join(str(v) for _, v in split + [("", microbatches)])
    fix = f"use {field}={near_multiples(batch, per)}"
    if batch >= parts and batch % parts == 0:
        fix += f" or {micro_field}={or_list(closest(divisors(batch // parts), microbatches))}"
    return f"{field}={batch} is not divisible by {what} = {per}; {fix}"


# --- pipeline ---------------------------------------------------------------------------

SCHEDULES = ("gpipe", "1f1b", "interleaved", "hanayo", "zb_h1", "zbv")
# Schedules whose backward is always split into B (input gradient) and W (weight gradient);
# hanayo splits it with pipeline.split_backward=true.
SPLIT_SCHEDULES = ("zb_h1", "zbv")


def splits_backward(schedule: str, split_backward: bool) -> bool:
    """Whether the config's schedule runs B and W apart."""
    return schedule in SPLIT_SCHEDULES or (schedule == "hanayo" and split_backward)
_ALIASES = {"one_f_one_b": "1f1b", "interleaved_1f1b": "interleaved", "wave": "hanayo", "dapple": "1f1b", "zbh1": "zb_h1", "zb_v": "zbv"}


def check_schedule_name(name: str) -> str:
    """The canonical schedule name; ``ValueError`` naming the valid ones otherwise."""
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key in SCHEDULES:
        return key
    hint = did_you_mean(str(name).lower(), SCHEDULES)
    raise ValueError(f"pipeline.schedule={name!r} is unknown; {hint}valid: {', '.join(SCHEDULES)}")


def num_chunks(schedule: str, pp: int, waves: int = 1, chunks_per_rank: int = 2) -> int:
    """How many model chunks ``schedule`` cuts the model into on ``pp`` ranks."""
    schedule = check_schedule_name(schedule)
    if schedule == "hanayo":
        return 2 * waves * pp
    if schedule == "interleaved":
        return chunks_per_rank * pp
    if schedule == "zbv":
        return 2 * pp
    return pp


def interleaved_microbatch_problem(pp: int, m: int, chunks_per_rank: int) -> Optional[str]:
    """Interleaved 1F1B takes ``m ≤ P`` or a multiple of ``P`` (see ``interleaved_1f1b``); None if fine."""
    if chunks_per_rank > 1 and m > pp and m % pp:
        return (f"pipeline.microbatches={m}: the interleaved schedule takes micro-batch counts ≤ parallel.pp={pp} "
                f"or multiples of it; use pipeline.microbatches={near_multiples(m, pp)}")
    return None


def pipeline_arg_problems(
    layers: int,
    pp: int,
    microbatches: int,
    schedule: str = "1f1b",
    waves: int = 1,
    chunks_per_rank: int = 2,
    batch: int | None = None,
    batch_divisor: int = 1,
    split_backward: bool = False,
) -> list[str]:
    """Every broken pipeline rule as one readable message (empty list = fine).

    ``layers``: transformer blocks (the model has ``layers + 2`` stages: embedding, blocks,
    head; every chunk needs at least one stage). ``batch``: global sequences per step, split
    over ``batch_divisor`` data replicas (dp·q) and then into ``microbatches`` micro-batches.
    """
    try:
        schedule = check_schedule_name(schedule)
    except ValueError as e:
        return [str(e)]
    out = _count_problems(layers, pp, microbatches, waves, chunks_per_rank)
    if out:
        return out
    out += _chunk_problems(layers, pp, schedule, waves, chunks_per_rank)
    if split_backward and schedule not in ("hanayo", *SPLIT_SCHEDULES):
        out.append(f"pipeline.split_backward=true splits the backward of pipeline.schedule=hanayo; {schedule} does "
                   f"not: use pipeline.schedule=hanayo, zb_h1 (1F1B's memory) or zbv (the V placement), or "
                   f"pipeline.split_backward=false")
    if schedule == "interleaved":
        out += filter(None, [interleaved_microbatch_problem(pp, microbatches, chunks_per_rank)])
    if batch is not None:
        out += filter(None, [batch_problem(batch, microbatches, [(str(batch_divisor), batch_divisor)]
                                           if batch_divisor > 1 else [])])
    return out


def _count_problems(layers: int, pp: int, microbatches: int, waves: int, chunks_per_rank: int) -> list[str]:
    out = []
    for field, value in (("parallel.pp", pp), ("pipeline.microbatches", microbatches), ("model.layers", layers)):
        if int(value) != value or value < 1:
            out.append(f"{field}={value} must be an integer ≥ 1; use {field}=1")
    if int(waves) != waves or waves < 1:
        out.append(f"pipeline.waves={waves} must be an integer ≥ 1 (Hanayo runs 2·waves chunks per rank); "
                   f"use pipeline.waves=1")
    if int(chunks_per_rank) != chunks_per_rank or chunks_per_rank < 1:
        out.append(f"pipeline.chunks_per_rank={chunks_per_rank} must be an integer ≥ 1; use 2")
    return out


def _chunk_problems(layers: int, pp: int, schedule: str, waves: int, chunks_per_rank: int) -> list[str]:
    """Every chunk needs one of the ``layers + 2`` stages."""
    chunks = num_chunks(schedule, pp, waves, chunks_per_rank)
    stages = layers + 2
    if pp == 1 or stages >= chunks:
        return []
    fix = f"use model.layers≥{chunks - 2}"
    if schedule in ("hanayo", "zbv"):
        w_max = stages // (2 * pp)
        # Fewer waves first; if even one wave is too many chunks, fewer ranks as well.
        if schedule == "zbv":
            fix += f" or parallel.pp≤{max(1, stages // 2)}"
        else:
            fix += (f" or pipeline.waves≤{w_max}" if w_max >= 1
                    else f" or pipeline.waves=1 with parallel.pp≤{max(1, stages // 2)}")
    elif schedule == "interleaved":
        v_max = stages // pp
        fix += f" or pipeline.chunks_per_rank≤{v_max}" if v_max >= 1 else ""
    else:
        fix += f" or parallel.pp≤{stages}"
    return [f"{schedule} with parallel.pp={pp} cuts the model into {chunks} chunks but it has only "
            f"model.layers+2 = {stages} stages (embedding, {layers} layers, head); {fix}"]

