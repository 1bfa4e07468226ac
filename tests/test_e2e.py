"""End to end through launch(configs/*.yaml): every layout's losses (and, for the
pipeline, final parameters) match the single-process run of the same job."""

from pathlib import Path

import pytest
import torch

from parallel4d import checkpoint, launch
from parallel4d.sequence import ring_bytes
from test_checkpoint import read_state

ROOT = Path(__file__).resolve().parents[1]
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.sp=1", "parallel.tp=1"]
_refs: dict = {}


def run(name, tmp_path, overrides, tag):
    out = tmp_path / tag
    return launch(ROOT / "configs" / f"{name}.yaml", [*overrides, f"train.out_dir={out}", "train.log_every=100"]), out


def reference(name, tmp_path_factory, extra=()):
    """The single-process run of a config (cached per config and overrides)."""
    key = (name, tuple(extra))
    if key not in _refs:
        tmp = tmp_path_factory.mktemp(f"ref-{name}")
        _refs[key] = run(name, tmp, [*extra, *SINGLE], "ref")
    return _refs[key]


def assert_losses_match(parallel, single, rtol=1e-4):
    # float64: the summaries' losses are Python floats; a float32 tensor would round away
    # differences far above the 1e-10 the float64 jobs are held to
    a, b = (torch.tensor(x["losses"], dtype=torch.float64) for x in (parallel, single))
    assert len(a) == len(b) == single["steps"]
    rel = ((a - b).abs() / b.abs()).max().item()
    assert rel <= rtol, f"max relative loss difference {rel:.2e} > {rtol}"
    assert a[-1] < a[0]  # it trains


def assert_params_match(out_a, out_b, rtol=1e-4, atol=1e-6):
    a = read_state(checkpoint.latest_checkpoint(out_a / "checkpoints"))
    b = read_state(checkpoint.latest_checkpoint(out_b / "checkpoints"))
    if "model.head.weight" in a and "model.head.weight" not in b:  # untied copy on the last stage
        b["model.head.weight"] = b["model.embed.tok.weight"]
    model_keys = sorted(k for k in b if k.startswith("model."))
    assert model_keys and set(model_keys) <= set(a)
    for k in model_keys:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("parallel", [["parallel.tp=4"], ["parallel.tp=4", "parallel.dp=2"]], ids=["tp4", "tp4-dp2"])
def test_tensor2d(parallel, tmp_path, tmp_path_factory):
    got, _ = run("tensor2d", tmp_path, parallel, "par")
    ref, _ = reference("tensor2d", tmp_path_factory)
    assert got["world_size"] == 4 * (2 if "parallel.dp=2" in parallel else 1)
    assert_losses_match(got, ref)


