"""Dropout whose masks are a function of the dense element, so every layout drops the same ones.

A mask element is kept or dropped by a counter-based hash of ``(train.seed, the step, the site, the
sample's global index in the batch, the element's dense position)`` — never torch's RNG state. A
rank holding a slice of an activation (a batch block, a sequence shard, a hidden block or some
heads, a micro-batch, a recomputation in the backward) draws exactly the elements the single
process draws there: the masks are layout-free, like the checkpoints.

The sites (``transformers``' own):

* gpt2: ``embedding`` after token + position embedding (``embd_pdrop``), ``attention`` on the
  attention probabilities (``attn_pdrop``), ``attention_output`` and ``mlp_output`` on each residual
  branch's output before its add (``resid_pdrop``);
* llama: ``attention`` only (``attention_dropout``; transformers' Llama and Qwen have no other);
* ``lora``: a low-rank adapter's input (``model.lora.dropout``, peft's ``lora_dropout``; the base
  sees its input untouched), one per adapted linear: ``part`` 1, 2, … numbers a stage's adapters.

Contract. Each site is a :class:`Site` module of a stage, keyed by the stage's index and its kind.
Every site of one model (a rank's stages) reads the same
:class:`~parallel4d.models.context.ForwardContext`: ``seed``, the global sequence positions of the
local tokens (a ring shard's; None: ``0..s-1``), and ``draw``, the current forward's
:class:`~parallel4d.models.context.Draw` (the step and the global index of its first sample), which
whoever runs the forward sets (the engine per micro-batch, ``DenseModel`` for a ``step=``); ``draw``
None means no dropout (evaluation, generation). A 2D twin's site carries its
offset in the dense hidden features or heads. The attention's site hands the core an
:class:`AttentionMask` (``attention_fn(q, k, v, causal=..., dropout=mask)``, only when one is
active): :meth:`AttentionMask.attend` for a core over the whole local sequence,
:meth:`AttentionMask.keep` for one over blocks of it (ring attention: by global positions).

The hash: 32-bit words mixed by Mueller's integer hash (two multiplies by ``0x45d9f3b``), the key
of ``(seed, step, site)`` in Python, then one mix per coordinate in torch's int64 (every product
stays below 2⁵⁹: no overflow on CPU or CUDA). Kept when the final word is ``≥ p·2³²``; kept
elements are scaled by ``1/(1-p)`` (``torch.nn.Dropout``'s inverted dropout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from parallel4d.models.context import ReadsContext

WORD = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2^27: a 32-bit word times it stays below 2^59
KINDS = ("embedding", "attention", "attention_output", "mlp_output", "lora")


def _mix(x):
    """A 32-bit word (Python int or int64 tensor in ``[0, 2³²)``) → its hash word (a bijection)."""
    x = ((x >> 16) ^ x) * _MULT & WORD
    x = ((x >> 16) ^ x) * _MULT & WORD
    return (x >> 16) ^ x


def site_key(seed: int, step: int, stage: int, kind: str, part: int = 0) -> int:
    """The 32-bit key of one site's masks in one step: stage index, kind (:data:`KINDS`) and, for a kind
    with several sites in a stage (the adapters'), which one (``part`` ≥ 1; 0: the stage's only one)."""
    words = (seed & WORD, seed >> 32, step & WORD, step >> 32, stage, KINDS.index(kind)) + ((part,) if part else ())
    return hash_words(words)


def hash_words(words) -> int:
    """32-bit words (Python ints) → one 32-bit key, each word mixed into the last."""
    h = 0x9E3779B9
    for word in words:
        h = _mix(h ^ (word & WORD))
    return h


def keep_scale(key: int, p: float, coords: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``0`` (dropped) or ``1/(1-p)`` (kept) for every element of the grid ``coords`` spans: a tensor
    ``[len(c) for c in coords]`` whose element ``[i0, i1, …]`` depends only on ``key`` and the dense
    coordinates ``coords[0][i0], coords[1][i1], …`` (int64, each in ``[0, 2³²)``)."""
    # The key enters as a Python scalar: a tensor built from it would be a blocking host→device copy.
    h = _mix(coords[0].to(torch.int64) ^ key)
    for c in coords[1:]:
        h = _mix(h.unsqueeze(-1) ^ c.to(torch.int64))
    threshold = min(round(p * 2.0 ** 32), WORD + 1)
    return (h >= threshold).to(dtype) * (1.0 / (1.0 - p))


