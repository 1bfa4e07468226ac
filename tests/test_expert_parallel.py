"""``parallel.ep`` in the engine (#48.2): an MoE llama's experts split over ep of the dp·sp data-replica
ranks, trained in float64 on 4 gloo workers, equal to one process on the whole batch — every loss
(1e-10) and every parameter after 3 AdamW steps with clipping (1e-9) — with the load-balancing loss
on (its statistics summed over the data replicas) and with packed documents; a checkpoint saved at
ep=2 resumed at ep=1, ep=4, dp=4 and tp=4, and one saved at tp=4 resumed at ep=2 (experts saved as boxes of
the stacked tensors, any layout loads them); and a Qwen3-MoE directory loaded at ep=2, each rank reading its
experts only.

Layouts: dp=2 × sp=2 at ep 1 (experts replicated, reduced as dense weights), 2 and 4 (with Ulysses), dp=4 at ep=2, the
2D grid tp=4 (q=2: the MoE layers' tokens split over the grid, experts whole on each rank; models/moe/tp2d.py),
hetero (ZeRO over the data replicas, the experts' rows over their replicas), and pipelines with ep: Hanayo
pp=2 × dp=2 and zb_h1 (split backward) pp=2 × sp=2, where the load-balancing loss's statistics travel with
the activations from chunk to chunk (models/moe/balance.py).
The auxiliary loss is a forward's (a micro-batch's): with m micro-batches the one process runs rows
``[i·B/m, (i+1)·B/m)`` as forward i, and every layout's micro-batch i is those rows (``engine/batch.py``: each
rank holds its share of each micro-batch), so the plain one-process reference holds at dp·q > 1 too;
``parallel4d check`` of an ep job with 2 micro-batches compares against exactly that.

The same workers train LoRA (``model.lora``, #49) on the dense llama: dp × ring sp with recomputation, 2
micro-batches and adapter dropout, Ulysses, Hanayo, zb_h1 (split backward: the W pass finds weight gradients for
the adapters only), packed documents and the 2D grid tp=4 (also GPT-2's fused c_attn there), each equal to one
process with the same adapters, the base unchanged and only the adapters trained, reduced and given optimizer
state (:data:`LORA_LAYOUTS`).

And FP8 (``train.fp8: rowwise``, #50) on the dense llama in float32: dp × ring sp with recomputation, dp × Ulysses,
1F1B, Hanayo, zb_h1 and zbv (split backward), hetero ZeRO and packed documents, each within 1e-6 of one process in
FP8 over 4 steps, the weight gradients' token amaxes MAX-reduced over the data replicas (:data:`FP8_LAYOUTS`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import run_workers
import torch.nn.functional as F

from parallel4d.data.packing import IGNORE, boundary_targets, document_starts
from parallel4d.models.lora import LoraShape, adapted_modules, add_adapters, is_adapter
from parallel4d.models.moe.balance import load_balancing_loss
from test_llama import check_pieces, dense_run
from test_packed_training import EOD

BASE = {"model": {"arch": "llama", "vocab_size": 16, "seq_len": 16, "hidden": 32, "heads": 4, "kv_heads": 2,
                  "layers": 3, "intermediate_size": 40, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "mlp_only_layers": [1],
                  "output_router_logits": True, "router_aux_loss_coef": 0.5},
        "data": {"source": "synthetic", "batch_size": 8},
        "optimizer": {"lr": 0.02, "warmup_steps": 1, "weight_decay": 0.1, "schedule": "cosine", "min_lr": 0.002},
        "train": {"steps": 3, "dtype": "float64", "grad_clip": 0.05, "timeout_s": 60}}


def _job(parallel: dict, **sections) -> dict:
    """BASE at ``parallel``; ``sections`` replace BASE's (``train`` is merged into it)."""
    return {**BASE, "parallel": parallel, **sections, "train": {**BASE["train"], **sections.get("train", {})}}


#: hetero's chunks: a device budget below each rank's model data (chunks move), ZeRO over the data replicas, the
#: experts' rows sharded over their replicas
HETERO = {"enabled": True, "chunk_elems": 2048, "device_budget_bytes": 150_000}
HETERO_EP = "dp=2 × sp=2, ep=2, hetero (a budget below the model)"
PACKED = "dp=2 × sp=2, ep=2, packed documents"
COMPILED = "dp=2 × sp=2, ep=2, compiled blocks"
ACCUMULATED = "dp=2 × sp=2, ep=2, 2 micro-batches, blocks recomputed"
GRID = "tp=4 (q=2), 2 micro-batches, blocks recomputed"
GRID_HETERO = "tp=4 (q=2), hetero (a budget below the model)"
HANAYO = "Hanayo pp=2 × dp=2, ep=2, 2 micro-batches, blocks recomputed"
ZERO_BUBBLE = "zb_h1 pp=2 × sp=2, ep=2, 2 micro-batches"
LORA = "dp=2 × sp=2, ep=2, LoRA on attention, the shared expert, the dense layer and the experts"
#: model.lora's adapters: the experts' stacked ones split with their experts (summed over the expert replicas)
LORA_SECTION = {"rank": 2, "alpha": 6, "rslora": True, "targets": ["q_proj", "o_proj", "gate_proj", "up_proj",
                                                                   "down_proj"]}
LORA_HANAYO = "Hanayo pp=2 × dp=2, ep=2, 2 micro-batches, LoRA on attention, the shared expert and the experts"
LORA_GRID = "tp=4 (q=2), LoRA on attention, the shared expert, the dense layer and the experts"
LORA_HETERO_EXPERTS = ("LoRA dp=2 × sp=2, ep=2, hetero, on attention, the shared expert, the dense layer and the "
                       "experts")
FOUR_AXES = "Hanayo pp=2 × zigzag ring sp=2 × tp=4, ep=2, hetero, 2 micro-batches, blocks recomputed"
LAYOUTS = {
    "dp=2 × sp=2, ep=1": _job({"dp": 2, "sp": 2}),
    "dp=2 × sp=2, ep=2": _job({"dp": 2, "sp": 2, "ep": 2}),
    # Ulysses: attention trades heads for sequence over the sp ranks; the MoE layers see [b, s/sp, h] as with a ring
    "dp=2 × Ulysses sp=2, ep=4": _job({"dp": 2, "sp": 2, "ep": 4}, sequence={"ulysses": 2}),
    "dp=4, ep=2": _job({"dp": 4, "ep": 2}),
    ACCUMULATED: _job({"dp": 2, "sp": 2, "ep": 2}, pipeline={"microbatches": 2},
                      train={"activation_checkpointing": "blocks"}),
    COMPILED: _job({"dp": 2, "sp": 2, "ep": 2}, train={"compile": "blocks"}),  # the dispatch a graph break
    "dp=4, ep=1, hetero": _job({"dp": 4}, hetero={"enabled": True, "chunk_elems": 2048}),
    # the grid's gradient sums taken on the parameters hetero has placed (each submodule's own forward)
    GRID_HETERO: _job({"tp": 4}, hetero=HETERO),
    HETERO_EP: _job({"dp": 2, "sp": 2, "ep": 2}, hetero=HETERO),  # the last hetero job: its statistics kept
    PACKED: _job({"dp": 2, "sp": 2, "ep": 2},  # 4 rows: the reference runs each document alone
                 data={**BASE["data"], "batch_size": 4, "packing": "documents", "eod_token": EOD}),
    # the q=2 grid: experts whole on each rank; each grid row holds its half of each micro-batch
    GRID: _job({"tp": 4}, pipeline={"microbatches": 2}, train={"activation_checkpointing": "blocks"}),
    # 4 chunks: [embedding, MoE layer 0] on pp rank 0, [dense layer 1], [MoE layer 2] on rank 1, [head] on rank 0
    HANAYO: _job({"pp": 2, "dp": 2, "ep": 2}, pipeline={"schedule": "hanayo", "waves": 1, "microbatches": 2},
                 train={"activation_checkpointing": "blocks"}),
    # [embedding, MoE layer 0, layer 1] on pp rank 0, [MoE layer 2, head: the loss] on rank 1
    ZERO_BUBBLE: _job({"pp": 2, "sp": 2, "ep": 2}, pipeline={"schedule": "zb_h1", "microbatches": 2}),
    LORA: _job({"dp": 2, "sp": 2, "ep": 2}, model={**BASE["model"], "lora": LORA_SECTION}),
    # the experts' adapters drawn from their stage's generator: pp rank 1's MoE layer 2 draws one process's
    LORA_HANAYO: _job({"pp": 2, "dp": 2, "ep": 2}, pipeline={"schedule": "hanayo", "waves": 1, "microbatches": 2},
                      model={**BASE["model"], "lora": LORA_SECTION}),
    # the grid: the experts' (and the shared expert's) adapters whole on each grid rank, their gradients summed
    # over the grid inside their own modules' forward as the experts' weights' are (models/moe/tp2d.py)
    LORA_GRID: _job({"tp": 4}, model={**BASE["model"], "lora": LORA_SECTION}),
}

