"""launch(): spawned and torchrun-style jobs, summary.json, DP = single process, failures."""

import json
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import run_workers
from parallel4d import launch
from parallel4d.config.errors import ConfigError
from parallel4d.launcher.spawn import spawn
from parallel4d.launcher.supervise import WorkerError
from parallel4d.launcher.workers import worker_pids


def worker_processes():
    """PIDs of live worker processes started by this process."""
    return sorted(worker_pids(os.getpid()).values())


def f64(losses):
    """Losses as float64: torch.tensor(list) is float32, which would round away differences far
    above the 1e-12 these float64 jobs are compared to."""
    return torch.tensor(losses, dtype=torch.float64)


def tiny(tmp_path, name, **parallel):
    return {
        "parallel": parallel,
        "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
        "data": {"source": "synthetic", "batch_size": 8},
        "train": {"steps": 4, "dtype": "float64", "out_dir": str(tmp_path / name), "timeout_s": 60,
                  "job_timeout_s": 240},
        "checkpoint": {"enabled": False},
    }


def test_data_parallel_equals_single_process(tmp_path):
    one = launch(tiny(tmp_path, "dp1"))
    two = launch(tiny(tmp_path, "dp2", dp=2))
    assert len(one["losses"]) == len(two["losses"]) == 4
    torch.testing.assert_close(f64(two["losses"]), f64(one["losses"]), rtol=1e-12, atol=0)
    assert one["losses"][-1] < one["losses"][0]
    summary = json.loads((tmp_path / "dp2" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["parallel"]["dp"] == 2
    assert summary["tokens_per_second"] > 0 and summary["losses"] == two["losses"]
    assert summary["config"]["train"]["steps"] == 4
    assert summary["bytes_communicated"]["sent"]["dp_grad"] > 0


def _join_like_torchrun(cfg):
    # The spawn helper sets RANK/WORLD_SIZE like torchrun does: launch() must join, not spawn. Its
    # workers start with one thread, as torchrun's do; a machine said to hold one rank of the job each
    # gives each rank all of its cores (the host optimizer's), not torchrun's one.
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    return launch(cfg), torch.get_num_threads()


def test_launch_joins_an_existing_job(tmp_path):
    results = run_workers(_join_like_torchrun, 2, tiny(tmp_path, "joined", dp=2), timeout_s=240)
    ref = launch(tiny(tmp_path, "ref"))
    assert results[1][0] == {"rank": 1, "stop_signal": None}
    torch.testing.assert_close(f64(results[0][0]["losses"]), f64(ref["losses"]), rtol=1e-12, atol=0)
    assert [threads for _, threads in results] == [os.cpu_count()] * 2


def test_world_size_mismatch_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="WORLD_SIZE=3"):
        launch(tiny(tmp_path, "bad", dp=2))
    assert not dist.is_initialized()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise RuntimeError("boom from rank one")
    dist.barrier()  # rank 0 would wait here forever without the launcher stepping in
    time.sleep(600)


def test_failing_worker_brings_job_down(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        spawn(_fail_on_rank_one, 3, backend="gloo", timeout_s=120, pg_timeout_s=60)
    assert err.value.rank == 1 and "boom from rank one" in str(err.value)
    assert time.monotonic() - start < 60
    assert worker_processes() == []


def _hang():
    time.sleep(600)


def test_hung_job_times_out():
    from parallel4d.launcher.supervise import WorkerTimeout

    with pytest.raises(WorkerTimeout, match="ranks still running"):
        spawn(_hang, 2, timeout_s=2)
    assert worker_processes() == []


def test_cli_launch_bad_config_exits_2(tmp_path, capsys):
    from parallel4d.tools.cli import main

    path = tmp_path / "job.yaml"
    path.write_text("parallel: {tp: 2}\n")
    assert main(["launch", str(path)]) == 2
    assert "perfect square" in capsys.readouterr().err


def test_cli_job_failure_exits_nonzero_with_the_error(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "job.yaml"
    # A learning rate this large makes the loss non-finite after the first update on every rank.
    cfg = tiny(tmp_path, "diverge", dp=2)
    cfg["optimizer"] = {"lr": 1e30}
    cfg["train"]["steps"] = 5
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "parallel4d", "launch", str(path)], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the job failed" in proc.stderr and "loss became" in proc.stderr
    # the launcher says, once, what its first silent seconds are spent on
    starting = proc.stderr.index("[parallel4d] starting 2 workers (pp=1 dp=2 sp=1 tp=1) on cpu")
    assert proc.stderr.count("workers joined the process group in") == 1, proc.stderr[-2000:]
    assert starting < proc.stderr.index("[parallel4d] 2 workers joined the process group in ")
    assert time.monotonic() - start < 120


def test_interrupt_saves_and_resume_continues(tmp_path, single_rank):
    """Ctrl-C (SIGINT to the launcher): the workers finish the step, save, and the job resumes.
    The steps the resumed run computes, and its parameters and optimizer state after them,
    equal a straight run's (dp=1, run in this process: float64 dp=2 and dp=1 agree to 1e-12)."""
    import json
    import signal
    import subprocess
    import sys

    import yaml

    from parallel4d.checkpoint.resume import latest_checkpoint

    cfg = tiny(tmp_path, "interrupted", dp=2)
    cfg["train"].update(steps=100000)  # float64 (tiny's), compared with a dp=1 run below
    cfg["checkpoint"] = {"enabled": True}
    # The attention key bias has a zero gradient in exact arithmetic; Adam turns its round-off
    # (dp=2 and dp=1 round differently) into lr·g/(|g|+eps) steps, negligible only for a large eps.
    cfg["optimizer"] = {"eps": 1e-4}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # A terminal delivers Ctrl-C; a suite started as a background job (`.ci/run &`) runs with
    # SIGINT ignored, which the launcher would inherit: give it the terminal's default.
    proc = subprocess.Popen([sys.executable, "-m", "parallel4d", "launch", str(path)], stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stderr:  # wait until training is under way
            if "step 3/" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[1]
    finally:  # a failed check must not leave a 100000-step job running under the rest of the suite
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest[-2000:]
    out = tmp_path / "interrupted"
    summary = json.loads((out / "summary.json").read_text())
    saved = latest_checkpoint(out / "checkpoints")
    assert summary["interrupted"] is True and saved is not None
    assert saved.name == f"step_{summary['steps']:08d}" and summary["steps"] >= 3
    # Resuming continues from the saved step with the saved losses kept.
    n = summary["steps"]
    cfg["train"].update(steps=n + 2, resume=True)
    resumed = launch(cfg)
    assert resumed["resumed_from"] == n and resumed["losses"][:n] == summary["losses"]  # reloaded from run.json
    # What the resumed run computed: steps n+1, n+2 and the state after them, against a straight run.
    from parallel4d.config.schema import Config
    from parallel4d.training.loop import run_training
    from test_checkpoint import read_state

    straight = tiny(tmp_path, "straight")
    straight["train"].update(steps=n + 2)
    straight["checkpoint"] = {"enabled": True}
    straight["optimizer"] = cfg["optimizer"]
    ref = run_training(Config.model_validate(straight))
    torch.testing.assert_close(f64(resumed["losses"]), f64(ref["losses"]), rtol=1e-12, atol=0)
    a = read_state(latest_checkpoint(out / "checkpoints"))
    b = read_state(latest_checkpoint(tmp_path / "straight" / "checkpoints"))
    assert a.keys() == b.keys() and int(a["step"]) == n + 2
    assert any(k.startswith("optim.") and k.endswith(".exp_avg_sq") for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-15, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.gpu
def test_quickstart_model_on_one_gpu(tmp_path):
    """On a CUDA machine the same job runs on the GPU (NCCL) and matches the CPU run."""
    cfg = tiny(tmp_path, "gpu")
    cfg["train"].update(device="cuda", dtype="float64")
    gpu = launch(cfg)
    cfg = tiny(tmp_path, "cpu")
    cfg["train"].update(device="cpu", dtype="float64")
    cpu = launch(cfg)
    assert gpu["device"].startswith("cuda")
    torch.testing.assert_close(f64(gpu["losses"]), f64(cpu["losses"]), rtol=1e-9, atol=0)


def test_workers_forked_by_a_zygote_or_started_alone_do_the_same(monkeypatch):
    """On Linux the workers are forked from one zygote that imported torch (and what ``preload``
    names) once; PARALLEL4D_FORK=0 starts one interpreter per rank. Both run the job alike. The zygote
    imports the function's module with torch.cuda.is_available() asking NVML
    (PYTORCH_NVML_BASED_CUDA_CHECK=1: the CUDA driver stays uninitialised before the fork); each worker
    gets the variable's own value back."""
    from parallel4d.launcher import workers

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert workers._forking()
    forked = spawn(_rank_and_world, 3, (5,), preload=(PRELOADED,))
    monkeypatch.setenv("PARALLEL4D_FORK", "0")
    assert not workers._forking()
    alone = spawn(_rank_and_world, 3, (5,), preload=(PRELOADED,))
    assert [r[:4] for r in alone] == [r[:4] for r in forked] == [(r, 3, 5, True) for r in range(3)]
    assert {r[4:] for r in forked} == {("1", None)} and {r[4:] for r in alone} == {(None, None)}


def test_jobs_forked_from_the_zygote_template_see_the_launchers_directory_environment_and_streams(
        tmp_path, monkeypatch, capfd):
    """The suite keeps a zygote template (conftest): each job's zygote is forked from it at the launcher's
    working directory, environment and standard streams of the moment (not of the template's start);
    worker_pids finds the workers through it; a template that ended is replaced by the next job."""
    from parallel4d.launcher import template

    assert template.wanted()
    with capfd.disabled():  # the template exists before this capture and these directories
        spawn(_rank_and_world, 1, (0,), preload=())
    for probe in ("one", "two", "three"):
        (tmp_path / probe).mkdir()
        monkeypatch.chdir(tmp_path / probe)
        monkeypatch.setenv("P4D_PROBE", probe)
        got = spawn(_where_and_who, 2, (os.getpid(),), preload=())
        assert [g[:2] for g in got] == [(str(tmp_path / probe), probe)] * 2
        assert got[0][2] == got[1][2] == {0: got[0][3], 1: got[1][3]}  # worker_pids, as each rank saw it
        assert capfd.readouterr().out.count(f"probe {probe} from rank") == 2
        if probe == "two":
            held = template._held["template"]
            held.proc.kill()
            held.proc.wait()
    assert template._held["template"] is not held and template._held["template"].alive()


def _where_and_who(launcher: int):
    print(f"probe {os.environ.get('P4D_PROBE')} from rank {dist.get_rank()}", flush=True)
    return os.getcwd(), os.environ.get("P4D_PROBE"), worker_pids(launcher), os.getpid()


PRELOADED = "colorsys"  # a module nothing here imports
# What this module's import saw: in the zygote, torch's NVML-based availability check
NVML_CHECK_AT_IMPORT = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")


def _rank_and_world(x):
    return (dist.get_rank(), dist.get_world_size(), x, PRELOADED in sys.modules, NVML_CHECK_AT_IMPORT,
            os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))


def test_restarts_without_resume_are_refused_under_torchrun(tmp_path, monkeypatch):
    """torchrun --max-restarts 2 with checkpoints and train.resume=false: the restart would refuse the
    run's own checkpoints, so every rank refuses the job at once, naming train.resume."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    cfg = tiny(tmp_path, "restarts", dp=2)
    cfg["checkpoint"] = {"enabled": True}
    with pytest.raises(ConfigError, match="--max-restarts 2 .* set train.resume=true"):
        launch(cfg)
    assert not dist.is_initialized()


def test_a_complete_run_resumed_keeps_its_figures(tmp_path, single_rank):
    """Relaunching a finished run with train.resume=true trains nothing: its summary keeps the figures of
    the session that trained (from the checkpoint's run.json, or for a checkpoint saved without them the
    summary.json before) instead of 0 tokens/s, and says it finished, stopped by no signal."""
    from parallel4d.checkpoint.checksums import write_checksums
    from parallel4d.checkpoint.resume import latest_checkpoint
    from parallel4d.config.schema import Config
    from parallel4d.training.loop import run_training

    figures = ("tokens_per_second", "model_flops_per_second")
    cfg = tiny(tmp_path, "complete")
    cfg["train"]["steps"] = 2
    cfg["checkpoint"] = {"enabled": True}
    first = run_training(Config.model_validate(cfg))
    assert first["tokens_per_second"] > 0 and first["finished"] is True
    cfg["train"]["resume"] = True
    again = run_training(Config.model_validate(cfg))
    assert again["resumed_from"] == again["steps"] == 2 and again["finished"] is True and again["stop_signal"] is None
    assert {k: again[k] for k in figures} == {k: first[k] for k in figures}
    saved = latest_checkpoint(tmp_path / "complete" / "checkpoints")
    info = json.loads((saved / "run.json").read_text())
    (saved / "run.json").write_text(json.dumps({k: v for k, v in info.items() if k not in figures}))
    write_checksums(saved)  # as a checkpoint from before run.json held the figures
    older = run_training(Config.model_validate(cfg))
    assert {k: older[k] for k in figures} == {k: first[k] for k in figures}


def test_the_cli_says_saved_only_of_a_checkpoint_that_verifies(tmp_path, monkeypatch, capsys):
    """After a run stopped by a signal, `parallel4d launch` names the checkpoint rank 0's summary names only
    once its files verify; a corrupted one is named as such. Either way the exit code is 128 + the signal."""
    from parallel4d.checkpoint import dcp as checkpoint
    from parallel4d.launcher import launch as launcher
    from parallel4d.tools import cli

    saved = checkpoint.save({"w": torch.ones(4)}, tmp_path / "ckpt", step=5)
    summary = {"losses": [1.0], "steps": 5, "stop_signal": "SIGTERM", "checkpoint": str(saved)}
    monkeypatch.setattr(launcher, "launch", lambda config, overrides: summary)  # the command imports it when run
    assert cli.main(["launch", "job.yaml"]) == 143
    assert f"stopped by SIGTERM at step 5, after saving checkpoint {saved} (verified" in capsys.readouterr().err
    data = next(p for p in saved.iterdir() if p.suffix == ".distcp")
    data.write_bytes(bytes(len(data.read_bytes())))
    summary["stop_signal"] = "SIGINT"
    assert cli.main(["launch", "job.yaml"]) == 130
    err = capsys.readouterr().err
    assert f"but its checkpoint {saved} does not verify: file {data.name} does not match" in err and "after saving" not in err


def _refuse_on(rank: int) -> None:
    if dist.get_rank() == rank:
        raise ConfigError("model.hidden=60 cannot run here; use model.hidden=64")
    dist.barrier()  # the other ranks lose their peer: consequences, not the cause


def test_a_workers_refusal_is_raised_as_itself_without_a_traceback():
    """#26.9: a ConfigError raised in a worker (a check that needs the process group) reaches the
    caller as that ConfigError, unchained, not as a WorkerError wrapping a worker's traceback."""
    with pytest.raises(ConfigError) as e:
        spawn(_refuse_on, 2, (1,), refusals=(ConfigError,), timeout_s=120, pg_timeout_s=30)
    assert str(e.value) == "model.hidden=60 cannot run here; use model.hidden=64"
    assert e.value.__cause__ is None and e.value.__context__ is None
    with pytest.raises(WorkerError, match="Traceback"):  # spawn's other callers still get the whole story
        spawn(_refuse_on, 2, (1,), timeout_s=120, pg_timeout_s=30)


def test_a_run_with_only_broken_checkpoints_is_refused_in_one_line_each_time(tmp_path, capfd):
    """#26.7/9: resuming where every checkpoint fails verification: refused with one line naming them
    all (no worker traceback), the same on the next attempt; exit 2 as every refusal (#45: it was 1)."""
    from parallel4d.tools.cli import main

    cfg = tiny(tmp_path, "run")
    cfg["train"]["steps"] = 2
    cfg["checkpoint"] = {"every": 1}
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(cfg))
    assert main(["launch", str(job)]) == 0
    for ckpt in (tmp_path / "run" / "checkpoints").glob("step_*"):
        data = next(ckpt.glob("*.distcp"))
        raw = bytearray(data.read_bytes())
        raw[10] ^= 0xFF
        data.write_bytes(bytes(raw))
    capfd.readouterr()
    errors = []
    for _ in range(2):
        assert main(["launch", str(job), "--set", "train.resume=true"]) == 2
        err = capfd.readouterr().err
        assert "Traceback" not in err, err
        errors.append(err.strip().splitlines()[-1])
    assert errors[0] == errors[1] and errors[0].startswith("parallel4d: no usable checkpoint under"), errors
    assert errors[0].count(".broken: file") == 2, errors[0]


# --- CUDA and the zygote: nothing before the fork initialises CUDA, and the zygote refuses if it was ----------

ZYGOTE_IMPORTS = ("tests", "parallel4d/launcher", "parallel4d/distributed/startup.py")


def _cuda_calls(tree, module_level_only: bool):
    """``(line, dotted name)`` of the ``torch.cuda.*`` calls in ``tree``: those evaluated at import
    (module and class bodies, decorators, defaults) or, without ``module_level_only``, every one."""
    import ast

    found = []

    def visit(node, at_import: bool):
        if isinstance(node, ast.Call):
            name, f = [], node.func
            while isinstance(f, ast.Attribute):
                name.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name) and [f.id, *reversed(name)][:2] == ["torch", "cuda"]:
                if at_import or not module_level_only:
                    found.append((node.lineno, ".".join([f.id, *reversed(name)])))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in getattr(node, "decorator_list", []) + node.args.defaults + node.args.kw_defaults:
                if d is not None:
                    visit(d, at_import)
            for child in node.body if isinstance(node.body, list) else [node.body]:
                visit(child, False)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, at_import)

    visit(tree, True)
    return found


