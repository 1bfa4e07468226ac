"""Checkpoints: 10 straight steps == 7 + resume (past a corrupted step 7) + 5 (losses and parameters);
atomic saves; nothing a user trained is lost (issue #12: retention per run, re-saves, checksums,
failing saves, kill -9)."""

import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from parallel4d.checkpoint import dcp as checkpoint
from parallel4d.checkpoint.failures import CheckpointError
from parallel4d.checkpoint.resume import check_start, choose_checkpoint, latest_checkpoint
from parallel4d.checkpoint.steps import read_info
from parallel4d import launch
from parallel4d.training import loop as train
from parallel4d.config.errors import ConfigError
from parallel4d.config.schema import Config


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


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One straight 10-step dp=2 run (every=5), the reference of the resume tests; states read by DCP itself."""
    out = tmp_path_factory.mktemp("straight") / "a"
    summary = launch(job(out, 10, every=5))
    ckpt = out / "checkpoints"
    return SimpleNamespace(out=out, summary=summary, state10=read_state(ckpt / "step_00000010"))


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    good = {"w": torch.arange(4.0)}
    checkpoint.save(good, root, step=1)

    def crash(*args, **kwargs):
        raise OSError("disk full in the middle of a save")

    monkeypatch.setattr(checkpoint.dcp, "save", crash)
    with pytest.raises(CheckpointError, match="step_00000002 not saved: .*disk full in the middle"):
        checkpoint.save({"w": torch.zeros(4)}, root, step=2)
    monkeypatch.undo()
    latest = latest_checkpoint(root)
    assert latest.name == "step_00000001"
    loaded = checkpoint.load({"w": torch.empty(4)}, latest)
    assert torch.equal(loaded["w"], good["w"])
    # the next save cleans the half-written directory up
    checkpoint.save({"w": torch.ones(4)}, root, step=3)
    assert not list(root.glob(".*.tmp"))
    assert latest_checkpoint(root).name == "step_00000003"


def test_resume_under_pipeline_and_data_parallelism(tmp_path):
    """pp=2 × dp=2 (4 workers): every pp rank saves its own chunks; a copy of the straight run's
    step-2 checkpoint resumed to 4 computes the straight run's steps 3-4 and state, bit for bit.
    (2D grid blocks saved and resumed, also under another layout: tests/test_reshard.py.)"""
    def job_pp(out, steps, resume=False, every=0):
        cfg = job(out, steps, resume, every)
        cfg["parallel"] = {"pp": 2, "dp": 2}
        cfg["pipeline"] = {"schedule": "1f1b", "microbatches": 2}
        cfg["model"].update(heads=4, layers=2)
        return cfg

    straight = launch(job_pp(tmp_path / "a", 4, every=2))
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000002", tmp_path / "b" / "checkpoints" / "step_00000002")
    resumed = launch(job_pp(tmp_path / "b", 4, resume=True))
    assert resumed["resumed_from"] == 2 and resumed["losses"][2:] == straight["losses"][2:]
    a = read_state(latest_checkpoint(tmp_path / "a" / "checkpoints"))
    b = read_state(latest_checkpoint(tmp_path / "b" / "checkpoints"))
    assert a.keys() == b.keys() and "model.head.weight" not in a  # the tied table saved once
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --- nothing a user trained is lost (issue #12): in-process, no process group ---------------------------


def w(x, n=4096):
    return {"w": torch.full((n,), float(x))}


def data_file(path):
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_byte(path):
    """Same-size corruption, in the middle of the file (inside the tensor data)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_retention_deletes_only_this_runs_older_checkpoints(tmp_path):
    """#12.1: a run into a directory holding higher-numbered steps of an earlier run (its `latest`
    deleted) keeps its own newest checkpoints and the earlier run's; before, sorting by name
    deleted the fresh ones and `latest` named a deleted directory."""
    root = tmp_path / "ckpt"
    for step in (10, 12):
        checkpoint.save(w(step), root, step)
    (root / "latest").unlink()
    for step in (1, 2, 3):
        checkpoint.save(w(step), root, step, keep=2)
    latest = latest_checkpoint(root)
    assert latest is not None and latest.name == "step_00000003"
    assert torch.equal(read_state(latest)["w"], w(3)["w"])
    names = sorted(p.name for p in root.glob("step_*"))
    assert names == ["step_00000002", "step_00000003", "step_00000010", "step_00000012"]  # step 1: this run's oldest
    assert torch.equal(read_state(root / "step_00000012")["w"], w(12)["w"])


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(tmp_path):
    """#12.1: train.resume=false where checkpoints exist stops before any process group exists,
    naming train.resume, the directory and the alternatives."""
    out = tmp_path / "run"
    checkpoint.save(w(7), out / "checkpoints", 7)
    with pytest.raises(ConfigError) as e:
        train.run_training(Config.model_validate(job(out, 3)))
    msg = str(e.value)
    assert "train.resume" in msg and str(out / "checkpoints") in msg and "step_00000007" in msg, msg
    assert "checkpoint.dir" in msg and "train.out_dir" in msg and "delete" in msg, msg
    check_start(out / "checkpoints", resume=True)  # resuming there is the way on
    check_start(tmp_path / "new", resume=False)  # a directory that does not exist yet
    (tmp_path / "empty").mkdir()
    check_start(tmp_path / "empty", resume=False)


