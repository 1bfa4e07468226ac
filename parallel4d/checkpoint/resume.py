"""Which checkpoint a run starts from: the newest one that verifies (broken ones set aside with a warning),
and the refusals made before any worker starts — a fresh run over checkpoints, a resume into a model of
another shape."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from parallel4d.checkpoint.checksums import CHECKSUMS, verify
from parallel4d.checkpoint.failures import CheckpointError, UnusableCheckpoint, on_writer
from parallel4d.checkpoint.lora_base import check_base
from parallel4d.checkpoint.steps import (WHY_BROKEN, broken_dirs, latest_name, recover, step_dirs,
                                         step_of)
from parallel4d.config.errors import ConfigError
from parallel4d.config.schema import Config, ModelConfig, model_shape_changes


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names if it has its data, else the newest one that has; None if none.

    Cheap (no checksums): use :func:`choose_checkpoint` to pick one to resume from.
    """
    root = Path(root)
    named = latest_name(root)
    if named and _has_data(root / named):
        return root / named
    return next((p for p in step_dirs(root) if _has_data(p)), None)


def _has_data(path: Path) -> bool:
    return (path / ".metadata").is_file() or (path / CHECKSUMS).is_file()


def _candidates(root: Path) -> list[Path]:
    """``latest``'s checkpoint first, then the older ones, newest first (all of them without ``latest``)."""
    named = latest_name(root)
    # `latest` may name a step an earlier resume set aside: it is not a candidate any more
    first = root / named if named and step_of(Path(named)) is not None and (root / named).is_dir() else None
    rest = step_dirs(root)
    if first is None:
        return rest
    return [first] + [p for p in rest if step_of(p) < step_of(first)]


def _why_broken(aside: Path) -> str:
    try:
        return (aside / WHY_BROKEN).read_text().strip() or "set aside as broken"
    except OSError:
        return "set aside as broken by an earlier resume"


def _warn(msg: str) -> None:
    print(f"[parallel4d] warning: {msg}", file=sys.stderr, flush=True)


def _set_aside(path: Path, problem: str) -> Path:
    """Rename a broken checkpoint out of the step names (kept for inspection, never loaded, never
    counted by retention, never in the way of the step when it is saved again), with ``problem``
    written in it so that every later resume reports the same."""
    aside = path.with_name(f"{path.name}.broken")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.broken{n}")
    os.replace(path, aside)
    try:
        (aside / WHY_BROKEN).write_text(problem + "\n")
    except OSError:  # a read-only checkpoint: the name alone says it is broken
        pass
    return aside


def _choose(root: Path) -> Path | None:
    if root.is_dir():
        recover(root)
    for path in _candidates(root):
        problem = verify(path)
        if problem is None:
            if not (path / CHECKSUMS).is_file():
                _warn(f"checkpoint {path} has no {CHECKSUMS} (saved before checksums): loading it unverified")
            return path
        aside = _set_aside(path, problem)
        _warn(f"checkpoint {path} is not usable: {problem}; kept as {aside.name} and trying the previous one")
    broken = broken_dirs(root)  # set aside now or by an earlier resume: the same report every time
    if broken:
        raise UnusableCheckpoint(f"no usable checkpoint under {root}: "
                              + "; ".join(f"{p}: {_why_broken(p)}" for p in broken)
                              + ". Restore one, or start afresh with train.resume=false in another directory")
    return None


def choose_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint to resume from: ``latest``'s if it verifies, else the newest older one that does.

    Warns on stderr for each broken checkpoint skipped; None if ``root`` holds no
    checkpoint; :class:`UnusableCheckpoint` naming each one if none is usable. With a
    process group every rank must call it: rank 0 chooses and broadcasts its choice.
    """
    return on_writer(lambda: _choose(Path(root)), f"checkpoint choice under {root}")


def holds_checkpoints(root: str | Path) -> bool:
    """Whether ``root`` holds a checkpoint, usable or set aside as broken (names only: cheap)."""
    return bool(step_dirs(Path(root)) or broken_dirs(Path(root)))


def check_start(root: str | Path, resume: bool) -> None:
    """Refuse a fresh run (``resume`` false) in a checkpoint directory that already holds checkpoints.

    Needs no process group and reads only directory names. ``ConfigError`` says
    what to change.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"the checkpoint directory {root} is a file; set checkpoint.dir (or train.out_dir) "
                          "to a directory")
    if resume:
        return
    steps = step_dirs(root)
    found = [p.name for p in steps + broken_dirs(root)]
    if found and not steps:
        raise ConfigError(
            f"train.resume=false but the checkpoint directory {root} holds an earlier run's checkpoints, all set "
            f"aside as broken ({', '.join(found[:3])}); give this run another checkpoint.dir or train.out_dir, or "
            f"delete {root} if they are no longer needed")
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(
            f"train.resume=false but the checkpoint directory {root} already holds checkpoints ({shown}) "
            "from an earlier run. Set train.resume=true to continue that run, give this run another "
            f"checkpoint.dir or train.out_dir, or delete {root} if it is no longer needed")


