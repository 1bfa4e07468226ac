"""Memory before launch (#45.5): a job whose ranks cannot fit this machine's memory or their GPUs is
refused in one line, exit 2, before any worker starts and before its run directory exists, naming the
figures and the fields to change; the shipped configs are not. The estimate is a lower bound
(parallel4d/config/memory.py; tests/test_plan.py holds it under what runs measure), read from the
config in microseconds; the machine's figures from /proc, the memory cgroup and NVML. In this process:
no worker ever starts (spawn is replaced by one that fails the test)."""

import importlib
import os
from pathlib import Path

import pytest
import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config, make_config
from parallel4d.config.memory import memory_problems, rank_bytes
from parallel4d.distributed import startup
from parallel4d.launcher import preflight
from parallel4d.tools.cli import main
from conftest import shipped_configs

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
# A Llama-2-7B shape: 6.7e9 parameters, ~100 GiB of float32 parameters, gradients and Adam moments
SEVEN_B = {"arch": "llama", "vocab_size": 32000, "seq_len": 512, "hidden": 4096, "heads": 32, "layers": 32,
           "intermediate_size": 11008}


@pytest.fixture
def no_workers(monkeypatch):
    def spawn(*args, **kwargs):
        raise AssertionError("a worker was started for a job that cannot fit")

    monkeypatch.setattr(importlib.import_module("parallel4d.launcher.launch"), "spawn", spawn)


