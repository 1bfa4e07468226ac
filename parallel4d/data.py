"""Training data: synthetic token streams and a byte-level corpus made of the Python
standard library's own source files (no download), or a user's token file (``TokenFile``).

Both are *global* and deterministic: ``batch(step)`` returns the same
``[batch_size, seq_len]`` tokens and next-token targets on every rank for a
given (seed, step), whatever the parallel layout. Each rank then takes its own
slice (:func:`local_slice`), so a parallel run sees exactly the data of the
single-process reference.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from .token_files import read_sidecar


class SyntheticTokens:
    """Learnable synthetic sequences: each row steps through the vocabulary with its own
    stride from a random start (``t_{i+1} = t_i + stride mod V``), so the next token is
    predictable from context and the loss can fall."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0):
        self.vocab_size, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab_size, (self.batch_size, 1), generator=g)
        stride = torch.randint(1, min(8, self.vocab_size), (self.batch_size, 1), generator=g)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(root: str | Path | None = None, max_bytes: int = 4_000_000, suffix: str = ".py") -> torch.Tensor:
    """Concatenate the ``suffix`` files under ``root`` (sorted, so every rank reads the
    same bytes) up to ``max_bytes``; returns a uint8 tensor."""
    root = Path(root) if root else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"data.text_root={str(root)!r} is not a directory")
    parts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        for name in sorted(filenames):
            if not name.endswith(suffix):
                continue
            try:
                data = (Path(dirpath) / name).read_bytes()
            except OSError:
                continue
            parts.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    if total < 1024:
        raise ValueError(f"data.text_root={str(root)!r} holds only {total} bytes of {suffix} files; need ≥ 1024")
    blob = b"".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class ByteCorpus:
    """Random windows of a byte corpus: tokens are bytes (vocabulary 256)."""

    def __init__(self, seq_len: int, batch_size: int, seed: int = 0, root=None, max_bytes: int = 4_000_000):
        self.data = read_corpus(root, max_bytes)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        if len(self.data) <= seq_len + 1:
            raise ValueError(f"corpus of {len(self.data)} bytes is shorter than model.seq_len+1={seq_len + 1}")

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        seq = self.data[idx].long()
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class TokenFile:
    """Random windows of a token file (``data.source: tokens``), memory-mapped: a step's batch
    reads its ``batch_size`` windows of ``seq_len + 1`` tokens, never the whole file."""

    def __init__(self, path, seq_len: int, batch_size: int, seed: int = 0):
        meta = read_sidecar(path)
        dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[meta["dtype"]]
        self.tokens = torch.from_file(str(path), shared=False, size=meta["tokens"], dtype=dtype)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=g)
        seq = torch.stack([self.tokens[s:s + self.seq_len + 1].to(torch.int64) for s in starts.tolist()])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def build_dataset(cfg):
    """The dataset a ``Config`` asks for."""
    m, d = cfg.model, cfg.data
    if d.source == "synthetic":
        return SyntheticTokens(m.vocab_size, m.seq_len, d.batch_size, d.seed)
    if d.source == "tokens":
        return TokenFile(d.path, m.seq_len, d.batch_size, d.seed)
    return ByteCorpus(m.seq_len, d.batch_size, d.seed, d.text_root, d.max_bytes)


def local_slice(x: torch.Tensor, index: int, parts: int, dim: int = 0) -> torch.Tensor:
    """Block ``index`` of ``parts`` equal blocks of ``x`` along ``dim``."""
    n = x.shape[dim]
    if n % parts:
        raise ValueError(f"size {n} along dim {dim} is not divisible into {parts} parts")
    return x.narrow(dim, index * (n // parts), n // parts)
