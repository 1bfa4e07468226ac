"""What every family's dense reference shares: a flat list of stages built one at a time.

A dense model is ``embed, block_0..block_{L-1}, head`` (:func:`stage_names`); stage ``i`` is built
alone from ``(seed, i)`` (:func:`seeded_stage`), so a rank can build just its own stages and get
exactly the values of the whole reference. :class:`DenseModel` runs them in order; the loss is
:func:`cross_entropy`. Shapes: tokens ``[b, s]`` → hidden ``[b, s, h]`` → logits ``[b, s, V]``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.models.context import Draw, ForwardContext, State, attach


def cross_entropy(logits, targets, ignore_index: int = -100, reduction: str = "mean"):
    """Mean (or ``"sum"``) token cross entropy of ``[b, s, V]`` logits against ``[b, s]`` targets;
    ``ignore_index`` targets count in neither."""
    if logits.dtype in (torch.float16, torch.bfloat16):  # the softmax wants ≥ fp32 accuracy
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction=reduction)


def dense_attention(q, k, v, causal: bool = True, dropout=None, documents=None):
    """Softmax attention over the whole local sequence, the single-process reference's core (every
    family's, dense and 2D): q ``[b, heads, s, d]``, k and v ``[b, kv_heads, s, d]`` (grouped-query when
    fewer). ``dropout``: an :class:`~parallel4d.models.dropout.AttentionMask` (plain operations then:
    SDPA cannot take it); ``documents``: packed :class:`~parallel4d.sequence.documents.Documents` over
    the ``s`` tokens (each query attends its own document's keys)."""
    if dropout is not None:
        return dropout.attend(q, k, v, causal, documents)
    gqa = k.shape[1] != q.shape[1]
    if documents is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask(causal)[:, None], enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def cached_attention(q, k, v, start: int) -> torch.Tensor:
    """Decoding with a KV cache: q ``[b, heads, t, d]`` at positions ``start..start+t-1`` over k, v
    ``[b, kv_heads, start+t, d]`` (the cached tokens' and the new ones')."""
    t, total = q.shape[2], k.shape[2]
    mask = None
    if t > 1:  # a new token sees every cached one and the new ones up to itself
        mask = torch.arange(total, device=q.device)[None, :] <= torch.arange(start, start + t, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


class _SkipRandomInit(torch.overrides.TorchFunctionMode):
    """Meta stages carry shapes only, so their random init is skipped: the meta kernel of
    ``normal_`` is a Python reference that imports ``torch._dynamo`` (~2 s of CPU), which
    every rank of a job would pay just to measure its stages' sizes."""

    _INIT = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_,
                       nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
                       nn.init.xavier_uniform_, nn.init.xavier_normal_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._INIT:  # nn.init passes its tensor by keyword
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def stage_names(shape) -> list[str]:
    """``["embed", "blocks.0", ..., "head"]``: stage ``i`` of :meth:`DenseModel.stages`."""
    return ["embed", *(f"blocks.{i}" for i in range(shape.layers)), "head"]


def seeded_stage(shape, index: int, seed: int, tied_weight, meta: bool, make, init) -> nn.Module:
    """``make(shape, index, tied_weight)`` then ``init(module, shape, skip)`` under the RNG seeded
    from ``(seed, index)`` (any model family); ``meta``: shapes only."""
    last = shape.layers + 1
    if not 0 <= index <= last:
        raise ValueError(f"stage index {index} out of range 0..{last}")
    if meta:
        with torch.device("meta"), _SkipRandomInit():
            return make(shape, index, tied_weight)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + index)
        module = make(shape, index, tied_weight)
        init(module, shape, skip=() if tied_weight is None else (tied_weight,))
    return module


class DenseModel(nn.Module):
    """Stages ``embed → blocks → head`` of a family; ``forward(tokens, targets=None, step=None)`` →
    logits or loss. A family's subclass sets ``build_stage`` (``(shape, index, seed, tied_weight=None)``
    → stage). Dropout (:mod:`.dropout`) is drawn only in a forward given the optimizer ``step`` in
    training mode, with masks from ``(seed, step)`` over the whole batch (sample 0 first): what the
    engine draws in any layout for the same step."""

    build_stage: Callable[..., nn.Module]

    @staticmethod
    def auxiliary_loss(shape, state: State, sum_over_ranks=None) -> torch.Tensor | None:
        """What the family adds to a forward's token loss, from what its modules recorded in the forward's
        ``state`` (mixtures of experts: the load-balancing loss); None: nothing (the default).
        ``sum_over_ranks``: sums the term's statistics over the ranks sharing the forward's batch (None: this
        process holds all of it)."""
        return None

    def __init__(self, shape, seed: int = 0):
        super().__init__()
        build = type(self).build_stage
        self.shape = shape
        self.embed = build(shape, 0, seed)
        self.blocks = nn.ModuleList(build(shape, i + 1, seed) for i in range(shape.layers))
        tied = self.embed.tok.weight if shape.tie_embeddings else None
        self.head = build(shape, shape.layers + 1, seed, tied_weight=tied)
        self.context = ForwardContext(seed)
        attach(self, self.context)

    def stages(self) -> list[nn.Module]:
        """The model as a flat list a pipeline cuts into contiguous chunks."""
        return [self.embed, *self.blocks, self.head]

    def run(self, tokens, step: int | None = None) -> tuple[torch.Tensor, State]:
        """Logits ``[b, s, V]`` of ``tokens`` and the forward's :class:`~.context.State` (what its modules
        recorded: the MoE layers' routing statistics)."""
        state = State(Draw(step) if step is not None and self.training else None)
        x = tokens
        with self.context.entering(state):
            for stage in self.stages():
                x = stage(x)
        return x, state

    def forward(self, tokens, targets=None, step: int | None = None):
        """Logits, or with ``targets`` the loss: mean token cross entropy plus the family's auxiliary loss."""
        logits, state = self.run(tokens, step)
        if targets is None:
            return logits
        return with_auxiliary(cross_entropy(logits, targets), type(self).auxiliary_loss(self.shape, state))


def with_auxiliary(loss: torch.Tensor, auxiliary: torch.Tensor | None) -> torch.Tensor:
    """``loss`` plus a family's auxiliary loss (None: ``loss`` itself)."""
    return loss if auxiliary is None else loss + auxiliary.to(loss.dtype)