# --- LoRA (#49) on a dense llama in the data, sequence and pipeline layouts: trained in this job's workers ---
LORA_MODEL = {k: BASE["model"][k] for k in ("arch", "vocab_size", "seq_len", "hidden", "heads", "kv_heads", "layers",
                                              "intermediate_size")}
DENSE_LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]}


def _lora_job(parallel: dict, dropout: float = 0.0, **sections) -> dict:
    """The dense llama with adapters on its seven linears (``model.lora.dropout`` ``dropout``) at ``parallel``."""
    return _job(parallel, model={**LORA_MODEL, "lora": {**DENSE_LORA, "dropout": dropout}}, **sections)


LORA_PACKED = "LoRA dp=2 × sp=2, packed documents"
LORA_LAYOUTS = {
    # the adapters' gradients reduced in buckets over the 4 data replicas, the base's not at all
    "LoRA dp=2 × ring sp=2, 2 micro-batches, blocks recomputed, adapter dropout":
        _lora_job({"dp": 2, "sp": 2}, 0.1, pipeline={"microbatches": 2}, train={"activation_checkpointing": "blocks"}),
    "LoRA dp=2 × Ulysses sp=2, adapter dropout": _lora_job({"dp": 2, "sp": 2}, 0.1, sequence={"ulysses": 2}),
    # 4 chunks: [embedding (frozen: its output needs no gradient), layer 0], [layer 1], [layer 2], [head]
    "LoRA Hanayo pp=2 × dp=2, 2 micro-batches, blocks recomputed, adapter dropout":
        _lora_job({"pp": 2, "dp": 2}, 0.1, pipeline={"schedule": "hanayo", "waves": 1, "microbatches": 2},
                  train={"activation_checkpointing": "blocks"}),
    # the split backward's W pass: weight gradients for the adapters only, the frozen linears none
    "LoRA zb_h1 pp=2 × sp=2, 2 micro-batches, adapter dropout":
        _lora_job({"pp": 2, "sp": 2}, 0.1, pipeline={"schedule": "zb_h1", "microbatches": 2}),
    LORA_PACKED: _lora_job({"dp": 2, "sp": 2},  # 4 rows: the reference runs each document alone (no dropout)
                           data={**BASE["data"], "batch_size": 4, "packing": "documents", "eod_token": EOD}),
    # the 2D grid (models/lora.py LoraLinear2D): x·A_jᵀ all-reduced over the grid row, again in the recomputation;
    # each rank's dropout mask the grid column's input features of its batch block
    "LoRA tp=4 (q=2), 2 micro-batches, blocks recomputed, adapter dropout":
        _lora_job({"tp": 4}, 0.1, pipeline={"microbatches": 2}, train={"activation_checkpointing": "blocks"}),
    # GPT-2's fused c_attn on the grid: one adapter over q, k and v, its lora_B rows permuted as the weight's
    "LoRA gpt2 tp=4 (q=2), c_attn, c_proj, c_fc, rsLoRA, adapter dropout":
        _job({"tp": 4}, model={**{k: LORA_MODEL[k] for k in ("vocab_size", "seq_len", "hidden", "heads", "layers")},
                               "arch": "gpt2", "lora": {"rank": 2, "alpha": 6, "rslora": True, "dropout": 0.1,
                                                        "targets": ["c_attn", "c_proj", "c_fc"]}},
             optimizer={**BASE["optimizer"], "lr": 0.05}),  # its third loss below its first (the test's check)
}  # compiled blocks: tests/test_lora.py, in one process (compiling in 4 workers on 2 cores took 35 s)
#: LoRA under hetero beside the other axes (dp alone: tests/test_hetero_master.py): the frozen base in chunks of
#: its own rows (no gradient, master or moments), moving under a budget below the model
LORA_HETERO = {
    "LoRA dp=2 × ring sp=2, hetero, 2 micro-batches, adapter dropout":
        _lora_job({"dp": 2, "sp": 2}, 0.1, pipeline={"microbatches": 2}, hetero=HETERO),
    "LoRA tp=4 (q=2), hetero, adapter dropout": _lora_job({"tp": 4}, 0.1, hetero=HETERO),
    "LoRA Hanayo pp=2 × dp=2, hetero, 2 micro-batches, adapter dropout":
        _lora_job({"pp": 2, "dp": 2}, 0.1, pipeline={"schedule": "hanayo", "waves": 1, "microbatches": 2},
                  hetero=HETERO),
    # the experts one module each (hetero), each with its rows of the experts' adapters, split over ep=2
    LORA_HETERO_EXPERTS: _job({"dp": 2, "sp": 2, "ep": 2}, hetero=HETERO,
                              model={**BASE["model"], "lora": LORA_SECTION}),
}

#: ``train.fp8: rowwise`` (#50) on the 2D grid, float32 (products written in float32 on the CPU), 4 steps: every block
#: linear's SUMMA products in FP8 with one process's scales (amaxes reduced over the grid), panels in eight bits.
#: AdamW's eps at 1e-5, not 1e-8: its first update lr·g/(|g|+eps) turns a gradient that is float32 noise (|g| ≲ 1e-8,
#: e.g. GPT-2's key bias, whose true gradient is 0) into a move of up to lr that differs between any two summation
#: orders; FP8 then rounds the moved weights to other e4m3 values and the runs part (GPT-2's third loss by 1.5e-4 at
#: eps 1e-8) — no layout can order float32 sums as one process does. With eps above that noise the runs agree to 1e-7.
FP8_TRAIN = {"steps": 4, "dtype": "float32", "fp8": "rowwise"}
FP8_OPT = {**BASE["optimizer"], "eps": 1e-5}
FP8_GPT2 = {**{k: LORA_MODEL[k] for k in ("vocab_size", "seq_len", "hidden", "heads", "layers")}, "arch": "gpt2"}
FP8_GRID = {
    "FP8 llama tp=4 (q=2), 2 micro-batches, blocks recomputed":
        _job({"tp": 4}, model={k: v for k, v in LORA_MODEL.items()}, pipeline={"microbatches": 2},
             train={**FP8_TRAIN, "activation_checkpointing": "blocks"}, optimizer=FP8_OPT),
    "FP8 gpt2 tp=4 (q=2)": _job({"tp": 4}, model=FP8_GPT2, train=FP8_TRAIN, optimizer=FP8_OPT),
}


# --- FP8 (#50): the dense llama's blocks in FP8 (train.fp8: rowwise) in float32, in the data, sequence and
# pipeline layouts and hetero: trained in this job's workers ---


def _fp8_job(parallel: dict, **sections) -> dict:
    """The dense llama in float32 with its blocks' linears in FP8, 4 steps, at ``parallel``."""
    train = {**BASE["train"], "dtype": "float32", "fp8": "rowwise", "steps": 4, **sections.pop("train", {})}
    return _job(parallel, model=LORA_MODEL, train=train, **sections)


