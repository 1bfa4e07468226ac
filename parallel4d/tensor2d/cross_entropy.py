"""The autograd function of the vocab-parallel cross entropy: logits ``[b/q, s, Vp/q]`` (vocab block j,
the vocabulary padded to the grid) against targets ``[b/q, s]``, reduced over the grid without gathering
the logits. Its module is :class:`~parallel4d.tensor2d.layers.VocabParallelCrossEntropy2D`."""

from __future__ import annotations

import torch

from parallel4d.tensor2d.layer_base import HALF


class VocabParallelCE(torch.autograd.Function):
    """Cross entropy of logits ``[b/q, s, Vp/q]`` (vocab block j) against targets ``[b/q, s]``.

    Max, Σexp, target logit (and Σlogits for label smoothing) are reduced over my grid
    row (``along_j``); token loss sums and counts over my grid column (``along_i``).
    Only the first ``vocab`` of the ``Vp`` columns are real: the padded ones (the last blocks'
    tails) take no part in the max, the sums or label smoothing, and get a zero gradient.
    The result is the loss over the whole grid batch, identical on every grid rank;
    the backward returns this rank's slice of its gradient (no further reduction)."""

    @staticmethod
    def forward(ctx, logits, targets, grid, ignore_index, smoothing, reduction, name, vocab):
        vq = logits.shape[-1]
        start = grid.j * vq
        real = max(0, min(vq, vocab - start))  # my real columns; the rest is padding
        x = logits.float() if logits.dtype in HALF else logits
        kept = x.detach()[..., :real]
        m = kept.amax(-1, keepdim=True) if real else x.new_full((*x.shape[:-1], 1), float("-inf"))
        grid.comm.all_reduce(m, grid.along_j, op=torch.distributed.ReduceOp.MAX, stats=grid.stats, label=f"{name}.max")
        x = x - m
        e = x.exp()
        if real < vq:
            e[..., real:] = 0.0  # the padded columns out of the softmax
        local_t = targets - start
        valid = targets != ignore_index
        mine = (local_t >= 0) & (local_t < real) & valid
        tl = x.gather(-1, local_t.clamp(0, vq - 1).unsqueeze(-1)).squeeze(-1) * mine
        parts = [e.sum(-1), tl] + ([x[..., :real].sum(-1)] if smoothing else [])
        sums = torch.stack(parts)
        grid.comm.all_reduce(sums, grid.along_j, stats=grid.stats, label=f"{name}.sums")
        lse = sums[0].log()
        tok = lse - sums[1]
        if smoothing:
            tok = (1.0 - smoothing) * tok + smoothing * (lse - sums[2] / vocab)
        tok = tok * valid
        tot = torch.stack([tok.sum(), valid.sum().to(tok.dtype)])
        grid.comm.all_reduce(tot, grid.along_i, stats=grid.stats, label=f"{name}.tokens")
        scale = 1.0 / tot[1] if reduction == "mean" else torch.ones_like(tot[1])
        ctx.smoothing, ctx.vocab, ctx.real, ctx.dtype = smoothing, vocab, real, logits.dtype
        ctx.save_for_backward(e / sums[0].unsqueeze(-1), local_t.clamp(0, vq - 1), mine, valid, scale)
        return tot[0] * scale

    @staticmethod
    def backward(ctx, g):
        p, local_t, mine, valid, scale = ctx.saved_tensors
        grad = p.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - ctx.smoothing) * mine.unsqueeze(-1).to(grad.dtype))
        if ctx.smoothing:
            grad[..., :ctx.real] -= ctx.smoothing / ctx.vocab
        grad *= valid.unsqueeze(-1) * (g * scale)
        return grad.to(ctx.dtype), None, None, None, None, None, None, None
