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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_in_this_process
from parallel4d.launcher.workers import child_processes

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


def agents(tmp: Path, name: str, cfg: dict, n: int, nproc: int, port: int, **kw) -> list["Agent"]:
    """``n`` agents of one c10d rendezvous; the first hosts its store (it binds the endpoint before
    the others start), as the head node of a cluster does, so that losing another node keeps it."""
    first = Agent(tmp, f"{name}0", cfg, nproc, kw.pop("nnodes", str(n)), port, **kw)
    wait_until("the rendezvous endpoint", lambda: _listening(port), [first])
    return [first, *(Agent(tmp, f"{name}{i}", cfg, nproc, first.nnodes, port, **kw) for i in range(1, n))]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """One torchrun agent (a 'node') of a c10d rendezvous on 127.0.0.1; its output in ``log``."""

    def __init__(self, tmp: Path, name: str, cfg: dict, nproc: int, nnodes: str, port: int,
                 max_restarts: int = 0, rdzv_conf: str | None = None, static_rank: int | None = None,
                 env: dict | None = None):
        """``static_rank``: a static rendezvous (``--node-rank``) instead of c10d's."""
        tmp.mkdir(parents=True, exist_ok=True)
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.nnodes = nnodes
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
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)

    def workers(self) -> dict[int, int]:
        """``{global rank: pid}`` of this agent's live workers."""
        found = {}
        for pid, _ in child_processes(self.proc.pid):
            try:
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            except OSError:
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = pid
        return found

    def kill(self) -> None:
        """The whole node: the agent and its workers, kill -9."""
        pids = [self.proc.pid, *(pid for pid, _ in child_processes(self.proc.pid))]
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