FP8_HETERO = "FP8 hetero (ZeRO over dp=2 × ring sp=2, a budget below the model)"
FP8_PACKED = "FP8 dp=2 × ring sp=2, packed documents"
FP8_LAYOUTS = {
    "FP8 dp=2 × ring sp=2, 2 micro-batches, blocks recomputed":
        _fp8_job({"dp": 2, "sp": 2}, pipeline={"microbatches": 2}, train={"activation_checkpointing": "blocks"}),
    "FP8 dp=2 × Ulysses sp=2": _fp8_job({"dp": 2, "sp": 2}, sequence={"ulysses": 2}),
    "FP8 1F1B pp=2 × dp=2, 2 micro-batches": _fp8_job({"pp": 2, "dp": 2},
                                                       pipeline={"schedule": "1f1b", "microbatches": 2}),
    "FP8 Hanayo pp=2 × dp=2, 2 micro-batches, blocks recomputed":
        _fp8_job({"pp": 2, "dp": 2}, pipeline={"schedule": "hanayo", "waves": 1, "microbatches": 2},
                 train={"activation_checkpointing": "blocks"}),
    # the split backward: B's dX products alone, W's dW products and their amax reductions alone
    "FP8 zb_h1 pp=2 × sp=2, 2 micro-batches": _fp8_job({"pp": 2, "sp": 2},
                                                        pipeline={"schedule": "zb_h1", "microbatches": 2}),
    "FP8 zbv pp=2 × dp=2, 2 micro-batches": _fp8_job({"pp": 2, "dp": 2}, pipeline={"schedule": "zbv", "microbatches": 2}),
    FP8_HETERO: _fp8_job({"dp": 2, "sp": 2}, hetero={"enabled": True, "chunk_elems": 2048,
                                                     "device_budget_bytes": 60_000}),
    FP8_PACKED: _fp8_job({"dp": 2, "sp": 2}, data={**BASE["data"], "batch_size": 4, "packing": "documents",
                                                   "eod_token": EOD}),
}


def fp8_held(engine) -> dict:
    """What an FP8 job's rank ran: its FP8 linears, the token-amax all-reduces it made (``fp8.amax``) and, under
    hetero, the bytes its chunks moved."""
    from parallel4d.fp8.linear import RowwiseLinear

    linears = [m for m in engine.store.model.modules() if isinstance(m, RowwiseLinear)]
    return {"linears": len(linears), "synced": sum(m.token_sync is not None for m in linears),
            "amax all-reduces": engine.mesh.comm_stats.calls.get("fp8.amax", 0),
            "bytes moved": engine.hetero_stats()["bytes_moved"] if engine.cfg.hetero.enabled else None}


def held_for_training(engine) -> dict[str, list[str]]:
    """What this rank holds for training, by local parameter name: what the store trains, what the gradient
    buckets reduce, what the optimizer keeps state for, and the parameters with a gradient after the step."""
    named = {id(p): n for n, p in engine.store.model.named_parameters()}
    buckets = getattr(engine.store, "grad_sync", None)
    return {"trained": sorted(named[id(p)] for p in engine.store.params),
            "reduced": sorted(named[id(p)] for b in (buckets.buckets if buckets else ()) for p in b.params),
            "optimizer state": sorted(named[id(p)] for p in engine.store.optimizer.state),
            "with a gradient": sorted(n for n, p in engine.store.model.named_parameters() if p.grad is not None),
            "adapters": sorted(n for n in named.values() if is_adapter(n))}


def summa_traffic(engine) -> dict:
    """What this rank's SUMMA ops moved over the job: per label (``"{layer}:summa_ab/bcast_b"``, ``".../amax_a"``)
    ``(bytes sent, calls)``, and under ``"weights"`` each grid layer's local weight's element count by its name."""
    stats = engine.mesh.comm_stats
    return {"weights": {m.name: m.weight.numel() for m in engine.store.model.modules() if hasattr(m, "grid")
                        and isinstance(getattr(m, "weight", None), torch.Tensor)},
            **{label: (n, stats.calls[label]) for label, n in stats.sent.items() if ":summa_" in label}}


def hetero_frozen(engine) -> dict:
    """Under hetero: the frozen rows and their parameters, and the bytes moved between host and device."""
    stats = engine.hetero_stats()
    return {k: stats[k] for k in ("frozen_rows", "frozen_params", "bytes_moved")}


#: hetero's ZeRO with experts 1 and 3 chosen by no token (tests/test_hetero_experts.py's one-sided router, top-1):
#: every rank skips its second expert (1 on ep rank 0, 3 on ep rank 1), agreed over the 4 data replicas
UNCHOSEN = "dp=2 × sp=2, ep=2, hetero, top-1, experts 1 and 3 chosen by no token"
UNCHOSEN_JOB = _job({"dp": 2, "sp": 2, "ep": 2}, hetero=HETERO, model={**BASE["model"], "num_experts_per_tok": 1})
EVAL_BATCH = 50  # a batch no step trained on, evaluated after the resumed step
# a checkpoint at step 2 of ep=2 (dp=2 × sp=2), resumed for step 3 in each of these
RESUMED = {"ep=1": {"dp": 2, "sp": 2}, "ep=4": {"dp": 2, "sp": 2, "ep": 4}, "dp=4, ep=2": {"dp": 4, "ep": 2},
           "tp=4": {"tp": 4}}
FROM_GRID = "dp=2 × sp=2, ep=2 from tp=4"  # a checkpoint at step 2 of tp=4, resumed for step 3 at ep=2


def pretrained_job(directory: str, parallel: dict) -> dict:
    """``model.pretrained`` (a Qwen3-MoE directory) evaluated in float64 at ``parallel``."""
    return {"model": {"pretrained": directory, "seq_len": 16}, "parallel": parallel,
            "data": {"source": "synthetic", "batch_size": 4}, "train": {"dtype": "float64", "timeout_s": 60}}


def evaluate_pretrained(directory: str, parallel: dict) -> tuple[float, int]:
    """``(the evaluated loss of batch 0, the bytes this rank read from the directory)``."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    cfg = make_config(pretrained_job(directory, parallel))
    p = cfg.parallel
    mesh = init_mesh(dp=p.dp, sp=p.sp, timeout_s=60)
    engine = compose(cfg, mesh)
    loss = float(engine.evaluate(*build_dataset(cfg).batch(0)))
    read = engine.pretrained_bytes_read
    engine.close()
    mesh.close()
    return loss, read


def checked_job() -> list[str]:
    """test_check's MoE job (ep=8 over dp=8, 16 experts, the auxiliary loss on) with 2 micro-batches: every data
    replica holds a share of each, so its auxiliary loss is one process's only if the layout's micro-batch i is
    one process's micro-batch i."""
    from test_check import MOE_JOB

    return [*MOE_JOB, "pipeline.microbatches=2"]


def checked_lora_job() -> list[str]:
    """:func:`checked_job` with LoRA adapters on attention, the shared expert, the dense layers and the experts."""
    return [*checked_job(), f"model.lora={json.dumps(LORA_SECTION)}"]


@functools.cache
def check_plan(job=checked_job):
    """``parallel4d check``'s plan of ``job()`` (default :func:`checked_job`) on 4 workers."""
    from parallel4d.tools.check import shrunk
    from test_check import QUICKSTART

    return shrunk(QUICKSTART, job(), max_workers=4)


