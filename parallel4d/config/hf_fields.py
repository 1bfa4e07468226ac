"""A Hugging Face ``config.json`` → the ``model:`` fields of a job (standard library only).

Used by :mod:`.load` for ``model.pretrained`` (before any field is validated, so the rules see
the checkpoint's shape) and by ``models/hf.py``. The ``model_type`` picks the family
(:mod:`parallel4d.models.registry`: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` and the MoE ``qwen3_moe``,
``qwen2_moe`` and ``mixtral`` become ``arch: llama``; ``gpt2`` stays ``gpt2``), whose spec maps the rest;
anything else, or a feature the models lack (sliding windows, experts in a dense model type, per-layer or
other rotary types, other activations), is a ``ValueError`` saying which.
"""

from __future__ import annotations

import math

from parallel4d.models.registry import HF_MODEL_TYPES, spec_for_hf

#: fields a config.json fills that a job may set otherwise: training choices, not the architecture
TRAINING_CHOICES = ("dropout", "attention_dropout", "embedding_dropout")


def model_fields_from_hf(config: dict) -> dict:
    """The ``model:`` fields of a job for a ``transformers`` ``config.json`` dict.

    ``seq_len`` (a training choice) and ``init_std`` are left out; gpt2's position table is
    ``max_positions`` (``n_positions``), which ``seq_len`` must not exceed. ``ValueError`` for a
    ``model_type`` no family loads or a feature the dense model lacks (sliding-window
    attention, mixtures of experts, per-layer or unsupported rotary, other activations, biases
    Llama's attention/MLP may have).
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
        if isinstance(a, dict) and isinstance(b, dict):  # model.rope_scaling: its unset keys are None
            return a.keys() - {k for k, v in a.items() if v is None} == b.keys() - {k for k, v in b.items()
                                                                                    if v is None} \
                and all(same(a[k], v) for k, v in b.items() if v is not None)
        return math.isclose(a, b, rel_tol=1e-9) if isinstance(b, float) and isinstance(a, (int, float)) else a == b

    return [(k, values[k], v) for k, v in fields.items()
            if k in values and k not in TRAINING_CHOICES and not same(values[k], v)]
