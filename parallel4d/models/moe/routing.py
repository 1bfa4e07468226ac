"""The router's arithmetic and the experts' SwiGLU; the tokens' trip to their experts and back is the
dispatcher's (:mod:`parallel4d.experts`: sorted by expert without a loop over tokens, on this rank or
over the ep ranks).

Shapes: ``T`` tokens (a micro-batch's ``b·s``, flattened), ``h`` hidden, ``E`` experts, ``k`` experts per
token, ``I`` an expert's SwiGLU width.

* :func:`route`: router logits ``[T, E]`` → softmax probabilities ``[T, E]``, each token's top ``k``
  experts ``[T, k]`` and their weights ``[T, k]`` (the top-k probabilities, renormalised to sum to 1
  with ``norm_topk_prob`` — which is Mixtral's softmax over the top-k logits, the same numbers);
* :func:`expert_ffn`: each expert's SwiGLU over its contiguous rows of the sorted tokens. The one
  place the experts compute: a loop over experts here, a grouped matrix product later (issue 48,
  fourth part) with the same arguments.

Dropless: every token reaches its ``k`` experts (no capacity, nothing dropped or padded).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Routing(NamedTuple):
    """One layer's routing of ``T`` tokens: ``probs`` ``[T, E]`` (the softmax, what the load-balancing
    loss reads), ``experts`` ``[T, k]`` (indices), ``weights`` ``[T, k]`` (what each expert's output is
    multiplied by)."""

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


def route(logits: torch.Tensor, k: int, norm_topk_prob: bool) -> Routing:
    """Softmax over the ``E`` experts of ``logits`` ``[T, E]`` (at least float32, as transformers
    computes it; wider inputs stay wide), the top ``k`` of each token, their probabilities as weights —
    renormalised to sum to 1 when ``norm_topk_prob``. Weights come back in ``logits``' dtype."""
    probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    top, experts = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routing(probs, experts, top.to(logits.dtype))


def expert_ffn(x: torch.Tensor, counts: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
               down_proj: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU ``down(silu(gate x) · up x)`` over its rows of ``x`` ``[N, h]`` (sorted by
    expert: ``counts[e]`` rows each, ``counts`` ``[E]``), weights stacked ``gate_proj``, ``up_proj``
    ``[E, I, h]`` and ``down_proj`` ``[E, h, I]`` (nn.Linear's ``[out, in]`` per expert) → ``[N, h]``.

    A loop over the experts that have rows; ``counts`` is read on the host once (the split sizes).
    A grouped matrix product replaces this function whole (same arguments, same result)."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = x[start:start + n]
            out.append(F.linear(F.silu(F.linear(rows, gate_proj[e])) * F.linear(rows, up_proj[e]), down_proj[e]))
            start += n
    if out:
        return torch.cat(out)
    # no rows: still [0, h] computed from x, so that a backward through x (an expert-parallel rank's
    # all-to-alls, which its peers run too) reaches this rank as well
    return F.linear(x, x.new_zeros(down_proj.shape[1], x.shape[1]))
