"""torchrun across agents: one job over two agents, checkpoints between agent counts, restarts.

Each agent is a real ``torchrun`` process on 127.0.0.1 with a c10d rendezvous, as on a
cluster with one agent per node; faults are done from outside (kill -9, SIGSTOP). Every
run is float64 and compared with one process (losses to 1e-12).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_in_this_process

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
MODEL = {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2}


def job(tmp: Path, name: str, steps: int, parallel: dict, **train) -> dict:
    return {"parallel": parallel, "model": MODEL, "data": {"source": "synthetic", "batch_size": 8},
            "train": {"steps": steps, "dtype": "float64", "out_dir": str(tmp / name), "timeout_s": 30,
                      "log_every": 1, **train},
            "checkpoint": {"every": 5}}


def reference_losses(tmp: Path, steps: int) -> torch.Tensor:
    """One process, the same model, data and seed."""
    cfg = job(tmp, "reference", steps, {})
    cfg["checkpoint"] = {"enabled": False}
    return torch.tensor(run_in_this_process(cfg, [])["losses"], dtype=torch.float64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """One torchrun agent (a 'node') of a c10d rendezvous on 127.0.0.1; its output in ``log``."""

    def __init__(self, tmp: Path, name: str, cfg: dict, nproc: int, nnodes: str, port: int,
                 max_restarts: int = 0, rdzv_conf: str | None = None, static_rank: int | None = None):
        """``static_rank``: a static rendezvous (``--node-rank``) instead of c10d's."""
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.log = tmp / f"{name}.log"
        cmd = [TORCHRUN, "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
               "--monitor-interval", "0.2"]
        if static_rank is None:
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}"]
        else:
            cmd += ["--node-rank", str(static_rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        if rdzv_conf:
            cmd += ["--rdzv-conf", rdzv_conf]
        cmd += ["-m", "parallel4d", "launch", str(path)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)

    def workers(self) -> dict[int, int]:
        """``{global rank: pid}`` of this agent's live workers."""
        found = {}
        for pid in _children(self.proc.pid):
            try:
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            except OSError:
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = pid
        return found

    def kill(self) -> None:
        """The whole node: the agent and its workers, kill -9."""
        pids = [self.proc.pid, *_children(self.proc.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"agent did not finish within {timeout}s; its log:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def wait_until(what: str, check, agents: list[Agent], timeout: float = 120.0):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` (with the logs) otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if all(a.proc.poll() is not None for a in agents):
            break
        time.sleep(0.05)
    logs = "\n".join(f"--- {a.log.name}\n{a.text()[-3000:]}" for a in agents)
    for a in agents:
        if a.proc.poll() is None:
            a.kill()
    pytest.fail(f"waited for {what}: not seen\n{logs}")


def steps_saved(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.name[5:].isdigit())


def test_two_agents_train_one_job_and_its_checkpoint_resumes_at_four_agents(tmp_path):
    """pp=2 across two agents × tp=4 within each (c10d rendezvous); its checkpoint resumes at four agents
    of one worker (dp=2 × sp=2, both across agents; static rendezvous). Losses equal one process's, for
    the whole run."""
    want = reference_losses(tmp_path, 6)
    port = free_port()
    two = job(tmp_path, "two", 3, {"pp": 2, "tp": 4})
    agents = [Agent(tmp_path, f"two{i}", two, 4, "2", port) for i in range(2)]
    for a in agents:
        assert a.wait(300) == 0, a.text()[-4000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64), want[:3], rtol=1e-12, atol=0)
    assert summary["elastic"]["nodes"] == 2 and summary["world_size"] == 8
    saved = tmp_path / "two" / "checkpoints" / "step_00000003"
    assert {f"__{r}_0.distcp" for r in range(8)} <= {p.name for p in saved.iterdir()}  # both agents' ranks

    port = free_port()
    four = job(tmp_path, "four", 6, {"dp": 2, "sp": 2}, resume=True)
    four["checkpoint"]["dir"] = str(tmp_path / "two" / "checkpoints")
    agents = [Agent(tmp_path, f"four{i}", four, 1, "4", port, static_rank=i) for i in range(4)]
    for a in agents:
        assert a.wait(300) == 0, a.text()[-4000:]
    summary = json.loads((tmp_path / "four" / "summary.json").read_text())
    assert summary["resumed_from"] == 3 and summary["elastic"]["nodes"] == 4
    torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64), want, rtol=1e-12, atol=0)


def test_restarts_resume_from_the_newest_checkpoint(tmp_path):
    """One job of two agents (a dp=2 worker each) under --max-restarts 3 survives three faults, each
    after a checkpoint: a worker killed (kill -9); a worker hung (SIGSTOP: its peer times out after
    train.timeout_s); a whole node killed and replaced by a new agent of the same rendezvous. Each
    restart re-forms the groups and resumes from the newest complete checkpoint, and the run ends with
    an uninterrupted run's losses in a summary.json that covers all of it."""
    steps = 60
    want = reference_losses(tmp_path, steps)
    port = free_port()
    cfg = job(tmp_path, "run", steps, {"dp": 2}, resume=True, timeout_s=5)
    ckpt = tmp_path / "run" / "checkpoints"
    live = [Agent(tmp_path, f"node{i}", cfg, 1, "2", port, max_restarts=3) for i in range(2)]
    everyone = list(live)
    resumed = []

    def workers() -> set[int]:
        return {pid for agent in live for pid in agent.workers().values()}

    def after_checkpoint(step: int, fault) -> None:
        wait_until(f"a checkpoint at step ≥ {step}", lambda: any(s >= step for s in steps_saved(ckpt)), everyone)
        before = workers()
        fault()
        wait_until("the restarted workers", lambda: len(workers()) == 2 and not workers() & before, everyone)
        resumed.append(max(steps_saved(ckpt)))  # the attempt before is gone: nothing writes now

    after_checkpoint(15, lambda: os.kill(live[0].workers().popitem()[1], signal.SIGKILL))
    after_checkpoint(30, lambda: os.kill(live[1].workers().popitem()[1], signal.SIGSTOP))

    def lose_a_node():
        live[1].kill()
        live[1] = Agent(tmp_path, "node2", cfg, 1, "2", port, max_restarts=3)
        everyone.append(live[1])

    after_checkpoint(45, lose_a_node)
    for agent in live:
        assert agent.wait(300) == 0, agent.text()[-4000:]
    logs = "".join(agent.text() for agent in everyone)
    assert "did not finish within 5s" in logs  # the hung worker's peer: train.timeout_s
    for step in resumed:
        assert f"step_{step:08d} at step {step}" in logs, (resumed, logs[-4000:])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == steps and summary["resumed_from"] == resumed[-1]
    torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64), want, rtol=1e-12, atol=0)


def test_a_node_lost_for_good_stops_naming_the_sizes(tmp_path):
    """--nnodes 1:2: after one of two agents is killed, torchelastic re-forms the job on one node, where
    dp=2 does not fit: every worker stops with the sizes, and the agent ends with its restarts spent."""
    port = free_port()
    cfg = job(tmp_path, "run", 200, {"dp": 2}, resume=True)
    agents = [Agent(tmp_path, f"node{i}", cfg, 1, "1:2", port, max_restarts=1, rdzv_conf="last_call_timeout=5")
              for i in range(2)]
    ckpt = tmp_path / "run" / "checkpoints"
    wait_until("a checkpoint", lambda: steps_saved(ckpt), agents)
    agents[1].kill()
    assert agents[0].wait(120) != 0
    assert "WORLD_SIZE=1 but parallel.pp·dp·sp·tp = 1·2·1·1 = 2" in agents[0].text()
