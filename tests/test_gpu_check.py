"""``make gpu-check`` (#28, point 5) where there is no GPU, and the GPU benchmarks' DeepSpeed baseline.

Without a GPU the check prints what it would run and exits 0, writing nothing; its parts keep within
10 minutes each (20 in all) by their budgets; every launch it would make is a valid one-rank job. The
DeepSpeed ZeRO-3 baseline of ``benchmarks/hetero_gpu.py`` trains the GPT with its own initialisation
(built under ``deepspeed.zero.Init`` the weights kept torch's defaults and the LM head was NaN), and is
reported as skipped, not failed, where DeepSpeed is not installed (the GPU machine).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    assert "no CUDA GPU visible" in p.stdout
    for step in [s for steps in gpu_check.parts().values() for s in steps]:
        assert step.name in p.stdout
    assert "benchmarks/hetero_gpu.py --out" in p.stdout and "-m gpu" in p.stdout
    assert "--ladders-only" not in p.stdout  # the ladders run only when named (PART=ladders)
    assert _results() == before  # nothing run, nothing written


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_gpu_check_runs_it_without_installing():
    p = subprocess.run(["make", "gpu-check", "PART=1", f"GPU_PYTHON={sys.executable}"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "part 1" in p.stdout and "part 2" not in p.stdout and "pip" not in p.stdout


def test_parts_fit_their_budgets_and_launch_valid_one_rank_jobs():
    from parallel4d.config.load import load_config

    every = gpu_check.parts()
    assert set(every) == {"1", "2"}
    for steps in every.values():
        assert sum(s.budget_s for s in steps) <= gpu_check.PART_BUDGET_S
        assert all(s.estimate_s < s.budget_s for s in steps)
    assert sum(s.budget_s for steps in every.values() for s in steps) <= 20 * 60
    for steps in gpu_check.optional_parts().values():  # named alone: each within one part's time
        assert sum(s.budget_s for s in steps) <= gpu_check.PART_BUDGET_S
        assert all(s.estimate_s < s.budget_s for s in steps)
    tests = gpu_check.gpu_test_files()
    assert "tests/test_launch.py" in tests and all((ROOT / t).exists() for t in tests)
    launches = [s for s in every["1"] if s.name.startswith("launch")]
    assert [s.argv[4] for s in launches] == [f"configs/{n}.yaml" for n in ("quickstart", "llama", "hetero", "sequence")]
    for s in launches:
        sets = [a for a in s.argv[5:] if a != "--set" and a != "train.device=cuda"]
        cfg = load_config(ROOT / s.argv[4], sets)  # train.device=cuda left out: there is no GPU here
        assert cfg.world_size == 1 and Path(cfg.train.out_dir).parent == gpu_check.RUNS


def test_pytest_summary_figures():
    assert gpu_check.pytest_figures("...\n5 passed, 2 skipped, 1 deselected in 3.1s\n") == \
        {"passed": 5, "skipped": 2, "deselected": 1}


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