@pytest.mark.parametrize("sets, fields", [
    # the quickstart with 16.7M sequences a step: ~50 TiB of activations per rank, beyond any machine
    (["data.batch_size=16777216"], ["data.batch_size (16777216)", "model.seq_len (128)", "pipeline.microbatches"]),
    # a model of 3.3e12 parameters: ~48 TiB of parameters, gradients and Adam moments on one rank
    (["model.hidden=32768", "model.heads=32", "model.layers=256", "parallel.dp=1"],
     ["model.hidden (32768)", "model.layers (256)"]),
])
def test_a_job_far_beyond_this_machine_is_refused_in_one_line_before_its_run_directory(
        sets, fields, tmp_path, capsys, no_workers):
    out = tmp_path / "run"
    code = main(["launch", str(ROOT / "configs" / "quickstart.yaml"), *(a for s in sets for a in ("--set", s)),
                 "--set", f"train.out_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("parallel4d: ") and "Traceback" not in err, err
    assert "of host memory on this machine" in err and "TiB" in err and "is available (" in err, err
    for field in fields:
        assert field in err, (field, err)
    assert not out.exists()  # refused before the run directory was made


def test_a_gpu_job_is_measured_against_its_gpu_and_hetero_is_offered(tmp_path, capsys, no_workers, monkeypatch):
    """A 7B model's 100 GiB of model state on one 80 GiB GPU: refused naming the GPU's figure and the
    fields (hetero, pp, tp); the host, which holds only the batch, is not what refuses it."""
    launch = importlib.import_module("parallel4d.launcher.launch")
    monkeypatch.setattr(launch, "device_and_backend", lambda cfg: ("cuda", "nccl"))
    monkeypatch.setattr(launch, "cpu_fallback_note", lambda cfg: None)
    monkeypatch.setattr(launch, "gpu_memory_bytes", lambda count: 80 * GIB)
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {SEVEN_B}\ndata: {{batch_size: 1}}\ntrain: {{out_dir: {tmp_path / 'run'}}}\n")
    assert main(["launch", str(job)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "each rank needs at least 1" in err and "of GPU memory" in err, err
    assert "its GPU has 80.0 GiB" in err and "host memory" not in err, err
    assert "hetero.enabled=true" in err and "parallel.pp (1)" in err and "parallel.tp (1)" in err, err
    assert not (tmp_path / "run").exists()
    # hetero keeps the model state on the host: the GPU holds a budget and the activations
    cfg = make_config({"model": SEVEN_B, "data": {"batch_size": 1}, "hetero": {"enabled": True}})
    assert memory_problems(cfg, 1, "cuda", (1 << 50, "ample"), 80 * GIB) == []
    # computing on the host (hetero.compute_device=cpu, no ZeRO): the GPU holds none of it
    on_host = make_config({"model": SEVEN_B, "data": {"batch_size": 128}, "hetero": {"enabled": True,
                                                                                    "compute_device": "cpu"}})
    assert rank_bytes(on_host).activations > 80 * GIB
    assert memory_problems(on_host, 1, "cuda", (1 << 50, "ample"), 80 * GIB) == []


@pytest.mark.parametrize("path", shipped_configs(ROOT), ids=lambda p: p.stem)
def test_the_shipped_configs_are_not_refused(path):
    """On this machine's memory as it is, and on 80 GiB GPUs."""
    cfg = load_config(path)
    preflight.check_memory(cfg, "cpu", None, str(path))
    assert memory_problems(cfg, cfg.world_size, "cuda", preflight.host_memory_available(), 80 * GIB) == []


def test_the_estimate_is_read_from_the_config_in_microseconds():
    import time

    cfg = load_config(ROOT / "configs" / "4d.yaml")
    t0 = time.perf_counter()
    for _ in range(100):
        rank_bytes(cfg), preflight.host_memory_available()
    assert (time.perf_counter() - t0) / 100 < 0.005


def test_host_memory_is_the_least_of_meminfo_and_every_memory_cgroup_above(tmp_path, monkeypatch):
    """cgroup v2 and v1 files as the kernel writes them: a limit above this process's cgroup counts, the
    page cache is given back, "max" and v1's no-limit figure are none; free swap is added."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemAvailable:    8388608 kB\nSwapFree:        1048576 kB\n")
    monkeypatch.setattr(preflight, "MEMINFO", meminfo)
    monkeypatch.setattr(preflight, "SELF_CGROUP", tmp_path / "cgroup")
    (tmp_path / "cgroup").write_text("0::/job/step\n4:memory:/slurm/task\n")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    monkeypatch.setattr(preflight, "_CGROUP_ROOTS", {"v2": v2, "v1": v1})
    for d, limit, usage, cache in ((v2 / "job" / "step", "max", 10 * GIB, 0), (v2 / "job", str(6 * GIB), 3 * GIB, GIB),
                                   (v1 / "slurm" / "task", str(2**63 - 4096), GIB, 0), (v1 / "slurm", str(7 * GIB), GIB, 0)):
        d.mkdir(parents=True, exist_ok=True)
        limit_file, usage_file, key = preflight._CGROUP_FILES["v2" if v2 in d.parents else "v1"]
        (d / limit_file).write_text(limit + "\n")
        (d / usage_file).write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"anon 5\n{key} {cache}\n")
    # v2's job: 6 − 3 + 1 (its page cache) = 4 GiB, less than v1's 6 and the machine's 8: then + 1 GiB of swap
    assert preflight.host_memory_available() == (5 * GIB, "the memory cgroup's limit less what it holds, "
                                                          "and free swap")
    (v2 / "job" / "memory.max").write_text("max\n")
    assert preflight.host_memory_available()[0] == 7 * GIB
    (tmp_path / "cgroup").write_text("0::/\n")  # under a cgroup namespace: the root is this process's
    assert preflight.host_memory_available() == (9 * GIB, "MemAvailable and free swap")


def test_the_gpu_memory_is_asked_of_nvml_without_initialising_cuda(monkeypatch):
    def initialises_cuda(*a, **k):
        raise AssertionError("asked the CUDA runtime: cuInit in this process, no forked child could use CUDA")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", initialises_cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "_parse_visible_devices", lambda: [3, 1])
    monkeypatch.setattr(startup, "_nvml_total_memory", {3: 80 * GIB, 1: 40 * GIB}.__getitem__)
    assert startup.gpu_memory_bytes(1) == 80 * GIB  # CUDA_VISIBLE_DEVICES=3,1: device 0 is NVML's 3
    assert startup.gpu_memory_bytes(2) == 40 * GIB  # the smallest of the ranks' GPUs
    assert startup.gpu_memory_bytes(3) is None  # more ranks than visible GPUs: not this check's to say
    monkeypatch.setattr(torch.cuda, "_parse_visible_devices", lambda: ["MIG-4f2e"])
    assert startup.gpu_memory_bytes(1) is None
    monkeypatch.setattr(torch.cuda, "_parse_visible_devices", lambda: [0])
    monkeypatch.setattr(startup, "_nvml_total_memory", lambda i: (_ for _ in ()).throw(OSError("no NVML")))
    assert startup.gpu_memory_bytes(1) is None


def test_torchrun_counts_the_ranks_of_this_node(monkeypatch):
    """Under torchrun the host holds LOCAL_WORLD_SIZE ranks, not the whole world."""
    cfg = make_config({"parallel": {"dp": 4}, "data": {"batch_size": 16777216}})
    per_rank = rank_bytes(cfg).host(on_cpu=True)
    monkeypatch.setattr(preflight, "host_memory_available", lambda: (3 * per_rank, "test"))
    with pytest.raises(ConfigError, match=r"4 ranks × "):
        preflight.check_memory(cfg, "cpu", None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    preflight.check_memory(cfg, "cpu", None)  # 2 ranks here fit
