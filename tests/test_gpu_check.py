"""``make gpu-check`` (#28.5, #47.4) where there is no GPU, and the GPU benchmarks' DeepSpeed baseline.

Without a GPU the check prints what it would run and exits 0, writing nothing. Its default part fits 5
minutes and each named part 8 by their caps; a step past its cap is stopped with every process it started and
reported with what it had, and the next step runs; ``--dry-run`` runs the whole default part on the CPU at
tiny sizes into one JSON, with the planner's predictions beside each measured one-GPU step. The DeepSpeed
ZeRO-3 baseline of ``benchmarks/hetero_gpu.py`` trains the GPT with its own initialisation (built under
``deepspeed.zero.Init`` the weights kept torch's defaults and the LM head was NaN), and is reported as
skipped, not failed, where DeepSpeed is not installed (the GPU machine).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine


def _results() -> dict:
    return {p.name: p.stat().st_mtime_ns for p in (ROOT / "benchmarks" / "results").glob("gpu_*.json")}


def test_without_a_gpu_it_prints_the_plan_and_exits_0():
    before = _results()
    p = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "no CUDA GPU visible" in p.stdout and "part default" in p.stdout
    for step in gpu_check.PARTS["default"].steps:
        assert step.name in p.stdout
    assert "benchmarks/results/gpu_check.json" in p.stdout
    assert "--ladders-only" not in p.stdout  # the ladders run only when named (PART=ladders)
    assert _results() == before  # nothing run, nothing written


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_gpu_check_runs_the_default_part_without_installing():
    p = subprocess.run(["make", "gpu-check", f"GPU_PYTHON={sys.executable}"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "part default" in p.stdout and "pip" not in p.stdout


def test_the_default_part_fits_5_minutes_and_each_named_part_8():
    from parallel4d.config.load import load_config

    assert gpu_check.DEFAULT_CAP_S <= 5 * 60 - 10  # the interpreter's start and the report within the 5 minutes
    assert gpu_check.NAMED_CAP_S <= 8 * 60
    for part in gpu_check.PARTS.values():
        assert sum(s.cap_s for s in part.steps) <= part.cap_s <= (gpu_check.DEFAULT_CAP_S if part.name == "default"
                                                                  else gpu_check.NAMED_CAP_S)
        for s in part.steps:
            assert s.estimate_s < s.cap_s
            module, function = s.fn.split(":")
            assert callable(getattr(importlib.import_module(module), function))
    names = [s.name for s in gpu_check.PARTS["default"].steps]  # the most telling first, predictions last
    assert names[:3] == ["GPU-marked tests", "engine vs plain (Llama-3.2-1B shape)", "hetero side by side (1.4B GPT)"]
    assert names[-1] == gpu_check.PREDICTIONS.name
    import gpu_check_steps

    tests = gpu_check_steps.gpu_test_files()
    assert "tests/test_launch.py" in tests and all((ROOT / t).exists() for t in tests)
    for s in gpu_check.PARTS["launches"].steps:  # every launch a valid one-rank job
        cfg = load_config(ROOT / s.args[0], [*gpu_check_steps.ONE_GPU[:-1], "train.out_dir=runs/x"])
        assert cfg.world_size == 1


def _fake(name: str, fn: str, cap_s: int, *args: str) -> "gpu_check.Step":
    return gpu_check.Step(name, f"gpu_check_fakes:{fn}", cap_s, 0, "a fake step", args)


@pytest.mark.parametrize("fork", [False, True], ids=["fresh interpreter", "forked"])
def test_a_step_past_its_cap_is_stopped_with_what_it_had_and_the_rest_still_run(tmp_path, monkeypatch, fork):
    """Six steps in a part of 4 s: one hangs past its 1 s cap (its own child process too), then one runs, one
    raises, one says what it measures is not there, one hangs until the part's time is spent, and the last
    finds none left."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    monkeypatch.setattr(gpu_check, "RUNS", tmp_path / "runs")
    part = gpu_check.Part("fake", 99, (_fake("hangs", "records_then_hangs", 1), _fake("quick", "quick", 5, "7"),
                                       _fake("raises", "raises", 5), _fake("absent", "not_there", 5),
                                       _fake("hangs again", "records_then_hangs", 30), _fake("late", "quick", 5)),
                             "fakes")
    out = tmp_path / "report.json"
    t0 = time.monotonic()
    report = gpu_check.run_part(part, out, tiny=False, cap_s=4, fork=fork)
    assert time.monotonic() - t0 < 10
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    hangs, quick, raises, absent, again, late = report["steps"]
    assert hangs["status"] == "timed_out" and 1 <= hangs["wall_s"] < 3 and hangs["figures"]["before_the_hang"] == 1
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):  # the hanging step's own child was stopped with it
        os.kill(hangs["figures"]["grandchild_pid"], 0)
    assert quick["status"] == "ok" and quick["figures"] == {"value": 7} and quick["headline"] == "value 7"
    assert raises["status"] == "failed" and "a step's own error" in raises["output_tail"]
    assert raises["figures"] == {"before_the_error": 1}
    assert absent["status"] == "not_available" and "does not exist yet" in absent["reason"]
    assert again["status"] == "timed_out" and again["cap_s"] < 4 - 1  # what was left of the part's
    assert late["status"] == "not_run" and "spent" in late["reason"]
    assert report["wall_s"] < 4 + 1
    assert {"python", "torch", "commit"} <= set(report["versions"]) and "gpu" in report["machine"]


