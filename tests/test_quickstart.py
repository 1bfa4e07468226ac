"""configs/quickstart.yaml (what `make demo` trains): real text, dp=2, ~3.2M parameters. Its first
40 steps here (the whole 200 would take a minute of the suite's 2 cores): the loss falls ≥ 40 %, and
at the measured pace the whole run takes < 3 minutes."""

import time
from pathlib import Path

import yaml

from parallel4d import launch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40


def test_quickstart_trains(tmp_path):
    shipped = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["train"]["steps"]
    start = time.monotonic()
    summary = launch(ROOT / "configs" / "quickstart.yaml", [f"train.out_dir={tmp_path}", f"train.steps={STEPS}"])
    seconds = time.monotonic() - start
    losses = summary["losses"]
    assert summary["world_size"] == 2 and summary["parameters"] > 2_000_000 and len(losses) == STEPS
    assert losses[-1] <= 0.6 * losses[0], (losses[0], losses[-1])
    val = summary["validation"]  # at the last step, on the held-out end of the corpus
    assert [v["step"] for v in val] == [STEPS] and val[-1]["loss"] <= 0.6 * losses[0], val
    assert summary["seconds"] / STEPS * shipped + (seconds - summary["seconds"]) < 180, (seconds, summary["seconds"])
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "metrics.jsonl").is_file()
    assert (tmp_path / "checkpoints" / "latest").is_file()
