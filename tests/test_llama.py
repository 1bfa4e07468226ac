"""model.arch: llama (#15.1) through every technique: ring attention with grouped-query heads and
rotary embeddings on global positions, 2D blocks, pipelines (Hanayo, 1F1B with a tied table on two
ranks), data parallelism and hetero's chunks — each equal to the dense Llama trained in this
process (float64: losses 1e-10, every parameter after the last step 1e-9). The 8-worker
combinations (2D × ring, Hanayo × 2D) are checked against transformers in tests/test_pretrained.py."""

import pytest
import torch

from conftest import run_workers
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.data.batches import build_dataset
from parallel4d.engine.model import model_shape
from parallel4d.models.build import build_dense
from parallel4d.optim.optimizer import build_optimizer, lr_at

BASE = {"model": {"arch": "llama", "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "kv_heads": 2,
                  "layers": 4, "intermediate_size": 48, "rope_theta": 5e5},
        "data": {"source": "synthetic", "batch_size": 8},
        "optimizer": {"lr": 0.01, "warmup_steps": 2, "weight_decay": 0.1, "schedule": "cosine", "min_lr": 0.002},
        "train": {"steps": 4, "dtype": "float64", "grad_clip": 0.5, "timeout_s": 60}}


def _job(parallel: dict, pipeline: dict | None = None, **sections) -> dict:
    out = {**BASE, "parallel": parallel, "pipeline": pipeline or {"microbatches": 2}, **sections}
    out["model"] = {**BASE["model"], **sections.get("model", {})}
    return out


LAYOUTS = {
    "ring sp=2 zigzag × dp=2": _job({"sp": 2, "dp": 2}),
    "Hanayo pp=2 × ring sp=2 contiguous": _job({"pp": 2, "sp": 2}, {"schedule": "hanayo", "microbatches": 2},
                                               sequence={"layout": "contiguous"}),
    "1F1B pp=2 × dp=2, tied head": _job({"pp": 2, "dp": 2}, {"schedule": "1f1b", "microbatches": 2},
                                        model={"tie_embeddings": True}),
    "2D tp=4, grouped heads over the grid columns": _job({"tp": 4}),
    # 4 query and 2 key/value heads per grid column: the core must group them (SDPA's enable_gqa)
    "2D tp=4, two key/value heads per grid column": _job({"tp": 4}, model={"heads": 8, "kv_heads": 4}),
    "2D tp=4, tied head": _job({"tp": 4}, model={"tie_embeddings": True}),
    "hetero ZeRO over dp=2 × sp=2": _job({"dp": 2, "sp": 2}, hetero={"enabled": True, "chunk_elems": 2048,
                                                                    "device_budget_bytes": 60000},
                                         train={**BASE["train"], "grad_clip": None}),
}


def dense_run(job: dict, loss_of=None, prepare=None):
    """The dense model in this process: the engine's AdamW, warm-up and clipping on the whole batch,
    each step's dropout masks drawn over it (``model(..., step=)``; none without dropout). ``loss_of(model,
    tokens, targets, step)``: the step's loss another way (default: the model's on the whole batch);
    ``prepare(model)``: changes the weights built from the seed before the first step."""
    cfg = make_config(job)
    model = build_dense(model_shape(cfg), seed=cfg.train.seed).double()
    if prepare is not None:
        prepare(model)
    optimizer = build_optimizer(model.named_parameters(), cfg.optimizer)
    data, losses = build_dataset(cfg), []
    for step in range(cfg.train.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optimizer, cfg.train.steps)
        loss = (loss_of or (lambda m, x, y, s: m(x, y, step=s)))(model, *data.batch(step), step)
        loss.backward()
        if cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def train_layouts(jobs: dict, with_hetero_stats: bool = False, inspect=None):
    """Each job through compose(): its losses and this rank's pieces of every dense parameter (and
    with ``with_hetero_stats`` the last hetero job's statistics under "hetero"); for an MoE job whose layers
    record their routing, each step's ``(aux_loss, expert_load)`` as metrics.jsonl gets them under
    ``("router", name)``; ``inspect(engine)``, if given, after the last step under ``("inspect", name)``."""
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    out = {}
    for name, job in jobs.items():
        cfg = make_config(job)
        p = cfg.parallel
        mesh = init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=60)
        engine, data = compose(cfg, mesh), build_dataset(cfg)
        losses, router = [], []
        for step in range(cfg.train.steps):
            losses.append(float(engine.train_step(*data.batch(step))))  # read back
            report = engine.router_load()
            if report is not None:
                router.append((float(report["aux_loss"]), report["expert_load"].tolist()))
        if router:
            out[("router", name)] = router
        pieces = {k[len("model."):]: [(tuple(off), view.detach().clone()) for off, view in v.pieces]
                  for k, v in engine.state_dict().items() if k.startswith("model.")}
        out[name] = losses, pieces
        if inspect is not None:
            out[("inspect", name)] = inspect(engine)
        if with_hetero_stats and cfg.hetero.enabled:
            out["hetero"] = engine.hetero_stats()
        engine.close()  # a shared worker trains other jobs after this one
        mesh.close()
    return out


