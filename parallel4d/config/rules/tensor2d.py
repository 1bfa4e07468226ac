"""2D tensor parallelism's rules: the tp = q² grid, and a GPT's shape on it (hidden and heads in q
blocks; a vocabulary that does not split is padded, :func:`padded_vocab`). ``tensor2d/checks.py`` raises
them as the layers are built; the config reports them for a job file."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from parallel4d.config.rules.common import FIELD_NAMES, closest, divisors, near_multiples, not_divisible, or_list

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config


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


def padded_vocab(vocab: int, q: int) -> int:
    """The rows a vocab-parallel table holds on a q×q grid: ``vocab`` rounded up to a multiple of q
    (Megatron's and torchtitan's padding, so a pretrained vocabulary runs at any q). The rows past
    ``vocab`` are no token's: zero, out of the softmax, out of every checkpoint and export."""
    return -(-vocab // q) * q


def tensor2d_problems(q: int, hidden: int, heads: int, vocab: int, names: Optional[dict] = None,
                      head_dim: Optional[int] = None) -> list[str]:
    """A GPT split over a q×q grid: ``hidden`` in q blocks (weights, activations ``h/q``), whole
    heads per grid column (of ``head_dim`` each when set, else ``hidden/heads``). ``vocab`` has no
    rule: the vocab-parallel embedding, head and loss pad it to :func:`padded_vocab`."""
    n = {**FIELD_NAMES, **(names or {})}
    by, alt = f"q={q} ({n['tp']}={q * q} is a {q}×{q} grid)", f" or a smaller {n['tp']}"
    out = [not_divisible(n["hidden"], hidden, q, by, alt=alt)]
    out += heads_problems(heads, heads * head_dim if head_dim else hidden, q, n["heads"], n["hidden"])
    return [p for p in out if p]


def grid_problems(cfg: Config) -> list[str]:
    """The job's model on its ``parallel.tp`` grid (:func:`tensor2d_problems`)."""
    m = cfg.model
    return tensor2d_problems(cfg.parallel.q, m.hidden, m.heads, m.vocab_size, head_dim=m.head_dim)
