"""A frozen LoRA base under hetero (issue 49, point 4): the base lives in chunks of the compute dtype only
(no master copy, no Adam moments, no gradient chunks, no ZeRO reduction, never stepped), streamed layer
by layer — its backward holds released as each module's backward ends — while the adapters train as
hetero's other parameters, in rows of their own.

In float64 through compose(), one process, with a device budget below the model (chunks move): equal to the
dense model with the same adapters trained by the same optimizer in this process (losses 1e-10, every
parameter 1e-9, the base unchanged bit for bit). Under bfloat16 chunks: the frozen rows' host bytes are their
16-bit chunks' and nothing else. ZeRO over dp=2 runs in tests/test_hetero_master.py's spawned job.
"""

from __future__ import annotations

import torch

from parallel4d.config.load import make_config
from parallel4d.models.build import build_dense, shape_from_config
from parallel4d.models.lora import LoraShape, adapted_modules, add_adapters, is_adapter
from test_llama import BASE, _job, check_pieces, dense_run, train_layouts

LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}
#: 2048-element chunks (16 KiB in float64); the model's chunks hold ~500 KB, the budget about a fifth of it
HETERO = {"enabled": True, "chunk_elems": 2048, "device_budget_bytes": 100_000}
LORA_ZERO = "LoRA, hetero ZeRO over dp=2 (a budget below the model)"  # in test_hetero_master.py's 2-worker job


def lora_hetero_job(parallel: dict | None = None, **train) -> dict:
    """test_llama's llama with adapters on q, v and down, trained under hetero with a budget below the model."""
    return _job(parallel or {}, {"microbatches": 2}, model={"lora": LORA}, hetero=HETERO,
                train={**BASE["train"], **train})


def dense_lora_run(job: dict):
    """One process's losses and parameters: the dense model with the same adapters (seeded train.seed)."""
    cfg = make_config(job)
    return dense_run(job, prepare=lambda m: add_adapters(m, adapted_modules(cfg.model), LoraShape.of(cfg.model.lora),
                                                         cfg.train.seed))


def check_against_one_process(results: list[dict], name: str, job: dict) -> None:
    """Every rank's losses (1e-10) and parameters (1e-9) equal one process's; the base did not move."""
    want_losses, want = dense_lora_run(job)
    check_pieces(results, name, want_losses, want)
    cfg = make_config(job)
    base = build_dense(shape_from_config(cfg.model), seed=cfg.train.seed).double().state_dict()
    for rank in results:
        for dense, boxes in rank[name][1].items():
            if not is_adapter(dense):
                for off, t in boxes:
                    box = base[dense][tuple(slice(o, o + n) for o, n in zip(off, t.shape))]
                    assert torch.equal(t, box), dense


def test_lora_under_hetero_with_chunks_moving_equals_one_process(single_rank):
    """float64, one process, clipping on: the frozen base streams through a budget a fifth of the model
    (frozen holds that lasted the whole backward needed 7 chunks = 114688 bytes at once here)."""
    job = lora_hetero_job()
    results = train_layouts({"lora hetero": job}, with_hetero_stats=True)
    check_against_one_process([results], "lora hetero", job)
    st = results["hetero"]
    assert st["model_data_bytes"] > 4 * st["device_budget_bytes"] and st["total"]["loads"] > 0  # chunks moved
    assert st["peak_resident_bytes"] <= st["device_budget_bytes"]


def test_frozen_base_costs_its_sixteen_bit_chunks_and_nothing_else(single_rank):
    """bfloat16 chunks over float32 parameters: a frozen row has its P chunk's host backing (2 bytes an element)
    and no master, no moments and no gradient chunk; the adapters' rows keep theirs (master W, M, V: 12 bytes)."""
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    job = lora_hetero_job(dtype="bfloat16", grad_clip=None)
    cfg = make_config(job)
    mesh = init_mesh(timeout_s=60)
    engine = compose(cfg, mesh)
    rt = engine.store.model._hetero_runtime
    frozen = [row for row in rt.rows if not row.trainable]
    trainable = [row for row in rt.rows if row.trainable]
    assert frozen and trainable and all(is_adapter(r.name) for row in trainable for r in row.records)
    assert all(row.G is None and row.M is None and row.V is None for row in frozen)
    assert not set(rt.master.W) & {row.index for row in frozen}
    st = engine.hetero_stats()
    C = st["chunk_elems"]
    assert st["frozen_rows"] == len(frozen) and st["frozen_host_bytes"] == 2 * C * len(frozen)
    assert st["frozen_params"] == sum(p.numel() for n, p in engine.store.model.named_parameters() if not is_adapter(n))
    # hetero's whole host memory: the frozen chunks, the adapters' gradient backings and float32 masters, staging
    assert st["host_bytes"] == 2 * C * len(frozen) + (2 + 12) * C * len(trainable) + st["staging_bytes"]
    engine.close()
    mesh.close()


