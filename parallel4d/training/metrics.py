"""A run's metrics while it trains: ``OUT/metrics.jsonl`` and, with ``train.tensorboard``, TensorBoard.

Each logged step (every ``train.log_every`` steps and the last) appends one JSON object to
``metrics.jsonl`` and flushes it, so a crashed run keeps its curve up to its last logged step:

* ``step``, ``loss`` (the global mean loss of that step), ``lr`` (the learning rate it used),
  ``grad_norm`` (the whole model's gradient norm before clipping);
* ``tokens_per_second`` and ``model_flops_per_second`` over the steps since the previous record;
* ``peak_memory_bytes``: per rank, the CUDA allocator's peak on a GPU, the process's peak
  resident set on the host (``peak_memory_kind`` says which; since just before the model was built
  where :class:`.host_memory.HostPeak` could reset it);
* ``bytes_sent_by_axis``: rank 0's bytes sent per mesh axis since this process started.

Between them, event records (``"event"`` names the kind; :func:`read_events`, which
:func:`read_records` leaves out): ``{"event": "save", "step", "seconds", "final"}`` after a checkpoint
of ``step`` was written (its seconds fall in the interval of the next record's throughput), and
``{"event": "resume", "step", "checkpoint", "parallel", "changes"}`` where a run resumed (its layout;
what it changed from the checkpoint's config, ``checkpoint.resume.resume_changes``).

A resumed run keeps the records up to the step it resumed from and drops those after it (the
steps it trains again), so the file holds each step once. Rank 0 writes; every rank takes part
in gathering the per-rank peaks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from parallel4d.distributed import comm
from parallel4d.training.host_memory import max_rss

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_second", "model_flops_per_second", "val_loss", "val_perplexity")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """``(bytes, kind)``: the CUDA allocator's peak on ``device``, else this process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max allocated"
    return max_rss(), "host max resident set"


def gather_per_rank(value: int, mesh) -> torch.Tensor | list[int]:
    """``value`` of every rank, in rank order: ``[value]`` in a one-rank job, else int64 ``[world]``
    on the mesh's device from a collective over the default group (waited as every wait of the
    step: :func:`comm.wait`), not read back: :func:`read_together` reads it with the step's other
    values."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    # NCCL takes device tensors only; a fill, where torch.tensor([value], device=) would copy and wait
    mine = torch.full((1,), value, dtype=torch.int64, device=mesh.device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    what = "metrics: per-rank peak memory gather"
    with comm.named(what):
        work = dist.all_gather(parts, mine, async_op=True)
    comm.wait(work, mesh.timeout_s, what, mesh.deadlines)
    return torch.cat(parts)


def read_together(values: dict) -> dict:
    """``values`` (name → tensor, list of tensors, or anything else) with their tensors read back to
    the host in one copy per device: one wait for a GPU, not one per value. A ``[]`` tensor becomes
    a float, any other tensor or a list of tensors a list of floats (int64 counts exact up to 2**53);
    anything else, an empty list included, is passed through."""
    def tensors(v):
        if isinstance(v, torch.Tensor):
            return [v]
        return v if isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v) else None

    flat = {k: torch.cat([t.detach().reshape(-1).to(torch.float64) for t in ts])
            for k, v in values.items() if (ts := tensors(v)) is not None}
    by_device: dict[torch.device, list[str]] = {}
    for k, t in flat.items():
        by_device.setdefault(t.device, []).append(k)
    out = dict(values)
    for keys in by_device.values():
        host = torch.cat([flat[k] for k in keys]).tolist()  # the one wait
        start = 0
        for k in keys:
            end = start + flat[k].numel()
            scalar = isinstance(values[k], torch.Tensor) and values[k].dim() == 0
            out[k] = host[start] if scalar else host[start:end]
            start = end
    return out


def gather_objects(obj) -> list:
    """``obj`` (picklable) of every rank, in rank order: a collective over the default group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    with comm.named("metrics: per-rank memory gather"):
        dist.all_gather_object(out, obj)
    return out


def read_records(path: Path) -> list[dict]:
    """The logged steps' records of a ``metrics.jsonl``, in order (its events left out)."""
    return [r for r in read_log(path) if "event" not in r]


def read_events(path: Path) -> list[dict]:
    """The events of a ``metrics.jsonl`` (checkpoint saves, resumes), in order."""
    return [r for r in read_log(path) if "event" in r]


def read_log(path: Path) -> list[dict]:
    """Every object of a ``metrics.jsonl``, records and events, in order (a torn last line, from a killed
    run, is skipped)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class MetricsLog:
    """Rank 0's ``metrics.jsonl`` (and TensorBoard writer) for a run in ``out_dir``.

    ``resumed_step``: the step the run resumed from (records after it are dropped), or None
    for a fresh run (the file starts empty).
    """

    def __init__(self, out_dir: Path, resumed_step: int | None, tensorboard: bool = False):
        self.path = Path(out_dir) / METRICS_FILE
        kept = [r for r in read_log(self.path) if _kept(r, resumed_step)] if resumed_step else []
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)
        self.file = self.path.open("a")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # the viz extra; config checks it is installed

            self.writer = SummaryWriter(str(Path(out_dir) / TENSORBOARD_DIR),
                                        purge_step=resumed_step + 1 if resumed_step else None)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key in SCALARS:
                if record.get(key) is not None:
                    self.writer.add_scalar(f"train/{key}" if not key.startswith("val_") else f"val/{key[4:]}",
                                           record[key], record["step"])
            self.writer.flush()

    def event(self, kind: str, step: int, **fields) -> None:
        """An event record: ``{"event": kind, "step": step, **fields}`` (a save after ``step``, a resume from it)."""
        self.file.write(json.dumps({"event": kind, "step": step, **fields}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def _kept(record: dict, resumed_step: int) -> bool:
    """Whether a resume from ``resumed_step`` keeps a record of the file: every one up to that step but
    an earlier resume from that same step (this one takes its place)."""
    step = record.get("step", 0)
    return step <= resumed_step and not (record.get("event") == "resume" and step == resumed_step)
