"""Mixed precision that says what it does (#16.4).

* ``train.dtype`` is a preset for explicit fields (``param_dtype``, ``autocast_dtype``,
  ``grad_reduce_dtype``); the explicit fields give the preset's run bit for bit.
* float16 autocast with dynamic loss scaling trains within 2e-2 of float32.
* An overflow injected on one rank of a pp=2 × dp=2 job (its gradient only: its pp peer sees it in
  the norm, the other pp rank would not) makes every rank skip that step — parameters unchanged
  everywhere, the scale halved everywhere — and the next step trains.
* ``grad_reduce_dtype=bfloat16`` all-reduces half the bytes and stays within 2e-2 of float32.
"""

import math

import pytest
import torch

from conftest import run_workers
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config

BASE = {
    "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2},
    "data": {"batch_size": 8, "seed": 3},
    "train": {"seed": 5, "steps": 12, "timeout_s": 60.0},
    "optimizer": {"lr": 1e-2, "warmup_steps": 2},
    "checkpoint": {"enabled": False},
}


def train(single: dict, steps: int = 12, **sections) -> list[float]:
    """Losses of ``steps`` steps of BASE with ``single``'s train fields (and other ``sections``), in
    this process's group."""
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    cfg = make_config({**BASE, **sections, "train": {**BASE["train"], **single}})
    engine = compose(cfg, init_mesh())
    data = build_dataset(cfg)
    return [engine.train_step(*data.batch(step)) for step in range(steps)]


def test_half_precisions_train_within_2e_2_of_float32(single_rank):
    f32 = train({"dtype": "float32"})
    for fields in ({"dtype": "float16"}, {"dtype": "bfloat16"}):
        half = train(fields)
        assert all(math.isfinite(x) for x in half) and half[-1] < half[0], (fields, half)
        assert half != f32  # computed in half precision, not float32 under another name
        assert max(abs(a - b) / b for a, b in zip(half, f32)) < 2e-2, (fields, half, f32)


def test_float16_under_hetero(single_rank):
    """hetero's chunks hold the scaled gradients; the unscaling rides on its clip coefficient."""
    hetero = {"enabled": True, "chunk_elems": 8192}
    f32 = train({"dtype": "float32", "grad_clip": 0.5}, hetero=hetero)
    f16 = train({"dtype": "float16", "grad_clip": 0.5}, hetero=hetero)
    assert f16 != f32 and f16[-1] < f16[0] and max(abs(a - b) / b for a, b in zip(f16, f32)) < 2e-2


def test_explicit_fields_are_the_presets(single_rank):
    assert train({"autocast_dtype": "bfloat16"}, 3) == train({"dtype": "bfloat16"}, 3)
    assert train({"param_dtype": "float64"}, 3) == train({"dtype": "float64"}, 3)
    assert train({"autocast_dtype": "float16"}, 3) == train({"dtype": "float16"}, 3)


@pytest.mark.parametrize("fields, words", [
    ({"dtype": "float64", "autocast_dtype": "bfloat16"}, "train.autocast_dtype=bfloat16 but train.dtype=float64"),
    ({"param_dtype": "float64", "autocast_dtype": "float16"}, "with float64 parameters"),
    ({"dtype": "float32", "param_dtype": "float64"}, "train.param_dtype=float64 but train.dtype=float32"),
])
def test_precision_fields_that_disagree_are_refused(fields, words):
    with pytest.raises(ConfigError, match=words):
        make_config({"train": fields})


def test_grad_reduce_dtype_with_hetero_is_refused():
    with pytest.raises(ConfigError, match="hetero reduces gradients in its chunks' dtype"):
        make_config({"train": {"grad_reduce_dtype": "bfloat16"}, "hetero": {"enabled": True}})


INJECT_AT, INJECT_RANK = 1, 3


def _overflow_worker():
    import torch.distributed as dist

    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    cfg = make_config({**BASE, "parallel": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2},
                       "train": {**BASE["train"], "dtype": "float16", "loss_scale_init": 1024.0}})
    mesh = init_mesh(pp=2, dp=2)
    engine = compose(cfg, mesh)
    real = engine.compute_gradients

    def compute_gradients(tokens, targets):
        loss = real(tokens, targets)
        if engine.step == INJECT_AT and dist.get_rank() == INJECT_RANK:
            p = next(p for p in engine.params if p.grad is not None)
            p.grad.view(-1)[0] = float("inf")  # this rank's gradient alone overflows
        return loss

    engine.compute_gradients = compute_gradients
    data = build_dataset(cfg)
    out = []
    for step in range(3):
        before = [p.detach().clone() for p in engine.params]
        engine.train_step(*data.batch(step))
        changed = any(not torch.equal(a, p) for a, p in zip(before, engine.params))
        out.append({"skipped": bool(engine.last_step_skipped), "changed": changed,
                    "scale": float(engine.loss_scale.scale)})  # read back: the scale is updated in place
    return {"coords": mesh.coords, "steps": out}


