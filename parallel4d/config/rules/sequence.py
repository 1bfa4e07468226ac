"""Ring sequence parallelism's rules: the layouts that cut the sequence over a ring of ``sp``
ranks, and a sequence length that splits into their pieces. ``sequence/layout.py`` raises them on
a tensor; the config reports them for a job file."""

from __future__ import annotations

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
    """The job's ``model.seq_len`` over its ring (``parallel.sp > 1``): ``sp`` pieces, or ``2·sp``
    for the zigzag layout."""
    sp = cfg.parallel.sp
    if sp <= 1:
        return []
    div = 2 * sp if cfg.sequence.layout == "zigzag" else sp
    why = f"2·parallel.sp={div} (zigzag cuts the sequence into 2·sp pieces)" if div != sp else f"parallel.sp={sp}"
    return list(filter(None, [not_divisible("model.seq_len", cfg.model.seq_len, div, why)]))
