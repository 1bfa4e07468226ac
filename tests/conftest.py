"""Shared pytest helpers: run a function on N gloo workers with a timeout."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

#: shipped jobs that name what their docs page makes first (a model.pretrained directory, a token file): run
#: there, as printed, by tests/test_docs.py — not from the repository as it is
MADE_BY_THEIR_PAGE = {"finetune_lora.yaml": "docs/finetuning.md"}


def shipped_configs(root) -> list:
    """``configs/*.yaml`` under ``root`` that load as they are (not :data:`MADE_BY_THEIR_PAGE`'s), sorted."""
    from pathlib import Path

    return sorted(p for p in (Path(root) / "configs").glob("*.yaml") if p.name not in MADE_BY_THEIR_PAGE)


def pytest_configure(config):
    """This session's jobs fork their zygotes from one kept template (parallel4d/launcher/template.py):
    ~3 s of imports once instead of once per job. Only this process (not on importing this module): a
    `parallel4d launch` it starts, or a process importing a test module, starts its zygotes as usual."""
    os.environ["PARALLEL4D_ZYGOTE_TEMPLATE"] = str(os.getpid())


def pytest_terminal_summary(terminalreporter):
    """The layout fuzzer's seed and counts, in every run that drew (tests/test_layout_fuzz.py)."""
    fuzz = sys.modules.get("test_layout_fuzz")
    if fuzz is not None and fuzz.RUN["start"] is not None:
        for line in fuzz.summary():
            terminalreporter.write_line(line)


def run_workers(fn, world_size, *args, timeout_s=180.0, preload=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo CPU workers; per-rank results.

    ``preload``: the modules the job's zygote imports once for all workers; by default what training
    imports (most of the suite's jobs train), ``()`` for a job that builds no optimizer."""
    from parallel4d.launcher.spawn import TRAINING_IMPORTS, spawn

    preload = TRAINING_IMPORTS if preload is None else preload
    return spawn(fn, world_size, args, kwargs, backend="gloo", timeout_s=timeout_s, preload=preload)


# Every 16-worker check of the suite runs in one spawned job (16 processes take ~13 s to start on
# the CI's 2 cores): each module listed defines ``sixteen_worker_job(tmp)``, run on every rank
# (``tmp``: a directory of its own, shared by the ranks).
SIXTEEN_WORKER_MODULES = ("test_mesh", "test_llama", "test_e2e", "test_reshard", "test_host_syncs", "test_dropout",
                          "test_packed_training", "test_check", "test_experts",
                          "test_plan_moe", "test_expert_parallel")


def _sixteen_worker_jobs(modules, tmp):
    import importlib
    from pathlib import Path

    return {name: importlib.import_module(name).sixteen_worker_job(Path(tmp) / name) for name in modules}


@pytest.fixture(scope="session")
def sixteen_workers(tmp_path_factory):
    """``{module: its sixteen_worker_job(tmp) result}`` per rank, from one 16-worker job; a module's
    ``sixteen_worker_prepare(tmp)``, if it has one, runs here first (what needs this process: no group)."""
    import importlib
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("sixteen")
    for name in SIXTEEN_WORKER_MODULES:
        prepare = getattr(importlib.import_module(name), "sixteen_worker_prepare", None)
        if prepare is not None:
            (Path(tmp) / name).mkdir()
            prepare(Path(tmp) / name)
    return run_workers(_sixteen_worker_jobs, 16, SIXTEEN_WORKER_MODULES, str(tmp), timeout_s=900)


def train_in_job(config, overrides) -> dict:
    """What ``launch(config, overrides)`` runs on each rank, inside a job already started (e.g.
    :func:`sixteen_workers`): rank 0's summary, ``{"rank": r}`` elsewhere."""
    from parallel4d.config.load import load_config
    from parallel4d.training.loop import run_training

    return run_training(load_config(config, list(overrides)))


def run_in_this_process(config, overrides) -> dict:
    """What ``launch`` runs on the one worker of a one-process job, in the test process: a
    one-rank gloo group, ``run_training``, the group destroyed."""
    import gc
    import tempfile

    import torch.distributed as dist

    from parallel4d.config.load import load_config
    from parallel4d.training.loop import run_training

    cfg = load_config(config, list(overrides))
    assert cfg.world_size == 1, cfg.parallel
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            return run_training(cfg)
        finally:
            dist.destroy_process_group()
            gc.collect()


def small_run(out_dir):
    """A byte-level GPT-2 trained 2 steps in this process into ``out_dir``: a checkpoint at each step,
    ``latest``, summary.json and metrics.jsonl — what export, gather, generate and plot read. Returns
    ``out_dir`` as a Path."""
    from pathlib import Path

    run_in_this_process({"model": {"vocab_size": 256, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
                         "data": {"source": "synthetic", "batch_size": 4},
                         "train": {"steps": 2, "out_dir": str(out_dir), "log_every": 1},
                         "checkpoint": {"every": 1}}, [])
    return Path(out_dir)


def snapshot(directory) -> dict:
    """Every file under ``directory`` (hidden ones too) with its bytes: compared before and after, it
    shows a command wrote nothing, and left no temporary file."""
    from pathlib import Path

    return {p.relative_to(directory).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(Path(directory).rglob("*"))}


def _train_cases(config, cases, common, tmp) -> dict:
    return {name: train_in_job(config, [*extra, *common, f"train.out_dir={tmp}/{name}", "train.log_every=100"])
            for name, extra in cases.items()}


def train_cases_in_one_job(world_size, config, cases: dict, common, tmp, timeout_s=600.0) -> dict:
    """Each of ``cases`` (``{name: overrides}``, plus ``common``) as ``launch`` would train it, one after
    another in one spawned job of ``world_size`` workers (one start-up for all), into ``tmp/name``:
    ``{name: rank 0's summary}``."""
    return run_workers(_train_cases, world_size, str(config), cases, list(common), str(tmp), timeout_s=timeout_s)[0]


PLANNED = ("parameters", "gradients", "optimizer_state", "activations", "hetero_device", "hetero_host")


def assert_plan_matches(config, overrides, summary, rel=0.10) -> dict:
    """``parallel4d plan``'s dry run of ``config`` under ``overrides`` against what the run measured
    on its first step (``summary["memory"]``), for every rank (its pp position's plan; dp, sp and
    grid peers hold the same): each byte count, and the bytes sent along each axis, within ``rel``.
    Returns ``{quantity: worst relative difference}``."""
    from parallel4d.config.load import load_config
    from parallel4d.planning.dry_run import plan

    cfg = load_config(config, list(overrides))
    ranks = plan(cfg)
    measured = summary["memory"]["per_rank"]
    assert len(measured) == cfg.world_size
    per_position = cfg.world_size // cfg.parallel.pp
    worst: dict = {}
    for g, got in enumerate(measured):
        want = ranks[g // per_position]
        pairs = [(k, getattr(want, k), got.get(k)) for k in PLANNED]
        axes = set(want.sent_by_axis) | set(got["sent_by_axis"])
        pairs += [(f"sent {a}", want.sent_by_axis.get(a, 0), got["sent_by_axis"].get(a, 0)) for a in axes]
        for key, planned, real in pairs:
            if planned is None or real is None:
                assert planned is real, (g, key, planned, real)  # hetero: in its chunks on both sides
                continue
            diff = abs(planned - real) / max(real, 1)
            worst[key] = max(worst.get(key, 0.0), diff)
            assert diff <= rel, f"rank {g}: {key} planned {planned} bytes, measured {real} ({diff:.1%})"
    hetero = summary.get("hetero")
    if hetero:  # rank 0's: pp position 0's plan
        for key, planned in (("host_bytes_per_param", ranks[0].host_bytes_per_param),
                             ("device_bytes_moved_per_step", ranks[0].hetero_moved)):
            real = hetero[key]
            worst[key] = abs(planned - real) / max(real, 1)
            assert worst[key] <= rel, f"rank 0: hetero {key} planned {planned}, measured {real}"
    assert worst["activations"] <= rel and "parameters" in worst
    return worst


@pytest.fixture
def workers():
    return run_workers


@pytest.fixture
def single_rank(tmp_path):
    """A one-rank gloo process group in this process (no spawn: ~0.01 s instead of ~6 s);
    destroyed afterwards, so later tests see no process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where a GPU is visible, asked without initialising CUDA in this
    process (``torch.cuda.is_available()`` would: see ``visible_gpus``). Test modules mark GPU tests
    with ``@pytest.mark.gpu`` alone: a condition evaluated at import would run in the launcher's
    zygote too, which imports the module of the function it forks workers for."""
    from parallel4d.distributed.startup import visible_gpus

    if visible_gpus() > 0:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