def _train(jobs: dict, tmp: str, pretrained: str | None) -> dict:
    """On every rank: each job's losses and this rank's pieces of every dense parameter (test_llama's
    format); then ep=2 saved at step 2 and resumed under each of :data:`RESUMED` for step 3; the
    ``pretrained`` directory (None: transformers is missing) evaluated at ep=2; and the layout run of
    :func:`check_plan` (its overrides in ``tmp/check.json``), as ``parallel4d check`` starts it."""
    from test_llama import train_layouts

    from parallel4d.config.load import make_config
    from parallel4d.engine import compile as compile_module

    compile_module.BACKEND = "aot_eager"  # this worker only (test_compile's seam: dynamo and AOTAutograd, no inductor)
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose
    from parallel4d.training.checkpoints import load_checkpoint, save_checkpoint

    out = train_layouts({n: j for n, j in jobs.items()
                         if n not in {**LORA_LAYOUTS, **LORA_HETERO, **FP8_LAYOUTS, **FP8_GRID}},
                        with_hetero_stats=True)
    out.update(train_layouts({n: j for n, j in jobs.items() if n in FP8_GRID}, inspect=summa_traffic))
    out.update(train_layouts({n: j for n, j in jobs.items() if n in LORA_LAYOUTS}, inspect=held_for_training))
    out.update(train_layouts({n: j for n, j in jobs.items() if n in LORA_HETERO}, inspect=hetero_frozen))
    out.update(train_layouts({n: j for n, j in jobs.items() if n in FP8_LAYOUTS}, inspect=fp8_held))
    from test_hetero_experts import one_sided_router, placed_with

    with mock.patch("parallel4d.engine.compose.place_experts", placed_with(one_sided_router)):
        out.update(train_layouts({UNCHOSEN: UNCHOSEN_JOB}))

    def engine_of(parallel):
        cfg = make_config(_job(parallel))
        mesh = init_mesh(dp=cfg.parallel.dp, sp=cfg.parallel.sp, tp=cfg.parallel.tp, timeout_s=60)
        return cfg, mesh, compose(cfg, mesh), build_dataset(cfg)

    def resumed(name, parallel, root):
        """Step 3 at ``parallel`` from the checkpoint under ``root``: its loss and pieces, and an evaluation."""
        cfg, mesh, engine, data = engine_of(parallel)
        load_checkpoint(engine, root)
        loss = float(engine.train_step(*data.batch(engine.step)))
        pieces = {k[len("model."):]: [(tuple(off), view.detach().clone()) for off, view in v.pieces]
                  for k, v in engine.state_dict().items() if k.startswith("model.")}
        out[f"resumed {name}"] = [loss], pieces
        out[f"evaluated {name}"] = float(engine.evaluate(*data.batch(EVAL_BATCH)))
        engine.close()
        mesh.close()

    cfg, mesh, engine, data = engine_of({"dp": 2, "sp": 2, "ep": 2})
    for step in range(2):
        engine.train_step(*data.batch(step))
    save_checkpoint(engine, cfg, root=f"{tmp}/checkpoints")
    engine.close()
    mesh.close()
    for name, parallel in RESUMED.items():
        resumed(name, parallel, f"{tmp}/checkpoints")
    cfg, mesh, engine, data = engine_of({"tp": 4})  # the other way: saved on the grid, resumed at ep=2
    for step in range(2):
        engine.train_step(*data.batch(step))
    save_checkpoint(engine, cfg, root=f"{tmp}/checkpoints-tp")
    engine.close()
    mesh.close()
    resumed(FROM_GRID, {"dp": 2, "sp": 2, "ep": 2}, f"{tmp}/checkpoints-tp")
    if pretrained is not None:
        out["pretrained"] = evaluate_pretrained(pretrained, {"dp": 2, "sp": 2, "ep": 2})
    from parallel4d.config.load import load_config
    from parallel4d.tools.check import into
    from parallel4d.training.loop import run_training
    from test_check import QUICKSTART

    for name in ("check", "check-lora"):
        overrides = json.loads(Path(tmp, f"{name}.json").read_text())
        out[name] = run_training(into(load_config(QUICKSTART, overrides), Path(tmp, name))), f"{tmp}/{name}"
    return out


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str | None:
    """A tiny Qwen3-MoE directory transformers saved (4 experts, top-2, auxiliary loss on); None without
    transformers."""
    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError:
        return None
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False, output_router_logits=True,
        router_aux_loss_coef=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    out = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(out)
    return str(out)


def write_chat_tokens(path: Path) -> Path:
    """A token file of 80 conversations over BASE's 16 ids and its loss mask, as `parallel4d tokenize` writes
    chat data: each a prompt (2–11 tokens, no loss), an answer (1–5 tokens, loss) and the end-of-document
    token :data:`EOD` (no loss); so a window's rows, sequence shards and micro-batches hold different numbers
    of answer tokens."""
    import hashlib
    from array import array

    g, ids, mask = torch.Generator().manual_seed(49), [], []
    for _ in range(80):
        prompt, answer = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((2, 12), (1, 6)))
        ids += [t + (t >= EOD) for t in torch.randint(0, 15, (prompt + answer,), generator=g).tolist()] + [EOD]
        mask += [0] * prompt + [1] * answer + [0]
    data, masks = array("H", ids).tobytes(), bytes(mask)  # uint16 in the machine's order, as tokenize
    path.write_bytes(data)
    path.with_suffix(".mask").write_bytes(masks)
    path.with_suffix(".json").write_text(json.dumps(
        {"dtype": "uint16", "tokens": len(ids), "vocab_size": 16, "max_id": max(ids), "eos_token_id": EOD,
         "sha256": hashlib.sha256(data).hexdigest(),
         "loss_mask": {"sha256": hashlib.sha256(masks).hexdigest(), "tokens_with_loss": sum(mask)}}))
    return path


CHAT = "chat data, dp=2 × ring sp=2, ep=2, 2 micro-batches"
CHAT_PACKED = "chat data packed, dp=2 × ring sp=2, ep=2, 2 micro-batches"


@pytest.fixture(scope="module")
def chat_layouts(tmp_path_factory) -> dict:
    """The chat-data layouts (#49.3): answers only carry loss, unpacked and packed, over every axis that splits
    a batch's answer tokens unevenly (data replicas, ring shards, micro-batches)."""
    path = str(write_chat_tokens(tmp_path_factory.mktemp("chat") / "chat.bin"))
    data = {"source": "tokens", "path": path, "batch_size": 4}  # 4 rows: the packed reference runs each document alone
    return {name: _job({"dp": 2, "sp": 2, "ep": 2}, pipeline={"microbatches": 2}, data={**data, **extra})
            for name, extra in ((CHAT, {}), (CHAT_PACKED, {"packing": "documents"}))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, qwen3_moe, chat_layouts):
    tmp = tmp_path_factory.mktemp("ep")
    (tmp / "check.json").write_text(json.dumps([*checked_job(), *check_plan().overrides]))  # the job's, the check's
    (tmp / "check-lora.json").write_text(json.dumps([*checked_lora_job(), *check_plan(checked_lora_job).overrides]))
    jobs = {**LAYOUTS, **LORA_LAYOUTS, **LORA_HETERO, **FP8_LAYOUTS, **FP8_GRID, **chat_layouts}
    return run_workers(_train, 4, jobs, str(tmp), qwen3_moe, timeout_s=300)