class Killed(BaseException):
    """kill -9 at this point of a save (nothing after it runs)."""


def kill_at_rename_of(monkeypatch, step):
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(f".step_{step:08d}.tmp"):
            raise Killed
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_resaving_a_step_never_deletes_the_only_good_copy(tmp_path, monkeypatch):
    """#12.3: kill -9 while step 5 is saved a second time (Ctrl-C on a checkpoint.every step, a resume
    with train.steps = the latest step). Before, the old copy was deleted before the new one was
    renamed in, and `latest` named a directory without data."""
    root = tmp_path / "ckpt"
    checkpoint.save(w(5), root, 5)
    kill_at_rename_of(monkeypatch, 5)
    try:
        checkpoint.save(w(5), root, 5)
    except Killed:
        pass
    monkeypatch.undo()
    assert torch.equal(read_state(root / "step_00000005")["w"], w(5)["w"])
    assert choose_checkpoint(root) == root / "step_00000005"


def test_replacing_a_broken_step_survives_a_kill_between_the_renames(tmp_path, monkeypatch, capsys):
    """#12.3: a broken step is replaced only once its replacement is complete; a kill after the old
    copy was moved aside puts it back, and the resume falls back past it with a warning."""
    root = tmp_path / "ckpt"
    checkpoint.save(w(4), root, 4)
    checkpoint.save(w(5), root, 5)
    flip_byte(data_file(root / "step_00000005"))
    kill_at_rename_of(monkeypatch, 5)
    with pytest.raises(Killed):
        checkpoint.save(w(5.5), root, 5)
    monkeypatch.undo()
    assert not (root / "step_00000005").exists()  # the kill came between the two renames
    assert choose_checkpoint(root) == root / "step_00000004"
    err = capsys.readouterr().err
    assert f"{root / 'step_00000005'} is not usable" in err and "checksum" in err, err
    checkpoint.save(w(5.5), root, 5)
    assert choose_checkpoint(root) == root / "step_00000005"
    assert torch.equal(read_state(root / "step_00000005")["w"], w(5.5)["w"])
    assert not list(root.glob(".step_*"))