def test_nothing_the_zygote_imports_initialises_cuda():
    """The launcher's zygote imports the module of the function it forks workers for (test modules
    included): no ``torch.cuda`` call runs at the import of any module of the repository, and the
    tests, the launcher and the device choice never call ``torch.cuda.is_available()``, which
    initialises the CUDA driver (``visible_gpus`` asks NVML; GPU tests carry ``@pytest.mark.gpu``)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    at_import, asking = [], []
    for path in sorted(root.glob("**/*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith((".", "build/")) or "/." in rel:
            continue
        tree = ast.parse(path.read_text(), filename=rel)
        at_import += [f"{rel}:{line} {name}" for line, name in _cuda_calls(tree, True)]
        if rel.startswith(ZYGOTE_IMPORTS):
            asking += [f"{rel}:{line} {name}" for line, name in _cuda_calls(tree, False)
                       if name == "torch.cuda.is_available"]
    assert at_import == [] and asking == [], (at_import, asking)


def test_visible_gpus_asks_nvml_and_never_initialises_cuda(monkeypatch):
    """A CUDA build on a 2-GPU machine, faked: the count and the device choice come from NVML (or a
    child interpreter where NVML cannot say); the CUDA runtime is never asked here."""
    from parallel4d.config.load import make_config
    from parallel4d.distributed import startup

    def initialises_cuda(*a, **k):
        raise AssertionError("asked the CUDA runtime: cuInit in this process, no forked child could use CUDA")

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", initialises_cuda)
    monkeypatch.setattr(torch.cuda, "device_count", initialises_cuda)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2, raising=False)
    monkeypatch.setattr(startup, "_count_in_child", initialises_cuda)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert startup.visible_gpus() == 2
    assert startup.device_and_backend(make_config({"parallel": {"dp": 2}})) == ("cuda", "nccl")
    assert startup.default_backend() == "nccl"
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1, raising=False)  # e.g. MIG devices
    monkeypatch.setattr(startup, "_count_in_child", lambda visible: 1)
    assert startup.visible_gpus() == 1
    with pytest.raises(ConfigError, match="needs one GPU per local rank"):
        startup.device_and_backend(make_config({"parallel": {"dp": 2}, "train": {"device": "cuda"}}))


def test_the_zygote_refuses_to_fork_once_cuda_is_initialised(monkeypatch):
    """CUDA initialised in the zygote while it imported the function's module: the zygote forks no
    worker and the launcher raises its reason, naming the cause and the ways out."""
    from parallel4d.launcher.worker_process import CudaBeforeFork, refuse_cuda_before_fork

    import cuda_at_import  # here, without the variable: nothing faked in this process

    assert not torch.cuda.is_initialized()
    refuse_cuda_before_fork(cuda_at_import.rank_zero)  # nothing initialised: nothing said
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(CudaBeforeFork, match="while it imported cuda_at_import.*visible_gpus.*PARALLEL4D_FORK=0"):
        refuse_cuda_before_fork(cuda_at_import.rank_zero)
    monkeypatch.undo()
    monkeypatch.setenv("PARALLEL4D_TEST_CUDA_AT_IMPORT", "1")  # the zygote's import of the module fakes it there
    with pytest.raises(WorkerError, match="before starting any worker:\nCudaBeforeFork: CUDA was initialised in "
                                          "the process that forks the workers"):
        spawn(cuda_at_import.rank_zero, 2, timeout_s=120)
    assert worker_processes() == []


def test_a_forked_worker_that_cannot_use_cuda_says_why(monkeypatch):
    from parallel4d.launcher.worker_process import use_gpu

    def set_device(i):
        raise RuntimeError("CUDA error: initialization error")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="(?s)initialization error.*forked by the job's zygote.*PARALLEL4D_FORK=0"):
        use_gpu(0, forked=True)
    with pytest.raises(RuntimeError, match="^CUDA error: initialization error$"):
        use_gpu(0, forked=False)
