"""``train.fp8: rowwise`` on a model: every linear of the transformer blocks (the attention projections
and the MLP) becomes a :class:`~parallel4d.fp8.linear.RowwiseLinear` over the same parameters — on the 2D
grid each block's :class:`~parallel4d.tensor2d.layers.Linear2D` runs its SUMMA products in FP8
(:class:`~parallel4d.tensor2d.summa.RowwiseFP8`); the embedding and the LM head stay as they are (torchtitan
leaves its output layer in 16 bits too). Where the layout splits a micro-batch's tokens over ranks, the
engine passes the reduction of ``dW``'s token amaxes over them (``token_sync``, see :mod:`parallel4d.fp8.linear`)."""

from __future__ import annotations

import torch.nn as nn

from parallel4d.fp8.linear import RowwiseLinear
from parallel4d.fp8.rowwise import AmaxSync
from parallel4d.tensor2d.layers import Linear2D
from parallel4d.tensor2d.summa import RowwiseFP8


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a dense model (``.blocks``, a list) or of a rank's local model (a dict)."""
    blocks = model.blocks
    return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)


def use_fp8(model: nn.Module, token_sync: AmaxSync = None) -> list[str]:
    """Swap every ``nn.Linear`` inside ``model``'s blocks for a :class:`RowwiseLinear` holding its
    parameters (names, values and optimizer identity unchanged), and turn on FP8 in every
    :class:`Linear2D` there (``token_sync``: the MAX reduction of an amax over the data replicas holding
    the micro-batch's other tokens, for the weight gradients; None: none do). Returns the changed modules'
    names within their block, block by block."""
    done = []
    for block in blocks_of(model):
        for name, module in list(block.named_modules()):
            if isinstance(module, Linear2D):
                module.fp8 = RowwiseFP8(token_sync)
                done.append(name)
            elif type(module) is nn.Linear:
                parent, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(parent) if parent else block, leaf, RowwiseLinear.of(module, token_sync))
                done.append(name)
    return done


def fp8_linears(model: nn.Module) -> int:
    """How many of ``model``'s modules compute in FP8: each :class:`RowwiseLinear`, and each linear whose ``fp8``
    recipe is set (a 2D block's SUMMA linear, #50.4). summary.json's ``fp8``: ``parallel4d check`` reads it to say
    its comparison ran FP8 products."""
    return sum(isinstance(m, RowwiseLinear) or getattr(m, "fp8", None) is not None for m in model.modules())
