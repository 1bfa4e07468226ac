"""``benchmarks/fp8.py`` (#50.5) on the CPU at tiny sizes: the GPU figures' code paths — the llama block in FP8
against bfloat16, dense and as every rank of a 2×2 grid on one device, and the engine's launch with
``train.fp8`` rowwise against none. No speed is asserted (the CPU's ``_scaled_mm`` is a reference kernel);
what is: FP8 ran where it is reported and nowhere else, the same products were counted, and a variant that
cannot run in FP8 yet is said to be left out, not measured in bfloat16 under FP8's name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fp8 as bench  # noqa: E402  benchmarks/fp8.py

#: e4m3's unit roundoff (tests/test_fp8.py argues the band on a loss)
E4M3_U = 2.0 ** -4


def test_the_block_benchmark_runs_fp8_only_where_it_says_and_counts_the_same_products(tmp_path):
    """One round at the tiny block: the dense FP8 step's products all ran in ``_scaled_mm`` and are bfloat16's
    products (the same FLOPs); bfloat16's none; the 2D FP8 row is measured only where the 2D blocks run in FP8,
    else left out as "not yet"; the engine is skipped on the CPU; the speed-up is bfloat16's step over FP8's;
    the JSON is what was returned."""
    out = tmp_path / "fp8.json"
    res = bench.main(["--tiny", "--cpu", "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    b = res["block"]
    r = b["results"]
    assert b["block"]["hidden"] == bench.TINY_BLOCK.hidden and b["q"] == 2 and b["batch_2d"] == 2
    assert r["dense bf16"]["scaled_mm_share"] == 0 and r["2D bf16"]["scaled_mm_share"] == 0
    assert r["dense fp8"]["scaled_mm_share"] > 0.9
    assert r["dense fp8"]["flops"] == r["dense bf16"]["flops"] > 0
    assert b["speedup_fp8_over_bf16"]["dense"] == pytest.approx(r["dense bf16"]["step_s"] / r["dense fp8"]["step_s"])
    if "2D fp8" in r:  # the 2D layers compute in FP8 (#50.4)
        assert r["2D fp8"]["scaled_mm_share"] > 0.9 and b["speedup_fp8_over_bf16"]["2D"] > 0
    else:
        assert b["left_out"]["2D fp8"].startswith("not yet") and b["speedup_fp8_over_bf16"]["2D"] is None
    assert "skipped" in res["engine"] and "GPU only" in res["engine"]["skipped"]
    assert b["target_dense_speedup"] == 1.3


def test_the_engine_benchmark_trains_the_same_model_in_fp8_and_in_bf16():
    """The engine's launch on the CPU's small model, one round of one step each: the FP8 engine's block linears
    are FP8 ones (14 in 2 layers), the other's none; both start from the same weights and batch, so their
    first losses agree within e4m3's precision; no MFU without a known GPU's peak; the process group it made
    is gone afterwards."""
    import torch.distributed as dist

    e = bench.engine_fp8(cuda=False, rounds=1, steps=1, batch=2)
    none, fp8 = e["runs"]["none"], e["runs"]["rowwise"]
    assert none["fp8_linears"] == 0 and fp8["fp8_linears"] == 7 * e["config"]["model"]["layers"]
    assert abs(fp8["first_loss"] - none["first_loss"]) <= E4M3_U * none["first_loss"]
    assert fp8["first_loss"] != none["first_loss"]  # FP8 products, not bfloat16's under another name
    assert none["mfu"] is None and e["peaks_flops"] is None and e["speedup_fp8_over_bf16"] > 0
    assert not dist.is_initialized()


def test_the_block_benchmark_times_the_dense_block_compiled_in_bf16_and_fp8(monkeypatch):
    """With its compiled variants (a GPU always runs them; ``--compiled`` on the CPU): the dense block compiled
    as ``train.compile: blocks`` compiles it, in bfloat16 and in FP8, each timed beside the eager ones; the
    compiled FP8 row counts its eager twin's products (all in ``_scaled_mm``) and its speed-up is the compiled
    bfloat16 step over it. Here compiled by dynamo and AOTAutograd only (``aot_eager``: the path, not inductor's
    minutes of code generation)."""
    import parallel4d.engine.compile as compile_module

    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    b = bench.measure_blocks(bench.TINY_BLOCK, "cpu", warmup=1, iters=1, rounds=1, compiled=True)
    r = b["results"]
    assert r["dense fp8 compiled"]["flops"] == r["dense fp8"]["flops"] == r["dense bf16 compiled"]["flops"]
    assert r["dense fp8 compiled"]["scaled_mm_share"] > 0.9 and r["dense bf16 compiled"]["scaled_mm_share"] == 0
    assert b["speedup_fp8_over_bf16"]["dense compiled"] == pytest.approx(
        r["dense bf16 compiled"]["step_s"] / r["dense fp8 compiled"]["step_s"])
    assert f"compiled {bench._x(b['speedup_fp8_over_bf16']['dense compiled'])} (target" in bench.headline(
        {"block": b, "engine": {"skipped": "-"}})
