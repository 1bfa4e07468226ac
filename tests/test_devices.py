"""Every collective and p2p of a training run gets tensors on the mesh's device (NCCL takes no
host tensors), checked on CPU by following where a GPU run would hold each tensor."""

import torch

from conftest import run_workers
from device_audit import DeviceAudit


def tiny(out_dir, parallel, **sections):
    cfg = {
        "parallel": parallel,
        "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 4},
        "data": {"source": "synthetic", "batch_size": 8},
        "train": {"steps": 2, "out_dir": str(out_dir), "timeout_s": 120, "grad_clip": 1.0},
        "checkpoint": {"every": 1},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _audited_runs(cfgs):
    from parallel4d.config.schema import Config
    from parallel4d.training.loop import run_training

    found = []
    for cfg in cfgs:
        audit = DeviceAudit()
        with audit:
            run_training(Config.model_validate(cfg))
            cfg["train"].update(resume=True, steps=3)  # and a resume: checkpoint load and save
            run_training(Config.model_validate(cfg))
        found += audit.violations
    return found


def test_every_collective_gets_device_tensors(tmp_path):
    """8 workers, two jobs: pp=2 (1F1B, tied embedding on two ranks) × 2D tp=4 with gradient
    clipping; pp=2 Hanayo × ring sp=2 × dp=2 with hetero's ZeRO. Each trains, checkpoints and
    resumes under the audit; no collective may be handed a host tensor."""
    jobs = [tiny(tmp_path / "pp_tp", {"pp": 2, "tp": 4}, pipeline={"schedule": "1f1b", "microbatches": 2}),
            tiny(tmp_path / "pp_sp_dp", {"pp": 2, "sp": 2, "dp": 2}, train={"grad_clip": None},
                 pipeline={"schedule": "hanayo", "microbatches": 2, "waves": 1},
                 hetero={"enabled": True})]
    per_rank = run_workers(_audited_runs, 8, jobs, timeout_s=300)
    found = sorted({v for rank in per_rank for v in rank})
    assert not found, "\n".join(found)


def test_the_audit_sees_a_host_tensor():
    """The audit itself: a host tensor handed to a collective is caught, a device one is not."""
    import os

    from device_audit import MESH_DEVICE

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    audit = DeviceAudit()
    with audit:
        moved = torch.tensor([1.0]).to(MESH_DEVICE)
        made = torch.zeros(1, device=MESH_DEVICE)
        derived = made.new_zeros(2) + torch.tensor(1.0)  # a 0-dim host scalar joins a device op
        like = torch.empty(3, device=made.device)
        assert [audit.is_host(t) for t in (moved, made, derived, like)] == [False] * 4
        assert audit.is_host(torch.tensor([2.0])) and audit.is_host(made.cpu())


def test_hetero_refuses_to_compute_on_the_host_of_a_gpu_mesh():
    """hetero.compute_device=cpu under ZeRO on a CUDA mesh would hand NCCL host chunks: refused,
    naming the field; `auto` follows the mesh's device."""
    import pytest

    from parallel4d.config.schema import HeteroConfig, OptimizerConfig
    from parallel4d.hetero.wrap import HeteroRuntime, resolve_device

    class CudaReplicas:  # what the engine passes hetero (DataReplicas), on a GPU mesh of 2 replicas
        device = torch.device("cuda", 0)

        def size(self, axis):
            return 2

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="hetero.compute_device='cpu' computes on cpu but the data replicas "
                                         "communicate on cuda:0; use hetero.compute_device=auto"):
        HeteroRuntime(model, OptimizerConfig(), HeteroConfig(enabled=True, compute_device="cpu"), mesh=CudaReplicas())
    assert resolve_device("auto", CudaReplicas()) == torch.device("cuda", 0)


def _fake_gpus(monkeypatch, n: int) -> None:
    from parallel4d.distributed import startup

    monkeypatch.setattr(startup, "visible_gpus", lambda: n)  # the launcher's one question (NVML, no CUDA init)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_a_cpu_fallback_with_gpus_visible_is_said_once(monkeypatch, tmp_path, capsys):
    """#28: ``make demo`` (dp=2) on a one-GPU machine ran on the CPU without a word. The launcher now
    says so once, naming the GPUs against the ranks and what to change (faked device count)."""
    from parallel4d.config.load import make_config
    from parallel4d.distributed.startup import cpu_fallback_note, device_and_backend
    from parallel4d.launcher import launch as launch_mod

    job = tiny(tmp_path / "run", {"dp": 2}, checkpoint={"enabled": False})
    cfg = make_config(job)
    _fake_gpus(monkeypatch, 1)
    assert device_and_backend(cfg) == ("cpu", "gloo")
    note = cpu_fallback_note(cfg)
    assert "1 GPU visible for 2 local ranks" in note and "parallel.dp=1" in note and "train.device=cpu" in note
    assert cpu_fallback_note(make_config({**job, "train": {**job["train"], "device": "cpu"}})) is None
    _fake_gpus(monkeypatch, 2)
    assert device_and_backend(cfg) == ("cuda", "nccl") and cpu_fallback_note(cfg) is None
    _fake_gpus(monkeypatch, 0)
    assert cpu_fallback_note(cfg) is None  # a CPU machine: nothing fell back

    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(launch_mod, "spawn", lambda *args, **kwargs: [{"rank": 0}])  # no workers started
    assert launch_mod.launch(job) == {"rank": 0}
    said = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(said) == 1 and "1 GPU visible for 2 local ranks" in said[0], said
