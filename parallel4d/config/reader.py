"""The hardened YAML reader (YAML 1.2's core schema, no aliases or duplicate keys, integers of any
length, bounded depth and size), dotted overrides, and load_config / save_config."""

from __future__ import annotations

import re
from typing import Any

import yaml

from parallel4d.config.errors import ConfigError, _short


MAX_YAML_DEPTH = 32


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML that a job file may not use (an alias, a duplicated key)."""


class _YamlLoader(yaml.SafeLoader):
    """``yaml.safe_load`` hardened for job files and ``--set`` values.

    Aliases are refused: a 300-byte alias bomb expands to gigabytes once walked, and a config
    needs none. A duplicated key is an error (PyYAML silently keeps the last). Plain scalars are
    typed by YAML 1.2's core schema, not PyYAML's YAML 1.1 one (:data:`CORE_SCHEMA`): ``yes``,
    ``on``, ``1:30``, ``017``, ``1_000`` and ``2001-12-14`` stay strings, which the strict fields
    refuse with a hint (:func:`yaml11_hint`), instead of becoming true, 90, 15, 1000 and a date.
    """

    depth = 0
    yaml_implicit_resolvers: dict = {}  # replaced below by CORE_SCHEMA's, never PyYAML's YAML 1.1 set

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(problem=f"YAML aliases (*{event.anchor}) are not accepted in a config; "
                                   "write the value out in full", problem_mark=event.start_mark)
        if self.depth >= MAX_YAML_DEPTH:  # deeper input would end in a RecursionError here or when dumped
            raise _Refused(problem=f"more than {MAX_YAML_DEPTH} levels of nesting; a job file is a few levels "
                                   "of sections: write it so (see configs/)", problem_mark=event.start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise _Refused(problem=f"duplicate key {key!r}; keep only one of them",
                                   problem_mark=key_node.start_mark)
                seen.add(key)
            except TypeError:  # an unhashable key: SafeConstructor reports it
                pass
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        """A core-schema integer: decimal, ``0o`` octal or ``0x`` hexadecimal, of any length (the
        field's bound then refuses it by name; ``int()`` alone refuses 4300+ digits with a traceback)."""
        text = self.construct_scalar(node)
        digits = text.lstrip("+-")
        base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
        value = _parse_int(digits[2:] if base != 10 else digits, base)
        return -value if text.startswith("-") else value


def _parse_int(digits: str, base: int, piece: int = 1000) -> int:
    """``int(digits, base)`` a ``piece`` of digits at a time, so that no conversion meets Python's
    limit on the digits of one string."""
    value = 0
    for start in range(0, len(digits), piece):
        part = digits[start:start + piece]
        value = value * base ** len(part) + int(part, base)
    return value


#: YAML 1.2's core schema: (tag, pattern, first characters)
CORE_SCHEMA = (
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?(?:0|[1-9][0-9]*)|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    # a dot or an exponent, as 1.2 floats that are not also integers (017 stays a string, see _YAML11)
    ("float", r"[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*|[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+)|[-+]?\.(?:inf|Inf|INF)"
              r"|\.(?:nan|NaN|NAN)", "-+0123456789."),
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
)
for _tag, _pattern, _first in CORE_SCHEMA:
    _YamlLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_pattern})$"), list(_first))
_YamlLoader.add_constructor("tag:yaml.org,2002:int", _YamlLoader.construct_yaml_int)

_YAML11_BOOL = (re.compile(r"(?i)yes|no|on|off|y|n"), "YAML 1.1 read it as a boolean; write true or false")
_YAML11 = ((re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"),
            "YAML 1.1 read it as a base-60 number; write the number itself, e.g. 90 for 1:30"),
           (re.compile(r"[-+]?0[0-9_]+"), "YAML 1.1 read a leading 0 as octal; write the number without it"),
           (re.compile(r"[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?"),
            "write the number without underscores"),
           (re.compile(r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}.*"), "YAML 1.1 read it as a date; write a number"))


def yaml11_hint(value: Any, boolean: bool) -> str | None:
    """Why a string a job file gave for a ``boolean`` (else numeric) field would have been one under
    YAML 1.1 (which parallel4d does not follow), and what to write; None for any other value."""
    if not isinstance(value, str):
        return None
    hints = (_YAML11_BOOL,) if boolean else _YAML11
    return next((hint for pattern, hint in hints if pattern.fullmatch(value)), None)


def _parse_yaml(text: str, what: str, fix: str) -> Any:
    """``text`` parsed by :class:`_YamlLoader`; ``ConfigError`` naming ``what`` and the place otherwise."""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        context = f" ({e.context})" if getattr(e, "context", None) else ""
        if isinstance(e, _Refused):  # the problem says what to do
            raise ConfigError(f"{what}: {where}{problem}") from None
        raise ConfigError(f"{what} is not valid YAML: {where}{problem}{context}; {fix}") from None
    except RecursionError:
        raise ConfigError(f"{what} nests too deeply to be a config") from None


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {_short(dotted)}: {_short(k)} is not a section; write section.field=value")
        node = nxt
    node[keys[-1]] = value


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Apply ``["train.steps=50", "parallel.dp=2"]`` to a config dict (values parsed as YAML)."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {_short(item)} must look like section.field=value; write it so, e.g. "
                              "train.steps=50")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {_short(item)} has no field name; use section.field=value")
        fix = "write a YAML value such as 64, 0.001, true, [0.9, 0.95] or a quoted string"
        value = _parse_yaml(raw, f"override {_short(item)}: the value {_short(raw)}", fix) if raw.strip() else None
        _set_dotted(data, key, value)
    return data
