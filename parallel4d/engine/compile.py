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

import torch
import torch.nn as nn

#: torch.compile's backend for the blocks: inductor, torch's default. A seam for the tests: the
#: multi-process composition test sets "aot_eager" in its workers (dynamo and AOTAutograd, the same
#: graphs and graph breaks, without inductor's code generation: minutes less on the CI's 2 cores).
BACKEND = "inductor"


def compile_block(block: nn.Module, eager_layers: bool = False) -> nn.Module:
    """``block`` with its ``forward`` compiled by :data:`BACKEND` (in place; returns it).

    ``eager_layers`` (hetero): the layers inside the block that hold parameters run eagerly too. Their
    hooks (which swap ``param.data``) break the graph before and after each of them anyway; compiled,
    each layer's forward (one linear or norm) would be a graph of its own, compiled again for every
    shape (qkv, projection, MLP) until dynamo's recompile limit, with nothing to fuse."""
    if eager_layers:
        for layer in block.modules():
            if layer is not block and next(layer.parameters(recurse=False), None) is not None:
                layer.forward = torch.compiler.disable(layer.forward)
    block.forward = torch.compile(block.forward, backend=BACKEND)
    return block
