"""End to end through launch(configs/*.yaml): every layout's losses (and, in float64, final
parameters) match the single-process run of the same job; bfloat16 (float32 parameters under bf16
autocast) runs through every technique and stays within 2e-2 of float32."""

import contextlib
from pathlib import Path

import pytest
import torch

from parallel4d.checkpoint.resume import latest_checkpoint
from parallel4d import launch
from conftest import assert_plan_matches, run_in_this_process, train_cases_in_one_job, train_in_job
from parallel4d.sequence import ring_bytes
from test_checkpoint import read_state

ROOT = Path(__file__).resolve().parents[1]
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.sp=1", "parallel.tp=1"]
FLOAT64 = ["train.dtype=float64", "train.steps=4"]  # 4 of a config's 20 (2 past warm-up): every parameter after them to 1e-9
_runs: dict = {}


def run(name, tmp_path, overrides, tag):
    out = tmp_path / tag
    overrides = [*overrides, f"train.out_dir={out}", "train.log_every=100"]
    if tag == "ref":  # one process: the worker launch would start, run here (saves a spawn)
        return run_in_this_process(ROOT / "configs" / f"{name}.yaml", overrides), out
    return launch(ROOT / "configs" / f"{name}.yaml", overrides), out


def shared_run(name, tmp_path_factory, overrides=(), tag="run"):
    """``(summary, out_dir)`` of a config under ``overrides``, run once per session: the tests
    that check the same job (e.g. a float32 layout and its bfloat16 twin) share it."""
    key = (name, tuple(overrides))
    if key not in _runs:
        _runs[key] = run(name, tmp_path_factory.mktemp(f"{tag}-{name}"), list(overrides), tag)
    return _runs[key]


def reference(name, tmp_path_factory, extra=()):
    """The single-process run of a config (cached per config and overrides)."""
    return shared_run(name, tmp_path_factory, [*extra, *SINGLE], tag="ref")


def assert_losses_match(parallel, single, rtol=1e-4):
    # float64: the summaries' losses are Python floats; a float32 tensor would round away
    # differences far above the 1e-10 the float64 jobs are held to
    a, b = (torch.tensor(x["losses"], dtype=torch.float64) for x in (parallel, single))
    assert len(a) == len(b) == single["steps"]
    rel = ((a - b).abs() / b.abs()).max().item()
    assert rel <= rtol, f"max relative loss difference {rel:.2e} > {rtol}"
    assert a[-1] < a[0]  # it trains


def assert_params_match(out_a, out_b, rtol=1e-4, atol=1e-6):
    a = read_state(latest_checkpoint(out_a / "checkpoints"))
    b = read_state(latest_checkpoint(out_b / "checkpoints"))
    if "model.head.weight" in a and "model.head.weight" not in b:  # untied copy on the last stage
        b["model.head.weight"] = b["model.embed.tok.weight"]
    model_keys = sorted(k for k in b if k.startswith("model."))
    assert model_keys and set(model_keys) <= set(a)
    for k in model_keys:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def assert_float64_match(got, out, ref, ref_out):
    """A float64 job equals its single-process run: losses to 1e-10, every parameter after the last
    step to 1e-9 relative. atol 1e-12 is for attention's key bias: its gradient is zero in exact
    arithmetic, so its entries are rounding noise (|k bias| ~1.5e-14 after tensor2d.yaml's 20 steps)
    where a relative bound means nothing. Measured (tp=4, tp=4 × dp=2, sp=4 in both layouts): losses
    within 2.4e-15, the key bias within 3e-14, every other entry within 1.4e-10 relative (over 20 steps;
    the jobs now run 4)."""
    assert got["config"]["train"]["dtype"] == ref["config"]["train"]["dtype"] == "float64"
    assert_losses_match(got, ref, rtol=1e-10)
    assert_params_match(out, ref_out, rtol=1e-9, atol=1e-12)


