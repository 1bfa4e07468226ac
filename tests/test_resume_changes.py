"""A resume tells what changed (#45.6), and the curves show saves and resumes (#45, the plot).

Resuming with another learning rate, data seed, batch or sequence length used to continue without a
word. Now the run compares its config with the one the checkpoint was saved with (its config.yaml):
one line on stderr, ``summary.json``'s ``resumed_with_changes``, a ``resume`` event in metrics.jsonl
(with the layout), the layout's changes said apart. Saves are events too, and ``parallel4d plot``
marks both (tools/plot.py ``marks``: the data it draws, read here instead of pixels). One rank, in
this process: two short runs (~2 s)."""

import copy
import json

import pytest

from conftest import run_in_this_process
from parallel4d.checkpoint.resume import describe_changes, resume_changes
from parallel4d.config.load import make_config
from parallel4d.tools.plot import marks
from parallel4d.training.metrics import read_events, read_log, read_records

JOB = {"model": {"vocab_size": 64, "seq_len": 16, "max_positions": 32, "hidden": 32, "heads": 2, "layers": 1},
       "data": {"batch_size": 4}, "optimizer": {"lr": 0.001},
       "train": {"steps": 4, "log_every": 1}, "checkpoint": {"every": 2}}
CHANGED = ["optimizer.lr=0.0005", "data.seed=3", "data.batch_size=2", "model.seq_len=8", "hetero.enabled=true"]


