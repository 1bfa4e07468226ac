"""configs/quickstart.yaml: real text, dp=2, trains on 2 CPU cores in < 3 minutes, loss falls ≥ 40 %."""

import time
from pathlib import Path

from parallel4d import launch

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_trains(tmp_path):
    start = time.monotonic()
    summary = launch(ROOT / "configs" / "quickstart.yaml", [f"train.out_dir={tmp_path}"])
    seconds = time.monotonic() - start
    losses = summary["losses"]
    assert summary["world_size"] == 2 and summary["parameters"] > 2_000_000
    assert losses[-1] <= 0.6 * losses[0], (losses[0], losses[-1])
    assert seconds < 180, seconds
    assert (tmp_path / "summary.json").is_file()
    assert (tmp_path / "checkpoints" / "latest").is_file()
