"""A job's checkpoints as the training loop and the Python API (``parallel4d.save_checkpoint``,
``parallel4d.load_checkpoint``) write and read them: the trainer's state (DCP files under the dense
model's names: any layout loads them) with what every checkpoint carries besides it — the job's
``config.yaml`` (the model's architecture, for ``parallel4d export`` / ``generate`` / a resume) and
``model.pretrained``'s small files (its tokenizer and config.json, for the export) — and the check
that a checkpoint holds the files of the trainer that loads it.

Every function here is a collective: call it on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from parallel4d.checkpoint import dcp as checkpoint
from parallel4d.checkpoint.failures import UnusableCheckpoint
from parallel4d.checkpoint.hf_source import checkpoint_files, source_files
from parallel4d.checkpoint.lora_base import base_file
from parallel4d.checkpoint.resume import choose_checkpoint
from parallel4d.checkpoint.steps import read_info
from parallel4d.config.schema import Config
from parallel4d.engine.trainer import Trainer


def _warn(msg: str) -> None:
    print(f"[parallel4d] warning: {msg}", file=sys.stderr, flush=True)


def _lead() -> bool:
    """Whether this process writes a checkpoint's small files (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def job_files(cfg: Config, with_pretrained: bool = True) -> dict[str, str | bytes]:
    """What each checkpoint of ``cfg``'s job carries besides the state: ``config.yaml`` and, with
    ``model.pretrained`` and ``with_pretrained`` (the process that writes them, when it saves at all),
    a LoRA job's base record (``checkpoint/lora_base.py``) and the directory's small files (``hf_source.source_files``: one too large to carry is left out with
    a warning)."""
    files: dict[str, str | bytes] = {"config.yaml": cfg.to_yaml()}
    if with_pretrained:  # a LoRA job's base, named: its checkpoints hold the adapters only
        files.update(base_file(cfg.model, cfg.train.seed))
    if with_pretrained and cfg.model.pretrained:  # its tokenizer etc., for the export
        found, skipped = source_files(cfg.model.pretrained)
        if skipped:
            _warn(f"model.pretrained: {', '.join(skipped)} not carried with the checkpoints (larger than a tokenizer "
                  "or config file); copy it into the export by hand")
        files.update(checkpoint_files(found))
    return files


def check_format(found: Path, trainer: Trainer, info: dict | None = None) -> None:
    """UnusableCheckpoint unless checkpoint ``found`` (its ``run.json`` ``info``) holds ``trainer``'s files:
    parallel4d's own engine and a ``deepspeed:`` section's write different ones."""
    saved_by = (read_info(found) if info is None else info).get("format", "parallel4d")
    if saved_by != trainer.checkpoint_format:
        raise UnusableCheckpoint(
            f"checkpoint {found} was saved by {saved_by} and this job trains with {trainer.checkpoint_format} "
            "(a deepspeed: section or not); resume it with the config it was saved with, or start afresh in "
            "another train.out_dir")


def save_checkpoint(trainer: Trainer, cfg: Config, root: str | Path | None = None) -> Path:
    """Checkpoint ``trainer`` at its step under ``root`` (default: ``cfg``'s, ``train.out_dir/checkpoints``),
    as ``parallel4d launch`` does: ``step_NNNNNNNN/`` with ``config.yaml``, checksums and ``latest``,
    keeping ``checkpoint.keep`` of this run's. ``parallel4d export`` and ``generate``, a launch with
    ``train.resume`` (in any layout) and :func:`load_checkpoint` read it. Returns its path;
    CheckpointError on every rank, naming the cause, when any rank could not write."""
    root = Path(root) if root is not None else cfg.checkpoint_dir
    return checkpoint.save(trainer.checkpoint_state(), root, trainer.step, keep=cfg.checkpoint.keep,
                           extra_files=job_files(cfg, _lead()), info={"format": trainer.checkpoint_format})


def load_checkpoint(trainer: Trainer, root: str | Path) -> Path | None:
    """Load into ``trainer`` (whatever layout it has) the newest usable checkpoint under ``root`` (its
    files verified; a broken one is set aside with a warning and the one before it tried), restoring
    its parameters, optimizer state and ``step``. Returns the checkpoint's path, or None when ``root``
    holds none (``trainer`` is left as it was); CheckpointError when none is usable or it holds
    another model or trainer's files."""
    found = choose_checkpoint(root)
    if found is None:
        return None
    check_format(found, trainer)
    trainer.load_checkpoint(found)
    return found