def test_launch_estimate_and_plan_count_a_frozen_base_at_its_chunk_bytes():
    """config/memory.py's lower bound and ``parallel4d plan``'s dry run of a LoRA job: the frozen base at its
    chunks' bytes alone (bfloat16 chunks: 2 a parameter; no gradient, master or moments), so the host bytes
    per parameter (besides the compute chunks) fall from full fine-tuning's 14 to about 2 plus the adapters'
    share; the estimate stays at most the dry run's (the adapters' padded row is left out, as all padding). Without hetero the plain store's frozen base holds its
    values only (no gradient, no optimizer state)."""
    from parallel4d.config.memory import rank_bytes
    from parallel4d.config.rules.lora import adapter_parameters
    from parallel4d.planning.dry_run import plan

    model = {**BASE["model"], "vocab_size": 256, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate_size": 384}
    job = {**BASE, "model": model, "train": {**BASE["train"], "dtype": "bfloat16", "grad_clip": None},
           "hetero": {"enabled": True}}
    full, lora = make_config(job), make_config({**job, "model": {**model, "lora": LORA}})
    (f,), (ll,) = plan(full), plan(lora)
    adapters = sum(adapter_parameters(lora.model))
    assert ll.hetero_params == f.hetero_params + adapters

    def held(r):  # hetero's model state: the host's, and the master state its budget (none: all) put on the device
        return r.hetero_host + r.master_placement["optimizer_device_bytes"]

    per = [held(r) / r.hetero_params for r in (f, ll)]
    print("bytes per parameter besides the compute chunks, full / LoRA:", per)
    # LoRA: 2 for the base, the adapters' 14 over their one row, padded to a whole chunk at this size (1.5 more)
    assert per[0] > 14 and per[1] < 4
    est = [rank_bytes(cfg) for cfg in (full, lora)]
    est = [e.model_state_host + e.master_placed for e in est]
    assert 0.75 * held(f) <= est[0] <= held(f) and est[1] <= held(ll), (est, held(f), held(ll))
    assert 2 * f.hetero_params <= est[1] < est[0] / 4  # the base's 16-bit bytes, and hardly more
    plain = {**job, "hetero": {"enabled": False}}
    (pf,), (pl,) = plan(make_config(plain)), plan(make_config({**plain, "model": {**model, "lora": LORA}}))
    for cfg_job, r in ((plain, pf), ({**plain, "model": {**model, "lora": LORA}}, pl)):
        est = rank_bytes(make_config(cfg_job)).model_state_device
        assert 0.75 * (r.parameters + r.gradients + r.optimizer_state) <= est <= r.parameters + r.gradients + r.optimizer_state
    assert pl.gradients + pl.optimizer_state < (pf.gradients + pf.optimizer_state) / 4


def test_lora_under_hetero_resumes_from_its_adapter_checkpoint_as_one_run(tmp_path, single_rank):
    """A LoRA checkpoint holds the adapters only; hetero's loader takes it (the frozen base stays in its
    chunks as train.seed made it): 4 steps = 2 steps, a checkpoint, a fresh engine resumed for 2 more —
    losses and the saved state (adapters, their Adam moments) equal bit for bit. (Found by the layout
    fuzzer: gpt2 tp=4 under hetero, interrupted and resumed, failed on the base's missing keys.)"""
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose
    from parallel4d.training.checkpoints import load_checkpoint, save_checkpoint

    cfg = make_config({**lora_hetero_job(), "train": {**BASE["train"], "out_dir": str(tmp_path / "run")}})
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 64, (8, 16), generator=gen),) * 2 for _ in range(4)]

    def run(engine, steps):
        return [float(engine.train_step(*batches[s])) for s in steps]

    whole = compose(cfg, init_mesh())
    want_losses = run(whole, range(4))
    want = whole.checkpoint_state()
    whole.close()
    first = compose(cfg, init_mesh())
    losses = run(first, range(2))
    save_checkpoint(first, cfg)
    first.close()
    second = compose(cfg, init_mesh())
    assert load_checkpoint(second, cfg.checkpoint_dir) is not None and second.step == 2
    losses += run(second, range(2, 4))
    got = second.checkpoint_state()
    second.close()
    assert losses == want_losses
    flat_want, flat_got = _flat(want), _flat(got)
    assert flat_want.keys() == flat_got.keys() and any("lora_A" in k for k in flat_got)
    assert all(torch.equal(flat_got[k], flat_want[k]) for k in flat_want), \
        [k for k in flat_want if not torch.equal(flat_got[k], flat_want[k])]


def _flat(state, prefix=""):
    """``{dotted key: tensor}`` of a nested state dict's tensors."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out
