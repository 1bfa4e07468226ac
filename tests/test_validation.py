"""Validation (#16.2): ``Engine.evaluate`` in every layout equals the dense model's loss, forwards only.

One 8-worker job builds five layouts in turn (float64): 2D × ring, Hanayo × 2D, interleaved × dp,
hetero × Hanayo × ring × dp, 1F1B × ring × dp with the tied table on two pp ranks. In each, the
validation loss before and after one training step equals the single-process dense model's on the
same batch (1e-10), no gradient is left anywhere, and the step between the two evaluations is the
dense step (its loss equal), so evaluating does not disturb training.
"""

import pytest
import torch

from conftest import run_workers

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


def config(layout):
    from parallel4d.config import make_config

    return make_config({**BASE, **LAYOUTS[layout]})


def _grads_left(engine) -> int:
    """Gradients anywhere after evaluate: parameters' .grad, hetero's gradient chunks."""
    n = sum(p.grad is not None for p in engine.model.parameters())
    if engine.hetero is not None:
        n += int(engine.optimizer.grad_sq_norm().item() != 0.0)
    return n


def _worker(layouts):
    from parallel4d.data import build_dataset
    from parallel4d.engine import compose
    from parallel4d.mesh import init_mesh

    out = {}
    for layout in layouts:
        cfg = config(layout)
        p = cfg.parallel
        engine = compose(cfg, init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=cfg.train.timeout_s))
        data = build_dataset(cfg)
        before = engine.evaluate(*data.batch(VAL_STEP))
        grads = _grads_left(engine)
        loss = engine.train_step(*data.batch(0))
        after = engine.evaluate(*data.batch(VAL_STEP))
        out[layout] = {"before": before, "after": after, "train": loss, "grads": grads}
    return out


def dense_reference():
    """The dense model's validation loss before and after its one AdamW step, and that step's loss."""
    from parallel4d.config import make_config
    from parallel4d.data import build_dataset
    from parallel4d.engine import PARAMETER_DTYPE, model_shape
    from parallel4d.models import build_dense
    from parallel4d.optim import build_optimizer, lr_at

    cfg = make_config(BASE)
    model = build_dense(model_shape(cfg), seed=cfg.train.seed).to(PARAMETER_DTYPE[cfg.train.dtype])
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
    for layout in LAYOUTS:
        for rank, r in enumerate(per_rank):
            got = r[layout]
            assert got["grads"] == 0, (layout, rank)
            for key in ("before", "train", "after"):
                assert got[key] == pytest.approx(ref[key], rel=1e-10, abs=0), (layout, rank, key, got[key], ref[key])
