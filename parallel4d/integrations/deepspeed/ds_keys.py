"""Which keys of a ds_config DeepSpeed reads, found by asking DeepSpeed.

DeepSpeed ignores a key it does not read (``"gradient_cliping": 1.0`` trains unclipped, silently).
The section is given to DeepSpeed's own ``DeepSpeedConfig`` with every mapping in it replaced by
a dict that records each key looked up (``get``, ``[]``, ``in``, ``in .keys()``, ``**``). A
top-level key never looked up is one DeepSpeed would ignore. Inside a sub-section the same holds
where DeepSpeed looks keys up one at a time (``activation_checkpointing``, ``flops_profiler``,
``optimizer``, …); a sub-section it hands to one of its pydantic models (``zero_optimization``,
``bf16``, …) is checked by that model, whose errors are reported under the section's own names.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterator, Optional

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.utils.logging import log_levels
from pydantic import BaseModel, ValidationError

from parallel4d.config.rules.common import did_you_mean
from parallel4d.config.rules.deepspeed import DOCS, TAKEN, taken_key_problems

#: mappings DeepSpeed hands on as keyword arguments (an optimizer's or scheduler's constructor checks them)
PASSED_ON = {"deepspeed.optimizer.params", "deepspeed.scheduler.params"}
# the probe's batch sizes are one process's: the real ones are checked against parallel4d's fields by
# config/rules/deepspeed.py
_ONE_PROCESS = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


class _Recording(dict):
    """A dict that notes every key looked up, and the default DeepSpeed passed with it (the type it
    reads the key as); nested mappings are recording too."""

    def __init__(self, data: dict):
        super().__init__({k: _Recording(v) if isinstance(v, dict) else v for k, v in data.items()})
        self.read: set = set()
        self.defaults: dict = {}

    def get(self, key, default=None):
        self.read.add(key)
        if default is not None:
            self.defaults.setdefault(key, default)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        return _RecordingKeys(self)


class _RecordingKeys:
    """``.keys()`` of a :class:`_Recording`: ``key in d.keys()`` is a look-up too."""

    def __init__(self, owner: _Recording):
        self.owner = owner

    def __contains__(self, key):
        return key in self.owner

    def __iter__(self):
        return iter(dict.keys(self.owner))

    def __len__(self):
        return len(self.owner)


class _OneReplica:
    """An mpu of one data replica, so the probe's batch sizes fit with or without a process group."""

    def get_data_parallel_world_size(self) -> int:
        return 1


_REFUSALS = (ValueError, AssertionError, TypeError, KeyError, AttributeError, DeepSpeedConfigError)


def _recording(section: dict) -> _Recording:
    return _Recording({**copy.deepcopy(section), **_ONE_PROCESS})


def _probe(section: dict) -> _Recording:
    """``section`` read by DeepSpeed's config parser; raises what the parser raises."""
    recording = _recording(section)
    DeepSpeedConfig(recording, mpu=_OneReplica())
    return recording


def key_problems(section: dict) -> list[str]:
    """Keys DeepSpeed would ignore or refuses, values of another type than it reads, and keys
    parallel4d decides; one message each."""
    recording = _recording(section)
    try:
        DeepSpeedConfig(recording, mpu=_OneReplica())
    except ValidationError as err:
        return located(err, section)
    except _REFUSALS as err:  # DeepSpeedConfigError: a removed feature (amp, elasticity, ...); a value's type
        return _typed(recording, section) or _not_mappings(section) or \
            [f"deepspeed: DeepSpeed refuses the section: {err}; {DOCS}"]
    ignored = [f"deepspeed.{'.'.join(path)}: DeepSpeed {deepspeed.__version__} does not read this key and would "
               f"ignore it; {did_you_mean(path[-1], sorted(read), prefix)}{DOCS}"
               for path, read, prefix in _unread(recording, section) if path[-1] not in TAKEN]
    return taken_key_problems(section) + ignored + _typed(recording, section) + _log_level(section)


#: the Python types DeepSpeed's defaults have, and what to write for each (bool before int: True is an int)
_KINDS = ((bool, "true or false"), (int, "a whole number"), (float, "a number"), (str, "a string"))


def _typed(recording: _Recording, section: dict, path: tuple = ()) -> list[str]:
    """Values of another type than the default DeepSpeed reads their key with, in every mapping it reads
    key by key: it takes them as given, then fails in a worker (``steps`` arithmetic on a string) or
    reads them wrongly (the string "no" is true)."""
    out = []
    for key, default in recording.defaults.items():
        kind = next((what for t, what in _KINDS if isinstance(default, t)), None)
        if kind is None or key not in section or (not path and key in _ONE_PROCESS) or _fits(section[key], default):
            continue
        out.append(f"deepspeed.{'.'.join((*path, key))}={section[key]!r}: DeepSpeed reads {kind} here (its default "
                   f"is {default!r}); write {kind} or leave the key out ({DOCS})")
    for key, value in dict.items(recording):
        if isinstance(value, _Recording) and isinstance(section.get(key), dict):
            out += _typed(value, section[key], (*path, key))
    return out


