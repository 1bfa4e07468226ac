"""A device profile refitted to a GPU run's measured steps (#47.4): ``parallel4d.planning.refit`` and
``benchmarks/calibrate.py``, on a synthetic gpu-check report (no GPU here, and no GPU figure invented: the
"measured" steps are the time model's own on a made-up machine whose rates differ from the H100 profile's).

The refitted profile predicts every measured step within 15 %, the uncalibrated one is flagged where it is off,
and what was measured directly (the host link, the host optimizer's rate) is taken as it is.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from parallel4d.config.load import make_config
from parallel4d.planning import profiles
from parallel4d.planning.cost import predict
from parallel4d.planning.profiles import Rate
from parallel4d.planning.refit import TOLERANCE, MeasuredStep, ratio_row, refit, side_by_side

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import calibrate  # noqa: E402

HOST_LINK, HOST_ADAM = 2.5e10, 7e9  # the made-up machine's host link and host optimizer rate (bytes/s)


def _job(arch: str, hidden: int, hetero: dict | None = None) -> dict:
    """bf16, 2 layers, seq 1024, batch 8: work enough that the rates, not the ops' latencies, decide the step."""
    model = {"arch": arch, "hidden": hidden, "layers": 2, "heads": hidden // 64, "vocab_size": 8192, "seq_len": 1024}
    if arch == "llama":
        model.update(kv_heads=hidden // 128, intermediate_size=3 * hidden)
    return {"model": model, "data": {"source": "synthetic", "batch_size": 8}, "train": {"dtype": "bfloat16"},
            "optimizer": {"name": "adamw"}, **({"hetero": hetero} if hetero else {})}


HOST_ROWS = {"enabled": True, "device_budget_bytes": 160_000_000}  # the master state of most rows on the host
JOBS = {"gpt2 plain": _job("gpt2", 1024), "llama plain": _job("llama", 1024),
        "gpt2 hetero, master rows on the host": _job("gpt2", 1024, HOST_ROWS)}


def _machine(h100: profiles.Profile) -> profiles.Profile:
    """A made-up GPU: bf16 products at 0.55 of the H100 profile's peak, memory at 0.7, attention at 0.8."""
    r = h100.rates
    def bf16(kind: str, share: float) -> Rate:
        return Rate(r[kind].latency_s, {**r[kind].peak, "bfloat16": share * r[kind].peak["bfloat16"]})

    scaled = {"matmul": bf16("matmul", 0.55), "attention": bf16("attention", 0.8),
              "memory": Rate(r["memory"].latency_s, 0.7 * r["memory"].peak)}
    return replace(h100, rates={**r, **scaled}, host_link_bytes_per_s=HOST_LINK,
                   host={"memory": Rate(h100.host["memory"].latency_s, HOST_ADAM)})


@pytest.fixture(scope="module")
def report() -> dict:
    """A gpu-check report as a GPU run on the made-up machine would write it (its steps' one_gpu_steps)."""
    machine = _machine(profiles.load("h100"))
    measured = []
    for name, job in JOBS.items():
        step = MeasuredStep(name, make_config(job), 0.0)
        pred = predict(step.cfg, step.timed_plans(), machine)
        host = pred.ranks[0].host_step_s if step.cfg.hetero.enabled else None
        measured.append({"name": name, "job": job, "step_s": pred.step_s, "peak_bytes": None, "host_update_s": host})
    return {"schema": "parallel4d.gpu_check/2", "dry_run": False, "started": "synthetic",
            "machine": {"gpu": "NVIDIA H100 80GB HBM3 (made up)"},
            "steps": [{"name": "synthetic", "status": "ok", "one_gpu_steps": measured,
                       "measured_rates": {"host_link_bytes_per_s": HOST_LINK}}]}


def test_a_prediction_off_by_more_than_15_percent_is_flagged():
    assert ratio_row(1.2, 1.0) == (pytest.approx(1.2), True)
    assert ratio_row(0.8, 1.0) == (pytest.approx(0.8), True)
    assert ratio_row(1.1, 1.0) == (pytest.approx(1.1), False)
    assert ratio_row(None, 1.0) == (None, False)  # not measured: nothing to flag


def test_the_refitted_profile_predicts_the_measured_steps_within_15_percent(report):
    h100 = profiles.load("h100")
    fit, before, after = calibrate.calibrate(report, h100)
    assert [r["name"] for r in before] == list(JOBS)
    assert any("step" in r["flagged"] for r in before)  # the shipped profile is off on this machine
    for r in after:
        assert abs(r["step_ratio"] - 1) <= TOLERANCE and r["flagged"] == [], r
    assert fit.direct["host_link_bytes_per_s"] == HOST_LINK == fit.profile.host_link_bytes_per_s
    assert fit.profile.host["memory"].peak == pytest.approx(HOST_ADAM, rel=1e-6)  # the host updates' own rate
    assert fit.factors["matmul bfloat16"] > 1  # the products were slower than the profile's peak
    assert h100 == profiles.load("h100")  # the shipped profile untouched


def test_calibrate_writes_a_profile_that_plan_device_reads(report, tmp_path):
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    assert calibrate.main([str(path), "--write", str(tmp_path / "refitted.yaml")]) == 0  # every step within 15 %
    refitted = profiles.load(str(tmp_path / "refitted.yaml"))
    for step in calibrate.measured_steps(report):
        assert side_by_side(step, refitted)["flagged"] == []


def test_a_step_the_model_cannot_fit_stays_flagged(report):
    """Two runs of the same job measured 2× apart: no profile predicts both, and the refit says so."""
    twice = json.loads(json.dumps(report))
    same = dict(twice["steps"][0]["one_gpu_steps"][0])
    again = {**same, "name": "gpt2 plain, measured again", "step_s": 2 * same["step_s"]}
    twice["steps"][0]["one_gpu_steps"].append(again)
    fit, _, after = calibrate.calibrate(twice, profiles.load("h100"))
    assert any("step" in r["flagged"] for r in after)
    with pytest.raises(ValueError, match="at least one measured step"):
        refit(profiles.load("h100"), [])
