"""Up-front shape checks for 2D tensor parallelism (pure Python, no torch, no side effects).

The rules and their messages live in :mod:`parallel4d.config.rules.tensor2d` (the config reports
them for a job file); these are their raising forms, which the layers call at construction,
before any collective. Every error is a ``ValueError`` that names the offending field and the nearest
valid values, e.g. ``model.hidden=70 is not divisible by q=4; use model.hidden=68 or 72``.
"""

from __future__ import annotations

from parallel4d.config.rules.common import FIELD_NAMES, not_divisible
from parallel4d.config.rules.data import batch_problem
from parallel4d.config.rules.tensor2d import grid_side, heads_problems, tensor2d_problems

__all__ = ["FIELD_NAMES", "check_divisible", "check_heads", "check_tensor2d"]


def _raise_first(problems) -> None:
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(problems[0])


def check_divisible(field: str, value: int, q: int, what: str = "q") -> None:
    """``ValueError`` unless ``value % q == 0``, naming ``field`` and the nearest multiples."""
    _raise_first([not_divisible(field, value, q, f"{what}={q}")])


def check_heads(heads: int, hidden: int, q: int, *, heads_field: str = FIELD_NAMES["heads"],
                hidden_field: str = FIELD_NAMES["hidden"]) -> None:
    """Heads are split over the q grid columns: ``heads % q == 0`` and ``hidden % heads == 0``."""
    _raise_first(heads_problems(heads, hidden, q, heads_field, hidden_field))


def check_tensor2d(tp: int, hidden: int, heads: int, vocab: int, batch: int | None = None, *,
                   dp: int = 1, microbatches: int = 1, names: dict[str, str] | None = None) -> int:
    """Check that a GPT of this shape can be split over a q×q grid; return ``q``.

    Requirements (q = √tp): ``hidden % q == 0`` (weight and activation blocks ``h/q``),
    ``heads % q == 0`` and ``hidden % heads == 0`` (whole heads per grid column), and
    ``batch % (dp·q·microbatches) == 0`` (each grid row takes batch block ``b/q`` of
    every micro-batch of every data-parallel replica). ``names`` overrides the field
    names used in messages (defaults in :data:`FIELD_NAMES`). Any ``vocab`` splits: the vocab-parallel
    layers pad it (:func:`~parallel4d.config.rules.tensor2d.padded_vocab`). Raises ``ValueError``.
    """
    n = {**FIELD_NAMES, **(names or {})}
    q = grid_side(tp, n["tp"])
    problems = tensor2d_problems(q, hidden, heads, vocab, n)
    if batch is not None:
        problems.append(batch_problem(batch, microbatches, [(n["dp"], dp), ("q", q)], n["batch"], n["microbatches"]))
    _raise_first(problems)
    return q