def assert_ring_bytes(got, dtype):
    """Rank 0's ring traffic: every layer's forward and backward of every step, exactly the formula's
    for ``dtype`` (the check used to look up "ring.fwd.kv", a label that never exists, and fell back
    to any label)."""
    m = got["config"]["model"]
    sp, dp = got["parallel"]["sp"], got["parallel"]["dp"]
    per_call = ring_bytes(sp, got["config"]["data"]["batch_size"] // dp, m["heads"], m["seq_len"] // sp,
                          m["hidden"] // m["heads"], dtype)
    calls = got["steps"] * m["layers"]
    for label, want in per_call.items():
        assert want > 0
        for way in ("sent", "received"):
            assert got["bytes_communicated"][way][label] == calls * want, (label, way)


TENSOR2D = {
    "tp4": ["parallel.tp=4"],  # float32, as shipped: losses within 1e-4
    # float64 at tp=4 alone is this run's grid without the data replicas (dropped to keep the suite short)
    "tp4-dp2-float64": ["parallel.tp=4", "parallel.dp=2", *FLOAT64],
}


@pytest.mark.parametrize("case", list(TENSOR2D))
def test_tensor2d(case, tmp_path_factory):
    """Optimus 2D at tp=4 (and × dp=2): float32 losses within 1e-4; in float64, losses to 1e-10 and
    every parameter to 1e-9 (each tensor compared under its dense name and shape)."""
    overrides = TENSOR2D[case]
    got, out = shared_run("tensor2d", tmp_path_factory, overrides)
    float64 = "float64" in case
    ref, ref_out = reference("tensor2d", tmp_path_factory, FLOAT64 if float64 else ())
    assert got["world_size"] == 4 * (2 if "parallel.dp=2" in overrides else 1)
    if float64:
        assert_float64_match(got, out, ref, ref_out)
    else:
        assert_losses_match(got, ref)


def test_sequence(tmp_path_factory):
    """configs/sequence.yaml as shipped (sp=4, zigzag, float32): ring bytes and losses within 1e-4."""
    got, _ = shared_run("sequence", tmp_path_factory)
    ref, _ = reference("sequence", tmp_path_factory)
    assert got["world_size"] == 4 and got["config"]["sequence"]["layout"] == "zigzag"
    assert_ring_bytes(got, torch.float32)
    assert_losses_match(got, ref)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_sequence_float64(layout, tmp_path_factory):
    """Ring attention over sp=4 in float64, both layouts: losses to 1e-10, every parameter to 1e-9
    (one single-process run for both: at sp=1 the layout does not exist)."""
    got, out = shared_run("sequence", tmp_path_factory, [f"sequence.layout={layout}", *FLOAT64])
    ref, ref_out = reference("sequence", tmp_path_factory, FLOAT64)
    assert got["world_size"] == 4 and got["config"]["sequence"]["layout"] == layout
    assert_ring_bytes(got, torch.float64)
    assert_float64_match(got, out, ref, ref_out)


PIPELINES = {  # one 4-worker job runs them all (pp=2 cases × dp=2)
    "hanayo-pp4-w2": [],  # the shipped layout unsplit; as shipped (split): test_pipeline_config_float32
    "gpipe-pp2-dp2": ["parallel.pp=2", "parallel.dp=2", "pipeline.schedule=gpipe"],
    "1f1b-pp2-dp2-recompute": ["parallel.pp=2", "parallel.dp=2", "pipeline.schedule=1f1b",
                               "train.activation_checkpointing=blocks"],
    "interleaved-pp2-dp2": ["parallel.pp=2", "parallel.dp=2", "pipeline.schedule=interleaved",
                            "pipeline.chunks_per_rank=2"],
    "hanayo-pp2-w2-dp2": ["parallel.pp=2", "parallel.dp=2", "pipeline.schedule=hanayo", "pipeline.waves=2"],
    "1f1b-pp2-dp2-m4": ["parallel.pp=2", "parallel.dp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
}


# configs/pipeline.yaml splits the backward (Hanayo only): these cases do not
UNSPLIT = [*FLOAT64, "pipeline.split_backward=false"]
PLANNED_SCHEDULES = ("1f1b-pp2-dp2-recompute",)  # test_plan: the shipped configs, Hanayo among them


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """Rank 0's summary per :data:`PIPELINES` case and their directory, from one 4-worker job."""
    tmp = tmp_path_factory.mktemp("pipelines")
    return train_cases_in_one_job(4, ROOT / "configs" / "pipeline.yaml", PIPELINES, UNSPLIT, tmp), tmp


PIPELINE_STEPS = ["train.steps=4"]  # 2 past warm-up; test_plan measures their first step


@pytest.mark.parametrize("name", ["pipeline", "pipeline_zb"])
def test_pipeline_config_float32(name, tmp_path_factory):
    """configs/pipeline.yaml as shipped (pp=4, Hanayo, 2 waves, split backward) and
    configs/pipeline_zb.yaml (pp=4, the zero-bubble V: one wave, split), 4 of their steps in float32:
    losses within 1e-4."""
    got, _ = shared_run(name, tmp_path_factory, PIPELINE_STEPS)
    ref, _ = reference(name, tmp_path_factory, PIPELINE_STEPS)
    assert got["world_size"] == 4 and got["config"]["pipeline"]["split_backward"]
    # rank 0 builds only its own chunks (4 of 16, 2 of 8): no whole-model copy per rank
    assert got["parameters"] < 0.5 * ref["parameters"]
    assert got["pipeline"]["peak_activations"] > 0
    if name == "pipeline_zb":  # hop_cost: auto — the order built for the hop measured at start
        order = got["pipeline"]["order"]
        assert order["measured"] and order["hop_s"] > 0 and order["chunk_forward_s"] > 0, order
        assert order["hop_cost"] == round(order["hop_s"] / order["chunk_forward_s"], 3), order
        assert order["bubble_at_hop"] <= order["bubble_at_hop_of_the_default_order"], order
        assert sorted(order["actions"]) == ["0", "1", "2", "3"] and order["actions"]["0"].startswith("F0.0 ")
    assert_losses_match(got, ref)


def test_llama_config_float32(tmp_path_factory):
    """configs/llama.yaml (Llama family: tp=4 × ring sp=2, 8 workers), 8 of its steps in float32:
    losses within 1e-4 of the single process; each rank holds a quarter of the weights."""
    short = ["train.steps=8"]
    got, _ = shared_run("llama", tmp_path_factory, short)
    ref, _ = reference("llama", tmp_path_factory, short)
    assert got["world_size"] == 8 and got["config"]["model"]["arch"] == "llama"
    assert got["parameters"] < 0.3 * ref["parameters"]
    assert_losses_match(got, ref)


@pytest.mark.parametrize("case", list(PIPELINES))
def test_pipeline_schedules(case, pipeline_runs, tmp_path_factory):
    """Every schedule, and pp × dp = 2 × 2: losses and final parameters equal pp=1 (1F1B with its
    blocks recomputed in the backward). ``parallel4d plan`` is within 10 % of what 1F1B with
    recomputation measured (tests/test_plan.py: the shipped configs, Hanayo among them).

    In float64: the key bias of attention has a zero gradient in exact arithmetic, and in
    float32 AdamW turns each layout's different rounding noise there into lr-sized
    steps, so parameters are compared where rounding noise stays far below Adam's eps."""
    summaries, tmp = pipeline_runs
    got, out = summaries[case], tmp / case
    overrides = [*PIPELINES[case], *UNSPLIT]
    micro = [o for o in overrides if o.startswith(("pipeline.microbatches", "train."))]
    ref, ref_out = reference("pipeline", tmp_path_factory, micro)
    assert got["world_size"] == 4
    assert_float64_match(got, out, ref, ref_out)
    if case in PLANNED_SCHEDULES:
        assert_plan_matches(ROOT / "configs" / "pipeline.yaml", overrides, got)


# bf16's checkpoint is read; float32 logs at step 3 of its 4 (tests/test_host_syncs.py counts its host syncs)
FOUR_D = {"float32": ["checkpoint.enabled=false", "train.log_every=3"],
          "bfloat16": ["train.dtype=bfloat16", "train.log_every=100"]}
FOUR_D_STEPS = ["train.steps=4"]  # of the config's 10: 16 workers share the CI's 2 cores
FOUR_D_SYNCS = "float32 host syncs"


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job (tests/conftest.py): configs/4d.yaml as shipped
    and in bfloat16, each as launch runs it on a rank; ``{case: (rank 0's summary, out_dir)}``, and
    under :data:`FOUR_D_SYNCS` this rank's host syncs of the float32 run, counted while it trained
    (``[(what, where, label)]``, for tests/test_host_syncs.py: one 16-rank run of the config for both)."""
    from host_syncs import HostSyncs
    from parallel4d.engine.step import Engine

    out = {}
    for case, extra in FOUR_D.items():
        counted = HostSyncs().watch_steps(Engine) if case == "float32" else contextlib.nullcontext()
        with counted:
            out[case] = (train_in_job(ROOT / "configs" / "4d.yaml", [*extra, *FOUR_D_STEPS,
                                                                     f"train.out_dir={tmp / case}"]), tmp / case)
        if case == "float32":
            out[FOUR_D_SYNCS] = [(s.what, s.where, s.label) for s in counted.syncs if s.label != "start"]
    return out


def test_all_four_techniques(sixteen_workers, tmp_path_factory):
    """configs/4d.yaml as shipped (float32; its first 4 steps), 16 workers: Hanayo pp=2 × ring sp=2 × 2D tp=4 × hetero
    (budget below each rank's model data, ZeRO over the dp·sp replicas) equals one process with none
    of them. Float64 (losses 1e-10, every parameter and Adam moment 1e-9) and resuming its
    checkpoint under other layouts: tests/test_reshard.py, not repeated here."""
    got, out = sixteen_workers[0]["test_e2e"]["float32"]
    ref, _ = reference("4d", tmp_path_factory, ["hetero.enabled=false", *FOUR_D_STEPS])
    assert got["world_size"] == 16
    h = got["hetero"]
    assert 0 < h["peak_resident_bytes"] <= h["device_budget_bytes"] < h["model_data_bytes"]
    assert h["bytes_moved"] > 0
    assert_losses_match(got, ref)


def test_hetero(tmp_path_factory):
    """configs/hetero.yaml: chunked memory with a budget below the model data, ZeRO over dp=2."""
    got, out = shared_run("hetero", tmp_path_factory)
    # 22 single-process steps: the reference of the 20 here and of the 2 the resume computes
    ref, _ = reference("hetero", tmp_path_factory, ["hetero.enabled=false", "train.steps=22"])
    h = got["hetero"]
    assert h["device_budget_bytes"] < h["model_data_bytes"]
    assert 0 < h["peak_resident_bytes"] <= h["device_budget_bytes"]
    assert h["bytes_moved"] > 0 and got["world_size"] == 2
    assert_losses_match(got, {**ref, "losses": ref["losses"][:20], "steps": 20}, rtol=1e-5)
    # Resume from the hetero checkpoint: the two steps it computes are the straight run's steps
    # 21-22 (steps 1-20 come back from the checkpoint's run.json and cannot differ).
    more, _ = run("hetero", out.parent, ["train.resume=true", "train.steps=22"], out.name)
    assert more["resumed_from"] == 20 and more["losses"][:20] == got["losses"]
    assert_losses_match(more, ref, rtol=1e-5)


# float32 chunks on float64 masters: the 16-bit chunks' machinery (a compute copy rounded from a master
# on the host, the update there) with rounding small enough to see a layout's error; eps 1e-5: Adam would
# turn float32 rounding of the attention key bias (true gradient zero) into whole steps
MIXED = ["parallel.tp=1", "train.dtype=float64", "hetero.compute_dtype=float32", "optimizer.eps=1e-5",
         "train.steps=10", "hetero.chunk_elems=16384", "hetero.device_budget_bytes=400000"]


def test_master_on_the_host_under_hanayo_ring_and_zero(tmp_path_factory):
    """configs/4d.yaml at tp=1 with hetero's chunks narrower than its master (#29.1): Hanayo pp=2 ×
    ring sp=2 × ZeRO over the dp·sp replicas, a budget below the model data (gradient chunks evicted
    mid-row are reduced then), equals one process of the same chunks: 10 steps, losses and every
    master parameter ≤ 1e-6 (measured 1.1e-7 and 6.8e-7; the one-process run equals torch's AdamW on
    its masters: tests/test_hetero_master.py)."""
    got, out = shared_run("4d", tmp_path_factory, MIXED)
    ref, ref_out = reference("4d", tmp_path_factory, MIXED)
    h = got["hetero"]
    assert (h["compute_dtype"], h["master_dtype"]) == ("float32", "float64") and got["world_size"] == 4
    assert h["peak_resident_bytes"] <= h["device_budget_bytes"] < h["model_data_bytes"]
    assert h["reduce_scatters"]["on_eviction"] > 0
    assert_losses_match(got, ref, rtol=1e-6)
    a, b = (read_state(latest_checkpoint(o / "checkpoints")) for o in (out, ref_out))
    rel = {k: ((a[k] - b[k]).norm() / b[k].norm()).item() for k in b if k.startswith("model.")}
    assert rel and max(rel.values()) <= 1e-6, max(rel.items(), key=lambda kv: kv[1])  # ‖Δ‖/‖ref‖ per tensor


def assert_bfloat16(got, out, f32):
    """A bfloat16 run (float32 parameters, bf16 autocast) against its layout's float32 run: finite
    losses within 2e-2, learning, and bf16 really used (float32 checkpoints, other losses, bf16 SUMMA
    operands and ring K/V)."""
    assert got["config"]["train"]["dtype"] == "bfloat16" and got["world_size"] == f32["world_size"]
    state = read_state(latest_checkpoint(out / "checkpoints"))
    assert {v.dtype for k, v in state.items() if k.startswith("model.")} == {torch.float32}  # bf16 compute only
    assert torch.isfinite(torch.tensor(got["losses"])).all()
    assert_losses_match(got, f32, rtol=2e-2)  # and last < first
    # bf16 was used, not float32 under another name
    assert got["losses"] != f32["losses"]
    sent, sent32 = got["bytes_communicated"]["sent"], f32["bytes_communicated"]["sent"]
    if got["parallel"]["sp"] > 1:  # K and V travel the ring in bf16, also from 2D layers; dK/dV in float32
        ring = [k for k in sent32 if k.startswith("ring_attention.")]
        assert len(ring) == 3 and all(sent[k] * (1 if k.endswith(".dkv") else 2) == sent32[k] for k in ring)
    if got["parallel"]["tp"] > 1:  # SUMMA broadcasts and reduces its bf16 operands: half of float32's bytes
        summa = [k for k in sent32 if ":summa_" in k]
        assert summa and all(2 * sent[k] == sent32[k] for k in summa)


def test_bfloat16_with_all_four_techniques(sixteen_workers):
    """configs/4d.yaml under ``train.dtype=bfloat16``: ring, SUMMA, the pipeline and hetero at once
    (each technique's own float32 run is checked above; their bf16 paths all run here)."""
    (got, out), (f32, _) = (sixteen_workers[0]["test_e2e"][case] for case in ("bfloat16", "float32"))
    assert got["parallel"]["sp"] > 1 and got["parallel"]["tp"] > 1 and got["parallel"]["pp"] > 1
    assert_bfloat16(got, out, f32)


def test_bfloat16_hetero(tmp_path, tmp_path_factory):
    """hetero alone under bf16 autocast: bf16 chunks on the device (half the bytes moved and reduced),
    the float32 master on the host (its checkpoints)."""
    f32, _ = shared_run("hetero", tmp_path_factory)
    got, out = run("hetero", tmp_path, ["train.dtype=bfloat16"], "bf16")
    assert_bfloat16(got, out, f32)
    h, h32 = got["hetero"], f32["hetero"]
    assert (h["compute_dtype"], h["master_dtype"], h32["compute_dtype"]) == ("bfloat16", "float32", "float32")
    assert 2 * h["total"]["reduce_scatter_bytes"] == h32["total"]["reduce_scatter_bytes"]
    # parallel4d plan says where the master state will be, as the run placed it (#46.1): some rows each side
    from parallel4d.config.load import load_config
    from parallel4d.planning.dry_run import plan

    (planned,) = plan(load_config(ROOT / "configs" / "hetero.yaml", ["train.dtype=bfloat16"]))
    assert planned.master_placement == {k: h[k] for k in planned.master_placement}, (planned.master_placement, h)
    assert h["optimizer_rows_on_device"] > 0 and h["optimizer_rows_on_host"] > 0