def test_corrupted_or_truncated_files_are_named_and_skipped(tmp_path, capsys):
    """#12.8: a same-size corruption used to load silently, a truncation to end in a bare EOFError.
    Now loading names the checkpoint and the file; the resume choice falls back to the previous
    checkpoint with a warning, and stops with the paths when none is usable."""
    root = tmp_path / "ckpt"
    checkpoint.save({"w": torch.arange(4096.0)}, root, 1)
    checkpoint.save({"w": torch.arange(4096.0) * 2}, root, 2)
    newest, older = root / "step_00000002", root / "step_00000001"
    bad = data_file(newest)
    flip_byte(bad)
    with pytest.raises(Exception, match="checksum") as e:
        checkpoint.load({"w": torch.empty(4096)}, newest)
    assert str(newest) in str(e.value) and bad.name in str(e.value)
    assert choose_checkpoint(root) == older
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is not usable: file {bad.name} does not match its sha256 checksum" in err, err
    # kept for inspection under a name that is no step: never loaded or counted by retention again
    assert not newest.exists() and (root / "step_00000002.broken" / bad.name).is_file()

    cut = data_file(older)
    size = cut.stat().st_size
    os.truncate(cut, size // 2)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load({"w": torch.empty(4096)}, older)
    assert f"checkpoint {older} is not usable: file {cut.name} has {size // 2} bytes, {size} were saved" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        choose_checkpoint(root)
    assert f"no usable checkpoint under {root}" in str(e.value)
    assert f"{older}.broken: file {cut.name} has {size // 2} bytes" in str(e.value)


def test_a_directory_of_broken_checkpoints_is_reported_the_same_way_every_time(tmp_path, capsys):
    """#26.7: once a resume has set every checkpoint aside, each later resume names them all with
    why they broke (it used to say "directory does not exist; kept as .broken2"), and a fresh run
    into the directory is refused like one that holds checkpoints."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        checkpoint.save({"w": torch.arange(4096.0) * step}, root, step)
        flip_byte(data_file(root / f"step_{step:08d}"))
    reports = []
    for _ in range(3):
        with pytest.raises(CheckpointError) as e:
            choose_checkpoint(root)
        reports.append(str(e.value))
    assert reports[0] == reports[1] == reports[2], reports
    for step in (1, 2):
        assert f"step_{step:08d}.broken: file" in reports[0] and "sha256 checksum" in reports[0], reports[0]
    assert ".broken2" not in reports[0] and not list(root.glob("*.broken2"))
    with pytest.raises(ConfigError, match="all set aside as broken"):
        check_start(root, resume=False)


@pytest.fixture
def file_size_limit():
    """Lower RLIMIT_FSIZE (soft) in this process while the test wants it; always restored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = 64 * 1024

    def apply(on: bool):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit if on else soft, hard))

    yield SimpleNamespace(bytes=limit, apply=apply)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_failing_save_names_the_path_and_why(tmp_path, monkeypatch, file_size_limit):
    """#12.6: over the file size limit DCP said only `inline_container.cc: unexpected pos`. The
    error now names the checkpoint and the cause, and the earlier checkpoint stays the latest."""
    root = tmp_path / "ckpt"
    checkpoint.save(w(1, 65536), root, 1)
    file_size_limit.apply(True)
    try:
        with pytest.raises(Exception) as e:
            checkpoint.save(w(2, 65536), root, 2)
    finally:
        file_size_limit.apply(False)
    msg = str(e.value)
    assert f"{root / 'step_00000002'} not saved" in msg, msg
    assert f"RLIMIT_FSIZE (ulimit -f) is {file_size_limit.bytes} bytes" in msg and "EFBIG" in msg, msg
    assert latest_checkpoint(root).name == "step_00000001" and not list(root.glob(".step_*"))

    for err, cause in ((OSError(errno.ENOSPC, "No space left on device"), "the disk or the quota is full, "),
                       (PermissionError(errno.EACCES, "Permission denied"), f"no permission to write in {root}")):
        def fail(*args, err=err, **kwargs):
            raise RuntimeError("unexpected pos 704 vs 598") from err

        monkeypatch.setattr(checkpoint.dcp, "save", fail)
        with pytest.raises(CheckpointError, match="step_00000002 not saved: .*" + re.escape(cause)):
            checkpoint.save(w(2, 65536), root, 2)
        monkeypatch.undo()
    assert latest_checkpoint(root).name == "step_00000001" and not list(root.glob(".step_*"))


def _one_rank_over_the_file_size_limit(root, limit):
    """On 2 gloo workers: rank 1 alone cannot write its shard of step 2."""
    import torch.distributed as dist

    rank = dist.get_rank()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    shard = {f"w{rank}": torch.full((65536,), float(rank))}
    checkpoint.save(shard, root, 1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit if rank == 1 else soft, hard))
    try:
        checkpoint.save(shard, root, 2)
        outcome = "saved"
    except CheckpointError as e:
        outcome = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    checkpoint.save(shard, root, 3)  # the ranks still work together afterwards
    return outcome, latest_checkpoint(root).name


def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path, workers):
    """#12.6: every rank agrees that the save failed (none waits for the others), the message is the
    failing rank's own diagnosis, and the next save works."""
    root = tmp_path / "ckpt"
    results = workers(_one_rank_over_the_file_size_limit, 2, root, 64 * 1024, timeout_s=120)
    for outcome, latest in results:
        assert f"checkpoint {root / 'step_00000002'} not saved: the file size limit RLIMIT_FSIZE (ulimit -f) " \
               "is 65536 bytes" in outcome, outcome
        assert latest == "step_00000003"
    assert sorted(p.name for p in root.glob("*step_*")) == ["step_00000001", "step_00000003"]


class FakeEngine:
    """The engine surface train._Run uses: a step, what to save, how to load it."""

    checkpoint_format = "parallel4d"

    def __init__(self):
        self.step, self.w = 0, torch.zeros(65536)

    def checkpoint_state(self):
        return {"w": self.w, "step": torch.tensor(self.step)}

    def load_checkpoint(self, path):
        state = self.checkpoint_state()
        checkpoint.load(state, path, verify_files=False, known={"w", "step"})
        self.w, self.step = state["w"], int(state["step"])


