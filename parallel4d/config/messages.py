"""pydantic's validation errors as one readable line per field, each with a fix."""

from __future__ import annotations

import re
from typing import Any, Optional

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from parallel4d.config.errors import _short
from parallel4d.config.reader import yaml11_hint
from parallel4d.config.schema import Config

from parallel4d.config.rules.common import did_you_mean


def _model_at(keys: tuple) -> Optional[type[BaseModel]]:
    """The section model at the path ``keys`` (``()`` = Config), or None past a plain field."""
    model: type[BaseModel] = Config
    for key in keys:
        ann = getattr(model.model_fields.get(str(key)), "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


#: other stacks' names for gradient accumulation (Hugging Face's Trainer and DeepSpeed, Lightning)
ACCUMULATION_NAMES = ("gradient_accumulation_steps", "accumulate_grad_batches")


def _accumulation(value: Any, data: dict) -> str:
    """The refusal of an accumulation field by another stack's name: parallel4d's is
    ``pipeline.microbatches``, which splits ``data.batch_size`` (one optimizer step's global batch)
    rather than multiplying it; with the job's batch, the batch that keeps today's micro-batches."""
    text = ("parallel4d's gradient accumulation is pipeline.microbatches: data.batch_size is the global batch of "
            "one optimizer step, split into that many micro-batches whose gradients add up before the step "
            "(at parallel.pp > 1 the pipeline runs them)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{text}; use pipeline.microbatches=N"
    section = lambda name: data.get(name) if isinstance(data.get(name), dict) else {}  # noqa: E731
    batch, micro = section("data").get("batch_size", _field_default(("data", "batch_size"))), \
        section("pipeline").get("microbatches", 1)
    keep = ""
    if isinstance(batch, int) and isinstance(micro, int) and micro >= 1 and batch % micro == 0:
        keep = f" (and data.batch_size={batch // micro * value} to keep micro-batches of {batch // micro} sequences)"
    return f"{text}; use pipeline.microbatches={value}{keep}"


def _suggest(loc: tuple) -> str:
    """'did you mean model?' for a misspelt key, from the fields valid at that place."""
    model = _model_at(loc[:-1])
    if model is None:
        return "remove it"
    valid = list(model.model_fields)
    return f"{did_you_mean(loc[-1], valid)}valid fields here: {', '.join(valid)}"


_WANT = {"int_type": "a whole number", "float_type": "a finite number", "finite_number": "a finite number",
         "bool_type": "true or false", "string_type": "a string (quote it if YAML reads it as a number)"}


def _shown(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, int) and abs(value).bit_length() > 100:  # repr() of 4300+ digits raises
        return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    return ("the string " if isinstance(value, str) else "") + _short(value)


def _field_default(loc: tuple) -> Any:
    """The default of the field at ``loc`` (an item of a list or tuple: the field's); PydanticUndefined
    past a plain field or without one."""
    loc = tuple(k for k in loc if not isinstance(k, int))
    model = _model_at(loc[:-1]) if loc else None
    field = model.model_fields.get(loc[-1]) if model else None
    return getattr(field, "default", PydanticUndefined)


def _example(loc: tuple, where: str, ok=lambda v: True) -> str:
    """', e.g. train.steps=10' from the field's default when ``ok(default)``, else ''."""
    default = _field_default(loc)
    if default is None or default is PydanticUndefined or isinstance(default, dict):
        return ""
    if isinstance(default, (tuple, list)):  # the whole list, under the field's own name
        return f", e.g. {where.split('[')[0]}=[{', '.join(map(str, default))}]"
    if not ok(default):
        return ""
    return f", e.g. {where}={default if isinstance(default, str) else _shown(default)}"


_BOUNDS = {"greater_than_equal": ("ge", "≥", lambda v, b: v >= b), "greater_than": ("gt", ">", lambda v, b: v > b),
           "less_than_equal": ("le", "≤", lambda v, b: v <= b), "less_than": ("lt", "<", lambda v, b: v < b)}


def _bound_fix(kind: str, bound: Any, loc: tuple, where: str) -> str:
    """'; use parallel.pp=1 or more' for an integer field, '; use a value > 0, e.g. optimizer.lr=0.001'."""
    key, sign, holds = _BOUNDS[kind]
    if isinstance(bound, int) and not isinstance(_field_default(loc), float):
        closest = bound + {"gt": 1, "lt": -1}.get(key, 0)
        return f"; use {where}={closest} or {'more' if key in ('ge', 'gt') else 'less'}"
    return f"; use a value {sign} {bound}{_example(loc, where, lambda v: holds(v, bound))}"


def _fix(e: dict, loc: tuple, where: str) -> str:
    """What to write instead, for pydantic's generic errors (our own value errors carry their fix)."""
    kind, ctx = e["type"], e.get("ctx") or {}
    yaml11 = yaml11_hint(e.get("input"), kind == "bool_type") if kind in _WANT else None
    if yaml11:
        return f" ({yaml11})"
    if kind in _WANT:
        return f"; write {_WANT[kind]}{_example(loc, where)}"
    if kind in _BOUNDS:
        return _bound_fix(kind, ctx.get(_BOUNDS[kind][0]), loc, where)
    if kind == "literal_error":
        return f"; {did_you_mean(str(e.get('input')), _literal_choices(ctx))}use one of those{_example(loc, where)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"; write {where} as a mapping of its fields (field: value on indented lines below it)"
    if kind in ("tuple_type", "list_type", "too_short", "too_long", "missing"):
        example = _example(loc, where)
        return f"; write the whole list{example}" if example else "; write it as a YAML list"
    return ""


def _literal_choices(ctx: dict) -> list[str]:
    """``"'gpt2' or 'llama'"`` → ``["gpt2", "llama"]``."""
    return re.findall(r"'([^']*)'", str(ctx.get("expected", "")))


def format_validation_error(err: ValidationError, prefix: tuple = (), data: Optional[dict] = None) -> str:
    """One ``  - `` line per error, naming the field as in the job file and the fix; ``prefix``:
    where the validated model sits in :class:`Config` (``("hetero",)`` for a section alone);
    ``data``: the whole job as given, for fixes that read other fields."""
    lines = []
    for e in err.errors():
        loc = (*prefix, *e["loc"])
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and loc[-1] in ACCUMULATION_NAMES:
            msg = f"unknown field '{where}': {_accumulation(e.get('input'), data or {})}"
        elif e["type"] == "extra_forbidden":
            msg = f"unknown field '{where}'; {_suggest(loc)}"
        elif e["type"] == "missing":
            msg = f"missing field '{where}'" if not isinstance(loc[-1], int) else f"{where} is missing"
        elif where and not msg.startswith(where.split(".")[0]):
            msg = f"{where}: {msg}"
        if e["type"] not in ("value_error", "extra_forbidden", "missing") and not isinstance(e.get("input"), dict):
            msg += f", got {_shown(e['input'])}"  # strict types: say what YAML made of the value
        lines.extend((msg + _fix(e, loc, where)).splitlines())
    return "\n".join(f"  - {line}" for line in lines)
