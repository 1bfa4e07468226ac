"""Packed documents in attention: a query attends only the keys of its own document.

A packed sequence holds several documents end to end; :class:`Documents` gives, for each sample, the
document of every global position (``ids [b, s]``, nondecreasing along the sequence: documents are
contiguous). Ring attention then masks each block pair by document (varlen semantics, as
``cu_seqlens`` gives them) and skips the block pairs in which no query shares a document with any key —
decided on the host, from the host copy, so the step never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from parallel4d.distributed.mesh import to_device


@dataclass(frozen=True)
class Documents:
    """``ids``: ``[b, s]`` int64, the document index of each global position, on the compute device;
    ``host``: the same on the host (block skipping reads it there)."""

    ids: torch.Tensor
    host: torch.Tensor
    _masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # mask(causal), built once
    _meets: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # meet's answers, asked once

    @classmethod
    def from_starts(cls, starts: torch.Tensor, device=None) -> "Documents":
        """From a host ``[b, s]`` boolean: True where a document begins (position 0 always is one); the
        device copy made without making the host wait (:func:`~parallel4d.distributed.mesh.to_device`)."""
        host = starts.to(torch.int64).cumsum(1)
        return cls(host if device is None else to_device(host, device), host)

    def pairs(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """``[b, lq, lk]``: whether each query at these global positions shares a document with each key."""
        ids = self.ids
        return ids[:, query_positions].unsqueeze(2) == ids[:, key_positions].unsqueeze(1)

    def meet(self, queries: tuple[int, int], keys: tuple[int, int]) -> bool:
        """Whether, in any sample, some query in global positions ``[lo, hi)`` shares a document with some
        key in theirs (documents are contiguous: their id ranges overlap). Read from the host copy, for real
        even in a fake-tensor dry run (``parallel4d plan``): which blocks run is data. Every layer's
        forward and backward asks the same questions of one micro-batch: each is answered once."""
        if (queries, keys) not in self._meets:
            h = self.host
            with unset_fake_temporarily():
                first = torch.maximum(h[:, queries[0]], h[:, keys[0]])
                last = torch.minimum(h[:, queries[1] - 1], h[:, keys[1] - 1])
                self._meets[queries, keys] = bool((first <= last).any())
        return self._meets[queries, keys]

    def mask(self, causal: bool) -> torch.Tensor:
        """``[b, s, s]``: the whole sequence's allowed (query, key) pairs — same document, and key ≤ query
        when causal (what attention over the whole sequence applies; the ring's reference). Built once per
        ``causal`` and shared by every layer's attention (autograd then saves one copy, not one per layer)."""
        if causal not in self._masks:
            s = self.ids.shape[1]
            pos = torch.arange(s, device=self.ids.device)
            allowed = self.pairs(pos, pos)
            self._masks[causal] = allowed & torch.ones(s, s, dtype=torch.bool, device=allowed.device).tril() \
                if causal else allowed
        return self._masks[causal]
