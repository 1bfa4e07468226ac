"""Checkpoints: 10 straight steps == 5 + resume + 5 (losses and parameters); atomic saves."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from parallel4d import checkpoint, launch


def job(out_dir, steps, resume=False, every=0):
    return {
        "parallel": {"dp": 2},
        "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
        "data": {"source": "synthetic", "batch_size": 8},
        "optimizer": {"lr": 0.01, "warmup_steps": 3, "weight_decay": 0.1},
        "train": {"steps": steps, "out_dir": str(out_dir), "resume": resume, "timeout_s": 60, "job_timeout_s": 240},
        "checkpoint": {"every": every},
    }


def read_state(path):
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=str(path))
    return state


def test_resume_equals_straight_run(tmp_path):
    straight = launch(job(tmp_path / "a", 10, every=5))
    launch(job(tmp_path / "b", 5))
    resumed = launch(job(tmp_path / "b", 10, resume=True))
    assert resumed["losses"] == straight["losses"]
    assert len(resumed["losses"]) == 10
    a = read_state(checkpoint.latest_checkpoint(tmp_path / "a" / "checkpoints"))
    b = read_state(checkpoint.latest_checkpoint(tmp_path / "b" / "checkpoints"))
    assert a.keys() == b.keys() and any(k.startswith("optim.") and k.endswith(".exp_avg") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # every=5 with 10 steps: step 5 and the final step 10 are kept
    names = sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("step_*"))
    assert names == ["step_00000005", "step_00000010"]


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    good = {"w": torch.arange(4.0)}
    checkpoint.save(good, root, step=1)

    def crash(*args, **kwargs):
        raise OSError("disk full in the middle of a save")

    monkeypatch.setattr(checkpoint.dcp, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save({"w": torch.zeros(4)}, root, step=2)
    monkeypatch.undo()
    latest = checkpoint.latest_checkpoint(root)
    assert latest.name == "step_00000001"
    loaded = checkpoint.load({"w": torch.empty(4)}, latest)
    assert torch.equal(loaded["w"], good["w"])
    # the next save cleans the half-written directory up
    checkpoint.save({"w": torch.ones(4)}, root, step=3)
    assert not list(root.glob(".*.tmp"))
    assert checkpoint.latest_checkpoint(root).name == "step_00000003"


def test_resume_under_pipeline_and_tensor2d(tmp_path):
    """pp=2 × tp=4 (8 workers): every rank saves its own chunks and grid blocks; 2 + resume + 2 == 4."""
    def job2d(out, steps, resume=False):
        cfg = job(out, steps, resume)
        cfg["parallel"] = {"pp": 2, "tp": 4}
        cfg["pipeline"] = {"schedule": "1f1b", "microbatches": 2}
        cfg["model"].update(heads=4, layers=2)
        return cfg

    straight = launch(job2d(tmp_path / "a", 4))
    launch(job2d(tmp_path / "b", 2))
    resumed = launch(job2d(tmp_path / "b", 4, resume=True))
    assert resumed["losses"] == straight["losses"]
    a = read_state(checkpoint.latest_checkpoint(tmp_path / "a" / "checkpoints"))
    b = read_state(checkpoint.latest_checkpoint(tmp_path / "b" / "checkpoints"))
    assert a.keys() == b.keys()
    # grid-sharded weights are saved per block (4 blocks of the first layer's qkv weight)
    assert len([k for k in a if k.startswith("model.blocks.0.") and "qkv.weight@tp" in k]) == 4
    for k in a:
        assert torch.equal(a[k], b[k]), k
