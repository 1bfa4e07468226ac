"""Metrics while a run trains (#16.5): metrics.jsonl, TensorBoard, ``parallel4d plot``.

One job, hetero × Hanayo pp=2 × dp=2 (4 workers, float64, a cosine schedule, clipping): every
logged step's loss, learning rate and gradient norm equal the dense model's trained by torch alone
(AdamW, LambdaLR, ``clip_grad_norm_``); TensorBoard's own reader finds the same scalars; a crash
after a logged step and a resume from the checkpoint before it leave each step once in the file.
"""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from parallel4d import launch
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.data.batches import build_dataset, build_validation
from parallel4d.engine.model import model_shape, parameter_dtype
from parallel4d.training.metrics import read_records
from parallel4d.models.build import build_dense
from parallel4d.optim.optimizer import build_optimizer, lr_lambda

JOB = {
    "parallel": {"pp": 2, "dp": 2},
    "pipeline": {"schedule": "hanayo", "microbatches": 2},
    "hetero": {"enabled": True, "chunk_elems": 4096},
    "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2},
    "data": {"batch_size": 8, "seed": 1},
    "optimizer": {"lr": 0.01, "warmup_steps": 2, "schedule": "cosine", "min_lr": 0.001,
                  "decay_steps": 8},  # not train.steps: the resumed run trains 8
    "train": {"steps": 6, "log_every": 2, "dtype": "float64", "grad_clip": 0.3, "tensorboard": True, "seed": 2,
              "eval_every": 4, "eval_batches": 2},
    "checkpoint": {"every": 4},
}


def dense_reference(job: dict, steps: int) -> list[dict]:
    """Per step: the loss, the learning rate and the gradient norm (before clipping) of the dense
    model trained in this process by torch alone, and at each validation its loss on the
    validation batches."""
    cfg = make_config({**job, "train": {**job["train"], "steps": steps}})
    model = build_dense(model_shape(cfg), seed=cfg.train.seed).to(parameter_dtype(cfg))
    optimizer = build_optimizer(model.named_parameters(), cfg.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    data, val, out = build_dataset(cfg), build_validation(cfg), []
    for step in range(steps):
        loss = model(*data.batch(step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        out.append({"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"], "grad_norm": norm.item()})
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if (step + 1) % cfg.train.eval_every == 0 or step + 1 == steps:
            with torch.no_grad():
                out[-1]["val_loss"] = sum(model(*val.batch(k)).item() for k in range(cfg.train.eval_batches)) / \
                    cfg.train.eval_batches
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("metrics") / "run"
    summary = launch({**JOB, "train": {**JOB["train"], "out_dir": str(out)}})
    return out, summary


def assert_records_match(records, reference, steps):
    assert [r["step"] for r in records] == steps
    for r in records:
        want = reference[r["step"] - 1]
        assert ("val_loss" in r) == ("val_loss" in want), r["step"]
        for key in ("loss", "lr", "grad_norm", "val_loss"):
            if key in want:
                assert r[key] == pytest.approx(want[key], rel=1e-10, abs=0), (r["step"], key, r[key], want[key])


def test_each_logged_step_is_a_record_equal_to_torch_alone(run):
    out, summary = run
    records = read_records(out / "metrics.jsonl")
    ref = dense_reference(JOB, 6)
    assert ref[1]["grad_norm"] > JOB["train"]["grad_clip"]  # clipping really scales
    assert_records_match(records, ref, [2, 4, 6])
    assert [r["loss"] for r in records] == [summary["losses"][s - 1] for s in (2, 4, 6)]
    assert [(v["step"], v["loss"]) for v in summary["validation"]] == [(4, records[1]["val_loss"]),
                                                                        (6, records[2]["val_loss"])]
    assert records[1]["val_perplexity"] == pytest.approx(math.exp(records[1]["val_loss"]))
    for r in records:
        assert len(r["peak_memory_bytes"]) == 4 and min(r["peak_memory_bytes"]) > 0
        assert r["peak_memory_kind"] == "host max resident set"
        assert r["tokens_per_second"] > 0
        # 6·(the blocks' matrices 2·12·h² + the LM head V·h) + the attention's 12·L·h·s (models/gpt2/spec.py)
        assert r["model_flops_per_second"] == pytest.approx(r["tokens_per_second"] * (
            6 * (2 * 12 * 32 ** 2 + 64 * 32) + 12 * 2 * 32 * 16))
        # the pipeline's activations along pp, hetero's ZeRO over the data replicas
        assert r["bytes_sent_by_axis"]["pp"] > 0 and r["bytes_sent_by_axis"]["dp+sp"] > 0
    sent = [r["bytes_sent_by_axis"]["pp"] for r in records]
    assert sent[0] < sent[1] < sent[2]  # cumulative


def test_tensorboard_holds_the_same_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = read_records(out / "metrics.jsonl")
    for key in ("loss", "lr", "grad_norm", "tokens_per_second", "val_loss"):
        tag = "val/loss" if key == "val_loss" else f"train/{key}"
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records if key in r], key


def test_plot_draws_the_run(run, tmp_path):
    out, _ = run
    png = tmp_path / "c.png"
    proc = subprocess.run([sys.executable, "-m", "parallel4d", "plot", str(out), "-o", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    proc = subprocess.run([sys.executable, "-m", "parallel4d", "plot", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "has no losses to plot" in proc.stderr


def test_a_resume_keeps_each_step_once(run, tmp_path):
    """The run crashed after logging step 6 but before saving it: resumed from step 4, the file
    keeps steps 2 and 4, and the steps trained again are logged again, equal to the first time."""
    out, _ = run
    again = tmp_path / "run"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints" / "step_00000006")
    first = read_records(out / "metrics.jsonl")
    summary = launch({**JOB, "train": {**JOB["train"], "out_dir": str(again), "steps": 8, "resume": True}})
    assert summary["resumed_from"] == 4 and len(summary["losses"]) == 8
    records = read_records(again / "metrics.jsonl")
    assert_records_match(records, dense_reference(JOB, 8), [2, 4, 6, 8])
    assert [r["loss"] for r in records[:3]] == [r["loss"] for r in first]
    assert [v["step"] for v in summary["validation"]] == [4, 8]  # step 4's from the checkpoint
    assert json.loads((again / "summary.json").read_text())["losses"][:6] == summary["losses"][:6]


def test_tensorboard_without_the_package_is_refused_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train.tensorboard=true needs the tensorboard package: pip install "
                                          r"'parallel4d\[viz\]'"):
        make_config({"train": {"tensorboard": True}})


def test_host_peak_is_the_growth_from_its_baseline_and_says_how_it_was_read(monkeypatch):
    """summary.json's hetero.host_rss_* (#46.3): the peak resident set reached above the resident set at the
    baseline — a 64 MiB block written and freed still counts (but for pages the heap held already) —; without /proc/self/clear_refs, the
    lifetime peak ru_maxrss, and the figures say which."""
    from parallel4d.training import host_memory

    peak = host_memory.HostPeak()
    block = b"\x01" * (64 << 20)  # every page written: resident
    del block
    assert peak.source == "VmHWM" and peak.grown() >= 56 << 20  # pages the heap held already: reused
    figures = peak.per_param(1 << 20)
    assert figures["host_rss_source"] == "VmHWM" and figures["host_rss_bytes_per_param"] >= 56
    monkeypatch.setattr(host_memory, "_reset_peak", lambda: False)
    fallback = host_memory.HostPeak()
    assert fallback.source == "ru_maxrss" and fallback.per_param(1)["host_rss_source"] == "ru_maxrss"