def _fits(value: Any, default: Any) -> bool:
    """Whether ``value`` is of the type of DeepSpeed's ``default`` (a whole number for a float too)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def _log_level(section: dict) -> list[str]:
    """``log_level``, read with no default to type it: DeepSpeed's engine sets its logger from it, by
    the names its logging module knows (a ValueError in every worker otherwise)."""
    level = section.get("log_level")
    if level is None or (isinstance(level, str) and level.lower() in log_levels):
        return []
    return [f"deepspeed.log_level={level!r} is not a level DeepSpeed knows; use one of {', '.join(log_levels)} ({DOCS})"]


def _unread(recording: _Recording, section: dict, path: tuple = ()) -> Iterator[tuple[tuple, set, str]]:
    """``(key path, keys read beside it, prefix)`` for each key never looked up: at the top, and in
    the sub-sections DeepSpeed reads key by key — not in those it hands to a model of its own
    (which refuses unknown keys itself) or passes on as keyword arguments."""
    where = ".".join(("deepspeed", *path))
    if where in PASSED_ON or (path and _checked_by_a_model(section, path)):
        return
    for key in dict.keys(recording):
        if key not in recording.read:
            yield (*path, key), recording.read - set(TAKEN), f"{where}."
    for key, value in dict.items(recording):
        if isinstance(value, _Recording) and key in recording.read:
            yield from _unread(value, section, (*path, key))


def _checked_by_a_model(section: dict, path: tuple) -> bool:
    """Whether DeepSpeed refuses an unknown key put into the mapping at ``path``."""
    probe = copy.deepcopy(section)
    node = probe
    for key in path:
        node = node[key]
    node["parallel4d_probe_key"] = 0
    try:
        _probe(probe)
    except ValidationError:
        return True
    except _REFUSALS:
        return False
    return False


def _not_mappings(section: dict) -> list[str]:
    """The sub-sections that make the parser fail only because they are not mappings (``optimizer: adam``)."""
    out = []
    for key, value in section.items():
        if isinstance(value, dict):
            continue
        try:
            _probe({**section, key: {}})
        except _REFUSALS + (ValidationError,):
            continue
        out.append(f"deepspeed.{key}={value!r}: DeepSpeed reads this as a section of settings; write "
                   f"{key}: {{...}} ({DOCS})")
    return out


def located(err: ValidationError, section: dict) -> list[str]:
    """A DeepSpeed model's errors named as in the job file (``deepspeed.<section>.<key>``), with
    the nearest field the model has for an unknown key."""
    model = _model_named(err.title)  # the error names the model, not the sub-section it validated
    out = []
    for e in err.errors():
        loc = tuple(str(x) for x in e["loc"])
        where = ".".join(("deepspeed", *_section_holding(section, loc), *loc))
        if e["type"] == "extra_forbidden":
            fields = _fields_at(model, loc[:-1]) if model else []
            out.append(f"{where}: DeepSpeed has no such key; {did_you_mean(loc[-1], fields)}remove it or fix its "
                       f"spelling ({DOCS})")
        else:
            out.append(f"{where}: {_listed_once(e['msg'].removeprefix('Value error, '))}, got {e.get('input')!r}; "
                       f"{_fix(e)}{DOCS}")
    return out


def _listed_once(msg: str) -> str:
    """pydantic lists an enum's aliases too ("0, 1, 2, 3 or 3" for ZeRO's max_stage = 3): each value once."""
    m = re.fullmatch(r"(Input should be )(.*)", msg)
    if not m or " or " not in m.group(2):
        return msg
    values = list(dict.fromkeys(re.split(r", | or ", m.group(2))))
    return m.group(1) + (", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0])


def _fix(e: dict) -> str:
    """What to write, for DeepSpeed's generic refusals."""
    if e["type"] in ("enum", "literal_error"):
        return "use one of those; "
    if e["type"] in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        return "use a value within that bound; "
    if e["type"].endswith("_type") or e["type"].endswith("_parsing"):
        return "write a value of that type; "
    return ""


def _section_holding(section: dict, loc: tuple) -> tuple:
    """The top-level key whose mapping holds the path ``loc[:-1]`` and the key ``loc[-1]``."""
    for key, value in section.items():
        node: Any = value
        for part in loc[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and loc and loc[-1] in node:
            return (key,)
    return ()


def _model_named(name: str) -> Optional[type[BaseModel]]:
    todo = list(DeepSpeedConfigModel.__subclasses__())
    while todo:
        model = todo.pop()
        if model.__name__ == name:
            return model
        todo += model.__subclasses__()
    return None


def _fields_at(model: type[BaseModel], path: tuple) -> list[str]:
    """Field names (and aliases) of the model reached from ``model`` along ``path``."""
    for part in path:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        nested = getattr(field, "annotation", None)
        nested = next((a for a in getattr(nested, "__args__", (nested,)) if isinstance(a, type)
                       and issubclass(a, BaseModel)), None)
        if nested is None:
            return []
        model = nested
    return [f.alias or n for n, f in model.model_fields.items()]