def test_failing_periodic_save_warns_and_training_goes_on(tmp_path, capsys, file_size_limit):
    """#12.6: a periodic save that fails warns (path and cause) and the next one is tried; a failing
    final save raises. Each saved checkpoint holds the loss history (#12.10)."""
    cfg = Config.model_validate(job(tmp_path / "run", 10, every=1))
    root = tmp_path / "run" / "checkpoints"
    engine = FakeEngine()
    run = train._Run(cfg, engine, root, lead=True)
    for step in (1, 2, 3):
        engine.step, engine.w = step, torch.full((65536,), float(step))
        run.losses.append(10.0 - step)
        file_size_limit.apply(step != 2)
        try:
            run.save(seconds=step, final=step == 3)
        except CheckpointError as e:
            assert step == 3 and f"{root / 'step_00000003'} not saved" in str(e) and "RLIMIT_FSIZE" in str(e)
        finally:
            file_size_limit.apply(False)
    err = capsys.readouterr().err
    assert f"warning: checkpoint {root / 'step_00000001'} not saved: the file size limit RLIMIT_FSIZE" in err, err
    assert "Training goes on" in err
    assert latest_checkpoint(root).name == "step_00000002"
    assert read_info(root / "step_00000002")["losses"] == [9.0, 8.0]
    resumed = train._Run(cfg, FakeEngine(), root, lead=False)
    resumed.resume(tmp_path / "run" / "summary.json")
    assert resumed.engine.step == 2 and resumed.losses == [9.0, 8.0] and resumed.run_id == run.run_id


def test_a_checkpoint_of_the_other_engine_is_refused_by_name(tmp_path):
    """A job with a deepspeed: section resumes only DeepSpeed's files and a job without one only
    parallel4d's: run.json's "format" is checked before any file is read, naming both."""
    cfg = Config.model_validate(job(tmp_path / "run", 10))
    root = tmp_path / "run" / "checkpoints"
    engine = FakeEngine()
    engine.checkpoint_format = "deepspeed"
    engine.step = 1
    train._Run(cfg, engine, root, lead=False).save(seconds=1.0, final=True)
    assert read_info(root / "step_00000001")["format"] == "deepspeed"
    with pytest.raises(CheckpointError,
                       match=r"step_00000001 was saved by deepspeed and this job trains with parallel4d"):
        train._Run(cfg, FakeEngine(), root, lead=False).resume(tmp_path / "run" / "summary.json")


# --- the same through launch(): two jobs of the tiny dp=2 model ------------------------------------------


