"""The checks of a valid config that need the machine but no lock, no worker and no torch: what
``parallel4d validate`` runs, and ``launch`` before it locks the run directories.

Torch-free at module top: the local job limits, the token files' contents, ``model.pretrained``'s
headers (through the hf extra, imported when the field is set) and a ``deepspeed:`` section against
DeepSpeed (the extra, imported when the section is there).
"""

from __future__ import annotations

import os

from parallel4d.checkpoint.pretrained import check_pretrained
from parallel4d.config.errors import ConfigError
from parallel4d.config.rules.data import byte_text_problems
from parallel4d.config.rules.hetero import dynamic_budget_problems
from parallel4d.config.rules.job import local_job_problems
from parallel4d.config.schema import Config
from parallel4d.data.token_files import content_problems
from parallel4d.integrations import deepspeed_integration


def check_job(cfg: Config, local: bool, device_type: str = "cpu", source: str | None = None) -> None:
    """Every check of a valid config that needs the machine but no lock and no worker: the local
    limits (``local``: this process spawns the workers), a dynamic hetero budget where ``auto`` finds
    only the CPU, a ``deepspeed:`` section against DeepSpeed
    for ``device_type``, ``model.pretrained``'s weight files, byte text under its tokenizer, the token
    files' contents. A ``ConfigError`` names ``source`` (the job file) first, as the config's own errors do."""
    try:
        problems = local_job_problems(cfg) if local else []
        if device_type == "cpu" and "cpu" not in (cfg.train.device, cfg.hetero.compute_device):
            problems += dynamic_budget_problems(cfg.hetero, "train.device=auto finds no GPU on this machine")
        if problems:
            raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
        if cfg.deepspeed is not None:
            deepspeed_integration().resolve(cfg, device_type)
        if cfg.model.pretrained:  # every weight file there and of the model's shape, from the headers
            check_pretrained(cfg.model)
        _refuse(byte_text_problems(cfg))  # byte ids under a model whose tokenizer reads them as other tokens
        verify_token_files(cfg)  # the token files' bytes against their sidecars (hashed once, then stamped)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


def verify_token_files(cfg: Config) -> None:
    """Before any worker starts: each token file a ``Config`` reads holds the bytes ``parallel4d
    tokenize`` wrote (:func:`.token_files.content_problems`: hashed once, then stamped) and was
    tokenized with ``model.pretrained``'s tokenizer where that has one; ConfigError naming the file."""
    d = cfg.data
    if d.source != "tokens":
        return
    files = [("data.path", d.path)] + ([("data.val_path", d.val_path)] if d.val_path else [])
    _refuse([p for field, path in files for p in content_problems(path, field, cfg.model.pretrained)])


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def under_torchrun() -> bool:
    """Whether this process is one rank of a job torchrun (or another env:// launcher) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
