"""A job file, or a dict, or a Config, with dotted overrides → a validated Config (ConfigError on failure); a Config → its YAML."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from parallel4d.config.errors import ConfigError
from parallel4d.config.messages import format_validation_error
from parallel4d.config.reader import _parse_yaml, apply_overrides
from parallel4d.config.schema import Config, expand_home

from parallel4d.config.hf_fields import mismatches, model_fields_from_hf
from parallel4d.config.peft_adapter import disagreements, lora_fields, read_adapter_config


def make_config(data: dict | Config | None = None, overrides: list[str] | None = None) -> Config:
    """Validate a dict (or re-validate a Config) with overrides; ``ConfigError`` on failure."""
    if isinstance(data, Config):
        data = data.model_dump(mode="json")
    # a deep copy: overrides and model.pretrained's fields set nested keys, never in the caller's dict
    data = _adapter_fields(_pretrained_fields(apply_overrides(copy.deepcopy(data or {}), overrides)))
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError("invalid configuration:\n" + format_validation_error(err, data=data)) from None


def _pretrained_fields(data: dict) -> dict:
    """``model:`` completed from ``model.pretrained``'s config.json; a field the job also gives
    must agree with it (ConfigError naming both)."""
    model = data.get("model")
    where = model.get("pretrained") if isinstance(model, dict) else None
    if not isinstance(where, str) or not where:
        return data  # absent, or refused by the field's own validation
    path = Path(expand_home(where)) / "config.json"
    try:
        hf = json.loads(path.read_text())
        if not isinstance(hf, dict):
            raise ValueError(f"holds a JSON {type(hf).__name__}, not the mapping of a model's settings; point "
                             "model.pretrained at a Hugging Face model directory")
        fields = model_fields_from_hf(hf)
    except OSError as e:
        raise ConfigError(f"model.pretrained={where!r}: cannot read {path} ({e.strerror or e}); point it at a "
                          "Hugging Face model directory (config.json and *.safetensors)") from None
    except ValueError as e:  # a JSON error or a model the dense references cannot be
        raise ConfigError(f"model.pretrained={where!r}: {path}: {e}") from None
    disagree = [f"model.{k}={ours!r} but {path} makes it {theirs!r}" for k, ours, theirs in mismatches(fields, model)]
    if disagree:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {d}; remove the field or change it"
                                                                  for d in disagree))
    return {**data, "model": {**fields, **model}}


def _adapter_fields(data: dict) -> dict:
    """``model.lora`` completed from ``model.lora.adapter``'s ``adapter_config.json`` (peft's), as
    ``PeftModel.from_pretrained`` takes the adapter's shape; a shape field the job also gives must agree
    (ConfigError naming both), a dropout the job gives is kept."""
    model = data.get("model")
    lora = model.get("lora") if isinstance(model, dict) else None
    where = lora.get("adapter") if isinstance(lora, dict) else None
    if not isinstance(where, str) or not where:
        return data  # absent, or refused by the field's own validation
    try:
        fields = lora_fields(read_adapter_config(expand_home(where)), where)
    except ValueError as e:
        raise ConfigError(f"model.lora.adapter={where!r}: {e}") from None
    disagree = disagreements(fields, lora, where)
    if disagree:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {d}" for d in disagree))
    return {**data, "model": {**model, "lora": {**fields, **lora}}}


MAX_CONFIG_BYTES = 1 << 20  # a job file is a few hundred bytes; refuse reading a huge one into memory

_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _config_kind(path: Path) -> Optional[str]:
    """What ``path`` is when it is not a regular file (it is never opened: a FIFO would block)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            return "a broken symbolic link"
        raise ConfigError(f"config file {str(path)!r} not found; check the path (the shipped jobs are in configs/)") \
            from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise ConfigError(f"config file {str(path)!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _NOT_FILES if test(mode)), "not a regular file")


def _read_config_text(path: Path) -> str:
    """The text of a job file; ``ConfigError`` saying what ``path`` is when it is not small UTF-8 text."""
    name = repr(str(path))
    kind = _config_kind(path)
    if kind:
        raise ConfigError(f"config file {name} is {kind}, not a YAML file; pass a job file such as "
                          "configs/quickstart.yaml")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config file {name} cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {name} is larger than {MAX_CONFIG_BYTES} bytes; a job file is a small YAML "
                          "file (see configs/)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {name} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                          "a binary file or a legacy encoding such as Latin-1; save the YAML as UTF-8") from None
    if "\0" in text:
        raise ConfigError(f"config file {name} is a binary file (it holds NUL bytes), not UTF-8 YAML text; pass a "
                          "job file such as configs/quickstart.yaml")
    return text


def load_config(path: str | Path | Config | dict, overrides: list[str] | None = None) -> Config:
    """Load a YAML job file (or take a dict / Config) and apply dotted ``overrides``."""
    if isinstance(path, (Config, dict)):
        return make_config(path, overrides)
    path = Path(path)
    data = _parse_yaml(_read_config_text(path), str(path), "fix the file at that place")
    if data is None:  # an empty file: all defaults
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (parallel:, model:, ...); write the "
                          "job as sections, e.g. 'train: {steps: 10}' (see configs/)")
    try:
        return make_config(data, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(cfg.to_yaml())
