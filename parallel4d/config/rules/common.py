"""What every technique's rules say with: the nearest working values for a message ("use 68 or
72"), "X is not divisible by Y; use ...", "did you mean", and the fields' names as the job file
spells them. The bottom of the import graph: the standard library only (no torch, nothing from
parallel4d), so every rule module, ``config`` and every strategy can import it at module top.
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


#: The ``model:`` fields that give the dense model's tensors their shapes: what a checkpoint's weights fix
SHAPE_FIELDS = ("arch", "vocab_size", "hidden", "heads", "kv_heads", "head_dim", "layers", "intermediate_size",
                "tie_embeddings", "qkv_bias", "qk_norm", "num_experts", "moe_intermediate_size",
                "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers")


def fixed_fields(model) -> frozenset[str]:
    """The ``model:`` fields (``"model.hidden"``) a job cannot change: with ``model.pretrained``, every
    one of :data:`SHAPE_FIELDS` (its config.json sets them and its weights have those shapes), so that a
    rule suggests the layout instead; none otherwise. ``model``: the job's ``ModelConfig``."""
    return frozenset(f"model.{f}" for f in SHAPE_FIELDS) if model.pretrained is not None else frozenset()


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


#: bytes of one element of each dtype a config names (train.parameters, hetero.compute_dtype, ...)
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``: bytes in the largest binary unit below 1024 of it (TiB at most)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
