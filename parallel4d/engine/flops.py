"""Model FLOPs per trained token, for ``summary.json``'s ``model_flops_per_second``."""

from __future__ import annotations

from parallel4d.config.schema import Config


def flops_per_token(cfg: Config) -> float:
    """≈ 6·N + 12·L·h·s training FLOPs per token (N: non-embedding parameters)."""
    m = cfg.model
    n = 12 * m.layers * m.hidden ** 2
    return 6 * n + 12 * m.layers * m.hidden * m.seq_len