def _reduce_worker():
    """dp=4: float32 and bfloat16 gradient all-reduces, 6 steps each."""
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    out = {}
    for reduce in ("float32", "bfloat16"):
        cfg = make_config({**BASE, "parallel": {"dp": 4}, "train": {**BASE["train"], "grad_reduce_dtype": reduce}})
        mesh = init_mesh(dp=4)
        engine = compose(cfg, mesh)
        data = build_dataset(cfg)
        out[reduce] = {"losses": [engine.train_step(*data.batch(s)) for s in range(6)],
                       "bytes": mesh.comm_stats.sent["dp_grad"]}
    return out


def _pipeline_worker():
    """pp=2 × dp=2 (1F1B) in bfloat16: activations and their gradients cross the stages in bf16."""
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    cfg = make_config({**BASE, "parallel": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2},
                       "train": {**BASE["train"], "dtype": "bfloat16"}})
    engine = compose(cfg, init_mesh(pp=2, dp=2))
    data = build_dataset(cfg)
    return [engine.train_step(*data.batch(step)) for step in range(PIPELINE_STEPS)]


PIPELINE_STEPS = 6


def _jobs():
    return {"overflow": _overflow_worker(), "reduce": _reduce_worker(), "pipeline": _pipeline_worker()}


@pytest.fixture(scope="module")
def four_ranks():
    return run_workers(_jobs, 4, timeout_s=300)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(four_ranks):
    assert {r["overflow"]["coords"]["pp"] for r in four_ranks} == {0, 1}
    for rank, r in enumerate(four_ranks):
        steps = r["overflow"]["steps"]
        assert [s["skipped"] for s in steps] == [False, True, False], (rank, steps)
        assert [s["changed"] for s in steps] == [True, False, True], (rank, steps)
        assert [s["scale"] for s in steps] == [1024.0, 512.0, 512.0], (rank, steps)


def test_gradients_reduced_in_bfloat16(four_ranks):
    for r in four_ranks:
        f32, bf16 = r["reduce"]["float32"], r["reduce"]["bfloat16"]
        assert bf16["bytes"] * 2 == f32["bytes"] > 0
        assert bf16["losses"] != f32["losses"]
        assert max(abs(a - b) / b for a, b in zip(bf16["losses"], f32["losses"])) < 2e-2


def test_bfloat16_through_the_pipeline_trains_as_in_one_process(four_ranks, single_rank):
    """The pp=2 × dp=2 bf16 run (16-bit activations between the stages) against the one-process bf16
    run of the same job (within 1e-2) and its float32 run (within 2e-2, as bf16 itself)."""
    one, f32 = train({"dtype": "bfloat16"}, PIPELINE_STEPS), train({"dtype": "float32"}, PIPELINE_STEPS)
    for r in four_ranks:
        pp = r["pipeline"]
        assert all(math.isfinite(x) for x in pp) and pp[-1] < pp[0], pp
        assert max(abs(a - b) / b for a, b in zip(pp, one)) < 1e-2, (pp, one)
        assert max(abs(a - b) / b for a, b in zip(pp, f32)) < 2e-2, (pp, f32)


# --- train.fused: torch's kernels, apex's when present, the error when forced without it ------------