def saved_config(ckpt: str | Path) -> dict:
    """The job config saved with checkpoint ``ckpt`` (``config.yaml``), without ``model.pretrained`` nor
    ``model.lora.adapter`` (their fields are all in the saved model section; a LoRA job's base is in its
    ``lora_base.json``); :class:`UnusableCheckpoint` when it has none, or
    one that is not a config's mapping."""
    saved = Path(ckpt) / "config.yaml"
    if not saved.is_file():
        raise UnusableCheckpoint(f"{ckpt} has no config.yaml (saved by parallel4d before exports existed), so the "
                                 "model's architecture is unknown; resume the run for a step to save a checkpoint "
                                 "that has one")
    try:
        data = yaml.safe_load(saved.read_text())
    except yaml.YAMLError:
        data = None  # not YAML: refused below, as no config
    if not isinstance(data, dict) or not isinstance(data.get("model", {}), dict):
        raise UnusableCheckpoint(f"{saved} holds no job config (a mapping of sections), so the model's architecture "
                                 "is unknown; use another checkpoint, or write the job's config.yaml there")
    data.get("model", {}).pop("pretrained", None)
    lora = data.get("model", {}).get("lora")
    if isinstance(lora, dict):  # its fields are in the saved section; its weights are in the checkpoint
        lora.pop("adapter", None)
    return data


def check_resume_model(root: str | Path, model: ModelConfig) -> None:
    """Refuse resuming, into ``model``, the newest checkpoint under ``root`` when it holds a model of
    another shape (read from its config.yaml, before any worker starts); ``ConfigError`` naming the
    fields. A checkpoint without a readable config.yaml is left to the workers' own shape check."""
    found = latest_checkpoint(root)
    try:
        saved = saved_config(found).get("model") if found is not None else None
    except (CheckpointError, OSError):
        return
    changes = model_shape_changes(saved, model) if isinstance(saved, dict) else []
    if changes:
        raise ConfigError(f"train.resume=true but checkpoint {found} holds another model: {'; '.join(changes)}; "
                          "resume with the model.* settings it was saved with, or start afresh in another "
                          "train.out_dir")


def check_resume_base(root: str | Path, cfg: Config) -> None:
    """Refuse resuming a LoRA job's newest checkpoint under ``root`` on another base than the one its adapters
    were trained on (:mod:`.lora_base`), before any worker starts; ``ConfigError`` naming both."""
    found = latest_checkpoint(root)
    if found is None or cfg.model.lora is None:
        return
    try:
        check_base(found, cfg.model, cfg.train.seed)
    except UnusableCheckpoint as e:
        raise ConfigError(f"train.resume=true but {e}") from None


# What a resume may change without a word: where files go, how often the run logs or evaluates, its
# limits, threads and kernels; not what it trains (a prefix ending in "." covers a section).
_UNREPORTED = ("train.resume", "train.out_dir", "train.log_every", "train.eval_every", "train.eval_batches",
               "train.tensorboard", "train.timeout_s", "train.join_timeout_s", "train.job_timeout_s",
               "train.threads_per_worker", "train.max_local_workers", "train.dp_bucket_mb", "train.fused",
               "train.compile", "train.device", "train.activation_checkpointing", "checkpoint.",
               "model.pretrained")
# How the job is laid out over its ranks, which a checkpoint loads under whatever it is: said as a
# change of layout (pipeline.microbatches is the batch's split: a change of what a step trains).
_LAYOUT = ("parallel.", "pipeline.", "sequence.", "tensor2d.", "hetero.")


def resume_changes(saved: dict, cfg: Config) -> list[dict]:
    """What ``cfg`` changes from ``saved`` (the config a checkpoint was saved with, :func:`saved_config`):
    ``{"field", "was", "now"}`` per field, ``"layout": True`` for a change of layout, in the config's
    order. Left out: the fields a run may change silently (output, logging, limits, kernels), those the
    saved config lacks (written before they existed), and ``train.steps`` unless the learning rate decays
    over it (``optimizer.decay_steps`` unset). The model's shape is refused before (:func:`check_resume_model`)."""
    was, now = _leaves(saved), _leaves(cfg.model_dump(mode="json"))
    if isinstance(now.get("model.lora"), dict):  # saved_config drops the adapter it started from: no change
        now["model.lora"] = {k: v for k, v in now["model.lora"].items() if k != "adapter"}
    o = cfg.optimizer
    silent = _UNREPORTED + (() if o.schedule != "constant" and o.decay_steps is None else ("train.steps",))
    out = []
    for field, value in now.items():
        if field not in was or was[field] == value or _under(field, silent):
            continue
        layout = _under(field, _LAYOUT) and field != "pipeline.microbatches"
        out.append({"field": field, "was": was[field], "now": value, **({"layout": True} if layout else {})})
    return out


def describe_changes(changes: list[dict]) -> str:
    """:func:`resume_changes` as one line: ``"optimizer.lr 0.001 → 0.0005; layout: parallel.pp 1 → 2"``."""
    def one(c: dict) -> str:
        return f"{c['field']} {_shown(c['was'])} → {_shown(c['now'])}"

    said = [one(c) for c in changes if not c.get("layout")]
    layout = [one(c) for c in changes if c.get("layout")]
    return "; ".join(said + (["layout: " + ", ".join(layout)] if layout else []))


def _shown(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _under(field: str, names: tuple[str, ...]) -> bool:
    return any(field == n or (n.endswith(".") and field.startswith(n)) for n in names)


def _leaves(config: dict) -> dict:
    """A config as ``{"section.field": value}``: a mapping a field holds (``model.rope_scaling``) is one value."""
    out = {}
    for section, fields in config.items():
        if isinstance(fields, dict):
            out.update({f"{section}.{name}": value for name, value in fields.items()})
        else:
            out[section] = fields
    return out
