"""``train.compile: blocks``: each transformer block's forward compiled on its own by ``torch.compile``.

Regional compilation (as torchtitan compiles each transformer block): every block of a rank is
compiled separately but from the same code, so dynamo traces one block and the others reuse its
graphs (their guards hold for every block); the embedding, the head, the loss, the pipeline's
sends and receives and the optimizer stay eager. What a block cannot hold runs eagerly inside it,
each a graph break (``torch.compiler.disable``): the collectives of 2D tensor parallelism and ring
attention (:func:`~parallel4d.distributed.comm.eager`), and under hetero every layer that holds
parameters, with its hooks. What lies between them (norms, activations, attention's local kernels,
residual adds) is compiled.

The compiled ``forward`` is an instance attribute: the block's own hooks run outside it, its
names and state dict are unchanged, and activation checkpointing
(:func:`~.compose.recompute_in_backward`) wraps the compiled forward, so the recomputation in the
backward runs the same compiled graph.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from parallel4d.fp8.linear import traced_token_syncs

#: torch.compile's backend for the blocks: inductor, torch's default. A seam for the tests: the
#: multi-process composition test sets "aot_eager" in its workers (dynamo and AOTAutograd, the same
#: graphs and graph breaks, without inductor's code generation: minutes less on the CI's 2 cores).
BACKEND = "inductor"


def compile_block(block: nn.Module, eager_layers: bool = False) -> nn.Module:
    """``block`` with its ``forward`` compiled by :data:`BACKEND` (in place; returns it).

    ``eager_layers`` (hetero): the layers inside the block that hold parameters run eagerly too. Their
    hooks (which swap ``param.data``) break the graph before and after each of them anyway; compiled,
    each layer's forward (one linear or norm) would be a graph of its own, compiled again for every
    shape (qkv, projection, MLP) until dynamo's recompile limit, with nothing to fuse. They are looked
    up at the first call (:func:`run_eagerly`), not now: ``train.fp8`` swaps the linears after this; so are
    the traced collectives to count (:func:`counting_traced_collectives`), once, off the step's path."""
    compiled = torch.compile(block.forward, backend=BACKEND)
    counts: list = []  # filled at the first call: [the counting calls of the block's traced collectives]

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        if not counts:
            if eager_layers:
                run_eagerly(layers_holding_parameters(block))
            counts.append(traced_token_syncs(m for m in block.modules() if not _eager(m)))
        return counting_traced_collectives(counts[0], compiled(*args, **kwargs))

    block.forward = forward
    return block


def layers_holding_parameters(block: nn.Module) -> list[nn.Module]:
    """The modules inside ``block`` (not itself) that hold parameters of their own."""
    return [layer for layer in block.modules()
            if layer is not block and next(layer.parameters(recurse=False), None) is not None]


def run_eagerly(layers: list[nn.Module]) -> None:
    """Each of ``layers``' ``forward`` a ``torch.compiler.disable``d call (once: those already are stay)."""
    for layer in layers:
        if not _eager(layer):
            layer.forward = torch.compiler.disable(layer.forward)


def counting_traced_collectives(counts: list, out):
    """``out`` (what a block's compiled forward returned), counting the collectives its graphs trace, which
    no Python runs to count: an FP8 linear's token-amax all-reduce over the data replicas (``train.fp8:
    rowwise`` with dp·sp > 1, :func:`~parallel4d.fp8.linear.traced_token_syncs`) runs in the compiled backward,
    once per linear per backward through the block — counted when the block's output gradient arrives (a
    hook: once per backward, and never for a recomputation's output, which no gradient reaches). Eager
    layers (hetero's) are not traced: they count their own. ``counts``: the block's counting calls
    (:func:`~parallel4d.fp8.linear.traced_token_syncs` of its traced modules)."""
    if counts and isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(lambda grad: _run_all(counts))
    return out


def _run_all(calls: list) -> None:
    for call in calls:
        call()


def _eager(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward is a ``torch.compiler.disable``d call (:func:`run_eagerly`)."""
    return getattr(layer.__dict__.get("forward"), "_torchdynamo_disable", False)
