"""SUMMA's overlap, seen in the order of its steps (#47.3): with ``tensor2d.overlap`` each SUMMA op posts
step t+1's broadcast before it computes step t's block product, in a 2D layer's forward and backward
alike; without it, each step is posted, waited for and multiplied before the next is posted.

The order is what a grid's ``trace`` (:class:`~parallel4d.tensor2d.grid.SummaTrace`) is told by the
SUMMA code as it runs, on one rank of a 3×3 grid alone in this process
(:class:`~parallel4d.tensor2d.emulate.LocalRank`: the layer's own code, stand-in collectives);
``test_tensor2d_ops`` checks the same order on gloo workers (:func:`check_summa_order`).
"""

from __future__ import annotations

import torch

from parallel4d.tensor2d import Linear2D, RowwiseFP8
from parallel4d.tensor2d.emulate import LocalRank
from parallel4d.tensor2d.grid import Grid

OPS = ("lin:summa_ab", "lin.bwd:summa_abt", "lin.bwd:summa_atb")  # Y = X·W; dX = dY·Wᵀ; dW = Xᵀ·dY


class Steps:
    """A :class:`SummaTrace` that keeps every event: ``(event, label, step)`` in the order told."""

    def __init__(self):
        self.events: list[tuple[str, str, int]] = []

    def __call__(self, event: str, label: str, step: int) -> None:
        self.events.append((event, label, step))

    def of(self, op: str) -> list[tuple[str, int]]:
        """The ``(event, step)`` of one op (``"lin:summa_ab"``), in order."""
        return [(e, t) for e, label, t in self.events if label.split("/")[0] == op]


def _at(events, event: str, step: int, last: bool = False) -> int:
    places = [n for n, e in enumerate(events) if e == (event, step)]
    assert places, f"no {event} of step {step} in {events}"
    return places[-1] if last else places[0]


def check_summa_order(events: list[tuple[str, int]], q: int, overlap: bool, what: str) -> None:
    """One SUMMA op's ``(event, step)`` list: q posts, waits and products; each step's product after
    its posts and its wait; step t+1's broadcast posted before step t's product (``overlap``) or only
    after it, and after step t's reduce was waited for (sequential)."""
    for kind in ("post", "wait", "product"):
        assert sorted({t for e, t in events if e == kind}) == list(range(q)), (what, kind, events)
    for t in range(q):
        assert _at(events, "post", t, last=True) < _at(events, "wait", t) < _at(events, "product", t), (what, events)
    for t in range(q - 1):
        posted_next, product = _at(events, "post", t + 1), _at(events, "product", t)
        if overlap:
            assert posted_next < product, f"{what}: step {t + 1}'s broadcast posted after step {t}'s product: {events}"
        else:
            assert product < posted_next, f"{what}: step {t + 1}'s broadcast posted before step {t}'s product: {events}"
            if ("reduce", t) in events:
                assert _at(events, "reduce_wait", t) < posted_next, (what, events)


def _layer_steps(overlap: bool, q: int = 3, fp8: RowwiseFP8 | None = None) -> Steps:
    """Forward and backward of one Linear2D (``[b/q, s, in/q]`` → ``[b/q, s, out/q]``) on grid rank (1, 2);
    ``fp8``: its products in FP8 (panels in eight bits)."""
    torch.manual_seed(0)
    lin = Linear2D(4 * q, 2 * q, LocalRank(q, 1, 2), bias=False, name="lin", overlap=overlap)
    lin.fp8 = fp8
    steps = Steps()
    lin.grid.trace = steps
    x = torch.randn(2, 3, 4, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    return steps


def test_summa_posts_the_next_broadcast_before_the_product_forward_and_backward():
    steps = _layer_steps(overlap=True)
    for op in OPS:
        check_summa_order(steps.of(op), 3, overlap=True, what=op)


def test_summa_without_overlap_runs_its_steps_one_after_another():
    steps = _layer_steps(overlap=False)
    for op in OPS:
        check_summa_order(steps.of(op), 3, overlap=False, what=op)
    # the whole sequence of the forward's op, spelled out: post both blocks, wait, multiply, per step
    assert steps.of("lin:summa_ab") == [e for t in range(3) for e in (("post", t), ("post", t), ("wait", t),
                                                                         ("product", t))]


def test_fp8_summa_keeps_the_overlap_forward_and_backward():
    """train.fp8 under 2D tp: the FP8 panels (quantized once, before the first post) are broadcast in the same
    order, step t+1's posted before step t's product, in the forward and both backward ops."""
    steps = _layer_steps(overlap=True, fp8=RowwiseFP8())
    for op in OPS:
        check_summa_order(steps.of(op), 3, overlap=True, what=op)
    assert steps.events and all(("product", t) in steps.of(op) for op in OPS for t in range(3))


def test_a_grid_records_nothing_unless_given_a_trace():
    assert Grid(LocalRank(2, 0, 1)).trace is None
