"""Training data, global and deterministic: synthetic token streams, a byte-level corpus (the
Python standard library's own source files, no download, or a user's files: ``data.text_glob``),
or a user's token file (``TokenFile``).

``batch(step)`` returns the same ``[batch_size, seq_len]`` tokens and next-token targets on every
rank for a given (seed, step), whatever the parallel layout. Each rank trains on its own rows
(``engine.local_rows``: its share of each micro-batch) and reads only those (``batch(step, rows)``,
any sequence of row indices), so a parallel run sees exactly the data of the single-process reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from parallel4d.data.text_files import corpus_files
from parallel4d.data.packing import IGNORE
from parallel4d.data.token_files import ITEM_BYTES, loss_mask_path, read_sidecar


class SyntheticTokens:
    """Learnable synthetic sequences: each row steps through the vocabulary with its own
    stride from a random start (``t_{i+1} = t_i + stride mod V``), so the next token is
    predictable from context and the loss can fall."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0):
        self.vocab_size, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed

    def batch(self, step: int, rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        del rows  # computed, not read: every row costs next to nothing
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab_size, (self.batch_size, 1), generator=g)
        stride = torch.randint(1, min(8, self.vocab_size), (self.batch_size, 1), generator=g)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def read_corpus(root: str | Path | None = None, max_bytes: int = 4_000_000,
                patterns: Sequence[str] | None = None) -> torch.Tensor:
    """Concatenate the corpus files under ``root`` (:func:`.text_files.corpus_files`: ``patterns``,
    or every .py file; sorted, so every rank reads the same bytes) up to ``max_bytes``; uint8."""
    if root and not Path(root).is_dir():
        raise ValueError(f"data.text_root={str(root)!r} is not a directory")
    parts, total = [], 0
    for path in corpus_files(root, patterns):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1024:
        what = f"files matching {list(patterns)}" if patterns else ".py files"
        raise ValueError(f"data.text_root={str(root)!r} holds only {total} bytes of {what}; need ≥ 1024")
    blob = b"".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


VALIDATION_STREAM = 1 << 40  # validation batch k draws with step VALIDATION_STREAM + k: never a training step's


def _window_starts(seed: int, step: int, lo: int, hi: int, seq_len: int, batch_size: int) -> list[int]:
    """``batch_size`` random starts of ``seq_len + 1``-token windows inside ``[lo, hi)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return (lo + torch.randint(0, hi - lo - seq_len - 1, (batch_size,), generator=g)).tolist()


def _split(n: int, val_fraction: float | None, validation: bool) -> tuple[int, int]:
    """The token range ``[lo, hi)`` of training (the first part) or validation (the last
    ``val_fraction``); the whole ``[0, n)`` without a fraction."""
    if not val_fraction:
        return 0, n
    cut = int(n * (1 - val_fraction))
    return (cut, n) if validation else (0, cut)


class _Windows:
    """Random windows of a token sequence ``self.tokens`` within ``[lo, hi)``: ``batch(step)``."""

    def _init_windows(self, seq_len: int, batch_size: int, seed: int, lo: int, hi: int, what: str):
        self.seq_len, self.batch_size, self.seed, self.lo, self.hi = seq_len, batch_size, seed, lo, hi
        if hi - lo <= seq_len + 1:
            raise ValueError(f"{what}: {hi - lo} tokens, not more than model.seq_len+1={seq_len + 1}; give more data, "
                             "or a larger data.val_fraction when it is the validation part")

    def batch(self, step: int, rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and next-token targets ``[batch_size, seq_len]`` of step ``step``. ``rows``: read
        only those windows (row indices: a rank's share, ``engine.local_rows``); the other rows are zeros."""
        starts = _window_starts(self.seed, step, self.lo, self.hi, self.seq_len, self.batch_size)
        seq = torch.zeros(self.batch_size, self.seq_len + 1, dtype=torch.int64)
        for r in rows if rows is not None else range(self.batch_size):
            seq[r] = self.tokens[starts[r]:starts[r] + self.seq_len + 1].to(torch.int64)
        self._check_ids(seq, starts)
        return seq[:, :-1].contiguous(), self._targets(seq[:, 1:], starts, rows)

    def _targets(self, targets: torch.Tensor, starts: list[int], rows) -> torch.Tensor:
        """The windows' next tokens ``[B, S]`` as the loss takes them (here: all of them)."""
        return targets.contiguous()

    def _check_ids(self, seq: torch.Tensor, starts: list[int]) -> None:
        """Every id the windows ``seq`` (drawn at ``starts``) hold is in range (bytes always are)."""


