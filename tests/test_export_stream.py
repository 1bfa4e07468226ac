"""``parallel4d export`` streams (#30.6): safetensors written a block of rows at a time, straight from the
checkpoint's chunks, in memory that does not grow with the model (``benchmarks/export.py`` measures it at
1B parameters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

safetensors = pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.models import hf  # noqa: E402
from parallel4d.models.build import build_dense, shape_from_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import export as bench  # noqa: E402  benchmarks/export.py: its checkpoint writer and its export runner


def test_blocks_of_rows_and_shards_write_every_tensor_exactly(tmp_path, monkeypatch):
    """save_hf with blocks of a few rows (GPT-2's transposed Conv1D weights a few columns at a time, some
    blocks one row) and shards of 8 kB: every tensor, read back by safetensors itself, is the dense
    model's (transposed where GPT-2 stores it so)."""
    cfg = make_config({"model": {"arch": "gpt2", "vocab_size": 61, "seq_len": 16, "hidden": 32, "heads": 4,
                                 "layers": 2, "tie_embeddings": False}}).model
    state = build_dense(shape_from_config(cfg), seed=1).state_dict()
    monkeypatch.setattr(hf, "BLOCK_BYTES", 3 * 32 * 4)  # three rows of a [*, 32] tensor; one of a [*, 128] one
    hf.save_hf(state, cfg, tmp_path, max_shard_bytes=8192)
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(files) > 3 and not list(tmp_path.glob(".*.tmp"))
    saved = {k: v for f in files for k, v in load_file(f).items()}
    names = hf.p4d_to_hf(cfg)
    assert saved.keys() == {n for n, _ in names.values()}
    for dense, (name, how) in names.items():
        want = state[dense].t() if how == "t" else state[dense]
        assert torch.equal(saved[name], want), name


def test_export_memory_does_not_grow_with_the_model(tmp_path):
    """``parallel4d export`` of a 109 MB float32 checkpoint (a Llama whose token table alone is 64 MiB) with
    blocks of 4 MiB, in a child process: its peak resident memory grows by less than a fifth of the
    model's bytes past what its imports took (~10 MB here, the same for a model twice as large; it grew
    by more than the model's bytes when the export gathered the model into one file first and built
    the safetensors in memory); the export holds every tensor."""
    model = {"arch": "llama", "vocab_size": 32768, "hidden": 512, "heads": 8, "layers": 4, "intermediate_size": 1024,
             "tie_embeddings": True, "seq_len": 64}
    step = bench.write_checkpoint(tmp_path / "ckpt", model)
    nbytes = sum(f.stat().st_size for f in step.glob("*.distcp"))
    run = bench.RUN_AND_REPORT.replace("rc = main(", "parallel4d.models.hf.BLOCK_BYTES = 4 << 20\nrc = main(")
    proc = subprocess.run([sys.executable, "-c", run, "export", str(step), str(tmp_path / "hf")], capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported, peak = (int(x) for x in proc.stderr.split("PEAK_RSS ")[1].split()[:2])
    assert nbytes > 100e6 and peak - imported < nbytes / 5, (peak - imported, nbytes)
    assert bench.check_export(tmp_path / "hf", model) == 4 * 9 + 2
