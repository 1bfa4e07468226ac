"""A Hugging Face ``config.json`` → the ``model:`` fields of a job (standard library only).

Used by :mod:`.load` for ``model.pretrained`` (before any field is validated, so the rules see
the checkpoint's shape) and by ``models/hf.py``. The ``model_type`` picks the family
(:mod:`parallel4d.models.registry`: ``llama``, ``mistral`` and ``qwen2`` become ``arch: llama``;
``gpt2`` stays ``gpt2``), whose spec maps the rest; anything else, or a feature the dense models
lack (sliding windows, rope scaling, other activations), is a ``ValueError`` saying which.
"""

from __future__ import annotations

import math

from parallel4d.models.registry import HF_MODEL_TYPES, spec, spec_for_hf

#: fields a config.json fills that a job may set otherwise: training choices, not the architecture
TRAINING_CHOICES = ("dropout", "attention_dropout", "embedding_dropout")


def model_fields_from_hf(config: dict) -> dict:
    """The ``model:`` fields of a job for a ``transformers`` ``config.json`` dict.

    ``seq_len`` (a training choice) and ``init_std`` are left out; :func:`hf_max_positions` gives
    the checkpoint's positions (a hard limit for gpt2's learned table). ``ValueError`` for a
    ``model_type`` no family loads or a feature the dense model lacks (sliding-window
    attention, rope scaling, other activations, biases Llama's attention/MLP may have).
    """
    mt = config.get("model_type")
    family = spec_for_hf(mt)
    if family is None:
        raise ValueError(f"Hugging Face model_type {mt!r} is not supported; supported: {', '.join(HF_MODEL_TYPES)}")
    return family.fields_from_hf(config)


def hf_max_positions(config: dict) -> int | None:
    """The family's positions key: ``n_positions`` (gpt2: the rows of its position table, so
    ``seq_len`` must not exceed it) or ``max_position_embeddings`` (llama family: the length it was
    trained for, rotary has no table; also for a ``model_type`` no family loads)."""
    family = spec_for_hf(config.get("model_type"))
    return config.get(family.hf_positions if family else "max_position_embeddings")


def mismatches(fields: dict, values: dict) -> list[tuple[str, object, object]]:
    """``(field, value, the checkpoint's)`` for each of :func:`model_fields_from_hf`'s ``fields``
    that ``values`` holds with another value (floats to 1e-9 relative); :data:`TRAINING_CHOICES` (the
    dropouts a fine-tune picks) never disagree."""
    def same(a, b):
        return math.isclose(a, b, rel_tol=1e-9) if isinstance(b, float) and isinstance(a, (int, float)) else a == b

    return [(k, values[k], v) for k, v in fields.items()
            if k in values and k not in TRAINING_CHOICES and not same(values[k], v)]


def positions_short(config: dict, arch: str, seq_len: int) -> int | None:
    """A learned position table's rows (gpt2) when ``seq_len`` needs more of them; None when they
    suffice or the family has no table."""
    limit = hf_max_positions(config)
    return limit if spec(arch).learned_positions and limit and seq_len > limit else None
