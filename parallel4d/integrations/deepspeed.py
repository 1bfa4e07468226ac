"""parallel4d inside DeepSpeed: the mesh as DeepSpeed's ``mpu`` and parameters tagged for it.

Work in progress (issue #14): what is here is the contract DeepSpeed's ZeRO and gradient
clipping read — ``Mesh.as_mpu()`` (parallel4d/mesh.py), :func:`tag_parameters` — and
:func:`avoid_compiled_ops`; ``build_model`` / ``initialize`` come next.

DeepSpeed counts a parameter's squared gradient norm on every rank if it is tagged
``tensor_model_parallel``, otherwise only on tensor-parallel rank 0, then sums over the
ZeRO group and the model-parallel group (pp × grid). That binary rule cannot say "one copy
per grid column" — what a 2D bias or norm (replicated over ``tp_row``) needs — so the tag is
set per rank: a parameter is tagged where its copy is the one to count (everywhere for a
unique block, on grid row 0 for a row-replicated one) and untagged elsewhere, where
DeepSpeed skips it (those ranks have a tensor-parallel rank ≠ 0). Under tp = 1 every
rank has tensor-parallel rank 0 and counts its own stages. The copy of a tied table on the
last pipeline stage is ``ds_pipe_replicated`` (skipped: the first stage counts it).
"""

from __future__ import annotations

import importlib

import torch.nn as nn

from ..mesh import Mesh

# `import deepspeed.comm.torch as m` would bind the package attribute `torch`: the torch library
deepspeed_comm = importlib.import_module("deepspeed.comm.torch")


def tag_parameters(model: nn.Module, mesh: Mesh, tied_copies=()) -> None:
    """Set ``tensor_model_parallel`` (and ``ds_pipe_replicated`` on ``tied_copies``, the
    pipeline's second copies of tied tables) so DeepSpeed counts every dense element once."""
    on_first_row = mesh.rank("tp_row") == 0
    copies = {id(p) for p in tied_copies}
    for p in model.parameters():
        row_replica = "tp_row" in getattr(p, "tensor2d_replicated_over", ())
        p.tensor_model_parallel = on_first_row or not row_replica
        p.ds_pipe_replicated = id(p) in copies


def avoid_compiled_ops() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory all-reduce op (g++ and ninja, ~45 s
    on first use): it serves only inference all-reduces on one host; training uses the
    process groups. Call before ``deepspeed.initialize``; idempotent."""
    deepspeed_comm.build_shm_op = lambda: None