class Site(ReadsContext):
    """A dropout site of stage ``stage`` (0 the embedding, 1…L the blocks), ``kind`` one of
    :data:`KINDS`, rate ``p``; ``offset``: where this module's features (``[b, s, w]`` sites) or heads
    (the attention's) start in the dense ones (a 2D twin's grid column); ``part``: which of the stage's
    sites of this kind (the adapters': 1, 2, …; 0: the only one)."""

    def __init__(self, p: float, stage: int, kind: str, offset: int = 0, part: int = 0):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"dropout site kind {kind!r} is not one of {KINDS}")
        self.p, self.stage, self.kind, self.offset, self.part = float(p), stage, kind, offset, part

    def extra_repr(self) -> str:
        return f"p={self.p}, stage={self.stage}, kind={self.kind}, offset={self.offset}, part={self.part}"

    def shifted(self, offset: int) -> "Site":
        """The same site for a slice starting at dense feature / head ``offset`` (a 2D twin's)."""
        return Site(self.p, self.stage, self.kind, offset, self.part)

    def _key(self) -> int | None:
        draw = None if self.context is None else self.context.draw
        if draw is None:
            return None
        return site_key(self.context.seed, draw.step, self.stage, self.kind, self.part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, s, w]`` (this slice's features) with the dense elements' masks applied."""
        if self.p == 0.0:  # decided on the module: nothing traced, nothing drawn
            return x
        return _apply(self, x)

    def attention(self, batch: int, heads: int, device) -> AttentionMask | None:
        """The mask of a forward's attention probabilities over ``batch`` rows and ``heads`` query heads
        (from dense head ``offset``); None when none is drawn (``p`` 0, no draw)."""
        if self.p == 0.0:
            return None
        return _attention_mask(self, batch, heads, device)


@torch.compiler.disable  # the draw changes every micro-batch: read eagerly (a graph break), never guarded
def _apply(site: Site, x: torch.Tensor) -> torch.Tensor:
    key = site._key()
    if key is None:
        return x
    b, s, w = x.shape
    m, d = site.context, site.context.draw
    coords = (torch.arange(d.first_row, d.first_row + b, device=x.device), m.seq_positions(s, x.device),
              torch.arange(site.offset, site.offset + w, device=x.device))
    return x * keep_scale(key, site.p, coords, x.dtype)


@torch.compiler.disable
def _attention_mask(site: Site, batch: int, heads: int, device) -> AttentionMask | None:
    key = site._key()
    if key is None:
        return None
    d = site.context.draw
    return AttentionMask(site.p, key, torch.arange(d.first_row, d.first_row + batch, device=device),
                         torch.arange(site.offset, site.offset + heads, device=device),
                         None if site.context.positions is None else site.context.positions.to(device))


@dataclass(frozen=True)
class AttentionMask:
    """Dropout of one forward's attention probabilities: ``out_i = Σ_j keep_ij · p_ij · v_j`` with ``p``
    the softmax over all keys and ``keep`` 0 or ``1/(1-p)`` by (sample, query head, query position,
    key position). ``rows`` ``[b]``: the samples' global indices; ``heads`` ``[h]``: the local query
    heads' dense indices; ``positions`` ``[s]``: the local tokens' global positions (None: ``0..s-1``)."""

    p: float
    key: int
    rows: torch.Tensor
    heads: torch.Tensor
    positions: torch.Tensor | None

    def keep(self, query_positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[b, h, lq, lk]``: 0 or ``1/(1-p)`` for these global query and key positions."""
        return keep_scale(self.key, self.p, (self.rows, self.heads, query_positions, key_positions), dtype)

    def attend(self, q, k, v, causal: bool, documents=None) -> torch.Tensor:
        """Softmax attention with this mask, in plain operations (fused kernels cannot take it): q
        ``[b, h, s, d]``, k and v ``[b, h_kv, s, d]`` (``h % h_kv == 0``, query head ``i`` reading
        key/value head ``i // (h/h_kv)``) → ``[b, h, s, d]``; scores in float32 or wider.
        ``documents``: packed documents over these ``s`` tokens (each query attends its own document's keys)."""
        b, h, s, d = q.shape
        hkv, wide = k.shape[1], torch.promote_types(q.dtype, torch.float32)
        pos = torch.arange(s, device=q.device) if self.positions is None else self.positions.to(q.device)
        scores = q.to(wide).reshape(b, hkv, h // hkv, s, d) @ k.to(wide).unsqueeze(2).transpose(-1, -2)
        scores = scores * d ** -0.5
        if documents is not None:
            scores = scores.masked_fill(~documents.mask(causal)[:, None, None], float("-inf"))
        elif causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        probs = scores.softmax(-1) * self.keep(pos, pos, wide).reshape(b, hkv, h // hkv, s, s)
        return (probs @ v.to(wide).unsqueeze(2)).reshape(b, h, s, v.shape[-1]).to(q.dtype)


def attend(attention_fn, q, k, v, causal: bool, mask: AttentionMask | None, documents=None):
    """``attention_fn(q, k, v, causal=causal)``, with ``dropout=mask`` when a mask is drawn and
    ``documents=`` when the forward is packed (a core that cannot take one raises: neither is ever
    silently left out)."""
    extra = {k: v for k, v in (("dropout", mask), ("documents", documents)) if v is not None}
    return attention_fn(q, k, v, causal=causal, **extra)