def test_resume_equals_straight_run_after_skipping_a_corrupted_checkpoint(tmp_path, straight, capfd):
    """7 steps (checkpoints 5 and 7) + resume to 10 == 10 straight steps: losses, parameters and
    optimizer state. Step 7 is corrupted (same size) and summary.json deleted first: the resume
    warns naming the file and falls back to step 5 (#12.8, #12.3), and the losses of steps 1-5
    come from the checkpoint itself (#12.10)."""
    out = tmp_path / "b"
    launch(job(out, 7, every=5))
    ckpt = out / "checkpoints"
    newest = ckpt / "step_00000007"
    bad = data_file(newest)
    flip_byte(bad)
    (out / "summary.json").unlink()
    resumed = launch(job(out, 10, resume=True, every=5))
    err = capfd.readouterr().err
    assert f"checkpoint {newest} is not usable: file {bad.name} does not match its sha256 checksum" in err, err
    assert f"resumed from {ckpt / 'step_00000005'} at step 5" in err, err
    # steps 1-5 come back from run.json; steps 6-10 are what the resumed run computed
    assert resumed["resumed_from"] == 5 and len(resumed["losses"]) == 10
    assert resumed["losses"][5:] == straight.summary["losses"][5:]
    assert resumed["losses"][:5] == straight.summary["losses"][:5]
    assert json.loads((out / "summary.json").read_text())["losses"] == straight.summary["losses"]
    a, b = straight.state10, read_state(latest_checkpoint(ckpt))
    assert a.keys() == b.keys() and any(k.startswith("optim.") and k.endswith(".exp_avg") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # every=5 with 10 steps: step 5 and the final step 10 are kept; the broken step 7 stays aside
    # and does not push the good step 5 out
    assert sorted(p.name for p in (straight.out / "checkpoints").glob("step_*")) == ["step_00000005", "step_00000010"]
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000005", "step_00000007.broken", "step_00000010"]


def test_kill_9_keeps_the_loss_history(tmp_path, straight):
    """#12.10: summary.json is written at each checkpoint, so a job killed with SIGKILL (launcher
    and workers) leaves the losses up to its last checkpoint; before, only the end wrote it."""
    cfg = job(tmp_path / "k", 100000, every=2)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the launcher's rendezvous directory dies with it
    proc = subprocess.Popen([sys.executable, "-m", "parallel4d", "launch", str(path)], stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    seen = []
    try:
        for line in proc.stderr:  # steps 2 and 4 are saved before step 5 is logged
            seen.append(line)
            if "step 5/" in line:
                break
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended by itself (the assertions below say how)
            pass
        proc.wait(timeout=60)
    summary = json.loads((tmp_path / "k" / "summary.json").read_text())
    n = summary["steps"]
    assert n >= 4 and n % 2 == 0 and len(summary["losses"]) == n, "".join(seen[-20:])
    assert summary["losses"][:10] == straight.summary["losses"][:n]
    assert summary["finished"] is False
    saved = latest_checkpoint(tmp_path / "k" / "checkpoints")
    assert int(saved.name.split("_")[1]) >= n


def one_rank(out_dir, **checkpoint_section):
    return {"model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 1},
            "data": {"batch_size": 2}, "train": {"steps": 3, "out_dir": str(out_dir), "log_every": 1},
            "checkpoint": checkpoint_section}


class Spawned(Exception):
    """What the test's stand-in for spawn raises: the job passed every check before the workers."""


def test_a_run_directory_keeps_its_history(tmp_path, monkeypatch):
    """#26.2: a second run into a train.out_dir that holds a run's summary.json and metrics.jsonl is
    refused before any worker starts — fresh, or "resumed" with nothing to resume from (checkpoints
    disabled) — and the first run's files keep every byte; resuming a run that has checkpoints goes on."""
    from conftest import run_in_this_process

    def spawn(*args, **kwargs):
        raise Spawned

    monkeypatch.setattr(sys.modules["parallel4d.launcher.launch"], "spawn", spawn)
    out = tmp_path / "run"
    run_in_this_process(one_rank(out, enabled=False), [])
    history = {name: (out / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    assert len(history["metrics.jsonl"].splitlines()) == 3
    for resume, words in ((False, "train.resume=false but"), (True, "train.resume=true but no checkpoint")):
        for section in ({"enabled": False}, {}):
            with pytest.raises(ConfigError, match=words) as e:
                launch({**one_rank(out, **section), "train": {**one_rank(out)["train"], "resume": resume}})
            assert "summary.json and metrics.jsonl" in str(e.value) and "train.out_dir" in str(e.value)
    assert {name: (out / name).read_bytes() for name in history} == history

    saved = tmp_path / "saved"
    run_in_this_process(one_rank(saved), [])
    with pytest.raises(Spawned):  # a run with its checkpoints continues
        launch({**one_rank(saved), "train": {**one_rank(saved)["train"], "resume": True, "steps": 5}})


@pytest.mark.parametrize("group, on_device", [({"fused": True}, True), ({"capturable": True}, True),
                                              ({"fused": None, "capturable": False}, False)])
def test_a_resumed_optimizer_keeps_step_where_its_kernels_read_it(group, on_device):
    """A checkpoint's Adam state is read into host tensors; loaded into a torch optimizer that is fused
    (train.fused=torch) or capturable, ``step`` must be a float32 on the parameters' device (their
    kernels read it there), as torch's own load_state_dict puts it; a plain one keeps it on the host.
    The parameters stand on the meta device for a GPU's."""
    import types

    import torch.nn as nn

    from parallel4d.engine.store import PlainStore

    model = nn.Linear(3, 2, device="meta")
    store = PlainStore.__new__(PlainStore)  # only what load_local_state reads
    store.model = model
    store.optimizer = types.SimpleNamespace(param_groups=[{"params": list(model.parameters()), **group}], state={})
    params = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    optim = {n: {"step": torch.tensor(7, dtype=torch.int64), "exp_avg": torch.zeros(p.shape, dtype=torch.float64),
                 "exp_avg_sq": torch.zeros(p.shape)} for n, p in model.named_parameters()}
    store.load_local_state((params, optim))
    for p in model.parameters():
        st = store.optimizer.state[p]
        assert st["exp_avg"].device == st["exp_avg_sq"].device == p.device and st["exp_avg"].dtype == p.dtype
        if on_device:
            assert st["step"].device == p.device and st["step"].dtype == torch.float32
        else:
            assert st["step"].device.type == "cpu" and float(st["step"]) == 7
