"""``parallel4d checkpoint gather CKPT OUT.pt``: a checkpoint of any layout → one dense state dict.

The output is ``torch.load``-able: ``{"model": {dense name: tensor}, "optimizer": {dense
name: {"step", "exp_avg", "exp_avg_sq"}}, "step": N, "tokens_seen": T}``. It is written
without holding the model: first a skeleton whose tensor bytes are left unwritten
(``torch.serialization.skip_data`` over fake tensors), then the file is mapped shared
and each tensor is read from the checkpoint straight into its place, one at a time, so
the process holds at most one tensor's pieces beyond the mapped file's pages. OUT follows
:mod:`.outputs`' rules: never onto or inside the checkpoint, written under a temporary name and
renamed once complete.
"""

from __future__ import annotations

import mmap
import sys
import time
import warnings
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from parallel4d.checkpoint import dcp as checkpoint
from parallel4d.checkpoint.checksums import verify
from parallel4d.checkpoint.failures import UnusableCheckpoint
from parallel4d.checkpoint.outputs import check_output, new_file, user_path
from parallel4d.checkpoint.resume import latest_checkpoint


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a checkpoint root (its newest complete checkpoint), that holds the
    dense tensors in parallel4d's layout-free format: every native checkpoint, and a ``deepspeed:`` run's
    (beside DeepSpeed's own files, the model's float32 parameters). ``~`` expands."""
    path = user_path(path)
    own = (path / ".metadata").is_file() or any(path.glob("*_model_states.pt"))
    found = path if own else latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise UnusableCheckpoint(f"{path} is neither a checkpoint (no .metadata) nor a directory of them; give a "
                                 "step_* directory or the directory holding them (train.out_dir/checkpoints)")
    if not (found / ".metadata").is_file():
        raise UnusableCheckpoint(f"{found} holds only DeepSpeed's files (saved before parallel4d wrote its own "
                                 "copy beside them): there is no layout-free copy of the model to read. "
                                 "At parallel.pp = tp = 1, the zero_to_fp32.py DeepSpeed wrote into "
                                 f"{found.parent} turns it into one state dict")
    return found


def verified(found: Path) -> Path:
    """Checkpoint ``found`` once its files match their checksums (else :class:`UnusableCheckpoint`
    naming the file)."""
    problem = verify(found)
    if problem is not None:
        raise UnusableCheckpoint(f"checkpoint {found} is not usable: {problem}; restore its files, or give an "
                                 f"earlier checkpoint (a step_* directory of {found.parent})")
    return found


def with_tied_head(model_state: dict, tied: bool) -> dict:
    """A checkpoint's (or gather's) model tensors as the dense model's ``state_dict()`` lists them:
    with tied embeddings the checkpoint holds the token table once, and ``head.weight`` is it (a LoRA job's
    checkpoint holds the adapters alone: no table, no head)."""
    if tied and "head.weight" not in model_state and "embed.tok.weight" in model_state:
        return {**model_state, "head.weight": model_state["embed.tok.weight"]}
    return dict(model_state)


def _skeleton(saved: dict) -> dict:
    """The output's structure with fake tensors of the saved dense shapes and dtypes."""
    out: dict = {"model": {}, "optimizer": {}}
    with FakeTensorMode():
        for key, md in saved.items():
            if not hasattr(md, "size"):
                continue
            t = torch.empty(md.size, dtype=md.properties.dtype)
            if key.startswith("model."):
                out["model"][key[len("model."):]] = t
            elif key.startswith("optim."):
                name, k = key[len("optim."):].rsplit(".", 1)
                out["optimizer"].setdefault(name, {})[k] = t
            else:
                out[key] = t
    return out


def _places(out: dict) -> dict[str, torch.Tensor]:
    """``{checkpoint key: tensor}`` over the (mapped) output structure."""
    places = {f"model.{k}": t for k, t in out["model"].items()}
    for name, state in out["optimizer"].items():
        places.update({f"optim.{name}.{k}": t for k, t in state.items()})
    places.update({k: t for k, t in out.items() if isinstance(t, torch.Tensor)})
    return places


class _Progress:
    """``gather: 12/40 tensors, 3.1/9.0 MB`` on stderr: redrawn on a terminal, every ~10% otherwise."""

    def __init__(self, total_tensors: int, total_bytes: int):
        self.n, self.total, self.bytes, self.total_bytes = 0, total_tensors, 0, total_bytes
        self.tty, self.shown, self.start = sys.stderr.isatty(), -1, time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.n += 1
        self.bytes += nbytes
        tenth = 10 * self.n // max(self.total, 1)
        if not self.tty and tenth == self.shown and self.n < self.total:
            return
        self.shown = tenth
        line = (f"gather: {self.n}/{self.total} tensors, {self.bytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB "
                f"({time.monotonic() - self.start:.1f}s)")
        print(f"\r{line}" if self.tty else line, end="" if self.tty and self.n < self.total else "\n",
              file=sys.stderr, flush=True)


def gather(ckpt: str | Path, out: str | Path, progress: bool = True) -> Path:
    """Write checkpoint ``ckpt`` (any layout) as the dense state dict ``out``; returns ``out``'s path
    (``~`` expanded). ``ConfigError`` for an ``out`` :func:`.outputs.check_output` refuses."""
    path = resolve_checkpoint(ckpt)
    out = check_output(out, "OUT", [(path, "the checkpoint it reads")])
    verified(path)  # after the cheap refusals: it reads every byte of the checkpoint
    with new_file(out, "OUT") as tmp:
        _write_dense(path, tmp, progress)
    return out


def _write_dense(path: Path, tmp: Path, progress: bool) -> None:
    """Checkpoint ``path``'s dense state dict into the new file ``tmp`` (see the module docstring)."""
    dcp = checkpoint.dcp

    class Reader(dcp.FileSystemReader):
        """The checkpoint's metadata read once: ``dcp.load`` reads it on every call, one per tensor here
        (the unpickling took most of a gather's time)."""

        metadata = None

        def read_metadata(self, *args, **kwargs):
            if self.metadata is None:
                self.metadata = super().read_metadata(*args, **kwargs)
            self.metadata.storage_meta.load_id = self.load_id  # this load's, as a fresh read sets it
            return self.metadata

    reader = Reader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(_skeleton(saved), tmp)
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)  # writes reach the file
    try:
        mapped = torch.load(tmp, mmap=True, weights_only=True)
    finally:
        torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    places = _places(mapped)
    bar = _Progress(len(places), sum(t.nbytes for t in places.values())) if progress else None
    with warnings.catch_warnings():  # "no process group: assuming a single process" is the intent here
        warnings.simplefilter("ignore", UserWarning)
        for key, t in places.items():
            dcp.load({key: t}, checkpoint_id=str(path), storage_reader=reader, no_dist=True)
            if bar is not None:
                bar.advance(t.nbytes)
    del mapped, places
