"""Checkpoints move between layouts (#13.2): a float64 checkpoint written by all four techniques
at once (Hanayo pp=2 × ring sp=2 × 2D tp=4 × hetero ZeRO, 16 workers) resumes at dp=2, at tp=4
and at pp=4 interleaved; each continuation computes the straight single-process run's steps
and state, and ``parallel4d checkpoint gather`` of any checkpoint is the dense state dict. The
vocabulary, 257, does not split over the 2×2 grid: the 2D runs pad it to 258 (a row no token uses),
and their checkpoints hold the single-process model's 257 rows (saved padded, resumed unpadded).
States are read back by torch.distributed.checkpoint itself (tests/test_checkpoint.read_state)."""

import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import run_in_this_process
from parallel4d.checkpoint import dcp as checkpoint
from parallel4d.checkpoint.failures import CheckpointError
from parallel4d.checkpoint.resume import latest_checkpoint
from parallel4d import launch
from parallel4d.config.errors import ConfigError
from test_checkpoint import read_state

ROOT = Path(__file__).resolve().parents[1]
# configs/4d.yaml with 6 layers (8 stages: pp=4 interleaved needs 8 chunks) and 4 micro-batches;
# vocabulary 257: the 2×2 grid's token table blocks are 129 × 32 = 4128 elements, hetero's chunks 4224 (128·33)
MODEL = ["model.layers=6", "model.vocab_size=257", "hetero.chunk_elems=4224", "pipeline.microbatches=4",
         "train.dtype=float64", "train.log_every=100", "data.batch_size=8", "checkpoint.every=3"]
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.sp=1", "parallel.tp=1", "hetero.enabled=false"]
TARGETS = {
    "dp2": ["parallel.pp=1", "parallel.dp=2", "parallel.sp=1", "parallel.tp=1", "hetero.enabled=false"],
    "tp4": ["parallel.pp=1", "parallel.sp=1", "parallel.tp=4", "hetero.enabled=false"],
    "pp4-interleaved": ["parallel.pp=4", "parallel.sp=1", "parallel.tp=1", "hetero.enabled=false",
                        "pipeline.schedule=interleaved", "pipeline.chunks_per_rank=2"],
}


