"""The backward of one chunk in two parts: input gradient now (B), weight gradients later (W).

A split schedule runs ``B(i, c)`` to produce the gradient the previous chunk waits for, and
``W(i, c)`` later, in time the rank would otherwise idle. Both parts run on the chunk's own
autograd graph, kept between them (``retain_graph``); nothing is computed twice.

How the graph is cut. Let ``D`` be the autograd nodes from which the chunk input ``x`` is
reachable (the nodes B must run). A *boundary* node is a node of ``D`` with at least one next
node outside ``D``: e.g. the matmul of a linear layer, whose one branch leads to ``x`` and
whose other leads only to the weight. B runs the engine towards ``x`` alone
(``backward(inputs=[x])``): built-in nodes then compute only the outputs on the way to ``x``,
and a pre-hook records the gradients arriving at each boundary node. W runs each boundary node
again from those recorded gradients towards the parameters under it
(``backward(GradientEdge(node, k), inputs=params)``), which computes only its weight-side
outputs and accumulates into ``.grad`` with the parameters' own hooks. Custom autograd
functions that do collectives (SUMMA) ask the engine which of their outputs it will use
(``torch._C._will_engine_execute_node``), so they too compute each half once.

A parameter used twice in one chunk at different depths is reachable from a boundary node's
``x`` branch as well; there the other boundary nodes' gradients are clamped to zero during that
node's W pass, so every contribution is counted exactly once (at some extra compute). Nodes that
share a parameter (a stacked weight sliced per expert) run in one pass, each from exactly what it
received in B, so the parameter accumulates once per W as it does once per backward (what the
data-parallel buckets count).

A chunk whose input needs no gradient (chunk 0: token ids) has nothing for B to compute; its W
is the whole backward. A chunk of several inputs and outputs (a message that carries more than the
activation) is cut the same way, ``D`` being the nodes from which any input is reachable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Boundary:
    node: Node
    grads: tuple            # gradients that arrived at the node during B (None where none did)
    params: list            # leaf tensors under its branches that do not lead to x


class WeightGradients:
    """What B keeps for W: the retained graph's boundary nodes and their recorded gradients."""

    def __init__(self, boundaries: list[_Boundary], whole: tuple | None = None):
        self._boundaries = boundaries
        self._whole = whole  # (outputs, gradients) that reach no input: W runs their whole backward

    def run(self) -> None:
        """Accumulate the chunk's weight gradients (once; frees the graph's references)."""
        whole, boundaries = self._whole, self._boundaries
        self._whole, self._boundaries = None, []
        if whole is not None:  # a graph apart from the boundary nodes' (none of its nodes reaches an input)
            torch.autograd.backward(whole[0], whole[1], retain_graph=bool(boundaries))
        recorded = {b.node: b.grads for b in boundaries}
        current: set[Node] = set()  # the boundary nodes of the pass that runs

        def clamp(grads, node):
            # A node of this pass computes from what it received in B, whatever else flows into it; one
            # reached through another pass's node's x branch is that pass's to count.
            if node in current:
                return recorded[node]
            return tuple(None if g is None else torch.zeros_like(g) for g in grads)

        hooks = [b.node.register_prehook(lambda grads, node=b.node: clamp(grads, node)) for b in boundaries]
        try:
            for group in _sharing(boundaries):
                current.clear()
                current.update(b.node for b in group)
                edges = [GradientEdge(b.node, k) for b in group for k, g in enumerate(b.grads) if g is not None]
                params = list({id(p): p for b in group for p in b.params}.values())
                if edges and params:
                    torch.autograd.backward(edges, [g for b in group for g in b.grads if g is not None],
                                            inputs=params, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()


def _sharing(boundaries: list[_Boundary]) -> list[list[_Boundary]]:
    """The boundary nodes in groups that share no parameter (each group's nodes in their order, the groups
    in the order of their first node): one W pass per group, so that a parameter under several nodes (an
    expert's slice each, of one stacked weight) accumulates once per W, as it does once per backward."""
    owner: dict[int, int] = {}  # parameter id → group (its first node's index)
    parent = list(range(len(boundaries)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, b in enumerate(boundaries):
        for p in b.params:
            j = owner.setdefault(id(p), i)
            a, c = root(i), root(j)
            parent[max(a, c)] = min(a, c)
    groups: dict[int, list[_Boundary]] = {}
    for i, b in enumerate(boundaries):
        groups.setdefault(root(i), []).append(b)
    return list(groups.values())


def input_gradient(ys, grads, xs):
    """Run B: the gradient of each of the chunk's inputs ``xs`` (a tuple, ``None`` where one needs none) and
    the :class:`WeightGradients` for W. ``ys``: the chunk's outputs (or its scaled loss alone, ``grads``
    None), ``grads``: theirs; ``xs``: its input leaves. An output that does not reach any input (chunk 0's:
    token ids need no gradient) is left to W whole."""
    ys, xs = tuple(ys), tuple(xs)
    grads = tuple(grads) if grads is not None else (None,) * len(ys)
    passed = [(y, g) for y, g in zip(ys, grads) if y.grad_fn is None]  # an input handed on unchanged, or a constant
    roots = [(y, g) for y, g in zip(ys, grads) if y.grad_fn is not None]
    wanted = [x for x in xs if x.requires_grad]
    order, parents = _graph([y.grad_fn for y, _ in roots])
    to_x = set().union(*(_ancestors(get_gradient_edge(x).node, parents) for x in wanted))
    through = [(y, g) for y, g in roots if y.grad_fn in to_x]
    whole = [(y, g) for y, g in roots if y.grad_fn not in to_x]  # its subgraph holds no node of to_x
    boundary = [n for n in order if n in to_x and any(f is not None and f not in to_x for f, _ in n.next_functions)]
    arrived: dict[Node, tuple] = {}
    had = [x.grad for x in xs]
    for x in xs:
        x.grad = None
    if through:
        hooks = [n.register_prehook(lambda grads, n=n: arrived.__setitem__(n, grads)) for n in boundary]
        try:
            torch.autograd.backward([y for y, _ in through], _grads(through), inputs=wanted, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
    gxs = []
    for x, before in zip(xs, had):
        g = x.grad
        for y, gy in passed:  # the output is this input: its gradient is the received one
            if y is x and gy is not None:
                g = gy if g is None else g + gy
        gxs.append(g)
        x.grad = before
    kept = [_Boundary(n, arrived[n], _leaves([f for f, _ in n.next_functions if f is not None and f not in to_x]))
            for n in boundary if n in arrived]
    return tuple(gxs), WeightGradients(kept, whole=(tuple(y for y, _ in whole), _grads(whole)) if whole else None)


def _grads(pairs) -> list | None:
    """The gradients of ``(output, gradient)`` pairs as ``backward`` takes them (None: a scalar loss's ones)."""
    return None if all(g is None for _, g in pairs) else [g for _, g in pairs]


def _graph(roots: list[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Nodes reachable from ``roots`` in a fixed (depth-first) order, and each node's parents."""
    order, parents, seen, stack = [], {}, set(), []
    for root in roots:
        if root not in seen:
            seen.add(root)
            order.append(root)
            stack.append(root)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            parents.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                order.append(nxt)
                stack.append(nxt)
    return order, parents


def _ancestors(node: Node, parents: dict[Node, list[Node]]) -> set[Node]:
    """``node`` and every node from which it is reachable."""
    if node not in parents:
        return set()
    found, stack = {node}, [node]
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def _leaves(nodes: list[Node]) -> list[torch.Tensor]:
    """The leaf tensors (gradient accumulators' variables) under ``nodes``, in a fixed order."""
    out, seen, stack = [], set(nodes), list(reversed(nodes))
    while stack:
        node = stack.pop()
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            out.append(leaf)
        for nxt, _ in reversed(node.next_functions):
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return out
