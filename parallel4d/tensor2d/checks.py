"""Up-front shape checks for 2D tensor parallelism (pure Python, no torch, no side effects).

The config module calls :func:`check_tensor2d` before any process group exists;
the layers call the small helpers at construction, before any collective. Every
error is a ``ValueError`` that names the offending field and the nearest valid
values, e.g. ``model.hidden=70 is not divisible by q=4; use model.hidden=68 or 72``.
"""

from __future__ import annotations

from ..rules import closest, divisors, grid_side, nearest_multiples, or_list

#: Default field names, as spelled in ``parallel4d.config``.
FIELD_NAMES = {
    "tp": "parallel.tp",
    "dp": "parallel.dp",
    "hidden": "model.hidden",
    "heads": "model.heads",
    "vocab": "model.vocab_size",
    "batch": "data.batch_size",
    "microbatches": "pipeline.microbatches",
}


def _use(field: str, options: list[int]) -> str:
    return f"use {field}={or_list(options)}"


def check_divisible(field: str, value: int, q: int, what: str = "q") -> None:
    """``ValueError`` unless ``value % q == 0``, naming ``field`` and the nearest multiples."""
    if value < 1 or value % q:
        raise ValueError(
            f"{field}={value} is not divisible by {what}={q}; {_use(field, nearest_multiples(value, q))}"
        )


def check_heads(heads: int, hidden: int, q: int, *, heads_field: str = FIELD_NAMES["heads"],
                hidden_field: str = FIELD_NAMES["hidden"]) -> None:
    """Heads are split over the q grid columns: ``heads % q == 0`` and ``hidden % heads == 0``."""
    if heads < 1 or hidden % heads:
        good = _head_counts(hidden, q)
        hint = _use(heads_field, closest(good, heads)) if good else f"change {hidden_field}"
        raise ValueError(f"{hidden_field}={hidden} is not divisible by {heads_field}={heads}; {hint}")
    if heads % q:
        # Prefer head counts that also divide hidden, so the suggestion is usable as is.
        good = _head_counts(hidden, q)
        options = closest(good, heads) if good else nearest_multiples(heads, q)
        raise ValueError(
            f"{heads_field}={heads} is not divisible by q={q} (whole heads per grid column); "
            f"{_use(heads_field, options)}"
        )


def _head_counts(hidden: int, q: int) -> list[int]:
    """Head counts that split over q columns and divide hidden."""
    return [a for a in divisors(hidden) if a % q == 0]


def check_tensor2d(tp: int, hidden: int, heads: int, vocab: int, batch: int | None = None, *,
                   dp: int = 1, microbatches: int = 1, names: dict[str, str] | None = None) -> int:
    """Check that a GPT of this shape can be split over a q×q grid; return ``q``.

    Requirements (q = √tp): ``hidden % q == 0`` (weight and activation blocks ``h/q``),
    ``heads % q == 0`` and ``hidden % heads == 0`` (whole heads per grid column),
    ``vocab % q == 0`` (vocab-parallel embedding / LM head / loss), and
    ``batch % (dp·q·microbatches) == 0`` (each grid row takes batch block ``b/q`` of
    every micro-batch of every data-parallel replica). ``names`` overrides the field
    names used in messages (defaults in :data:`FIELD_NAMES`). Raises ``ValueError``.
    """
    n = {**FIELD_NAMES, **(names or {})}
    q = grid_side(tp, n["tp"])
    check_divisible(n["hidden"], hidden, q)
    check_heads(heads, hidden, q, heads_field=n["heads"], hidden_field=n["hidden"])
    check_divisible(n["vocab"], vocab, q)
    if batch is not None:
        per_step = dp * q * microbatches
        if batch < 1 or batch % per_step:
            raise ValueError(
                f"{n['batch']}={batch} is not divisible by {n['dp']}·q·{n['microbatches']} = "
                f"{dp}·{q}·{microbatches} = {per_step}; "
                f"{_use(n['batch'], nearest_multiples(batch, per_step))}"
            )
    return q
