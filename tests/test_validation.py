"""Validation (#16.2) and activation checkpointing (#16.7).

``Engine.evaluate`` in every layout equals the dense model's loss, forwards only: one 8-worker job
builds five layouts in turn (float64): 2D × ring, Hanayo × 2D, interleaved × dp, hetero × Hanayo ×
ring × dp, 1F1B × ring × dp with the tied table on two pp ranks. In each, the validation loss before
and after one training step equals the single-process dense model's on the same batch (1e-10), no
gradient is left anywhere, and the step between the two evaluations is the dense step (its loss
equal), so evaluating does not disturb training. Three layouts (2D × ring, hetero × Hanayo × ring,
1F1B × ring with the tied table) run once more with ``train.activation_checkpointing=blocks``: the same numbers, so the recomputed blocks (collectives
included) give the same gradients. In one process, the bytes held from the end of the forward to
the backward fall by more than 4× with it (measured with glibc's ``mallinfo2``).
"""

import ctypes
import gc
import sys

import pytest
import torch

from conftest import run_workers
from parallel4d.config.load import make_config

BASE = {
    "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 6},
    "data": {"batch_size": 8, "seed": 3},
    "train": {"seed": 5, "dtype": "float64", "timeout_s": 60.0},
    "optimizer": {"lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"enabled": False},
}
LAYOUTS = {
    "tp4-sp2": {"parallel": {"tp": 4, "sp": 2}},
    "hanayo-pp2-tp4": {"parallel": {"pp": 2, "tp": 4}, "pipeline": {"schedule": "hanayo", "microbatches": 2}},
    "interleaved-pp4-dp2": {"parallel": {"pp": 4, "dp": 2},
                            "pipeline": {"schedule": "interleaved", "chunks_per_rank": 2, "microbatches": 4}},
    "hetero-hanayo-pp2-sp2-dp2": {"parallel": {"pp": 2, "sp": 2, "dp": 2},
                                  "pipeline": {"schedule": "hanayo", "microbatches": 2},
                                  "hetero": {"enabled": True, "chunk_elems": 4096}},
    "1f1b-pp2-sp2-dp2": {"parallel": {"pp": 2, "sp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
}
VAL_STEP = 1000  # a batch no training step draws
RECOMPUTE = ("none", "blocks")  # train.activation_checkpointing
# blocks recomputed under each technique: 2D and ring, hetero with Hanayo, 1F1B with the tied table
RECOMPUTED = {"tp4-sp2", "hetero-hanayo-pp2-sp2-dp2", "1f1b-pp2-sp2-dp2"}


def config(layout, recompute="none"):
    from parallel4d.config.load import make_config

    return make_config({**BASE, **LAYOUTS[layout], "train": {**BASE["train"], "activation_checkpointing": recompute}})


def _grads_left(engine) -> int:
    """Gradients anywhere after evaluate: parameters' .grad, hetero's gradient chunks."""
    n = sum(p.grad is not None for p in engine.model.parameters())
    if engine.cfg.hetero.enabled:
        n += int(engine.optimizer.grad_sq_norm().item() != 0.0)
    return n


def _worker(layouts):
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    out = {}
    for layout in layouts:
        for recompute in RECOMPUTE if layout in RECOMPUTED else RECOMPUTE[:1]:
            cfg = config(layout, recompute)
            p = cfg.parallel
            engine = compose(cfg, init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=cfg.train.timeout_s))
            data = build_dataset(cfg)
            before = engine.evaluate(*data.batch(VAL_STEP))
            grads = _grads_left(engine)
            loss = engine.train_step(*data.batch(0))
            after = engine.evaluate(*data.batch(VAL_STEP))
            out[layout, recompute] = {"before": before, "after": after, "train": loss, "grads": grads}
    return out


def dense_reference():
    """The dense model's validation loss before and after its one AdamW step, and that step's loss."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.model import model_shape, parameter_dtype
    from parallel4d.models.build import build_dense
    from parallel4d.optim.optimizer import build_optimizer, lr_at

    cfg = make_config(BASE)
    model = build_dense(model_shape(cfg), seed=cfg.train.seed).to(parameter_dtype(cfg))
    data = build_dataset(cfg)
    with torch.no_grad():
        before = model(*data.batch(VAL_STEP)).item()
    loss = model(*data.batch(0))
    loss.backward()
    opt = build_optimizer(model.named_parameters(), cfg.optimizer)
    for group in opt.param_groups:
        group["lr"] = lr_at(0, cfg.optimizer, cfg.train.steps)
    opt.step()
    with torch.no_grad():
        after = model(*data.batch(VAL_STEP)).item()
    return {"before": before, "after": after, "train": loss.item()}


def test_evaluate_equals_the_dense_loss_in_every_layout():
    per_rank = run_workers(_worker, 8, list(LAYOUTS), timeout_s=400)
    ref = dense_reference()
    assert ref["after"] != ref["before"]  # the step changed the model
    for (layout, recompute), rank, got in ((k, rank, r[k]) for rank, r in enumerate(per_rank) for k in r):
        assert got["grads"] == 0, (layout, recompute, rank)
        for key in ("before", "train", "after"):
            assert got[key] == pytest.approx(ref[key], rel=1e-10, abs=0), (layout, recompute, rank, key, got[key],
                                                                          ref[key])
    assert {k for r in per_rank for k in r} == {(lay, rec) for lay in LAYOUTS for rec in RECOMPUTE
                                                if rec == "none" or lay in RECOMPUTED}


# --- activation checkpointing keeps less between the forward and the backward -----------------

class _MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> int:
    """Bytes this process holds from malloc (glibc's mallinfo2: small blocks + mmapped ones)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures with glibc's mallinfo2")
@pytest.mark.parametrize("arch, hetero", [("gpt2", False), ("llama", False), ("gpt2", True)])
def test_activation_checkpointing_holds_less_until_the_backward(arch, hetero, single_rank):
    """Bytes held when the forward ends (at the head, before the loss's backward), measured with and
    without ``train.activation_checkpointing=blocks``: with it, the blocks keep only their inputs.

    Also what ``parallel4d plan`` and a run's ``memory`` count as activations
    (:class:`~parallel4d.memory.SavedActivations`) against the heap: as the head starts, the heap
    has grown by the saved tensors live then plus the head's input, within 10 %."""
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.engine.memory import SavedActivations
    from parallel4d.distributed.mesh import init_mesh

    held = {}
    for recompute in ("none", *RECOMPUTE):  # the first: a step that only warms up
        cfg = make_config({"model": {"arch": arch, "vocab_size": 256, "seq_len": 128, "hidden": 128, "heads": 4,
                                     "layers": 8},
                           "data": {"batch_size": 16}, "hetero": {"enabled": hetero},
                           "train": {"activation_checkpointing": recompute}, "checkpoint": {"enabled": False}})
        engine = compose(cfg, init_mesh())
        tokens, targets = build_dataset(cfg).batch(0)
        if not held:  # the process's first step allocates once what later steps reuse (28 MB here, run
            held["warm"] = engine.train_step(tokens, targets)  # alone): not the step's own heap
            continue
        meter = SavedActivations(engine.store.model_storages())
        if hetero:
            engine.optimizer.watch_activations(meter)  # the HeteroOptimizer
        marks = {}
        engine.model.head.register_forward_pre_hook(
            lambda mod, args: marks.update(head=_heap_in_use(), live=meter.live, input=args[0].nbytes))
        engine.model.head.register_forward_hook(lambda *_: marks.update(end=_heap_in_use()))  # returns None
        gc.collect()  # earlier tests' garbage, collected during the step, would shrink the heap
        gc.disable()
        try:
            marks["start"] = _heap_in_use()
            with meter:
                engine.train_step(tokens, targets)
        finally:
            gc.enable()
        held[recompute] = marks["end"] - marks["start"]
        counted = marks["live"] + marks["input"]
        assert abs(marks["head"] - marks["start"] - counted) <= 0.1 * counted, (recompute, marks)
    # none: ~20 activations of [b, s, h] per block; blocks: one per block (its input) and the head's
    assert held["blocks"] * 4 < held["none"], held