def test_the_dry_run_runs_the_default_part_on_the_cpu_into_one_json(tmp_path):
    """``--dry-run``: every step of the default part at tiny sizes, the one JSON's schema, and the planner's
    predictions beside every one-GPU step measured (engine and plain loop, hetero's three)."""
    before, out = _results(), tmp_path / "gpu_check.json"
    p = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == gpu_check.SCHEMA and report["dry_run"] and report["part"] == "default"
    assert {"gpu", "driver", "cuda", "cudnn", "gpu_memory_bytes", "host_memory_bytes"} <= set(report["machine"])
    assert {"python", "torch", "parallel4d", "commit", "deepspeed"} <= set(report["versions"])
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == [s.name for s in gpu_check.PARTS["default"].steps]
    for s in steps.values():
        assert s["status"] in ("ok", "not_available"), s
        assert 0 <= s["wall_s"] <= s["cap_s"]
    engine = steps["engine vs plain (Llama-3.2-1B shape)"]["figures"]
    assert engine["engine"]["step_s"] > 0 and engine["ratio_engine_over_plain"] > 0
    hetero = steps["hetero side by side (1.4B GPT)"]["figures"]
    assert "step_s_median" in hetero["hetero_half"] and "skipped" in hetero["deepspeed_zero3_offload"]
    assert steps["ring at 8 ranks (s = 32k, causal)"]["figures"]["rows"][0]["ring"] == 8
    measured = [m for s in report["steps"] for m in s["one_gpu_steps"]]
    rows = report["predictions"]["rows"]
    assert len(measured) == 5 and [r["name"] for r in rows] == [m["name"] for m in measured]
    for r, m in zip(rows, measured):
        assert r["measured_step_s"] == m["step_s"] and r["predicted_step_s"] > 0
        assert r["step_ratio"] == pytest.approx(r["measured_step_s"] / r["predicted_step_s"])
        assert r["predicted_peak_bytes"] > 0 and "step" in r["flagged"]  # a CPU against an H100's profile
    assert "predicted on h100" in p.stdout and _results() == before


def test_the_deepspeed_baseline_is_skipped_with_a_note_without_deepspeed(monkeypatch):
    import hetero_gpu

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed → ImportError
    res = hetero_gpu.run_deepspeed(None, torch.device("cuda"), None)
    assert "deepspeed not importable" in res["skipped"]


def test_the_deepspeed_baseline_starts_from_the_gpt_initialisation(tmp_path, monkeypatch):
    """ZeRO-3 (no offload: the CPU has no DeepSpeed CPU-Adam build here), bf16, one gloo rank in this
    process: the engine's gathered weights are ``build_gpt``'s, in bf16."""
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed as dist

    import hetero_gpu
    from parallel4d.integrations.deepspeed import avoid_compiled_ops
    from parallel4d.models.gpt2.model import GPTShape, build_gpt

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    avoid_compiled_ops()
    shape = GPTShape(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, tie_embeddings=False)
    cfg = {k: v for k, v in hetero_gpu.deepspeed_config(2, offload=False).items() if k != "optimizer"}
    cfg["zero_allow_untested_optimizer"] = True
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        engine = hetero_gpu.deepspeed_engine(shape, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            got = [p.detach().clone() for p in params]
    finally:
        dist.destroy_process_group()
    want = list(build_gpt(shape, seed=0).bfloat16().parameters())
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.isfinite(g).all() for g in got)


def _fake_ladder_runs(monkeypatch, hetero_gpu, accepted: set[int], trains: set[int]):
    """The plan accepts the depths ``accepted``; a child trains the depths ``trains`` (no process is started)."""
    monkeypatch.setattr(hetero_gpu, "hetero_gate", lambda cfg, memory: {"accepted": cfg.model.layers in accepted})

    def child(spec, args):
        layers = spec.job["model"]["layers"]
        if layers not in trains:
            return {"failed": "stopped: resident set passed the host's memory"}
        return {"TFLOPs": 1.0, "params": layers, "step_s_median": 1.0, "host_rss_bytes_per_param": 14.0}
    monkeypatch.setattr(hetero_gpu, "in_child", child)


def test_the_ladder_tries_the_largest_size_the_plan_accepts_first_and_none_it_refuses(monkeypatch):
    import hetero_gpu
    from parallel4d.tools.largest import Memory

    args = hetero_gpu.parse_args(["--ladders-only", "--ladder", "64x2,64x4,64x8,64x16,64x32"])
    _fake_ladder_runs(monkeypatch, hetero_gpu, accepted={2, 4, 8}, trains={2, 4, 16, 32})
    out = hetero_gpu.ladder("hetero", args, Memory(2**30, 2**30))
    assert [r["layers"] for r in out["tried"]] == [8, 4]  # the plan's largest, then down to the first that trains
    assert out["largest_shape"] == "h64 L4" and out["largest_params"] == 4
    assert [r["layers"] for r in out["refused_by_plan"]] == [16]  # the next size up: refused, not tried

    args.beyond_plan = True  # past the plan on request: up to the first size that fails
    _fake_ladder_runs(monkeypatch, hetero_gpu, accepted={2, 4, 8}, trains={2, 4, 8, 16})
    out = hetero_gpu.ladder("hetero", args, Memory(2**30, 2**30))
    assert [r["layers"] for r in out["tried"]] == [8, 16, 32] and out["largest_shape"] == "h64 L16"
