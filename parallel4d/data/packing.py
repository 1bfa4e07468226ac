"""Packed documents: where each document of a packed sequence starts, each token's position in its
document, and targets that never predict across a boundary (pure functions on ``[B, S]`` tensors).

A token stream holds documents end to end, each ended by the end-of-document token (``parallel4d
tokenize`` appends the tokenizer's EOS after every file). A training sequence is a window of that
stream: its first token starts a document (the part of one the window cut counts as one), and every
token after an end-of-document token starts the next. The end-of-document token itself belongs to the
document it ends; its target — the next document's first token — is ignored.
"""

from __future__ import annotations

import torch

IGNORE = -100  # the loss's ignore_index: a target that counts neither in the sum nor in the mean


def document_starts(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[B, S]`` bool: True where a document begins (position 0, and after each ``eod`` token)."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod
    return starts


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` int64: each token's position in its document (0 at each start)."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def boundary_targets(tokens: torch.Tensor, targets: torch.Tensor, eod: int) -> torch.Tensor:
    """``targets`` with :data:`IGNORE` where the token is ``eod`` (its next token starts another document)."""
    return targets.masked_fill(tokens == eod, IGNORE)
