"""Every ATen op a dry-run step makes, as the time model's work list.

:class:`OpTrace` is a dispatch mode entered around ``parallel4d plan``'s dry run (fake tensors:
shapes, no values), so the list is the job's own code's ops — the 2D pieces, ring blocks, the
recomputed forward under activation checkpointing, the optimizer — never a second description of
them. Each op is kept as an :class:`Op`: its kind, its phase and its work:

* ``matmul``: ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm`` (mixture-of-experts' experts) —
  work in FLOPs, ``2·m·k·n`` per product (a grouped product's: its groups' together);
* ``attention``: ATen's fused attention kernels (any ``_scaled_dot_product_*`` or
  ``_flash/_efficient_attention`` op) — FLOPs ``4·b·h·s_q·s_k·d`` forward, 2.5× that backward
  (the score recomputation and four products), halved when causal (the kernels skip the masked
  half);
* ``memory``: every other op that produces data — work in bytes read and written;
* ``view``: ops that only describe a tensor (views, ``detach``) — no work, only their dispatch.

Phases: ``backward`` for ops the autograd engine runs (recomputation included), ``step`` for what
follows the last backward op (gradient norm, clipping, the optimizer), ``forward`` for the rest.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
KINDS = ("matmul", "attention", "memory", "view")
PHASES = ("forward", "backward", "step")
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm}
_FREE = {aten.detach, aten.lift_fresh, aten.alias}


@dataclass(frozen=True)
class Op:
    """One kind of op call: ``kind`` (:data:`KINDS`), ``phase`` (:data:`PHASES`), the dtype of its
    first tensor, and its work (FLOPs for matmul and attention, bytes for memory, 0 for views)."""

    kind: str
    phase: str
    dtype: str
    work: float


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _bytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _matmul_flops(func, args) -> float:
    """``2·k`` per output element: the first matrix operand's last dimension is ``k``. A grouped product
    (``a [N, K] × b [E, K, n]``, ``a [m, ΣK] × b [ΣK, n]`` or batched) multiplies every element of ``a`` by a
    row of ``n``: ``2·a.numel()·n`` in all."""
    if func.overloadpacket is aten._grouped_mm:
        return 2.0 * args[0].numel() * args[1].shape[-1]
    a, b = args[1:3] if func.overloadpacket in (aten.addmm, aten.baddbmm) else args[:2]
    return 2.0 * a.shape[:-1].numel() * b.shape[-1] * a.shape[-1]


def _is_attention(name: str) -> bool:
    return "scaled_dot_product" in name or name.startswith(("_flash_attention", "_efficient_attention"))


def _attention_flops(func, args, kwargs) -> float:
    """``4·b·h·s_q·s_k·d`` (scores and weighted sum) forward, 2.5× backward, ÷2 when causal."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args), **kwargs)
    backward = "backward" in func.__name__
    q, k = (bound["query"], bound["key"])
    b, h, sq, d = q.shape[-4:] if q.dim() == 4 else (1, *q.shape[-3:])
    sk = k.shape[-2]
    flops = 4.0 * b * h * sq * sk * d * (2.5 if backward else 1.0)
    return flops / 2 if bound.get("is_causal") else flops


class OpTrace(TorchDispatchMode):
    """Records every op dispatched while entered (see the module docstring); :meth:`ops` gives them
    counted, with their phases decided."""

    def __init__(self):
        super().__init__()
        self._calls: list[tuple[str, bool, str, float]] = []  # (kind, in backward, dtype, work)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        dtype = str(inputs[0].dtype if inputs else next(iter(_tensors(out)), torch.empty(0)).dtype)
        name = func.__name__.split(".")[0]
        if func.overloadpacket in _MATMULS:
            kind, work = "matmul", _matmul_flops(func, args)
        elif _is_attention(name):
            kind, work = "attention", _attention_flops(func, args, kwargs)
        elif func.is_view or func.overloadpacket in _FREE or not _tensors(out):
            kind, work = "view", 0.0
        else:
            kind, work = "memory", float(_bytes(inputs) + _bytes(_tensors(out)))
        self._calls.append((kind, torch._C._current_graph_task_id() != -1, dtype.removeprefix("torch."), work))
        return out

    def calls(self) -> list[Op]:
        """Every call in order, its phase decided."""
        last_backward = max((i for i, c in enumerate(self._calls) if c[1]), default=-1)
        return [Op(kind, "backward" if backward else ("step" if i > last_backward >= 0 else "forward"), dtype, work)
                for i, (kind, backward, dtype, work) in enumerate(self._calls)]

    def ops(self) -> Counter[Op]:
        """Each distinct :class:`Op` and how many times it ran."""
        return Counter(self.calls())


def total(ops: Counter[Op], kind: str | None = None, phase: str | None = None) -> float:
    """The summed work of ``ops`` of that kind and phase (None: any)."""
    return math.fsum(op.work * n for op, n in ops.items()
                     if kind in (None, op.kind) and phase in (None, op.phase))
