"""Checkpoint state by the dense model's names: where each local parameter sits in the
single-process model (:func:`dense_layouts`), and this rank's parameters and optimizer state
to and from DCP entries under those names, loadable under any layout."""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel4d.checkpoint.shards import DenseShards, Pieces, whole
from parallel4d.engine.model import PositionedEmbedding
from parallel4d.models.build import Shape, build_stage
from parallel4d.models.lora import is_adapter
from parallel4d.models.moe.layer import Experts
from parallel4d.models.stages import stage_names
from parallel4d.tensor2d import Composite2D


def dense_layouts(stages: dict[str, nn.Module], tied: bool) -> dict[str, tuple[str, tuple, Pieces]]:
    """``{name in LocalModel: (dense name, dense shape, pieces)}`` for every parameter name
    (tied aliases included): where each local parameter sits in the single-process model.

    A 2D stage reports its own layout; an MoE layer's experts under expert parallelism are one box
    of each stacked tensor, rows ``held`` along ``E`` (:meth:`~parallel4d.models.moe.layer.Experts.dense_layout`,
    as a 2D block is a box of its matrix); any other parameter is the whole dense tensor.
    A tied LM head (shared, or its untied copy on the last pipeline stage) is the token
    table ``embed.tok.weight``."""
    out = {}
    for stage_name, stage in stages.items():
        local = f"{stage_name}."
        if isinstance(stage, PositionedEmbedding):  # a wrapper; the dense stage has no such level
            stage, local = stage.embed, f"{local}embed."
        if isinstance(stage, Composite2D):  # a 2D stage: its parts say where they sit
            found = {n: (d, shape, pieces) for n, (d, (shape, pieces)) in stage.dense_layout().items()}
        else:
            found = {n: (n, tuple(p.shape), whole) for n, p in stage.named_parameters(remove_duplicate=False)}
            found.update(_expert_boxes(stage))
        for name, (dense, shape, pieces) in found.items():
            dense = f"{stage_name}.{dense}"
            if tied and dense == "head.weight":
                dense = "embed.tok.weight"
            out[local + name] = (dense, shape, pieces)
    return out


def _expert_boxes(stage: nn.Module) -> dict[str, tuple[str, tuple, Pieces]]:
    """``{name: (dense name, dense shape, pieces)}`` of the stage's experts (all E of them when held whole;
    one module per expert: each weight a row of its stacked tensor)."""
    return {f"{prefix}.{name}": (f"{prefix}.{module.dense_name(name)}", shape, pieces)
            for prefix, module in stage.named_modules()
            if isinstance(module, Experts) for name, (shape, pieces) in module.dense_layout().items()}


LocalState = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]  # (parameters, optimizer state)


def dense_state_dict(step: int, tokens_seen: int, local: LocalState, layouts: dict) -> dict:
    """``step`` and ``tokens_seen``, then this rank's ``(parameters, optimizer state)`` (by LocalModel
    name, tied aliases included) under the dense model's names and shapes (``model.<dense name>``,
    ``optim.<dense name>.<step|exp_avg|exp_avg_sq>``; each a :class:`DenseShards` of this rank's
    pieces, ``layouts``: :func:`dense_layouts`): loadable under any layout."""
    out = {"step": torch.tensor(step), "tokens_seen": torch.tensor(tokens_seen)}
    params, optim = local

    def put(key, shape, t, pieces, name):  # several local tensors of one dense tensor: one expert each
        if key in out:
            out[key].add(name, t, pieces)
        else:
            out[key] = DenseShards(shape, t, pieces, name)

    for name, t in params.items():
        dense, shape, pieces = layouts[name]
        put(f"model.{dense}", shape, t, pieces, name)
    for name, state in optim.items():
        dense, shape, pieces = layouts[name]
        out.setdefault(f"optim.{dense}.step", state["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            put(f"optim.{dense}.{k}", shape, state[k], pieces, name)
    return out


def local_state(state: dict, layouts: dict) -> LocalState:
    """The inverse of :func:`dense_state_dict` on a template ``checkpoint.load`` filled: this
    rank's ``(parameters, optimizer state)`` by LocalModel name (optimizer state only for the
    parameters that have one)."""
    params, optim = {}, {}
    for name, (dense, _, _) in layouts.items():
        params[name] = state[f"model.{dense}"].tensor_of(name)
        if f"optim.{dense}.step" in state:
            optim[name] = {"step": state[f"optim.{dense}.step"],
                           **{k: state[f"optim.{dense}.{k}"].tensor_of(name) for k in ("exp_avg", "exp_avg_sq")}}
    return params, optim


def saved_layouts(layouts: dict, lora: bool) -> dict:
    """What a checkpoint holds of :func:`dense_layouts`' ``layouts``: every parameter, or with ``model.lora``
    the adapters only (the frozen base is named by the checkpoint, not copied: ``checkpoint/lora_base.py``)."""
    return {n: v for n, v in layouts.items() if is_adapter(v[0])} if lora else layouts


def checkpoint_keys(shape: Shape, adapters: list[str] | None = None) -> set[str]:
    """Every key :func:`dense_state_dict` has on some rank: the whole model's, from its shapes; with
    ``adapters`` (``models.lora.adapter_names``: a LoRA job's adapter parameters, the routed experts' too) the
    adapters' and their optimizer state's only."""
    keys = {"step", "tokens_seen"}
    if adapters:
        dense = adapters
        return keys | {f"model.{d}" for d in dense} | {f"optim.{d}.{k}" for d in dense
                                                        for k in ("step", "exp_avg", "exp_avg_sq")}
    for index, stage_name in enumerate(stage_names(shape)):
        for name, p in build_stage(shape, index, meta=True).named_parameters():
            dense = f"{stage_name}.{name}"
            if shape.tie_embeddings and dense == "head.weight":
                continue
            keys.add(f"model.{dense}")
            if p.requires_grad:
                keys.update(f"optim.{dense}.{k}" for k in ("step", "exp_avg", "exp_avg_sq"))
    return keys
