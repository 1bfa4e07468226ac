"""Ring sequence parallelism's rules: the layouts that cut the sequence over a ring of ``sp``
ranks, and a sequence length that splits into their pieces. ``sequence/layout.py`` raises them on
a tensor; the config reports them for a job file."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from parallel4d.config.rules.common import near_multiples, not_divisible

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config


LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    """``ValueError`` unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use one of {LAYOUTS} "
                         "('zigzag' balances causal work, 'contiguous' is simplest)")


def num_pieces(n: int, layout: str) -> int:
    """How many equal pieces the sequence is cut into for a ring of ``n``."""
    check_layout(layout)
    return n if layout == "contiguous" else 2 * n


def seq_len_problem(seq_len: int, n: int, layout: str, field: str = "seq_len") -> Optional[str]:
    """``seq_len`` in this layout's pieces on a ring of ``n``: None when it splits, else the message."""
    m = num_pieces(n, layout)
    if seq_len <= 0 or seq_len % m:
        return (f"{field}={seq_len} must be a positive multiple of {m} for layout={layout!r} on a ring of {n} "
                f"({'N' if layout == 'contiguous' else '2N'} pieces); nearest valid values: "
                f"{near_multiples(seq_len, m)}")
    return None


def ring_problems(cfg: Config) -> list[str]:
    """The job's ``model.seq_len`` over its ring of ``sp/ulysses`` ranks (``parallel.sp > 1``): that many
    pieces, or twice that for the zigzag layout, and a multiple of ``sp`` (each ring shard cut among its
    Ulysses group); ``sequence.ulysses`` dividing ``sp`` and the heads each grid column holds. At sp = 1 with
    ``sequence.kernel: blockwise``, the layout's pieces on a ring of one."""
    sp, u = cfg.parallel.sp, cfg.sequence.ulysses
    if sp % u:
        return [f"sequence.ulysses={u} does not divide parallel.sp={sp}; use one of "
                f"{[d for d in range(1, sp + 1) if sp % d == 0]} (1: the ring alone, sp: pure Ulysses)"]
    if sp <= 1:  # the ring's kernel on one rank still cuts the sequence into its layout's pieces
        problem = seq_len_problem(cfg.model.seq_len, 1, cfg.sequence.layout, "model.seq_len") \
            if cfg.sequence.kernel == "blockwise" else None
        return [f"{problem} (sequence.kernel=blockwise; or sequence.layout=contiguous)"] if problem else []
    ring = sp // u
    div = 2 * ring if cfg.sequence.layout == "zigzag" else ring
    if u > 1:
        why = (f"{div} and parallel.sp={sp} (the ring of sp/ulysses={ring} cuts it into {div} pieces, each ring "
               f"shard into ulysses={u} parts)")
    else:
        why = f"2·parallel.sp={div} (zigzag cuts the sequence into 2·sp pieces)" if div != sp else f"parallel.sp={sp}"
    out = [not_divisible("model.seq_len", cfg.model.seq_len, math.lcm(div, sp), why)]
    q = math.isqrt(cfg.parallel.tp)
    for field, heads in (("model.heads", cfg.model.heads), ("model.kv_heads", cfg.model.kv_heads or cfg.model.heads)):
        if u > 1 and (heads % q or (heads // q) % u):
            out.append(f"{field}={heads} does not split into sequence.ulysses={u} groups of whole heads"
                       + (f" on each of the q={q} grid columns" if q > 1 else "")
                       + f"; use a sequence.ulysses dividing {heads // q if heads % q == 0 else heads}, or fewer "
                       "Ulysses ranks (a larger ring)")
    return list(filter(None, out))