def run(out, overrides):
    return launch(ROOT / "configs" / "4d.yaml", [*MODEL, *overrides, f"train.out_dir={out}"])


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job (tests/conftest.py): the 4D run, 3 steps."""
    from conftest import train_in_job

    return train_in_job(ROOT / "configs" / "4d.yaml", [*MODEL, "train.steps=3", f"train.out_dir={tmp / '4d'}"])


@pytest.fixture(scope="module")
def jobs(sixteen_workers, tmp_path_factory):
    """The 4D run (3 steps, in the suite's 16-worker job) and the single-process run of 5 steps
    (checkpoints at 3 and 5)."""
    tmp = tmp_path_factory.mktemp("reshard")
    source = sixteen_workers[0]["test_reshard"]
    ref = run(tmp / "ref", [*SINGLE, "train.steps=5"])
    ckpts = tmp / "ref" / "checkpoints"
    ckpt = Path(source["checkpoint"])
    assert ckpt.name == "step_00000003"
    return SimpleNamespace(tmp=tmp, source=source, ref=ref, ref3=read_state(ckpts / "step_00000003"),
                           ref5=read_state(ckpts / "step_00000005"), ckpt=ckpt)


def assert_state_close(got: dict, want: dict, what: str):
    """Every saved tensor (parameters and Adam moments; steps exactly), 1e-9 relative."""
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())[:4]}"
    assert any(k.endswith(".exp_avg_sq") for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-13 if "exp_avg_sq" in k else 1e-12,
                                   msg=lambda m, k=k: f"{what} {k}: {m}")


def as_checkpoint_keys(dense: dict) -> dict:
    """gather's ``{"model": .., "optimizer": .., "step", "tokens_seen"}`` → checkpoint keys."""
    flat = {f"model.{k}": v for k, v in dense["model"].items()}
    for name, state in dense["optimizer"].items():
        flat.update({f"optim.{name}.{k}": v for k, v in state.items()})
    return {**flat, "step": dense["step"], "tokens_seen": dense["tokens_seen"]}


def test_the_4d_checkpoint_is_the_dense_state(jobs):
    """Saved under dense names and shapes: equal to the single-process run's step-3 state."""
    assert jobs.source["world_size"] == 16 and jobs.source["hetero"]["bytes_moved"] > 0
    torch.testing.assert_close(torch.tensor(jobs.source["losses"], dtype=torch.float64),
                               torch.tensor(jobs.ref["losses"][:3], dtype=torch.float64), rtol=1e-10, atol=0)
    state = read_state(jobs.ckpt)
    assert not [k for k in state if "@" in k]
    assert_state_close(state, jobs.ref3, "4d step 3")


@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_under_another_layout(target, jobs):
    out = jobs.tmp / target
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(jobs.ckpt, out / "checkpoints" / jobs.ckpt.name)
    got = run(out, [*TARGETS[target], "train.steps=5", "train.resume=true"])
    assert got["resumed_from"] == 3
    # steps 4-5 are computed here (1-3 come back from run.json): the straight run's
    torch.testing.assert_close(torch.tensor(got["losses"][3:], dtype=torch.float64),
                               torch.tensor(jobs.ref["losses"][3:], dtype=torch.float64), rtol=1e-10, atol=0)
    final = latest_checkpoint(out / "checkpoints")
    assert final.name == "step_00000005"
    saved = read_state(final)
    assert_state_close(saved, jobs.ref5, f"{target} step 5")
    # gather: the same tensors, bit for bit, as DCP reads them; i.e. the dense reference's state
    dense = torch.load(checkpoint_gather(final, out / "dense.pt", in_process=True), weights_only=True)
    gathered = as_checkpoint_keys(dense)
    assert gathered.keys() == saved.keys()
    for k in saved:
        assert torch.equal(gathered[k], saved[k]), k
    assert int(dense["step"]) == 5


def checkpoint_gather(ckpt, out, in_process: bool = False):
    """``parallel4d checkpoint gather CKPT OUT``: as its own process (the command end to end), or
    ``in_process`` through the same CLI entry point (no interpreter start: ~5 s less each)."""
    argv = ["checkpoint", "gather", str(ckpt), str(out)]
    if in_process:
        from parallel4d.tools.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        stderr = err.getvalue()
    else:
        proc = subprocess.run([sys.executable, "-m", "parallel4d", *argv], capture_output=True, text=True, timeout=120)
        code, stderr = proc.returncode, proc.stderr
    assert code == 0, stderr
    assert "gather: " in stderr and " tensors" in stderr  # the progress
    return out


def test_gather_of_the_4d_checkpoint(jobs, tmp_path):
    """The checkpoint root works too (its newest checkpoint); the result is the dense state at step 3."""
    dense = torch.load(checkpoint_gather(jobs.ckpt.parent, tmp_path / "d.pt"), weights_only=True)
    assert set(dense) == {"model", "optimizer", "step", "tokens_seen"}
    assert_state_close(as_checkpoint_keys(dense), jobs.ref3, "gathered 4d")


def mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process ("" for anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 else ""
    return ""


def test_gather_reads_one_tensor_at_a_time(jobs, tmp_path, monkeypatch):
    """In process, DCP's load recorded: every call reads one key, straight into the output file's map."""
    from parallel4d.checkpoint.gather import gather

    saved = read_state(jobs.ckpt)
    dcp = checkpoint.dcp
    calls = []
    real_load = dcp.load

    def load(state, **kwargs):
        calls.append(list(state))
        t = next(iter(state.values()))
        mapped = Path(mapped_file(t.data_ptr())).name  # the output file's pages, not a copy: its temporary
        assert mapped.startswith(".d.pt.") and mapped.endswith(".tmp"), mapped  # name (.d.pt.<pid>.<hex>.tmp)
        return real_load(state, **kwargs)

    monkeypatch.setattr(dcp, "load", load)
    out = gather(jobs.ckpt, tmp_path / "d.pt", progress=False)
    monkeypatch.undo()
    assert calls and all(len(keys) == 1 for keys in calls)
    assert sorted(k for keys in calls for k in keys) == sorted(saved)
    assert_state_close(as_checkpoint_keys(torch.load(out, weights_only=True)), jobs.ref3, "gathered in process")


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(jobs):
    out = jobs.tmp / "wider"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(jobs.ckpt, out / "checkpoints" / jobs.ckpt.name)
    wider = [*SINGLE, "model.vocab_size=512", "train.steps=4", "train.resume=true", f"train.out_dir={out}"]
    with pytest.raises(ConfigError, match=r"holds another model: model\.vocab_size=257 there, 512 here"):
        run(out, wider)  # before any worker, from the checkpoint's config.yaml
    with pytest.raises(CheckpointError,  # and in the worker, from the saved tensors' shapes: the real rows
                       match=r"model\.embed\.tok\.weight.* is \[257, 64\] there and \[512, 64\] here"):
        run_in_this_process(ROOT / "configs" / "4d.yaml", [*MODEL, *wider])