def microbatch_rows(name: str | None = None) -> tuple[tuple[int, ...], ...]:
    """The rows of each micro-batch of job ``name`` (None: BASE's one) as one process cuts its batch of 8:
    ``[i·8/m, (i+1)·8/m)``."""
    m = {**LAYOUTS, **SIXTEEN, **LORA_LAYOUTS}[name].get("pipeline", {}).get("microbatches", 1) if name else 1
    return tuple(tuple(range(i * 8 // m, (i + 1) * 8 // m)) for i in range(m))


def one_process(name: str | None = None):
    """The dense model on the whole batch in this process (the layout changes nothing: one run for all);
    with packed documents each document alone (tests/test_packed_training.py's reference), the
    load-balancing loss over every document's tokens; with m micro-batches one process's m micro-batches
    (:func:`microbatch_rows`), one forward each."""
    if name in (PACKED, LORA, LORA_HANAYO, LORA_GRID):
        return _one_process(name)
    rows = microbatch_rows(name)
    return _one_process(None if len(rows) == 1 else rows)


@functools.cache
def _one_process(how):
    if how == PACKED:
        return dense_run(LAYOUTS[PACKED], loss_of=documents_and_balance)
    if how in (LORA, LORA_GRID):  # the same model and batch: the layouts' one process
        return dense_run(LAYOUTS[LORA], prepare=with_adapters)
    if how == LORA_HANAYO:
        return dense_run(LAYOUTS[how], prepare=with_adapters,
                         loss_of=functools.partial(microbatches, microbatch_rows(how)))
    if how is None:
        return dense_run(BASE)
    return dense_run(BASE, loss_of=functools.partial(microbatches, how))


def with_adapters(model) -> None:
    """The one-process model of :data:`LORA`: its adapters as the engine adds them (seeded ``train.seed``)."""
    from parallel4d.config.load import make_config
    from parallel4d.models.lora import LoraShape, adapted_modules, add_adapters

    cfg = make_config(LAYOUTS[LORA])
    add_adapters(model, adapted_modules(cfg.model), LoraShape.of(cfg.model.lora), cfg.train.seed)


def microbatches(rows_of, model, tokens, targets, step):
    """The mean of each micro-batch's loss, micro-batch i being rows ``rows_of[i]`` of the batch."""
    return sum(model(tokens[list(rows)], targets[list(rows)], step=step) for rows in rows_of) / len(rows_of)


def documents_and_balance(model, tokens, targets, step):
    """The batch's mean token loss with every document run on its own, plus (an MoE model recording its routing)
    ``router_aux_loss_coef`` × the load-balancing loss of the statistics of all those forwards together (one
    forward's, as the packed one)."""
    targets = boundary_targets(tokens, targets, EOD)
    total, loads = 0.0, []
    for row, starts in enumerate(document_starts(tokens, EOD)):
        cuts = starts.nonzero().flatten().tolist() + [tokens.shape[1]]
        for lo, hi in zip(cuts, cuts[1:]):
            logits, state = model.run(tokens[row:row + 1, lo:hi])
            loads += [state.routing[i] for i in sorted(state.routing)]
            total = total + F.cross_entropy(logits[0], targets[row, lo:hi], ignore_index=IGNORE, reduction="sum")
    moe, tokens_loss = model.shape.moe, total / int((targets != IGNORE).sum())
    if moe is None or not moe.output_router_logits:
        return tokens_loss
    return tokens_loss + moe.aux_loss_coef * load_balancing_loss(loads, moe.num_experts)


def _documents(row: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` spans of a packed row's documents (each ends after an :data:`EOD`)."""
    cuts = document_starts(row[None], EOD)[0].nonzero().flatten().tolist()
    return list(zip(cuts, cuts[1:] + [row.shape[0]]))


def answers_and_balance(packed: bool, model, tokens, targets, step):
    """One process on chat data in 2 micro-batches (the batch's halves; with ``packed`` every document run
    alone): the summed loss of every answer token over their count in the whole batch (transformers' −100
    rule on the batch), plus ``router_aux_loss_coef`` × each micro-batch's load-balancing loss, averaged."""
    if packed:
        targets = boundary_targets(tokens, targets, EOD)
    total, aux, moe = 0.0, 0.0, model.shape.moe
    half = tokens.shape[0] // 2
    for rows in (slice(0, half), slice(half, 2 * half)):
        pieces = ([(slice(row, row + 1), slice(lo, hi)) for row in range(rows.start, rows.stop)  # documents
                   for lo, hi in _documents(tokens[row])] if packed else [(rows, slice(None))])  # the micro-batch
        loads = []
        for r, c in pieces:
            logits, state = model.run(tokens[r, c])
            loads += [state.routing[i] for i in sorted(state.routing)]
            total = total + F.cross_entropy(logits.flatten(0, 1), targets[r, c].flatten(), ignore_index=IGNORE,
                                            reduction="sum")
        aux = aux + moe.aux_loss_coef * load_balancing_loss(loads, moe.num_experts)
    return total / int((targets != IGNORE).sum()) + aux / 2


@pytest.mark.parametrize("name", [CHAT, CHAT_PACKED])
def test_chat_data_over_data_ring_and_microbatch_ranks_trains_as_one_process(trained, chat_layouts, name):
    """Only the answers carry loss, and the ranks' and micro-batches' shares hold different numbers of them:
    the losses (1e-10) and every parameter after 3 steps (1e-9) are one process's, whose loss is the whole
    batch's mean over its answer tokens."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset

    job = chat_layouts[name]
    _, y = build_dataset(make_config(job)).batch(0)
    per_block = [int((row != IGNORE).sum()) for row in y]  # micro-batch i's rows 2i, 2i + 1: dp rank 0's, 1's
    assert 0 < sum(per_block) < y.numel() // 2 and len(set(per_block)) > 1  # uneven shares: a mean of means ≠
    want_losses, want = dense_run(job, loss_of=functools.partial(answers_and_balance, name == CHAT_PACKED))
    check_pieces(trained, name, want_losses, want)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_experts_over_data_and_sequence_ranks_train_as_one_process(trained, name):
    """Losses (cross entropy + 0.5 × the load-balancing loss) 1e-10, every parameter after 3 steps 1e-9;
    each rank's expert pieces are its slice of the one-process stacked tensors: one box of E/ep experts, or
    under hetero (one module per expert, but on the 2D grid) one box per expert."""
    want_losses, want = one_process(name)
    assert want_losses[1] < want_losses[0]
    check_pieces(trained, name, want_losses, want)
    parallel = LAYOUTS[name]["parallel"]
    # hetero makes the experts one module each, but on the 2D grid (stacked there)
    ep, one_per_expert = parallel.get("ep", 1), "hetero" in LAYOUTS[name] and parallel.get("tp", 1) == 1
    for _, pieces in [r[name] for r in trained]:
        boxes = pieces.get("blocks.0.mlp.experts.gate_proj")
        if boxes is None:  # a pp rank without layer 0
            continue
        rows = sorted(off[0] + i for off, t in boxes for i in range(t.shape[0]))
        assert rows == list(range(rows[0], rows[0] + 4 // ep)) and rows[0] % (4 // ep) == 0, rows
        assert len(boxes) == (4 // ep if one_per_expert else 1)


def test_lora_adapters_of_the_experts_travel_with_their_experts(trained):
    """:data:`LORA` at ep=2: each rank holds its experts' adapters only (rows of the stacked ``[E, 2r, h]`` /
    ``[E, 2I, 2r]`` adapters, the rows of its experts), the base does not move, and the adapters (every
    expert's too) are one process's after 3 steps (the parametrized test above checks every piece)."""
    _, want = one_process(LORA)
    adapters = [n for n in want if ".experts.adapters." in n]
    assert len(adapters) == 2 * 2 * 2  # 2 MoE layers × gate_up, down × lora_A, lora_B
    from parallel4d.config.load import make_config
    from parallel4d.engine.model import model_shape
    from parallel4d.models.build import build_dense

    cfg = make_config(LAYOUTS[LORA])
    model = build_dense(model_shape(cfg), seed=cfg.train.seed).double()
    with_adapters(model)
    base = dict(model.named_parameters())
    assert all(torch.equal(want[n], base[n]) for n in want if ".lora_" not in n)
    assert all(not torch.equal(want[n], base[n]) for n in adapters)
    for _, pieces in [r[LORA] for r in trained]:
        [(off, t)] = pieces["blocks.0.mlp.experts.adapters.gate_up_proj.lora_B"]
        assert t.shape == (2, 2 * 16, 2 * 2) and off[0] in (0, 2), (off, t.shape)


def test_experts_no_token_chose_are_skipped_alike_on_every_zero_rank(trained):
    """hetero's ZeRO over the 4 data replicas (dense rows) and the expert replicas (expert rows), each rank
    skipping the expert no token chose: nothing hangs, and the run equals one process with the same router."""
    from test_hetero_experts import one_sided_router

    check_pieces(trained, UNCHOSEN, *dense_run(UNCHOSEN_JOB, prepare=one_sided_router))


def test_hetero_moves_chunks_under_a_budget_below_the_models_data(trained):
    """The hetero layout above ran with its chunks moving: a device budget below every rank's model data
    (dense rows sharded over the 4 data replicas, the experts' over their 2 replicas) and more bytes moved
    than the model's data; launch's memory preflight (config/memory.py) stays a lower bound of its host bytes."""
    from parallel4d.config.load import make_config
    from parallel4d.config.memory import rank_bytes

    least = rank_bytes(make_config(LAYOUTS[HETERO_EP])).model_state_host
    for rank in trained:
        stats = rank["hetero"]
        assert stats["device_budget_bytes"] == HETERO["device_budget_bytes"] < stats["model_data_bytes"]
        assert stats["bytes_moved"] > stats["model_data_bytes"]
        assert 0 < least <= stats["host_bytes"]


# the suite's 16-worker job (tests/conftest.py): the grid with every other axis an MoE layer composes with
SIXTEEN = {"tp=4 × dp=2 × sp=2, ep=2": _job({"tp": 4, "dp": 2, "sp": 2, "ep": 2}),
           # every axis an MoE layer composes with at once: the pipeline's messages carry the statistics, the grid
           # splits the MoE layers' tokens, the ring's shards are the ep ranks (4 chunks as HANAYO's)
           FOUR_AXES: _job({"pp": 2, "sp": 2, "tp": 4, "ep": 2},
                           pipeline={"schedule": "hanayo", "waves": 1, "microbatches": 2},
                           sequence={"layout": "zigzag", "causal": True},
                           hetero={**HETERO, "device_budget_bytes": 200_000},  # 4 chunks resident at once here
                           train={"activation_checkpointing": "blocks"})}


#: FP8 on the grid beside data replicas and sequence shards (#50): the weight gradients' amaxes reduced over the
#: dp·sp replicas too (:func:`~parallel4d.engine.compose.fp8_token_sync`), the ring's attention inside the 2D blocks.
#: Seed 1: at seed 0 the ring's float32 roundings (2 shards against one) flip one e4m3 rounding in step 3 and the
#: fourth loss parts by 7.3e-6 (the first three within 1e-7, where a wrong scale would show at step 2); at seeds 1–4
#: all four within 1.7e-7, as at sp=1 (tp=4 × dp=4: 1.3e-7) — FP8's discontinuity, not the layout's scales
FP8_SIXTEEN = {"FP8 gpt2 tp=4 × dp=2 × sp=2": _job({"tp": 4, "dp": 2, "sp": 2}, model=FP8_GPT2,
                                                    train={**FP8_TRAIN, "seed": 1}, optimizer=FP8_OPT)}


def token_amaxes(engine) -> dict:
    """The MAX all-reduces of FP8's token amaxes over the data replicas this rank made, their bytes, and the mesh
    axes of the group each FP8 linear reduces over."""
    stats = engine.mesh.comm_stats
    syncs = {getattr(m, "fp8", None) for m in engine.store.model.modules()} - {None}
    return {"calls": stats.calls["fp8.amax"], "bytes": stats.sent["fp8.amax"],
            "over": {stats.group_names.get(id(f.token_sync.group), "other") for f in syncs}}


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job: :data:`SIXTEEN` and :data:`FP8_SIXTEEN` trained, and the
    seconds it took."""
    import time

    from test_llama import train_layouts

    start = time.perf_counter()
    out = train_layouts(SIXTEEN, with_hetero_stats=True)  # the hetero statistics: FOUR_AXES's
    out.update(train_layouts(FP8_SIXTEEN, inspect=token_amaxes))
    return {**out, "seconds": time.perf_counter() - start}


def test_experts_on_the_grid_with_data_sequence_and_expert_ranks_train_as_one_process(sixteen_workers):
    """tp=4 (q=2) × dp=2 × sp=2 with ep=2 (ep groups: the ranks at one grid position), and every axis at once
    (Hanayo pp=2 × zigzag ring sp=2 × tp=4, ep=2 over the ring's ranks, 2 micro-batches, recomputation): the
    one-process losses (1e-10) and parameters (1e-9); each rank's experts are its ep slice, whole on each grid rank."""
    results = [r["test_expert_parallel"] for r in sixteen_workers]
    for name in SIXTEEN:
        check_pieces(results, name, *one_process(name))
        rows = {off for r in results for off, _ in r[name][1].get("blocks.0.mlp.experts.gate_proj", [])}
        assert rows == {(0, 0, 0), (2, 0, 0)}
    for r in results:  # FOUR_AXES's chunks moved: a device budget below every rank's model data
        assert r["hetero"]["device_budget_bytes"] < r["hetero"]["model_data_bytes"] and r["hetero"]["bytes_moved"] > 0


def router_reference(steps: int, rows_of=(tuple(range(8)),)) -> list[tuple[float, list[float]]]:
    """One process: each step's ``router_aux_loss_coef`` × load-balancing loss (each micro-batch's — rows
    ``rows_of[i]``, one forward each — averaged) and each expert's share of the picks over every MoE layer and
    micro-batch."""
    reports = []

    def loss_of(model, tokens, targets, step):
        moe, loss, aux_sum, picks = model.shape.moe, 0.0, 0.0, 0.0
        for rows in map(list, rows_of):
            logits, state = model.run(tokens[rows])
            loads = [state.routing[i] for i in sorted(state.routing)]
            aux = moe.aux_loss_coef * load_balancing_loss(loads, moe.num_experts)
            picks = picks + sum(load.counts for load in loads)
            aux_sum += float(aux)
            loss = loss + F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten()) + aux
        reports.append((aux_sum / len(rows_of), (picks / picks.sum()).tolist()))
        return loss / len(rows_of)

    dense_run({**BASE, "train": {**BASE["train"], "steps": steps}}, loss_of)
    return reports


@pytest.mark.parametrize("name", ["dp=2 × sp=2, ep=2", ZERO_BUBBLE])
def test_every_rank_reports_the_whole_batchs_auxiliary_loss_and_expert_load(trained, name):
    """What metrics.jsonl gets (``Engine.router_load``), on every rank: the one-process auxiliary loss of the
    whole batch (1e-10; micro-batches' averaged) and each expert's share of its picks (exact fractions) —
    under zb_h1 on pp rank 0 too, whose chunk holds MoE layer 0 but not the loss (rank 0 writes
    metrics.jsonl)."""
    want = router_reference(3, microbatch_rows(name))
    for rank in trained:
        for (aux, load), (want_aux, want_load) in zip(rank[("router", name)], want, strict=True):
            assert aux == pytest.approx(want_aux, rel=1e-10)
            assert load == pytest.approx(want_load, abs=1e-12) and sum(load) == pytest.approx(1.0)


@pytest.mark.parametrize("name", [*RESUMED, FROM_GRID])
def test_a_checkpoint_saved_at_ep_2_resumes_under_another_layout(trained, name):
    """Step 3 after resuming ep=2's step-2 checkpoint (or, :data:`FROM_GRID`, tp=4's, whose experts every grid
    rank holds whole): the straight one-process run's loss and parameters;
    then the evaluation of another batch (forwards only, the auxiliary loss's statistics summed over the
    replicas there too) is the one-process model's loss on it."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.model import model_shape
    from parallel4d.models.build import build_dense

    want_losses, want = one_process()
    check_pieces(trained, f"resumed {name}", want_losses[2:], want)
    cfg = make_config(BASE)
    model = build_dense(model_shape(cfg)).double()
    model.load_state_dict(want)
    with torch.no_grad():
        evaluated = float(model(*build_dataset(cfg).batch(EVAL_BATCH)))
    assert all(abs(r[f"evaluated {name}"] - evaluated) <= 1e-10 * evaluated for r in trained)


def test_a_pretrained_moe_directory_loads_each_ranks_experts_only(trained, qwen3_moe, single_rank):
    """model.pretrained at dp=2 × sp=2, ep=2: every rank evaluates one process's loss (1e-10) having read
    the directory but for the other rank's experts (its 2 of the 4 of each layer)."""
    if qwen3_moe is None:
        pytest.skip("transformers (the hf extra) writes the directory")
    whole, whole_read = evaluate_pretrained(qwen3_moe, {})
    experts_bytes = 2 * 4 * 3 * 32 * 12 * 4  # 2 layers × 4 experts × 3 float32 [12, 32] matrices
    for loss, read in (r["pretrained"] for r in trained):
        assert abs(loss - whole) <= 1e-10 * whole
        assert whole_read - read == experts_bytes // 2



def test_the_check_of_an_ep_job_shrunk_to_4_workers_is_equal(trained, tmp_path):
    """``parallel4d check`` of an ep=8 job over dp=8 (16 experts, a shared expert, dense layers, the
    auxiliary loss, 2 micro-batches) on 4 workers: a sub-layout keeping ep > 1, dp > 1 and fewer experts,
    equal to one process running the same 2 micro-batches; its report names ep."""
    from conftest import run_in_this_process
    from parallel4d.tools.check import compare, format_report, into
    from test_check import QUICKSTART

    plan = check_plan()
    summary, out = trained[0]["check"]
    reference = into(plan.reference(QUICKSTART, checked_job()), tmp_path)
    outcome = compare(plan.cfg, summary, run_in_this_process(reference, []), Path(out) / "checkpoints",
                      tmp_path / "checkpoints")
    report = "\n".join(format_report(QUICKSTART, plan, outcome))
    assert plan.cfg.world_size == 4 and plan.cfg.parallel.ep > 1 and plan.cfg.parallel.dp > 1, report
    assert plan.cfg.pipeline.microbatches == 2 and plan.cfg.model.output_router_logits, report
    assert outcome.equal, report
    assert f"ep={plan.cfg.parallel.ep}" in report.splitlines()[0], report
def test_the_check_of_an_ep_lora_job_compares_its_adapters(trained, tmp_path):
    """``parallel4d check`` of :func:`checked_lora_job` on 4 workers (ep > 1 over dp): equal to one process, the
    adapters among the tensors compared — every one of them, the experts' stacked ones whole from the ep ranks'
    rows — and the report's adapters line says how many and how close."""
    from conftest import run_in_this_process
    from parallel4d.models.lora import LoraShape, adapted_modules, add_adapters
    from parallel4d.engine.model import model_shape
    from parallel4d.models.build import build_dense
    from parallel4d.tools.check import compare, format_report, into
    from test_check import QUICKSTART

    plan = check_plan(checked_lora_job)
    summary, out = trained[0]["check-lora"]
    reference = into(plan.reference(QUICKSTART, checked_lora_job()), tmp_path)
    outcome = compare(plan.cfg, summary, run_in_this_process(reference, []), Path(out) / "checkpoints",
                      tmp_path / "checkpoints")
    report = "\n".join(format_report(QUICKSTART, plan, outcome))
    model = build_dense(model_shape(plan.cfg))
    add_adapters(model, adapted_modules(plan.cfg.model), LoraShape.of(plan.cfg.model.lora))
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert plan.cfg.parallel.ep > 1 and any(".experts.adapters." in n for n in adapters), report
    assert outcome.equal and outcome.adapters[0] == len(adapters), report
    assert f"adapters (model.lora): {len(adapters)} tensors" in report and " lora: rank=2" in report, report


def test_a_pipelines_evaluation_carries_the_statistics_too(single_rank):
    """Forwards only (``for_evaluation``, as ``Engine.evaluate`` runs a pipeline): 4 chunks in this process
    (interleaved at pp=1), the loss with the auxiliary term of every layer — the dense model's (1e-12)."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import build_pipeline
    from parallel4d.engine.model import model_shape
    from parallel4d.models.build import build_dense

    cfg = make_config(_job({}, pipeline={"schedule": "interleaved", "chunks_per_rank": 4, "microbatches": 1}))
    mesh = init_mesh(timeout_s=60)
    evaluation = build_pipeline(cfg, mesh).executor.for_evaluation()
    tokens, targets = build_dataset(cfg).batch(0)
    with torch.no_grad():
        loss = float(evaluation.step([tokens], [targets]).loss)
        want = float(build_dense(model_shape(cfg), seed=cfg.train.seed).double()(tokens, targets))
    mesh.close()
    assert loss == pytest.approx(want, rel=1e-12)


def lora_one_process(name: str):
    """One process training the dense llama with job ``name``'s adapters (added as the engine adds them: seeded
    ``train.seed``), on the whole batch with each step's adapter-dropout masks drawn over it (a micro-batch's
    rows are drawn as the whole batch's, so m micro-batches change nothing); packed: each document alone. (GPT-2's
    job: the dense GPT-2 the same way.)"""
    from parallel4d.config.load import make_config

    job = {**LORA_LAYOUTS, **LORA_HETERO}[name]
    cfg = make_config(job)

    def prepare(model):
        add_adapters(model, adapted_modules(cfg.model), LoraShape.of(cfg.model.lora), cfg.train.seed)

    return dense_run(job, loss_of=documents_and_balance if name == LORA_PACKED else None, prepare=prepare)


@pytest.mark.parametrize("name", list(LORA_HETERO))
def test_lora_under_hetero_beside_the_other_axes_trains_as_one_process(trained, name):
    """Hetero with the data, sequence, grid and pipeline axes (float64, a device budget below the model): losses
    (1e-10) and every parameter (1e-9) one process's after 3 steps, the base as built; every rank holds frozen
    rows and moves chunks."""
    from parallel4d.config.load import make_config
    from parallel4d.engine.model import model_shape
    from parallel4d.models.build import build_dense

    want_losses, want = lora_one_process(name)
    check_pieces(trained, name, want_losses, want)
    cfg = make_config(LORA_HETERO[name])
    built = build_dense(model_shape(cfg), seed=cfg.train.seed).double().state_dict()
    for rank in trained:
        for dense, boxes in rank[name][1].items():
            for off, t in boxes:
                if not is_adapter(dense):
                    assert torch.equal(t, built[dense][tuple(slice(o, o + n) for o, n in zip(off, t.shape))]), dense
        held = rank[("inspect", name)]
        assert held["frozen_rows"] > 0 and held["frozen_params"] > 0 and held["bytes_moved"] > 0, (name, held)


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_adapters_train_in_every_data_sequence_pipeline_and_grid_layout_as_one_process(trained, name):
    """``model.lora`` (llama: all seven linears, rank 4; gpt2: its three, rsLoRA) in float64: every rank's losses (1e-10) and every parameter's
    pieces after 3 AdamW steps with clipping (1e-9) are one process's, the adapters moved and the base as built;
    every rank trains, reduces and keeps optimizer state for its adapters only, and no frozen parameter holds a
    gradient."""
    from parallel4d.config.load import make_config
    from parallel4d.engine.model import model_shape
    from parallel4d.models.build import build_dense

    want_losses, want = lora_one_process(name)
    assert want_losses[-1] < want_losses[0]
    check_pieces(trained, name, want_losses, want)
    cfg = make_config(LORA_LAYOUTS[name])
    built = build_dense(model_shape(cfg), seed=cfg.train.seed).double().state_dict()
    for rank in trained:
        _, pieces = rank[name]
        for dense, boxes in pieces.items():
            for off, t in boxes:
                box = tuple(slice(o, o + n) for o, n in zip(off, t.shape))
                if is_adapter(dense):
                    assert not dense.endswith("lora_B") or t.abs().max() > 0, (name, dense)
                else:
                    assert torch.equal(t, built[dense][box]), (name, dense)
        held = rank[("inspect", name)]
        assert held["adapters"] and held["trained"] == held["adapters"] == held["optimizer state"], (name, held)
        assert set(held["with a gradient"]) <= set(held["adapters"]), (name, held)
        parallel = LORA_LAYOUTS[name]["parallel"]
        assert held["reduced"] == (held["adapters"] if parallel.get("dp", 1) * parallel.get("sp", 1) > 1 else []), held


def fp8_one_process(name: str):
    """One process training the dense llama of FP8 job ``name`` in float32 with its blocks' linears in FP8
    (:func:`~parallel4d.models.fp8.use_fp8`, no reduction: every micro-batch whole), on the whole batch as its
    m micro-batches; under sp with the ring's attention kernel on one rank (the attention core the layout
    computes, see :func:`test_fp8_trains_in_the_data_sequence_and_pipeline_layouts_and_hetero_as_one_process`)."""
    job = FP8_LAYOUTS[name]
    if name == FP8_PACKED:
        return _fp8_packed_one_process()
    return _fp8_one_process(job.get("pipeline", {}).get("microbatches", 1), job["parallel"].get("sp", 1) > 1)


@functools.cache
def _fp8_packed_one_process():
    """:data:`FP8_PACKED` through compose() in this process (its one rank holds the whole batch; packed
    documents masked in one forward, as the layout's): the dense model cannot be the reference here, since it
    runs each document alone, and each alone is another FP8 product (its own tokens' scales)."""
    from test_llama import train_layouts

    losses, pieces = train_layouts({"one": {**FP8_LAYOUTS[FP8_PACKED], "parallel": {}}})["one"]
    return losses, {dense: boxes[0][1] for dense, boxes in pieces.items()}


@functools.cache
def _fp8_one_process(m: int, ring: bool):
    from parallel4d.models.fp8 import use_fp8
    from parallel4d.sequence import make_ring_attention_fn

    attention = make_ring_attention_fn(None) if ring else None  # the default group: this process alone

    def prepare(model):
        model.float()
        use_fp8(model)
        for block in model.blocks if ring else ():
            block.attn.attention_fn = attention

    rows = tuple(tuple(range(i * 8 // m, (i + 1) * 8 // m)) for i in range(m))
    return dense_run(_fp8_job({}), prepare=prepare, loss_of=functools.partial(microbatches, rows))


#: float32's reordering over these 4 AdamW steps moves the parameters by at most 2.2e-6 (measured: the same
#: layouts with train.fp8=none); an e4m3 rounding that the reordering flips (an operand element within float32's
#: reach of a rounding midpoint) changes one term of a sum by one e4m3 step, at FP8's own precision (2⁻⁴ of it)
FP8_FLOAT32_ATOL, FP8_FLIPS = 1e-5, 1e-3


@pytest.mark.parametrize("name", list(FP8_LAYOUTS))
def test_fp8_trains_in_the_data_sequence_and_pipeline_layouts_and_hetero_as_one_process(trained, name, single_rank):
    """``train.fp8: rowwise`` in float32: every rank's losses within 1e-6 (relative) of one process's in FP8 over
    4 steps — the weight gradients' scales are the whole micro-batch's (their token amaxes MAX-reduced over the
    dp·sp replicas: one ``fp8.amax`` all-reduce per FP8 linear per micro-batch per step on every rank) —, and
    the parameters within float32's reordering but for at most 0.1 % of the elements (flipped e4m3 roundings),
    those within 2⁻⁴·lr. Hetero's chunks moved. Packed documents: against one process through compose()
    (:func:`_fp8_packed_one_process`).

    Why one process with the ring's kernel under sp: FP8's rounding is discontinuous, so a float32 reordering in
    the attention core (the ring's blockwise softmax against SDPA: ~1e-7) flips e4m3 roundings, and each flip
    moves an operand element by one e4m3 step, which the next quantized products pass on: measured, the step-0
    gradients then differ by ~1 % and the losses by 3e-3 after 4 steps, in every sp layout alike. The scales
    are not the cause: against one process running the ring's kernel on one rank they agree to 1e-7."""
    want_losses, want = fp8_one_process(name)
    assert want_losses[-1] < want_losses[0]
    lr, job = FP8_LAYOUTS[name]["optimizer"]["lr"], FP8_LAYOUTS[name]
    seen = set()
    for rank in trained:
        seen |= assert_fp8_rank_close(name, rank[name], want_losses, want, lr, FP8_FLIPS,
                                      further=lambda diff, box: diff > FP8_FLOAT32_ATOL)
        held = rank[("inspect", name)]
        steps, m = job["train"]["steps"], job.get("pipeline", {}).get("microbatches", 1)
        assert held["linears"] == held["synced"] > 0, held
        assert held["amax all-reduces"] == held["linears"] * m * steps, held
        assert held["bytes moved"] is None or held["bytes moved"] > 0, held
    assert seen == set(want), set(want) - seen


def assert_fp8_as_one_process(ranks: list, name: str, job: dict) -> None:
    """Every rank's losses of FP8 job ``name`` within 1e-6 (relative) of the same job in one process (FP8 there too,
    trained here: a one-rank process group is up), every parameter within float32's reordering through AdamW.
    A job over ``parallel.sp``: the one process runs the ring's attention kernel (``sequence.kernel: blockwise``),
    as ``parallel4d check`` does, and as in
    :func:`test_fp8_trains_in_the_data_sequence_and_pipeline_layouts_and_hetero_as_one_process` at most
    :data:`FP8_FLIPS` of the parameters' elements may be further off, within 2⁻⁴·lr: the ring's float32 roundings
    over its shards differ from one shard's by ~1e-7, which can flip an e4m3 rounding (measured at tp=4 × dp=2 ×
    sp=2: 1 element of a rank's 10,256 at 6.3e-6 on 4 of the 16 ranks, the element they share)."""
    from test_llama import train_layouts

    split = job["parallel"].get("sp", 1) > 1
    sequence = {**job.get("sequence", {}), "kernel": "blockwise"} if split else {}
    want_losses, pieces = train_layouts({name: {**job, "parallel": {}, "sequence": sequence}})[name]
    want = {dense: whole for dense, [(_, whole)] in pieces.items()}
    for rank in ranks:
        assert_fp8_rank_close(name, rank[name], want_losses, want, job["optimizer"]["lr"], FP8_FLIPS if split else 0,
                              further=lambda diff, box: diff > 1e-5 * box.abs() + 5e-6)


def assert_fp8_rank_close(name: str, trained: tuple, want_losses: list, want: dict, lr: float, flips: float,
                          further) -> set[str]:
    """One rank's ``trained = (losses, {dense name: [(offset, piece)]})`` of FP8 job ``name`` against one process's
    losses and dense parameters ``want``: every loss within 1e-6 (relative), every element within 2⁻⁴·lr, and at most
    ``flips`` of the elements ``further(diff, want's box)`` off (e4m3 roundings a float32 reordering flipped).
    Returns the dense names the rank holds."""
    losses, pieces = trained
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-6, atol=0,
                               msg=lambda m: f"{name} losses: {m}")
    beyond, elements = 0, 0
    for dense, parts in pieces.items():
        for off, t in parts:
            box = want[dense][tuple(slice(o, o + n) for o, n in zip(off, t.shape))]
            diff = (t - box).abs()
            assert diff.max() <= 2 ** -4 * lr, (name, dense, float(diff.max()))
            beyond, elements = beyond + int(further(diff, box).sum()), elements + diff.numel()
    assert beyond <= flips * elements, (name, beyond, elements)
    return set(pieces)


@pytest.mark.parametrize("name", list(FP8_GRID))
def test_fp8_on_the_2d_grid_trains_as_one_process_in_fp8(trained, single_rank, name):
    """``train.fp8: rowwise`` at tp=4 (llama with 2 micro-batches and recomputation, GPT-2 with its fused, permuted
    qkv): every rank's losses over 4 steps within 1e-6 (relative) of the same job in one process (FP8 there too),
    every parameter within float32's reordering through AdamW; so each FP8 product used one process's scales.
    Every block linear's SUMMA reduced its amaxes over the grid and broadcast its weight panel in one byte per
    element (the forward's panels carry no scales: each receiver holds them); the LM head's stayed in float32
    (4 bytes per element)."""
    job, q = FP8_GRID[name], 2
    assert_fp8_as_one_process(trained, name, job)
    for rank in trained:
        traffic = dict(rank[("inspect", name)])
        weights = traffic.pop("weights")

        def bytes_per_element(layer, op):  # a weight panel is sent once per op (step t = my grid row), q calls
            sent, calls = traffic[f"{layer}:{op}/bcast_b"]
            return sent / (calls // q) / weights[layer]

        linears = {label.split(":")[0] for label in traffic if label.endswith("summa_ab/amax_a")}
        per_block = 7 if job["model"].get("arch", "llama") == "llama" else 4  # q k v o gate up down / qkv proj fc1 fc2
        assert len(linears) == per_block * job["model"]["layers"], sorted(linears)
        for layer in linears:
            assert bytes_per_element(layer, "summa_ab") == 1, (layer, traffic)
            assert f"{layer}.bwd:summa_atb/amax_a" in traffic and f"{layer}.bwd:summa_abt/amax_b" in traffic, layer
        assert bytes_per_element("head.lm_head", "summa_abt") == 4
        assert not any(label.startswith("head.") and "amax" in label for label in traffic), sorted(traffic)


def test_fp8_on_the_grid_beside_data_and_sequence_replicas_trains_as_one_process_in_fp8(sixteen_workers, single_rank):
    """GPT-2 in FP8 at tp=4 × dp=2 × sp=2: the weight gradients contract over tokens the grid column, the data
    replicas and the sequence shards share, their amaxes reduced over all (one MAX all-reduce over dp·sp per
    operand: 2 per block linear per step); every rank's losses within 1e-6 of one process in FP8 (running the
    ring's kernel, ``sequence.kernel: blockwise``: see :func:`assert_fp8_as_one_process`), every parameter within
    float32's reordering."""
    results = [r["test_expert_parallel"] for r in sixteen_workers]
    for name, job in FP8_SIXTEEN.items():
        assert_fp8_as_one_process(results, name, job)
        steps, layers = job["train"]["steps"], job["model"]["layers"]
        for r in results:
            assert r[("inspect", name)]["calls"] == 2 * 4 * layers * steps, r[("inspect", name)]
            assert r[("inspect", name)]["over"] == {"dp+sp"}, r[("inspect", name)]