LLAMA = {"arch": "llama", "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2}


def train_llama(fields: dict, steps: int = 6) -> list[float]:
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    cfg = make_config({**BASE, "model": LLAMA, "train": {**BASE["train"], **fields}})
    engine = compose(cfg, init_mesh())
    data = build_dataset(cfg)
    return [engine.train_step(*data.batch(step)) for step in range(steps)]


def close(a, b, rtol):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= rtol


def test_torch_fused_kernels_train_like_the_plain_ones(single_rank):
    """fused AdamW and F.rms_norm (llama's norms) against the plain float32 ops; auto is torch here."""
    from parallel4d.config.rules.training import apex_available

    assert not apex_available()  # not on this machine's package index
    plain, fused = train_llama({"fused": "off"}), train_llama({"fused": "torch"})
    assert close(fused, plain, 1e-5) and fused[-1] < fused[0]
    assert train_llama({"fused": "auto"}) == fused


def test_apex_forced_without_apex_says_how_to_install_it():
    with pytest.raises(ConfigError, match=r"train.fused=apex needs NVIDIA apex.*git\+https://github.com/NVIDIA/apex"):
        make_config({"train": {"fused": "apex"}})


@pytest.fixture
def apex_stub(monkeypatch):
    """An ``apex`` package with apex's FusedAdam and fused-norm signatures, recording its calls
    (torch's kernels underneath): what parallel4d does with apex when it is installed."""
    import importlib.machinery
    import sys
    import types

    import torch.nn.functional as F

    calls = []

    class FusedAdam(torch.optim.AdamW):
        def __init__(self, params, adam_w_mode=True, **kwargs):
            calls.append(("FusedAdam", adam_w_mode))
            super().__init__(params, **kwargs)

    def fused_rms_norm_affine(x, weight, normalized_shape, eps):
        calls.append(("fused_rms_norm_affine",))
        return F.rms_norm(x, normalized_shape, weight, eps)

    def fused_layer_norm_affine(x, weight, bias, normalized_shape, eps):
        calls.append(("fused_layer_norm_affine",))
        return F.layer_norm(x, normalized_shape, weight, bias, eps)

    modules = {"apex": types.ModuleType("apex"), "apex.optimizers": types.ModuleType("apex.optimizers"),
               "apex.normalization": types.ModuleType("apex.normalization"),
               "apex.normalization.fused_layer_norm": types.ModuleType("apex.normalization.fused_layer_norm")}
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    modules["apex.optimizers"].FusedAdam = FusedAdam
    modules["apex.normalization.fused_layer_norm"].fused_rms_norm_affine = fused_rms_norm_affine
    modules["apex.normalization.fused_layer_norm"].fused_layer_norm_affine = fused_layer_norm_affine
    return calls


def test_apex_is_used_when_installed(single_rank, apex_stub):
    plain = train_llama({"fused": "off"})
    assert apex_stub == []
    got = train_llama({"fused": "auto"})  # auto picks apex when it is importable
    assert ("FusedAdam", True) in apex_stub and ("fused_rms_norm_affine",) in apex_stub
    assert close(got, plain, 1e-5)


# --- train.tf32: TensorFloat-32 for float32 matmuls on CUDA, set per worker process -------------------------------

@pytest.mark.parametrize("train_fields, allowed", [
    ({}, True), ({"dtype": "bfloat16"}, True), ({"dtype": "float16"}, True),
    ({"tf32": False}, False), ({"dtype": "float64"}, False),
])
def test_tf32_follows_train_tf32_on_cuda(train_fields, allowed):
    from parallel4d.engine.model import tf32_allowed

    cfg = make_config({"train": train_fields})
    assert tf32_allowed(cfg, torch.device("cuda", 0)) is allowed
    assert tf32_allowed(cfg, "cpu") is None  # nothing to set off CUDA


def test_the_worker_allows_tf32_before_building_the_model(single_rank, monkeypatch):
    """run_training on a (faked) CUDA mesh sets this process's cuBLAS and cuDNN TF32 switches from
    train.tf32 before it builds anything; train.tf32=false turns both off."""
    import types

    from parallel4d.training import loop

    class Built(Exception):
        pass

    seen = []

    def compose(cfg, mesh):
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        raise Built

    monkeypatch.setattr(loop, "init_mesh", lambda **kw: types.SimpleNamespace(device=torch.device("cuda", 0)))
    monkeypatch.setattr(loop, "compose", compose)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's defaults
        for tf32 in (True, False):
            with pytest.raises(Built):
                loop.run_training(make_config({**BASE, "train": {**BASE["train"], "tf32": tf32}}))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    assert seen == [(True, True), (False, False)]


# --- activations cross pipeline stages in the autocast dtype ---------------------------------------------------

@pytest.mark.parametrize("dtype, wire", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16)])
def test_activations_cross_pipeline_stages_in_the_autocast_dtype(dtype, wire, monkeypatch):
    """pp=2 (1F1B), one step of each rank dry-run as ``parallel4d plan`` runs it: every activation and
    activation-gradient posted between the stages is in the autocast dtype (the parameters' without
    autocast): the same messages as float32's, at half the bytes under bf16/fp16."""
    from parallel4d.distributed import comm
    from parallel4d.planning.dry_run import dry_run

    posted, real = {}, comm.p2p

    def p2p(ops, group=None, **kw):
        ops = list(ops)
        if kw.get("label") != "pp.warm_up":  # the one-element handshake that opens each pair, not an activation
            posted[run].extend((op[0], tuple(op[1].shape), op[1].dtype) for op in ops)
        return real(ops, group, **kw)

    monkeypatch.setattr(comm, "p2p", p2p)
    pipeline = {"parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    for run in {"float32", dtype}:
        posted[run] = []
        cfg = make_config({**BASE, **pipeline, "train": {**BASE["train"], "dtype": run}})
        for pp_rank in (0, 1):
            dry_run(cfg, pp_rank)
    assert {kind for kind, _, _ in posted[dtype]} == {"send", "recv"}
    assert {t for _, _, t in posted[dtype]} == {wire}, posted[dtype]
    assert [m[:2] for m in posted[dtype]] == [m[:2] for m in posted["float32"]]