def job(*overrides: str) -> dict:
    """:data:`JOB` as ``launch`` trains it under ``overrides`` (a copy: overrides set into the sections of
    the dict given, which load_config copies only at the top)."""
    return run_in_this_process(copy.deepcopy(JOB), list(overrides))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A 4-step run saved at steps 2 and 4, resumed to step 6 with CHANGED: (its directory, the resumed
    run's summary, what it said on stderr)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("resume") / "run"
    job(f"train.out_dir={out}")
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        summary = job(f"train.out_dir={out}", "train.resume=true", "train.steps=6", *CHANGED)
    return out, summary, said.getvalue()


def test_resuming_with_a_changed_lr_seed_and_batch_says_so_in_one_line_and_in_the_summary(resumed):
    out, summary, said = resumed
    line = next(x for x in said.splitlines() if x.startswith("[parallel4d] resumed from"))
    assert line.endswith("at step 4, with changes: optimizer.lr 0.001 → 0.0005; model.seq_len 16 → 8; data.batch_size 4 → 2; "
                         "data.seed 0 → 3; layout: hetero.enabled false → true"), line
    want = [{"field": "hetero.enabled", "was": False, "now": True, "layout": True},
            {"field": "optimizer.lr", "was": 0.001, "now": 0.0005},
            {"field": "data.batch_size", "was": 4, "now": 2}, {"field": "data.seed", "was": 0, "now": 3},
            {"field": "model.seq_len", "was": 16, "now": 8}]
    assert sorted(summary["resumed_with_changes"], key=str) == sorted(want, key=str)
    assert json.loads((out / "summary.json").read_text())["resumed_with_changes"] == summary["resumed_with_changes"]
    assert summary["resumed_from"] == 4 and summary["steps"] == 6
    assert [r["lr"] for r in read_records(out / "metrics.jsonl")] == [0.001] * 4 + [0.0005] * 2  # it did change


def test_saves_and_the_resume_are_events_between_the_logged_steps(resumed):
    out, summary, _ = resumed
    log = read_log(out / "metrics.jsonl")
    assert [(r.get("event", "step"), r["step"]) for r in log] == [
        ("step", 1), ("step", 2), ("save", 2), ("step", 3), ("step", 4), ("save", 4), ("resume", 4), ("step", 5),
        ("step", 6), ("save", 6)]
    resume = read_events(out / "metrics.jsonl")[2]
    assert resume["parallel"] == {"pp": 1, "dp": 1, "sp": 1, "tp": 1, "ep": 1}
    assert resume["changes"] == summary["resumed_with_changes"] and resume["checkpoint"].endswith("step_00000004")
    assert [e["final"] for e in read_events(out / "metrics.jsonl") if e["event"] == "save"] == [False, True, True]
    assert all(e["seconds"] > 0 for e in log if e.get("event") == "save")


def test_the_plot_marks_each_save_the_interval_it_slowed_and_the_resume(resumed):
    out, _, _ = resumed
    found = marks(read_log(out / "metrics.jsonl"))
    assert [s for s, _ in found["saves"]] == [2, 4, 6]
    # step 2's save counts in step 3's interval; step 4's (the first session's last) in none: the run resumed
    assert [s for s, _, _ in found["slowed"]] == [3] and found["slowed"][0][2] == found["saves"][0][1]
    assert found["resumes"] == [(4, "resumed, new layout", "optimizer.lr 0.001 → 0.0005; model.seq_len 16 → 8; "
                                 "data.batch_size 4 → 2; data.seed 0 → 3; layout: hetero.enabled false → true")]


def test_a_second_resume_from_the_same_step_takes_the_first_ones_place(resumed, tmp_path):
    import shutil

    out, _, _ = resumed
    again = tmp_path / "run"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints" / "step_00000006")  # lost: the run resumes from step 4 again
    (again / "checkpoints" / "latest").write_text("step_00000004")
    summary = job(f"train.out_dir={again}", "train.resume=true", "train.steps=5")
    assert summary["resumed_with_changes"] == []  # against step 4's config: the first session's
    events = [(e["event"], e["step"]) for e in read_events(again / "metrics.jsonl")]
    assert events == [("save", 2), ("save", 4), ("resume", 4), ("save", 5)]


def test_a_change_of_layout_is_said_apart_and_what_may_change_silently_is_not_said():
    saved = make_config({"parallel": {"dp": 2}, "data": {"batch_size": 8}, "optimizer": {"schedule": "cosine"},
                         "train": {"steps": 10}}).model_dump(mode="json")
    now = make_config({"parallel": {"pp": 2}, "model": {"layers": 2}, "pipeline": {"microbatches": 2},
                       "data": {"batch_size": 8}, "optimizer": {"schedule": "cosine", "betas": [0.9, 0.95]},
                       "train": {"steps": 20, "resume": True, "log_every": 5, "out_dir": "elsewhere", "timeout_s": 60},
                       "checkpoint": {"every": 3}})
    changes = resume_changes(saved, now)
    assert describe_changes(changes) == ("pipeline.microbatches 1 → 2; optimizer.betas [0.9, 0.999] → [0.9, 0.95]; "
                                         "train.steps 10 → 20; layout: parallel.pp 1 → 2, parallel.dp 2 → 1")
    # a constant rate does not depend on train.steps: extending the run is what a resume is for
    constant = make_config({"train": {"steps": 20, "resume": True}})
    assert resume_changes(make_config({"train": {"steps": 10}}).model_dump(mode="json"), constant) == []
    # a field the saved config lacks (written before it existed) is not a change
    older = make_config({}).model_dump(mode="json")
    del older["data"]["seed"]
    assert resume_changes(older, make_config({"data": {"seed": 5}})) == []


def test_a_synthetic_log_marks_a_change_of_pipeline_layout():
    log = [{"step": 2, "tokens_per_second": 8000.0}, {"event": "save", "step": 3, "seconds": 1.5, "final": False},
           {"step": 4, "tokens_per_second": 785.0}, {"event": "save", "step": 4, "seconds": 0.5, "final": True},
           {"event": "resume", "step": 4, "parallel": {"pp": 2, "dp": 1, "sp": 1, "tp": 1},
            "changes": [{"field": "parallel.pp", "was": 1, "now": 2, "layout": True},
                        {"field": "pipeline.schedule", "was": "1f1b", "now": "zbv", "layout": True}]},
           {"step": 6, "tokens_per_second": 7000.0}]
    assert marks(log) == {"saves": [(3, 1.5), (4, 0.5)], "slowed": [(4, 785.0, 1.5)],
                          "resumes": [(4, "resumed, new layout", "layout: parallel.pp 1 → 2, pipeline.schedule 1f1b → zbv")]}