def wait_until(what: str, check, watched: list[Agent], timeout: float = 120.0):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` (with the logs) otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if all(a.proc.poll() is not None for a in watched):
            break
        time.sleep(0.05)
    logs = "\n".join(f"--- {a.log.name}\n{a.text()[-3000:]}" for a in watched)
    for a in watched:
        if a.proc.poll() is None:
            a.kill()
    pytest.fail(f"waited for {what}: not seen\n{logs}")


def steps_saved(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.name[5:].isdigit())


def two_agents_train_one_job_and_its_checkpoint_resumes_at_four_agents(tmp: Path, reference: torch.Tensor,
                                                                       hung: threading.Event) -> None:
    """pp=2 across two agents × tp=4 within each (c10d rendezvous); its checkpoint resumes at four agents
    of one worker (dp=2 × sp=2, both across agents; static rendezvous). Losses equal one process's, for
    the whole run. It starts once the restart scenario has hung its worker: its twelve workers' start-up fills
    that scenario's wait for the timeout and the restart, and stays out of its first 30 steps."""
    assert hung.wait(300), "the restart scenario never hung its worker"
    want = reference[:6]
    port = free_port()
    two = job(tmp, "two", 3, {"pp": 2, "tp": 4})
    for a in agents(tmp, "two", two, 2, 4, port):
        assert a.wait(300) == 0, a.text()[-4000:]
    summary = json.loads((tmp / "two" / "summary.json").read_text())
    torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64), want[:3], rtol=1e-12, atol=0)
    assert summary["elastic"]["nodes"] == 2 and summary["world_size"] == 8
    saved = tmp / "two" / "checkpoints" / "step_00000003"
    assert {f"__{r}_0.distcp" for r in range(8)} <= {p.name for p in saved.iterdir()}  # both agents' ranks

    port = free_port()
    four = job(tmp, "four", 6, {"dp": 2, "sp": 2}, resume=True)
    four["checkpoint"]["dir"] = str(tmp / "two" / "checkpoints")
    for a in [Agent(tmp, f"four{i}", four, 1, "4", port, static_rank=i) for i in range(4)]:
        assert a.wait(300) == 0, a.text()[-4000:]
    summary = json.loads((tmp / "four" / "summary.json").read_text())
    assert summary["resumed_from"] == 3 and summary["elastic"]["nodes"] == 4
    torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64), want, rtol=1e-12, atol=0)


class FaultyRun:
    """A job of two agents (one dp=2 worker each) and faults done to it, each once a checkpoint at
    or after a given step exists; records the newest checkpoint when each restart began."""

    def __init__(self, tmp: Path, steps: int, max_restarts: int, env: dict | None = None):
        self.tmp, self.steps, self.env = tmp, steps, env
        self.port = free_port()
        self.cfg = job(tmp, "run", steps, {"dp": 2}, resume=True, timeout_s=5)
        self.ckpt = tmp / "run" / "checkpoints"
        self.max_restarts = max_restarts
        self.live = agents(tmp, "node", self.cfg, 2, 1, self.port, max_restarts=max_restarts, env=env)
        self.everyone = list(self.live)
        self.resumed: list[int] = []

    def workers(self) -> set[int]:
        return {pid for agent in self.live for pid in agent.workers().values()}

    def after_checkpoint(self, step: int, fault) -> None:
        wait_until(f"a checkpoint at step ≥ {step}", lambda: any(s >= step for s in steps_saved(self.ckpt)),
                   self.everyone)
        before = self.workers()
        fault()
        wait_until("the restarted workers", lambda: len(now := self.workers()) == 2 and not now & before, self.everyone)
        self.resumed.append(max(steps_saved(self.ckpt)))  # the attempt before is gone: nothing writes now

    def signal_worker(self, node: int, sig: int) -> int:
        pid = self.live[node].workers().popitem()[1]
        os.kill(pid, sig)
        return pid

    def hang_worker(self, node: int, hung: threading.Event) -> None:
        """SIGSTOP on ``node``'s worker; its peer times out (train.timeout_s) and the agents stop the attempt.
        A stopped process acts on torchrun's SIGTERM only once continued, so torchrun would wait 30 s and then
        kill -9 it: once the agent has sent that SIGTERM, the kill -9 it would send is sent here at once."""
        agent, pid = self.live[node], self.signal_worker(node, signal.SIGSTOP)
        hung.set()
        wait_until(f"torchrun's SIGTERM to the stopped worker (pid {pid})",
                   lambda: f"Sending process {pid} closing signal SIGTERM" in agent.text(), self.everyone)
        os.kill(pid, signal.SIGKILL)

    def replace_node(self, node: int) -> None:
        self.live[node].kill()
        self.live[node] = Agent(self.tmp, f"node{len(self.everyone)}", self.cfg, 1, "2", self.port,
                                max_restarts=self.max_restarts, env=self.env)
        self.everyone.append(self.live[node])

    def finish(self, want: torch.Tensor) -> str:
        """Wait for the end; check the losses, every resume and summary.json; the agents' logs."""
        for agent in self.live:
            assert agent.wait(300) == 0, agent.text()[-4000:]
        logs = "".join(agent.text() for agent in self.everyone)
        for step in self.resumed:
            assert f"step_{step:08d} at step {step}" in logs, (self.resumed, logs[-4000:])
        summary = json.loads((self.tmp / "run" / "summary.json").read_text())
        assert summary["finished"] and summary["steps"] == self.steps
        assert summary["resumed_from"] == self.resumed[-1]
        torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64), want, rtol=1e-12, atol=0)
        return logs


def restarts_resume_from_the_newest_checkpoint(tmp: Path, reference: torch.Tensor, hung: threading.Event) -> None:
    """Under --max-restarts 2 (torchrun's default store), a worker killed (kill -9) and later a worker
    hung (SIGSTOP: its peer times out after train.timeout_s; torchrun's kill -9 of it sent at once, see
    :meth:`FaultyRun.hang_worker`) each lead to a restart that re-forms the groups and resumes from the
    newest complete checkpoint; the run ends with an uninterrupted run's losses in a summary.json that
    covers all of it."""
    steps = 45
    try:
        run = FaultyRun(tmp, steps, max_restarts=2)
        run.after_checkpoint(15, lambda: run.signal_worker(0, signal.SIGKILL))
        run.after_checkpoint(30, lambda: run.hang_worker(1, hung))
    finally:
        hung.set()  # never leave the multi-node scenario waiting
    logs = run.finish(reference[:steps])
    assert "a peer stopped answering" in logs  # the hung worker's peer, after train.timeout_s (5 s)


def a_lost_node_is_replaced_and_the_job_continues(tmp: Path, reference: torch.Tensor, _) -> None:
    """One agent killed whole (its workers too) and a new one started with the same rendezvous id: the
    job continues from the newest checkpoint. (torch 2.13's agents keep the bootstrap store of their
    first round, which a new agent never learns: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the README says.)"""
    steps = 30
    run = FaultyRun(tmp, steps, max_restarts=1, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    run.after_checkpoint(15, lambda: run.replace_node(1))
    run.finish(reference[:steps])


def a_node_lost_for_good_stops_naming_the_sizes(tmp: Path, reference: torch.Tensor, _) -> None:
    """--nnodes 1:2: after one of two agents is killed, torchelastic re-forms the job on one node, where
    dp=2 does not fit: every worker stops with the sizes, and the agent ends with its restarts spent.
    (The rendezvous waits 15 s for a second node: under the other scenarios' load the second agent
    takes seconds to start.)"""
    port = free_port()
    cfg = job(tmp, "run", 200, {"dp": 2}, resume=True)
    nodes = agents(tmp, "node", cfg, 2, 1, port, nnodes="1:2", max_restarts=1, rdzv_conf="last_call_timeout=15")
    ckpt = tmp / "run" / "checkpoints"
    wait_until("a checkpoint", lambda: steps_saved(ckpt), nodes)
    nodes[1].kill()
    assert nodes[0].wait(120) != 0
    assert "WORLD_SIZE=1 but parallel.pp·dp·sp·tp = 1·2·1·1 = 2" in nodes[0].text()


def sigterm_saves_and_exits_143(tmp: Path, reference: torch.Tensor, _) -> None:
    """SIGTERM to torchrun (what SLURM and Kubernetes send): it passes it to its workers, which finish the
    step, save it and exit 143, not 0; summary.json says the run was stopped and by what."""
    cfg = job(tmp, "run", 1000, {"dp": 2})
    node = Agent(tmp, "node", cfg, 2, "1", free_port())
    ckpt = tmp / "run" / "checkpoints"
    wait_until("a checkpoint", lambda: steps_saved(ckpt), [node])
    node.proc.send_signal(signal.SIGTERM)
    assert node.wait(120) != 0
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert summary["stop_signal"] == "SIGTERM" and summary["interrupted"]
    assert summary["steps"] < 1000 and summary["steps"] == max(steps_saved(ckpt)), (summary["steps"], steps_saved(ckpt))
    assert "stopped by SIGTERM at step" in node.text()
    n = min(len(reference), summary["steps"])
    torch.testing.assert_close(torch.tensor(summary["losses"][:n], dtype=torch.float64), reference[:n], rtol=1e-12,
                               atol=0)


def a_refused_config_is_one_line_in_torchruns_report(tmp: Path, reference: torch.Tensor, _) -> None:
    """#26.9: an invalid config under torchrun: exit 2 on every worker, the refusal printed once per node,
    and torchrun's failure report quotes it (from the error file) instead of a traceback of ours."""
    cfg = job(tmp, "run", 5, {"pp": 0})
    node = Agent(tmp, "node", cfg, 2, "1", free_port())
    assert node.wait(120) != 0
    text = node.text()
    refusal = "parallel4d: " + str(tmp / "node.yaml") + ": invalid configuration:"
    printed = [line for line in text.splitlines() if line.startswith(refusal)]
    assert len(printed) <= 1, printed  # by local rank 0 only (unless torchrun stopped it first)
    assert f"traceback : {refusal}" in text, text[-3000:]  # torchrun's report quotes it
    assert "exitcode  : 2" in text and "parallel.pp" in text
    assert not [line for line in text.splitlines() if line.strip().startswith("File ") and "parallel4d/" in line]


def test_torchrun_jobs(tmp_path):
    """The six torchrun scenarios above, side by side, each its own job on its own ports and directory.
    Much of the fault scenarios' time is waiting (for a timeout, a rendezvous, a restart), and the
    multi-node job, which keeps both cores busy, runs in those waits."""
    scenarios = (restarts_resume_from_the_newest_checkpoint, a_lost_node_is_replaced_and_the_job_continues,
                 a_node_lost_for_good_stops_naming_the_sizes, sigterm_saves_and_exits_143,
                 two_agents_train_one_job_and_its_checkpoint_resumes_at_four_agents,
                 a_refused_config_is_one_line_in_torchruns_report)
    reference = reference_losses(tmp_path, 45)  # here: one process group per process, none in the threads
    hung = threading.Event()
    with ThreadPoolExecutor(len(scenarios)) as pool:
        futures = [pool.submit(fn, tmp_path / fn.__name__, reference, hung) for fn in scenarios]
    for fn, future in zip(scenarios, futures):
        if future.exception() is not None:
            raise AssertionError(f"{fn.__name__}: {future.exception()}") from future.exception()


def _nodes_agree_checks(tmp: str) -> list[str]:
    """On each of 2 ranks: the messages of check_nodes_agree for (a) rank 1 on another learning rate,
    (b) rank 1 not seeing rank 0's probe file (a checkpoint directory that is not shared)."""
    import torch.distributed as dist

    from parallel4d.distributed import elastic
    from parallel4d.config.errors import ConfigError

    rank, messages = dist.get_rank(), []
    cfg = {"optimizer": {"lr": 0.001}, "train": {"steps": 5}}
    if rank == 1:
        cfg = {"optimizer": {"lr": 0.002}, "train": {"steps": 5}}
    try:
        elastic.check_nodes_agree(cfg, Path(tmp))
    except ConfigError as e:
        messages.append(str(e))
    if rank == 1:  # this rank's disk is not rank 0's: it never sees the probe file
        is_file = type(Path()).is_file
        type(Path()).is_file = lambda self: not self.name.startswith(".parallel4d-shared-") and is_file(self)
    try:
        elastic.check_nodes_agree({"same": 1}, Path(tmp))
    except ConfigError as e:
        messages.append(str(e))
    return messages


def test_nodes_must_run_one_config_on_one_shared_checkpoint_directory(tmp_path):
    from conftest import run_workers

    for messages in run_workers(_nodes_agree_checks, 2, str(tmp_path)):
        assert len(messages) == 2  # every rank raises, naming the rank that differs
        assert "rank 1 (host" in messages[0] and "optimizer.lr=0.001 on rank 0, 0.002 here" in messages[0]
        assert "rank 1 (host" in messages[1] and "one directory shared by every node" in messages[1]
    assert not list(tmp_path.glob(".parallel4d-shared-*"))  # the probe is removed