class ByteCorpus(_Windows):
    """Random windows of a byte corpus: tokens are bytes (vocabulary 256). ``val_fraction``:
    the last part is held out; ``validation``: draw from it instead."""

    def __init__(self, seq_len: int, batch_size: int, seed: int = 0, root=None, max_bytes: int = 4_000_000,
                 val_fraction: float | None = None, validation: bool = False, patterns: Sequence[str] | None = None):
        self.tokens = self.data = read_corpus(root, max_bytes, patterns)
        lo, hi = _split(len(self.data), val_fraction, validation)
        part = "the validation part of " if validation else ""
        self._init_windows(seq_len, batch_size, seed, lo, hi, f"{part}the text corpus")


class TokenFile(_Windows):
    """Random windows of a token file (``data.source: tokens``), memory-mapped: a step's batch
    reads its ``batch_size`` windows of ``seq_len + 1`` tokens, never the whole file. A file with a loss
    mask (chat data: ``parallel4d tokenize`` of ``.jsonl``) gives :data:`~.packing.IGNORE` as the target
    wherever the mask says the target token carries no loss (the prompts)."""

    def __init__(self, path, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0,
                 val_fraction: float | None = None, validation: bool = False, field: str = "data.path"):
        meta = read_sidecar(path, field)
        self.path, self.field, self.vocab_size, self.item_bytes = path, field, vocab_size, ITEM_BYTES[meta["dtype"]]
        dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[meta["dtype"]]
        self.tokens = torch.from_file(str(path), shared=False, size=meta["tokens"], dtype=dtype)
        self.loss_mask = (torch.from_file(str(loss_mask_path(path)), shared=False, size=meta["tokens"],
                                          dtype=torch.uint8) if "loss_mask" in meta else None)
        lo, hi = _split(len(self.tokens), val_fraction, validation)
        self._init_windows(seq_len, batch_size, seed, lo, hi, f"{path}" + (" (its validation part)" if validation
                                                                             and val_fraction else ""))

    def _targets(self, targets: torch.Tensor, starts: list[int], rows) -> torch.Tensor:
        """``targets`` ``[B, S]`` with IGNORE where the loss mask holds 0 (the read rows' windows only)."""
        if self.loss_mask is None:
            return targets.contiguous()
        keep = torch.zeros_like(targets, dtype=torch.bool)
        for r in rows if rows is not None else range(self.batch_size):
            keep[r] = self.loss_mask[starts[r] + 1:starts[r] + self.seq_len + 1].bool()
        return targets.masked_fill(~keep, IGNORE).contiguous()

    def _check_ids(self, seq: torch.Tensor, starts: list[int]) -> None:
        """The second line of defence behind the sidecar's checksum (an old sidecar has none; a file can
        change after the launch checked it): an id the embedding has no row for stops the step here,
        naming where it is, not as an index error deep in the model."""
        if int(seq.max()) < self.vocab_size:
            return
        r, c = (int(i) for i in (seq >= self.vocab_size).nonzero()[0])
        at = starts[r] + c
        raise ValueError(f"{self.field}={str(self.path)!r} holds token id {int(seq[r, c])} at token offset {at} (byte "
                         f"offset {at * self.item_bytes}), not below model.vocab_size={self.vocab_size}: the file "
                         "changed or was tokenized with a larger vocabulary; tokenize it again with the model's "
                         "tokenizer (or raise model.vocab_size)")


def build_dataset(cfg):
    """The training dataset a ``Config`` asks for (without ``data.val_fraction``'s held-out part)."""
    m, d = cfg.model, cfg.data
    if d.source == "synthetic":
        return SyntheticTokens(m.vocab_size, m.seq_len, d.batch_size, d.seed)
    if d.source == "tokens":
        return TokenFile(d.path, m.vocab_size, m.seq_len, d.batch_size, d.seed, d.val_fraction)
    return ByteCorpus(m.seq_len, d.batch_size, d.seed, d.text_root, d.max_bytes, d.val_fraction, patterns=d.text_glob)


class Validation:
    """The validation batches: ``batch(k)`` for ``k < train.eval_batches``, the same at every evaluation."""

    def __init__(self, source):
        self.source = source

    def batch(self, k: int, rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.batch(VALIDATION_STREAM + k, rows)


def build_validation(cfg) -> Validation | None:
    """The validation data a ``Config`` asks for (``train.eval_every``), else None: ``data.val_path``,
    the held-out ``data.val_fraction``, or synthetic sequences training never draws."""
    m, d = cfg.model, cfg.data
    if cfg.train.eval_every is None:
        return None
    if d.source == "synthetic":
        return Validation(SyntheticTokens(m.vocab_size, m.seq_len, d.batch_size, d.seed))
    if d.val_path:
        return Validation(TokenFile(d.val_path, m.vocab_size, m.seq_len, d.batch_size, d.seed, field="data.val_path"))
    if d.source == "tokens":
        return Validation(TokenFile(d.path, m.vocab_size, m.seq_len, d.batch_size, d.seed, d.val_fraction,
                                    validation=True))
    return Validation(ByteCorpus(m.seq_len, d.batch_size, d.seed, d.text_root, d.max_bytes, d.val_fraction,
                                 validation=True, patterns=d.text_glob))