def test_sequence(tmp_path, tmp_path_factory):
    got, _ = run("sequence", tmp_path, [], "par")
    ref, _ = reference("sequence", tmp_path_factory)
    assert got["world_size"] == 4 and got["config"]["sequence"]["layout"] == "zigzag"
    # rank 0's ring traffic: every layer's forward and backward of every step, exactly the formula's
    # (the check used to look up "ring.fwd.kv", a label that never exists, and fell back to any label)
    m = got["config"]["model"]
    sp, dp = got["parallel"]["sp"], got["parallel"]["dp"]
    per_call = ring_bytes(sp, got["config"]["data"]["batch_size"] // dp, m["heads"], m["seq_len"] // sp,
                          m["hidden"] // m["heads"], torch.float32)
    calls = got["steps"] * m["layers"]
    for label, want in per_call.items():
        assert want > 0
        for way in ("sent", "received"):
            assert got["bytes_communicated"][way][label] == calls * want, (label, way)
    assert_losses_match(got, ref)


PIPELINES = {
    "hanayo-pp4-w2": [],
    "gpipe-pp2": ["parallel.pp=2", "pipeline.schedule=gpipe"],
    "1f1b-pp2": ["parallel.pp=2", "pipeline.schedule=1f1b"],
    "interleaved-pp2": ["parallel.pp=2", "pipeline.schedule=interleaved", "pipeline.chunks_per_rank=2"],
    "hanayo-pp2-w2": ["parallel.pp=2", "pipeline.schedule=hanayo", "pipeline.waves=2"],
    "1f1b-pp2-dp2": ["parallel.pp=2", "parallel.dp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
}


def test_pipeline_config_float32(tmp_path, tmp_path_factory):
    """configs/pipeline.yaml as shipped (pp=4, Hanayo, 2 waves), float32: losses within 1e-4."""
    got, _ = run("pipeline", tmp_path, [], "par")
    ref, _ = reference("pipeline", tmp_path_factory)
    assert got["world_size"] == 4
    # rank 0 builds only its 4 of 16 chunks (no whole-model copy per rank)
    assert got["parameters"] < 0.5 * ref["parameters"]
    assert got["pipeline"]["peak_activations"] > 0
    assert_losses_match(got, ref)


@pytest.mark.parametrize("case", list(PIPELINES))
def test_pipeline_schedules(case, tmp_path, tmp_path_factory):
    """Every schedule, and pp × dp = 2 × 2: losses and final parameters equal pp=1.

    In float64: the key bias of attention has a zero gradient in exact arithmetic, and in
    float32 AdamW turns each layout's different rounding noise there into lr-sized
    steps, so parameters are compared where rounding noise stays far below Adam's eps."""
    overrides = [*PIPELINES[case], "train.dtype=float64"]
    got, out = run("pipeline", tmp_path, overrides, "par")
    micro = [o for o in overrides if o.startswith("pipeline.microbatches") or o.startswith("train.dtype")]
    ref, ref_out = reference("pipeline", tmp_path_factory, micro)
    assert_losses_match(got, ref, rtol=1e-10)
    assert_params_match(out, ref_out, rtol=1e-9, atol=1e-12)


def test_all_four_techniques(tmp_path, tmp_path_factory):
    """configs/4d.yaml as shipped (float32), 16 workers: Hanayo pp=2 × ring sp=2 × 2D tp=4 × hetero
    (budget below each rank's model data, ZeRO over the dp·sp replicas) equals one process with none
    of them. Float64 parameters and resuming its checkpoint under other layouts: tests/test_reshard.py."""
    got, out = run("4d", tmp_path, [], "par")
    ref, _ = reference("4d", tmp_path_factory, ["hetero.enabled=false"])
    assert got["world_size"] == 16
    h = got["hetero"]
    assert 0 < h["peak_resident_bytes"] <= h["device_budget_bytes"] < h["model_data_bytes"]
    assert h["bytes_moved"] > 0
    assert_losses_match(got, ref)


def test_hetero(tmp_path, tmp_path_factory):
    """configs/hetero.yaml: chunked memory with a budget below the model data, ZeRO over dp=2."""
    got, out = run("hetero", tmp_path, [], "par")
    # 22 single-process steps: the reference of the 20 here and of the 2 the resume computes
    ref, _ = reference("hetero", tmp_path_factory, ["hetero.enabled=false", "train.steps=22"])
    h = got["hetero"]
    assert h["device_budget_bytes"] < h["model_data_bytes"]
    assert 0 < h["peak_resident_bytes"] <= h["device_budget_bytes"]
    assert h["bytes_moved"] > 0 and got["world_size"] == 2
    assert_losses_match(got, {**ref, "losses": ref["losses"][:20], "steps": 20}, rtol=1e-5)
    # Resume from the hetero checkpoint: the two steps it computes are the straight run's steps
    # 21-22 (steps 1-20 come back from the checkpoint's run.json and cannot differ).
    more, _ = run("hetero", tmp_path, ["train.resume=true", "train.steps=22"], "par")
    assert more["resumed_from"] == 20 and more["losses"][:20] == got["losses"]
    assert_losses_match(more, ref, rtol=1e-5)