def _check(results, layouts):
    for name, job in layouts.items():
        want_losses, want = dense_run(job)
        assert want_losses[-1] < want_losses[0]
        check_pieces(results, name, want_losses, want)


def check_pieces(results, name: str, want_losses, want: dict) -> None:
    """Every rank's losses of job ``name`` (1e-10) and pieces of every dense parameter (1e-9) against
    one process's ``want_losses`` and ``want`` (dense name → tensor); together the pieces cover all."""
    seen = set()
    for rank_results in results:
        losses, pieces = rank_results[name]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-10, atol=0,
                                   msg=lambda m, n=name: f"{n} losses: {m}")
        for dense, boxes in pieces.items():
            seen.add(dense)
            for off, t in boxes:
                box = want[dense][tuple(slice(o, o + n) for o, n in zip(off, t.shape))]
                torch.testing.assert_close(t, box, rtol=1e-9, atol=1e-12,
                                           msg=lambda m, n=name, d=dense: f"{n} {d}: {m}")
    assert seen == set(want), (name, set(want) - seen)


def test_llama_in_every_layout_equals_the_dense_llama():
    _check(run_workers(train_layouts, 4, LAYOUTS, timeout_s=300), LAYOUTS)


# All four at once, 16 workers: Hanayo pp=2 × ring sp=2 (zigzag) × 2D tp=4 × hetero (a device budget
# below each rank's model data; ZeRO over the dp·sp = 2 replicas). No clipping: hetero's norm covers
# the data replicas only, so the config refuses it with pp or tp.
FOUR_D = {"Hanayo pp=2 × ring sp=2 × 2D tp=4 × hetero": _job(
    {"pp": 2, "sp": 2, "tp": 4}, {"schedule": "hanayo", "waves": 1, "microbatches": 2},
    sequence={"layout": "zigzag"}, hetero={"enabled": True, "chunk_elems": 1024, "device_budget_bytes": 40000},
    train={**BASE["train"], "grad_clip": None})}


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job (tests/conftest.py): the 4D run, and hetero's
    budget, peak residency and model data on this rank."""
    return train_layouts(FOUR_D, with_hetero_stats=True)


def test_llama_with_all_four_techniques_equals_the_dense_llama(sixteen_workers):
    results = [r["test_llama"] for r in sixteen_workers]
    _check(results, FOUR_D)
    for rank_results in results:
        h = rank_results["hetero"]
        assert 0 < h["peak_resident_bytes"] <= h["device_budget_bytes"] < h["model_data_bytes"], h
        assert h["bytes_moved"] > 0


@pytest.mark.parametrize("fields, words", [
    ({"kv_heads": 3}, ["model.kv_heads=3 must divide model.heads=4", "use 1 or 2 or 4"]),
    ({"hidden": 36, "heads": 4}, ["model.hidden/model.heads = 9 is odd"]),
    ({"activation": "gelu_tanh"}, ["model.activation=gelu_tanh is gpt2's"]),
])
def test_llama_fields_that_cannot_run_are_refused(fields, words):
    with pytest.raises(ConfigError) as err:
        make_config({"model": {**BASE["model"], **fields}})
    for w in words:
        assert w in str(err.value), str(err.value)


def test_llama_defaults_and_gpt2_fields():
    llama = make_config({"model": {"arch": "llama"}}).model
    assert llama.tie_embeddings is False and llama.kv_heads_or_heads == llama.heads
    assert make_config({"model": {"arch": "llama", "tie_embeddings": True}}).model.tie_embeddings is True
    assert make_config({}).model.tie_embeddings is True  # gpt2 unchanged
    with pytest.raises(ConfigError, match="model.rope_theta=500000.0 is a llama field"):
        make_config({"model": {"rope_theta": 5e5}})
    with pytest.raises(ConfigError, match="model.kv_heads=2 with model.arch=gpt2"):
        make_config({"model": {"kv_heads": 2}})
