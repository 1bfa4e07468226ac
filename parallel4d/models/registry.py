"""The model families, torch-free: one :class:`~.spec.ModelSpec` per ``model.arch``, one line each.

Adding a family is its package ``models/<name>/`` (``spec.py`` torch-free, ``model.py`` the dense
reference, ``tp2d.py`` its 2D twin, ``family.py`` the torch side) and one line in :data:`SPECS`
(docs/contributing.md walks through it). :mod:`parallel4d.config` reads the names, fields, rules and
Hugging Face ``model_type`` values from here; :mod:`.build` reaches each family's torch modules through
its spec.
"""

from __future__ import annotations

from parallel4d.models.gpt2.spec import SPEC as GPT2
from parallel4d.models.llama.spec import SPEC as LLAMA
from parallel4d.models.spec import ModelSpec

SPECS: tuple[ModelSpec, ...] = (GPT2, LLAMA)  # the first is model.arch's default

NAMES: tuple[str, ...] = tuple(s.name for s in SPECS)
HF_MODEL_TYPES: tuple[str, ...] = tuple(t for s in SPECS for t in s.hf_model_types)


def spec(arch: str) -> ModelSpec:
    """The family named ``arch`` (``model.arch``); ``KeyError`` for another name (the schema's
    ``Literal`` of :data:`NAMES` refuses those first)."""
    return _BY_NAME[arch]


def spec_for_hf(model_type) -> ModelSpec | None:
    """The family a Hugging Face ``config.json`` of ``model_type`` loads as; None when none does."""
    return _BY_HF_TYPE.get(model_type)


_BY_NAME = {s.name: s for s in SPECS}
_BY_HF_TYPE = {t: s for s in SPECS for t in s.hf_model_types}
