"""Faults a user meets: a stopped or killed worker, SIGTERM, a shared or unwritable run
directory. Each job must end within its limits, name the rank or path at fault, and
keep what was trained."""

import importlib
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_workers
from parallel4d.checkpoint.checksums import verify
from parallel4d.checkpoint.resume import latest_checkpoint
from parallel4d.launcher.spawn import spawn
from parallel4d.launcher.supervise import WorkerError
from parallel4d.launcher.workers import _start_time, child_processes, worker_pids

TIMEOUT_S = 2.0  # the mesh groups' collective limit in the strategy scenarios
GRACE_S = 1.5    # what a wait may take beyond it


def stay_away(tmp: str, what: str, ranks) -> None:
    """What a rank that takes no part in ``what`` does: nothing, until each of ``ranks`` has given up on
    it (:func:`gave_up`), or at most TIMEOUT_S + GRACE_S + 1 s (a rank still waiting by then has failed
    its limit anyway)."""
    deadline = time.monotonic() + TIMEOUT_S + GRACE_S + 1.0
    while not all(os.path.exists(os.path.join(tmp, f"{what}.gave_up.{r}")) for r in ranks):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)


def gave_up(tmp: str, what: str) -> None:
    """This rank is done waiting in ``what`` (for :func:`stay_away`)."""
    open(os.path.join(tmp, f"{what}.gave_up.{torch.distributed.get_rank()}"), "w").close()


def tiny_job(out_dir, steps=100000, **parallel):
    return {
        "parallel": parallel,
        "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
        "data": {"source": "synthetic", "batch_size": 8},
        "train": {"steps": steps, "out_dir": str(out_dir), "timeout_s": 3, "job_timeout_s": 240},
        "checkpoint": {"enabled": False},
    }


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the worker of ``rank`` started by the launcher ``launcher_pid``."""
    pids = worker_pids(launcher_pid)
    if rank not in pids:
        raise LookupError(f"no worker of rank {rank} under pid {launcher_pid} (found {pids})")
    return pids[rank]


def start_job(tmp_path, cfg, name="job.yaml", command=None):
    """The CLI launcher on ``cfg`` (or the interpreter with ``command``), after its third step (stderr
    lines read up to there). Its temporary files go to ``tmp_path/tmp`` (a killed launcher leaves
    them there, not in /tmp)."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    command = command or ["-m", "parallel4d", "launch", str(path)]
    proc = subprocess.Popen([sys.executable, *command], stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "step 3/" in line:
            return proc, seen
    proc.wait()
    raise AssertionError("the job ended before its third step:\n" + "".join(seen[-30:]))


def finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:  # a failed check must not leave a job running under the rest of the suite
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- jobs run side by side ------------------------------------------------------------------------
# Most of a fault test's time is waiting: for a timeout, a slow save, a blame to settle. The tests whose
# job is a process of its own (the CLI) have it run in a thread from the module's first test on, each in a
# directory of its own, while the others run; each such test waits for its job and checks what it returned.

SIDE_BY_SIDE: dict = {}  # test name → its job: a function of a directory, returning what the test checks


def side_by_side(job):
    """Registers ``job`` as the job of the test named ``test_`` + its name."""
    SIDE_BY_SIDE[f"test_{job.__name__}"] = job
    return job


@pytest.fixture(scope="module", autouse=True)
def jobs_side_by_side(request, tmp_path_factory):
    """The jobs of this module's selected tests, started at once; ``{test name: future}``. Leaving the
    module waits for every one (none outlives it: each ends or kills its processes)."""
    selected = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    names = [name for name in SIDE_BY_SIDE if name in selected]
    with ThreadPoolExecutor(max(1, len(names)), thread_name_prefix="fault-job") as pool:
        yield {name: pool.submit(SIDE_BY_SIDE[name], tmp_path_factory.mktemp(name)) for name in names}


@pytest.fixture
def job_result(request, jobs_side_by_side):
    """What the requesting test's job (:func:`side_by_side`) returned; its exception if it raised."""
    return jobs_side_by_side[request.node.name].result()


# --- every wait of every strategy ends within the mesh's timeout ---------------------------------


def _scenarios(absent: int, tmp: str):
    """Each strategy's communication with global rank ``absent`` not taking part (until the others
    have given up); the other ranks return ``(scenario, exception type, message, seconds)``."""
    from parallel4d.distributed import comm
    from parallel4d.hetero import zero
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.sequence import ring_attention
    from parallel4d.tensor2d import summa_ab

    me, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = []

    def attempt(name, fn):
        if me == absent:  # stalls: takes no part until the others have given up
            stay_away(tmp, name, [r for r in range(world) if r != absent])
            return
        t0 = time.monotonic()
        try:
            fn()
            out.append((name, "finished", "", time.monotonic() - t0))
        except Exception as e:
            out.append((name, type(e).__name__, str(e), time.monotonic() - t0))
        gave_up(tmp, name)

    mesh = init_mesh(tp=4, timeout_s=TIMEOUT_S)
    attempt("summa", lambda: summa_ab(torch.ones(2, 2), torch.ones(2, 2), mesh, name="test.summa"))
    mesh = init_mesh(sp=4, timeout_s=TIMEOUT_S)
    x = torch.ones(1, 2, 4, 8)
    attempt("ring", lambda: ring_attention(x, x, x, mesh.group("sp"), causal=True))
    mesh = init_mesh(dp=2, sp=2, timeout_s=TIMEOUT_S)
    group = mesh.group_over("dp", "sp")
    attempt("zero", lambda: zero.all_gather_into(torch.empty(8), torch.ones(2), group))
    mesh = init_mesh(pp=4, timeout_s=TIMEOUT_S)
    group = mesh.new_group([0, 1, 2, 3])
    attempt("pp.group", lambda: comm.all_reduce(torch.ones(1), group, label="pp.tied"))
    return out


def test_every_strategy_wait_ends_within_the_timeout(tmp_path):
    """tp SUMMA, sp ring, ZeRO over dp·sp and a pp group: a rank that takes no part makes the
    others fail within the mesh's timeout (not torch's 30-minute default for sub-groups),
    with the action and the group named."""
    results = run_workers(_scenarios, 4, 2, str(tmp_path), timeout_s=200, preload=())
    names = {"summa": "test.summa", "ring": "ring_attention forward", "zero": "hetero ZeRO parameter all-gather",
             "pp.group": "pp.tied"}
    for rank, rows in enumerate(results):
        if rank == 2:
            assert rows == []
            continue
        assert [r[0] for r in rows] == list(names), rows
        for name, kind, msg, seconds in rows:
            if name == "summa" and rank == 1:  # grid (0, 1) shares no row or column with rank 2 at (1, 0)
                assert kind == "finished", (rank, name, kind, msg)
                continue
            assert kind in ("CommTimeout", "PeerLost"), (rank, name, kind, msg)
            assert names[name] in msg and f"rank {rank}" in msg, (rank, name, msg)
            assert name in ("summa", "ring") or "group ranks [0, 1, 2, 3]" in msg, msg  # p2p waits name no group
            assert seconds < TIMEOUT_S + GRACE_S, (rank, name, seconds, msg)
    # Nobody exits, so the first rank to give up in each scenario timed out; which rank that is
    # depends on scheduling, and the others may see it close its connections (PeerLost).
    for name in names:
        kinds = [kind for rows in results for n, kind, _, _ in rows if n == name]
        assert "CommTimeout" in kinds, (name, kinds)


def _checkpoint_save_without_rank_1(root, tmp):
    from parallel4d.checkpoint import dcp as checkpoint

    if torch.distributed.get_rank() == 1:  # never joins the save
        stay_away(tmp, "save", [0])
        return None
    t0 = time.monotonic()
    try:
        checkpoint.save({"w": torch.ones(4)}, root, step=1)
        return "finished", "", time.monotonic() - t0
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        gave_up(tmp, "save")


def test_checkpoint_save_waits_end_within_the_timeout(tmp_path):
    """The checkpoint's agreements (on the default group, whose timeout is train.timeout_s) fail
    within the limit, naming the checkpoint step, when a rank never joins the save."""
    kind, msg, seconds = spawn(_checkpoint_save_without_rank_1, 2, (str(tmp_path / "ckpt"), str(tmp_path)),
                               timeout_s=120, pg_timeout_s=TIMEOUT_S)[0]
    assert kind in ("CommTimeout", "PeerLost", "CheckpointError"), (kind, msg)
    assert "checkpoint" in msg and "did not finish" in msg, msg
    assert seconds < TIMEOUT_S + GRACE_S, (seconds, msg)


# --- the launcher blames the right rank -----------------------------------------------------------


def _collectives_forever():
    while True:
        torch.distributed.all_reduce(torch.ones(1000))


def test_killed_worker_is_blamed_not_the_peer_that_saw_it_leave(tmp_path):
    """kill -9 of rank 2 among 4: its peers report lost connections first, but rank 2 is named."""
    import threading

    for attempt in range(2):
        killer = threading.Timer(0.5, lambda: os.kill(worker_pid(os.getpid(), 2), signal.SIGKILL))
        try:
            with pytest.raises(WorkerError) as err:  # killed once the workers have joined: in their collectives
                spawn(_collectives_forever, 4, timeout_s=120, pg_timeout_s=30, joined=killer.start)
        finally:
            killer.cancel()
        assert err.value.rank == 2, (attempt, str(err.value)[:2000])
        assert "killed by SIGKILL" in str(err.value)


class FakeProcess:
    def __init__(self, pid, returncode=None):
        self.pid, self.returncode = pid, returncode

    def poll(self):
        return self.returncode


def _report(tmp_path, rank, details, when):
    import pickle

    path = tmp_path / f"result{rank}.pkl"
    path.write_bytes(pickle.dumps(("error", (details, None))))  # as a worker reports: (details, refusal)
    os.utime(path, (when, when))


def test_blame_prefers_a_silent_death_to_the_peers_it_disconnected(tmp_path):
    """The race behind 'killed rank 2, blamed rank 3': rank 3 has already reported its lost
    connection (and exited) when the launcher first looks; rank 2 died without a word."""
    from parallel4d.launcher.blame import blame

    now = time.time()
    procs = [FakeProcess(10), FakeProcess(11), FakeProcess(12, -9), FakeProcess(13, 1)]
    _report(tmp_path, 3, "PeerLost: rank 3: tp_col all-reduce: a peer closed its connection", now)
    assert blame(procs, str(tmp_path), settled=False) == (2, "process was killed by SIGKILL without reporting "
                                                                "an error (killed?)")
    # A real error (not a consequence) wins over an earlier consequence and over a silent death.
    _report(tmp_path, 1, "FloatingPointError: loss became nan at step 3", now + 1)
    assert blame(procs, str(tmp_path), settled=False)[0] == 1
    # Only timeouts so far: wait (not settled), then name the silent, stopped rank.
    procs = [FakeProcess(10, 1), FakeProcess(11, 1), FakeProcess(os.getpid()), FakeProcess(13, 1)]
    for r in (0, 1, 3):
        (tmp_path / f"result{r}.pkl").unlink(missing_ok=True)
        _report(tmp_path, r, f"CommTimeout: rank {r}: summa_ab step 0 did not finish within 3s", now + r)
    assert blame(procs, str(tmp_path), settled=False) is None
    rank, details = blame(procs, str(tmp_path), settled=True)
    assert rank == 2 and "rank 2 (alive, but not in the collective)" in details and "rank 0 timed out first" in details
    # The race of a loaded machine: rank 1's timeout closed its sockets, and rank 0's "connection
    # closed" reached the disk before rank 1's own report. The timeout is what is shown.
    _report(tmp_path, 0, "PeerLost: rank 0: metrics gather: a peer closed its connection", now - 1)
    rank, details = blame(procs, str(tmp_path), settled=True)
    assert rank == 2 and "rank 1 timed out first" in details and "CommTimeout: rank 1" in details


def test_blame_counts_an_abort_as_the_watchdogs_consequence_of_a_stopped_rank(tmp_path):
    """On NCCL the watchdog aborts (SIGABRT, no report) a rank whose collective outlived the group's
    timeout, waiting on a stopped peer: the stopped rank is named once settled, not the aborted one;
    another kill is still blamed at once."""
    from parallel4d.launcher.blame import blame

    procs = [FakeProcess(10, -signal.SIGABRT), FakeProcess(os.getpid()), FakeProcess(12, 1)]
    _report(tmp_path, 2, "CommTimeout: rank 2: dp_grad did not finish within its limit", time.time())
    assert blame(procs, str(tmp_path), settled=False) is None
    rank, details = blame(procs, str(tmp_path), settled=True)
    assert rank == 1 and "stopped answering" in details and "rank 2 timed out first" in details, details
    (tmp_path / "result2.pkl").unlink()
    procs[2] = FakeProcess(12)  # no report at all: the abort is what is shown
    rank, details = blame(procs, str(tmp_path), settled=True)
    assert rank == 1 and "killed by SIGABRT without reporting an error: an abort in native code" in details
    procs[2] = FakeProcess(12, -signal.SIGKILL)
    assert blame(procs, str(tmp_path), settled=False)[0] == 2


def stop_a_worker(tmp_path, cfg, rank: int, command=None) -> tuple[subprocess.Popen, str, float]:
    """The job of ``cfg`` (:func:`start_job`) after its third step, SIGSTOP on worker ``rank``; returns
    the launcher, its stderr and how long it took to end after the stop."""
    proc, _ = start_job(tmp_path, cfg, command=command)
    os.kill(worker_pid(proc.pid, rank), signal.SIGSTOP)
    t0 = time.monotonic()
    err = finish(proc, timeout=120)
    return proc, err, time.monotonic() - t0


@side_by_side
def stopped_worker_ends_the_job_naming_it(tmp_path):
    cfg = tiny_job(tmp_path / "run", tp=4)
    return cfg, *stop_a_worker(tmp_path, cfg, 2)


def test_stopped_worker_ends_the_job_naming_it(job_result):
    """With tp=4, SIGSTOP on rank 2: the job ends within train.timeout_s plus a grace and
    names rank 2 as the one that stopped answering, with the action its peers waited in."""
    cfg, proc, err, took = job_result
    assert proc.returncode == 1, err[-3000:]
    assert "worker rank 2 failed" in err and "rank 2 (stopped)" in err, err[-3000:]
    assert "CommTimeout" in err and "did not finish" in err, err[-3000:]
    assert took < cfg["train"]["timeout_s"] + 10, took


def train_as_on_nccl(cfg_dict: dict) -> dict:
    """launch's worker function in a worker whose waits behave as NCCL's (tests/nccl_like.py)."""
    from nccl_like import wait_as_on_nccl

    wait_as_on_nccl()
    return importlib.import_module("parallel4d.launcher.launch")._train_entry(cfg_dict)


def launch_as_on_nccl(path: str) -> int:
    return launch_with(train_as_on_nccl, path)


@side_by_side
def a_stopped_worker_ends_a_job_waiting_as_on_nccl_naming_it(tmp_path):
    cfg = tiny_job(tmp_path / "run", dp=2)
    cli = ["-c", f"import sys; sys.path.insert(0, {TESTS!r}); import test_faults; "
                 f"sys.exit(test_faults.launch_as_on_nccl({str(tmp_path / 'job.yaml')!r}))"]
    return cfg, *stop_a_worker(tmp_path, cfg, 1, command=cli)


def test_a_stopped_worker_ends_a_job_waiting_as_on_nccl_naming_it(job_result):
    """Waits as on NCCL (the host never blocks in one; the stream does): SIGSTOP on rank 1 of dp=2. Rank
    0's host runs on to its next read step, where the deadlines it left end the job within train.timeout_s
    (plus a grace), naming the wait that never finished; the launcher names rank 1, the stopped one."""
    cfg, proc, err, took = job_result
    assert proc.returncode == 1, err[-3000:]
    assert "worker rank 1 failed" in err and "rank 1 (stopped)" in err, err[-3000:]
    assert "CommTimeout: rank 0:" in err and "did not finish within its limit (the stream waited for it)" in err, \
        err[-3000:]
    assert took < cfg["train"]["timeout_s"] + 10, took


# --- signals, run directories ---------------------------------------------------------------------


TESTS = os.path.dirname(os.path.abspath(__file__))
SLOW_SAVE_S = 2.5  # what each checkpoint of train_with_slow_saves takes longer


def train_with_slow_saves(cfg_dict: dict) -> dict:
    """launch's worker function, with each checkpoint's last phase (rank 0's checksums) SLOW_SAVE_S longer,
    as a large model's save is: a signal can arrive while it is in progress. Only this worker changes."""
    from parallel4d.checkpoint import dcp as checkpoint

    write_checksums = checkpoint.write_checksums  # looked up there by save

    def slowly(directory):
        time.sleep(SLOW_SAVE_S)
        write_checksums(directory)

    checkpoint.write_checksums = slowly
    return importlib.import_module("parallel4d.launcher.launch")._train_entry(cfg_dict)


def launch_with(train_entry, path: str) -> int:
    """``parallel4d launch PATH`` (the CLI, launch, spawn and its supervision as they are) with workers
    that run ``train_entry`` (a function of this module, which the workers import by name)."""
    from parallel4d.tools.cli import main

    importlib.import_module("parallel4d.launcher.launch")._train_entry = train_entry
    return main(["launch", path])


def launch_with_slow_saves(path: str) -> int:
    return launch_with(train_with_slow_saves, path)


def _terminal_defaults() -> None:
    """SIGINT and SIGHUP as a terminal's job has them, whatever this test session inherited (a CI may
    run it with SIGINT ignored, or under nohup)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


class Launcher:
    """``parallel4d launch`` on ``cfg`` in a session of its own (its process group is what a terminal's
    Ctrl-C signals), under ``wrapper`` (e.g. GNU timeout); stderr collected by a thread, from a pipe or,
    with ``terminal``, from a pseudo-terminal (:meth:`hang_up` closes it). On leaving the ``with`` block,
    a job still running is killed (a failed check must not leave it under the suite)."""

    def __init__(self, tmp_path, cfg, wrapper=(), slow_saves=False, terminal=False):
        self.tmp = tmp_path
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(cfg))
        (tmp_path / "tmp").mkdir(exist_ok=True)
        cli = (["-c", f"import sys; sys.path.insert(0, {TESTS!r}); import test_faults; "
                      "sys.exit(test_faults.launch_with_slow_saves(sys.argv[1]))"] if slow_saves
               else ["-m", "parallel4d", "launch"])
        self.wrapped = bool(wrapper)
        self.terminal, self.hung_up = pty.openpty() if terminal else None, threading.Event()
        self.proc = subprocess.Popen([*wrapper, sys.executable, *cli, str(path)], text=True,
                                     stderr=self.terminal[1] if terminal else subprocess.PIPE,
                                     start_new_session=True, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
                                     preexec_fn=_terminal_defaults)
        if terminal:
            os.close(self.terminal[1])
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read_terminal if terminal else self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def _read_terminal(self):
        master = self.terminal[0]
        while not self.hung_up.is_set():
            if select.select([master], [], [], 0.05)[0]:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # every process of the job has closed it
                    return
                self.lines.append(chunk.decode(errors="replace"))

    def hang_up(self) -> None:
        """Close the terminal, as its window closing does: every write to it fails (EIO) from now on."""
        self.hung_up.set()
        self.reader.join(5)
        os.close(self.terminal[0])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.terminal and not self.hung_up.is_set():
            self.hang_up()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, check, what: str, timeout: float = 120.0):
        """``check()``'s first true value, polled while the job runs."""
        deadline = time.monotonic() + timeout
        while not (found := check()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.reader.join(5)
                raise AssertionError(f"never saw {what}:\n" + self.text()[-4000:])
            time.sleep(0.02)
        return found

    def wait_for_line(self, text: str) -> None:
        self.wait_for(lambda: text in self.text(), repr(text))

    def ctrl_c_twice_during_a_save(self, ckpt) -> int:
        """Ctrl-C to the job's group, then again once a save has begun and the launcher took the first
        (the kernel merges a signal sent while the same one is pending); the step being saved."""
        os.killpg(self.proc.pid, signal.SIGINT)
        self.wait_for_line("SIGINT received")
        step = self.wait_for_save(ckpt)
        os.killpg(self.proc.pid, signal.SIGINT)
        self.wait_for_line(f"SIGINT again: waiting for the save of step {step} to complete")
        return step

    def wait_for_save(self, ckpt) -> int:
        """The step of the save in progress (checkpoint.save writes ``.step_XXXXXXXX.tmp``) once there is one."""
        tmp = self.wait_for(lambda: sorted(ckpt.glob(".step_*.tmp")), "a save in progress")[0]
        return int(tmp.name[len(".step_"):-len(".tmp")])

    def launcher_pid(self) -> int:
        return child_processes(self.proc.pid)[0][0] if self.wrapped else self.proc.pid

    def zygote_pid(self) -> int:
        return next(pid for pid, cmd in child_processes(self.launcher_pid()) if b"--fork" in cmd)

    def job_processes(self) -> dict[int, str]:
        """``{pid: start time}`` of the zygote and the workers."""
        pids = [self.zygote_pid(), *worker_pids(self.launcher_pid()).values()]
        return {pid: _start_time(pid) for pid in pids}

    def finish(self, timeout: float = 120.0) -> int:
        self.proc.wait(timeout)
        self.reader.join(5)
        return self.proc.returncode


def running(processes: dict[int, str]) -> list[int]:
    """Those of ``processes`` (``{pid: start time}``) that still run (a zombie has ended)."""
    return [pid for pid, started in processes.items() if _start_time(pid) == started]


def saving_job(tmp_path, every=0, **parallel):
    cfg = tiny_job(tmp_path / "run", **parallel)
    cfg["train"]["timeout_s"] = 30  # rank 1 waits in the save's agreement while rank 0 writes the checksums slowly
    cfg["checkpoint"] = {"enabled": True, "every": every}
    return cfg


def assert_stopped_and_saved(job, code: int, left: list, signame: str):
    """A job stopped by ``signame``: its exit code, no process left, summary.json saying so and naming a
    checkpoint that verifies. Returns (stderr, summary, that checkpoint)."""
    err = job.text()
    assert code == 128 + signal.Signals[signame].value, err[-3000:]
    assert left == [], left
    summary = json.loads((job.tmp / "run" / "summary.json").read_text())
    saved = Path(summary["checkpoint"])
    assert summary["stop_signal"] == signame and summary["finished"] is False
    assert verify(saved) is None
    return err, summary, saved


@side_by_side
def ctrl_c_twice_waits_for_the_save_in_progress_then_names_the_verified_checkpoint(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    with Launcher(tmp_path, saving_job(tmp_path, dp=2), slow_saves=True) as job:
        job.wait_for_line("step 3/")
        processes = job.job_processes()
        step = job.ctrl_c_twice_during_a_save(ckpt)
        code = job.finish()
        left = running(processes)
    return job, ckpt, step, code, left


def test_ctrl_c_twice_waits_for_the_save_in_progress_then_names_the_verified_checkpoint(job_result):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it), and again while the final
    save is in progress: the launcher says it waits for that save, the save completes, and only then does
    the CLI say it saved, naming the checkpoint it verified. Exit 130; summary.json records SIGINT (the
    signal received) and finished: false; no process of the job outlives the launcher."""
    job, ckpt, step, code, left = job_result
    err, summary, saved = assert_stopped_and_saved(job, code, left, "SIGINT")
    assert summary["steps"] == step and saved == ckpt / f"step_{step:08d}"
    assert f"stopped by SIGINT at step {step}, after saving checkpoint {saved} (verified" in err, err[-3000:]
    assert sorted(ckpt.glob(".step_*.tmp")) == [] and "Traceback" not in err


@side_by_side
def a_third_signal_stops_at_once_saying_what_is_lost(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    with Launcher(tmp_path, saving_job(tmp_path, every=2, dp=2), slow_saves=True) as job:
        job.wait_for_line("step 3/")
        processes = job.job_processes()
        step = job.ctrl_c_twice_during_a_save(ckpt)
        os.killpg(job.proc.pid, signal.SIGINT)
        code = job.finish()
        left = running(processes)
    return job, ckpt, step, code, left


def test_a_third_signal_stops_at_once_saying_what_is_lost(job_result):
    """Three Ctrl-Cs, the last two while a save is in progress: the third kills the workers at once (the
    save never completes) and waits for them, and the CLI says what is lost: that save, and the steps
    since the newest complete checkpoint, named. Exit 130; no process of the job is left."""
    job, ckpt, step, code, left = job_result
    err = job.text()
    assert code == 130, err[-3000:]
    assert left == [], left
    newest = latest_checkpoint(ckpt)
    assert newest is not None and newest.name < f"step_{step:08d}" and not (ckpt / f"step_{step:08d}").exists()
    assert (f"stopped at once by a third signal (SIGINT); lost: the save of step {step} in progress and the "
            f"steps trained since {newest}, the newest complete checkpoint") in err, err[-3000:]
    assert "Traceback" not in err


@side_by_side
def gnu_timeout_signalling_twice_waits_for_the_workers_and_their_save(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    with Launcher(tmp_path, saving_job(tmp_path, dp=2), wrapper=["timeout", "-s", "TERM", "600"]) as job:
        job.wait_for_line("step 3/")
        processes = job.job_processes()
        assert [n for n in os.listdir(tmp_path / "tmp") if n.startswith("parallel4d-")], "the launcher's files"
        job.proc.send_signal(signal.SIGTERM)  # timeout passes a signal it gets on as it passes its own at the limit
        code = job.finish()
        left = running(processes)
    return tmp_path, job, ckpt, code, left


def test_gnu_timeout_signalling_twice_waits_for_the_workers_and_their_save(job_result):
    """GNU timeout (the README names it for SIGTERM) sends SIGTERM to the launcher and then to its whole
    process group: the zygote and the workers, and the launcher a second time (which the kernel may merge
    with the first). The launcher outlives its workers, names the checkpoint they saved once it verified,
    exits 143; no traceback; its temporary directory is removed."""
    tmp_path, job, ckpt, code, left = job_result
    err, summary, saved = assert_stopped_and_saved(job, code, left, "SIGTERM")
    assert saved == ckpt / f"step_{summary['steps']:08d}"
    assert f"after saving checkpoint {saved} (verified" in err, err[-3000:]
    assert "Traceback" not in err and "FileNotFoundError" not in err, err[-3000:]
    assert [n for n in os.listdir(tmp_path / "tmp") if n.startswith("parallel4d-")] == []


@side_by_side
def sighup_to_the_group_saves_and_stops_as_sigterm_does(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    with Launcher(tmp_path, saving_job(tmp_path, dp=2)) as job:
        job.wait_for_line("step 3/")
        processes = job.job_processes()
        os.killpg(job.proc.pid, signal.SIGHUP)  # a shell passing on its terminal's hang-up to the job
        code = job.finish()
        left = running(processes)
    return job, ckpt, code, left


def test_sighup_to_the_group_saves_and_stops_as_sigterm_does(job_result):
    """SIGHUP to the whole process group (a terminal closed under the job, an ssh session ending without
    nohup): the workers finish the step and save, the launcher names the checkpoint it verified and
    exits 129; summary.json records SIGHUP and finished: false; no process of the job is left."""
    job, ckpt, code, left = job_result
    err, summary, saved = assert_stopped_and_saved(job, code, left, "SIGHUP")
    assert saved == ckpt / f"step_{summary['steps']:08d}"
    assert f"stopped by SIGHUP at step {summary['steps']}, after saving checkpoint {saved} (verified" in err, \
        err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def metrics_lines(run) -> int:
    """How many steps the run has logged (metrics.jsonl's lines)."""
    try:
        return (run / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


@side_by_side
def sighup_to_the_launcher_of_a_closed_terminal_saves_and_stops(tmp_path):
    with Launcher(tmp_path, saving_job(tmp_path, dp=2), terminal=True) as job:
        job.wait_for(lambda: metrics_lines(tmp_path / "run") >= 3, "the third step (a progress bar on a terminal)")
        processes = job.job_processes()
        job.hang_up()
        os.kill(job.proc.pid, signal.SIGHUP)  # what the kernel sends a session's leader when its terminal closes
        code = job.finish()
        left = running(processes)
    return job, code, left


def test_sighup_to_the_launcher_of_a_closed_terminal_saves_and_stops(job_result):
    """The terminal of the job (every process's stderr) hangs up, then SIGHUP reaches the launcher alone: it
    passes it on, the workers save as for SIGTERM though no line they write can be shown (each write to a
    hung-up terminal fails), and the launcher exits 129 once the checkpoint verified; nothing is left running."""
    job, code, left = job_result
    assert_stopped_and_saved(job, code, left, "SIGHUP")


def _zygote(job) -> int | None:
    return next((pid for pid, cmd in child_processes(job.proc.pid) if b"--fork" in cmd), None)


@side_by_side
def ctrl_c_while_the_workers_start_ends_the_job_in_one_line(tmp_path):
    with Launcher(tmp_path, tiny_job(tmp_path / "run", dp=2)) as job:
        job.wait_for(lambda: _zygote(job), "the zygote's interpreter starting")
        os.killpg(job.proc.pid, signal.SIGINT)  # its interpreter's start: Python's own SIGINT handler, then imports
        code = job.finish()
    return tmp_path, job, code


def test_ctrl_c_while_the_workers_start_ends_the_job_in_one_line(job_result):
    """Ctrl-C to the group while the zygote's interpreter starts (its own imports, before it forks a worker):
    exit 130 and the one line saying the job was stopped before its workers started, never a
    KeyboardInterrupt traceback from a process of the job; the run directory it created is gone."""
    tmp_path, job, code = job_result
    err = job.text()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.splitlines()[-1] == "parallel4d: SIGINT stopped the job before its workers started: nothing was lost"
    assert not (tmp_path / "run").exists()


@side_by_side
def a_job_stopped_whole_longer_than_its_timeout_is_not_blamed_on_a_rank(tmp_path):
    cfg = tiny_job(tmp_path / "run", dp=2)
    with Launcher(tmp_path, cfg) as job:
        job.wait_for_line("step 3/")
        processes = job.job_processes()
        # rank 0 a moment first, as a Ctrl-Z reaches processes one by one: rank 1 is waiting for it by then
        os.kill(worker_pid(job.proc.pid, 0), signal.SIGSTOP)
        time.sleep(0.2)
        os.killpg(job.proc.pid, signal.SIGSTOP)
        time.sleep(cfg["train"]["timeout_s"] + 1.0)
        os.killpg(job.proc.pid, signal.SIGCONT)  # `fg`
        code = job.finish()
        left = running(processes)
    return job, code, left


def test_a_job_stopped_whole_longer_than_its_timeout_is_not_blamed_on_a_rank(job_result):
    """SIGSTOP to the whole group (Ctrl-Z) for longer than train.timeout_s, then SIGCONT (fg): the waits in
    progress ran out while it was stopped (gloo's timer counts the stop), so the job ends, and it says that
    the job was stopped and for how long, that no rank is at fault, what is lost and how to pause a job
    instead; exit 1, no worker's traceback, no rank blamed, nothing left running."""
    job, code, left = job_result
    err = job.text()
    assert code == 1 and left == [], err[-3000:]
    stopped = re.search(r"the job was stopped \(SIGSTOP or Ctrl-Z of its whole process group\) for ([\d.]+)s", err)
    assert stopped and float(stopped[1]) >= 4.0, err[-3000:]
    assert ("no rank is at fault (CommTimeout: rank " in err and "lost: everything trained (there is no complete "
            "checkpoint). To pause a job, stop it with Ctrl-C or SIGTERM" in err), err[-3000:]
    assert "Traceback" not in err and "worker rank" not in err and "stopped answering:" not in err, err[-3000:]


@side_by_side
def a_killed_zygote_is_blamed_as_the_zygote_and_its_workers_are_stopped(tmp_path):
    with Launcher(tmp_path, tiny_job(tmp_path / "run", dp=2)) as job:
        job.wait_for_line("step 3/")
        processes = job.job_processes()
        zygote = job.zygote_pid()
        os.kill(zygote, signal.SIGKILL)
        code = job.finish()
        left = running(processes)
    return job, zygote, code, left


def test_a_killed_zygote_is_blamed_as_the_zygote_and_its_workers_are_stopped(job_result):
    """SIGKILL to the process that forks the workers: the job names it (not a worker, none was killed),
    its workers (no longer its children) are stopped before the launcher leaves, and no worker prints a
    traceback about the launcher's files."""
    job, zygote, code, left = job_result
    err = job.text()
    assert code == 1, err[-3000:]
    assert left == [], left
    assert f"the process that forks the workers (zygote, pid {zygote}) was killed by SIGKILL" in err, err[-3000:]
    assert "worker rank" not in err and "Traceback" not in err and "FileNotFoundError" not in err, err[-3000:]


def test_a_worker_outliving_its_zygote_is_watched_and_stopped_by_its_pid(tmp_path):
    """Once the zygote is dead no one records how its workers end: one still running is seen running (not
    ended with the zygote's status), and stopping it signals it by the pid the zygote recorded."""
    from parallel4d.launcher.workers import Forked

    zygote = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    zygote.wait()
    orphan = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "pid0").write_text(str(orphan.pid))
        worker = Forked(str(tmp_path), 0, zygote)
        assert worker.poll() is None
        worker.terminate()
        assert orphan.wait(10) == -signal.SIGTERM
        assert worker.poll() is not None
    finally:
        orphan.kill()
        orphan.wait()


def test_a_zygote_the_stop_signal_reached_during_its_imports_ends_the_job_as_stopped(tmp_path):
    """SIGTERM to the group while the zygote still imports (before it ignores the signal, before any worker):
    the job was stopped, nothing was lost; not a failure of the zygote."""
    from parallel4d.launcher.supervise import Interrupted, Signals, Supervisor
    from parallel4d.launcher.workers import Forked

    zygote = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    zygote.wait()
    signals = Signals()
    signals.received.append(signal.SIGTERM)  # the launcher got it too
    supervisor = Supervisor([Forked(str(tmp_path), 0, zygote)], zygote, str(tmp_path), signals, timeout_s=60,
                             interrupt_grace_s=120, saving=None, saved=None)
    with pytest.raises(Interrupted, match="SIGTERM stopped the job before its workers started: nothing was lost"):
        supervisor.run()
    signals.received.clear()  # the zygote alone got it: someone killed it
    with pytest.raises(WorkerError, match=rf"zygote, pid {zygote.pid}\) was killed by SIGTERM"):
        Supervisor([Forked(str(tmp_path), 0, zygote)], zygote, str(tmp_path), signals, timeout_s=60,
                    interrupt_grace_s=120, saving=None, saved=None).run()


class SlowToDie(FakeProcess):
    """A worker that ends only a while after SIGKILL (as one in uninterruptible sleep does)."""

    killed_at = None

    def kill(self):
        self.killed_at = time.monotonic()

    def poll(self):
        if self.killed_at is not None and time.monotonic() - self.killed_at > 0.3:
            self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout=None):
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode


def test_a_third_signal_returns_only_once_the_killed_workers_ended(tmp_path):
    """The third signal kills the workers and waits until each has ended before the launcher goes on (to
    remove the job's directory and exit)."""
    from parallel4d.launcher.supervise import Interrupted, Signals, Supervisor

    procs = [SlowToDie(10), SlowToDie(11)]
    signals = Signals()
    signals.received += [signal.SIGINT] * 3  # recorded by its handler, as three Ctrl-Cs are
    supervisor = Supervisor(procs, None, str(tmp_path), signals, timeout_s=60, interrupt_grace_s=120,
                             saving=lambda: "step 9", saved=lambda: "ckpt/step_00000006")
    with pytest.raises(Interrupted, match=r"third signal \(SIGINT\); lost: the save of step 9 in progress and the "
                                          r"steps trained since ckpt/step_00000006, the newest complete checkpoint"):
        supervisor.run()
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2


class Endless(FakeProcess):
    """A worker that runs until it is signalled."""

    def send_signal(self, sig):
        self.returncode = -sig

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout=None):
        return self.returncode


def test_the_job_time_limit_counts_only_the_time_the_job_could_run(tmp_path):
    """train.job_timeout_s (the supervisor's ``timeout_s``) measures the time the job could run: a stop of
    the whole job (the launcher frozen with it, then SIGCONT) does not count, so a 1 s limit still ends the
    job about 1 s of running time after its start, not at the first look after a 5 s stop."""
    from parallel4d.launcher.supervise import Signals, Supervisor, WorkerTimeout

    class StoppedOnce(Supervisor):
        """On its fifth turn the launcher's clock jumps 5 s and a SIGCONT has come: the job was stopped."""
        now, turns = 0.0, 0
        clock = lambda self: self.now  # noqa: E731

        def sleep(self, seconds):
            self.turns += 1
            self.now += seconds + (5.0 if self.turns == 5 else 0.0)
            self.signals.continued += self.turns == 5

    supervisor = StoppedOnce([Endless(10), Endless(11)], None, str(tmp_path), Signals(), timeout_s=1.0,
                             interrupt_grace_s=120, saving=None, saved=None)
    with pytest.raises(WorkerTimeout, match=r"the job's time limit of 1s ran out while the workers were still"):
        supervisor.run()
    assert supervisor.stopped_s == pytest.approx(5.05) and supervisor.now == pytest.approx(6.05, abs=0.06)


def _save_slowly_after_a_signal(launcher: int, marker: str, save_s: float) -> str:
    """Rank 0 starts a "save" (``marker`` exists while it lasts) and sends SIGINT to the launcher; every rank
    waits for the signal the launcher passes on, and returns its name once the save is over."""
    got = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        os.mkdir(marker)
        os.kill(launcher, signal.SIGINT)
    while not got:
        time.sleep(0.01)
    time.sleep(save_s)
    if torch.distributed.get_rank() == 0:
        os.rmdir(marker)
    return signal.Signals(got[0]).name


def test_the_interrupt_grace_never_cuts_a_save_short(tmp_path):
    """A signal to the launcher reaches the workers as it is (SIGINT stays SIGINT); interrupt_grace_s does
    not end while a save is in progress, and ends the job once none is, saying what is lost."""
    from parallel4d.launcher.supervise import Interrupted

    marker = tmp_path / "saving"
    t0 = time.monotonic()
    try:
        got = spawn(_save_slowly_after_a_signal, 2, (os.getpid(), str(marker), 1.0), timeout_s=60,
                    interrupt_grace_s=0.2, saving=lambda: "step 7" if marker.is_dir() else None)
    except Interrupted as e:  # a KeyboardInterrupt: uncaught, it would end the whole test session
        pytest.fail(f"the workers were stopped: {e}")
    assert got == ["SIGINT", "SIGINT"] and time.monotonic() - t0 > 1.0
    with pytest.raises(Interrupted, match=r"did not stop within interrupt_grace_s=0.2s of SIGINT: stopped at once; "
                                          "lost: whatever the workers had not saved"):
        spawn(_save_slowly_after_a_signal, 2, (os.getpid(), str(tmp_path / "unseen"), 30.0), timeout_s=60,
              interrupt_grace_s=0.2)
    assert worker_pids(os.getpid()) == {}


def test_a_job_timeout_shorter_than_the_workers_start_up_is_said_in_one_line(tmp_path, capsys, monkeypatch):
    """train.job_timeout_s=1 with workers slower to start (their zygote imports a module that takes 3 s):
    exit 1 and one line naming the field and the fix, not the launcher's traceback about a worker never
    started; no run directory left behind, no process left."""
    from parallel4d.tools.cli import main

    launch_module = importlib.import_module("parallel4d.launcher.launch")
    monkeypatch.setattr(launch_module, "_preload", lambda cfg: ("slow_to_import",))
    cfg = tiny_job(tmp_path / "run", steps=2, dp=2)
    cfg["train"]["job_timeout_s"] = 1
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["launch", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "parallel4d: the job failed: train.job_timeout_s=1 ran out while the workers were still starting (importing, "
        "joining the process group; ranks still running: [0, 1]); raise train.job_timeout_s well above their "
        "start-up, or leave it out (a week)"), err
    assert not (tmp_path / "run").exists() and worker_pids(os.getpid()) == {}


def test_a_refused_launch_leaves_no_directory_behind(tmp_path, capsys):
    """A launch refused once its run directory exists (here train.resume=false and a checkpoint.dir holding
    an earlier run's checkpoints) exits 2 and removes the train.out_dir it created, with the parents it
    created; what was there before stays."""
    from parallel4d.tools.cli import main

    ckpt = tmp_path / "earlier" / "checkpoints"
    (ckpt / "step_00000002").mkdir(parents=True)
    cfg = tiny_job(tmp_path / "new" / "run", steps=2)
    cfg["checkpoint"] = {"enabled": True, "dir": str(ckpt)}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["launch", str(path)]) == 2
    assert "already holds checkpoints (step_00000002)" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and (ckpt / "step_00000002").is_dir()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_before_the_workers_start_ends_the_launch_in_one_line(sig, tmp_path, capsys, monkeypatch):
    """SIGTERM or SIGHUP while the launch checks its run directory (before any worker: as during torch's
    import or the preflight) ends it with 128 + the signal and one line, as Ctrl-C there does; the
    directory it made is gone. Before, the signal's default action ended the launcher without a word."""
    from parallel4d.launcher import launch as launching
    from parallel4d.tools.cli import main

    def signalled(cfg):
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises here

    def unhandled(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the test: the launch did not take it")

    monkeypatch.setattr(launching, "_check_other_runs", signalled)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny_job(tmp_path / "new" / "run", steps=2)))
    old = signal.signal(sig, unhandled)  # a handler, not SIG_IGN (nohup) nor the default (it would end pytest)
    try:
        assert main(["launch", str(path)]) == 128 + sig
    finally:
        signal.signal(sig, old)
    assert capsys.readouterr().err.splitlines()[-1] == f"parallel4d: stopped by {signal.Signals(sig).name}"
    assert not (tmp_path / "new").exists()


def _sighup_ignored() -> bool:
    return signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_a_launch_under_nohup_keeps_sighup_ignored_in_its_workers():
    """SIGHUP stops a job as SIGTERM does, except where the launcher started with it ignored (nohup): its
    workers ignore it too, as nohup asked."""
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        assert spawn(_sighup_ignored, 1, timeout_s=60, preload=()) == [False]
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert spawn(_sighup_ignored, 1, timeout_s=60, preload=()) == [True]
    finally:
        signal.signal(signal.SIGHUP, old)


def _remove_the_job_directory_then_fail():
    shutil.rmtree(os.path.dirname(sys.argv[1]))  # the launcher's directory (argv: the zygote's, or this worker's)
    raise RuntimeError("failing after the job directory went")


def test_a_worker_whose_job_directory_is_gone_exits_without_a_traceback(capfd):
    """A worker (and the zygote) with nowhere to report, the launcher gone or done, exits quietly."""
    with pytest.raises(WorkerError):
        spawn(_remove_the_job_directory_then_fail, 1, timeout_s=60)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "FileNotFoundError" not in err, err


def test_second_job_on_a_run_directory_in_use_is_refused(tmp_path):
    """A second job on a directory in use refuses at once, naming the first job's pid and host;
    once that job is killed, its stale lock is taken over."""
    from parallel4d import launch
    from parallel4d.config.errors import ConfigError

    cfg = tiny_job(tmp_path / "run")
    proc, _ = start_job(tmp_path, cfg)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=rf"in use by another parallel4d job \(pid {proc.pid} on host "):
            launch(tiny_job(tmp_path / "run", steps=2))
        assert time.monotonic() - t0 < 5
    finally:
        proc.kill()  # the launcher dies without releasing anything: its lock is now stale
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # its workers notice their parent is gone within a second
        try:
            worker_pid(proc.pid, 0)
            time.sleep(0.2)
        except LookupError:
            break
    with pytest.raises(ConfigError, match="holds another run's history"):  # the killed run's metrics.jsonl
        launch(tiny_job(tmp_path / "run", steps=2))
    for name in ("summary.json", "metrics.jsonl"):  # moved away, as the refusal says
        (tmp_path / "run" / name).unlink(missing_ok=True)
    summary = launch(tiny_job(tmp_path / "run", steps=2))
    assert summary["steps"] == 2


def test_a_local_job_above_the_worker_limit_is_refused_before_spawning(tmp_path, monkeypatch):
    """parallel.dp=4096 on one machine (10**12 is beyond every axis's bound now) would start spawning
    workers without limit."""
    from parallel4d import launch
    from parallel4d.config.errors import ConfigError

    spawned = []
    monkeypatch.setattr(sys.modules["parallel4d.launcher.launch"], "spawn", lambda *a, **k: spawned.append(a))
    cfg = tiny_job(tmp_path / "run", steps=2)
    cfg["data"]["batch_size"] = 4096
    cfg["parallel"] = {"dp": 4096}
    with pytest.raises(ConfigError, match="train.max_local_workers=64"):
        launch(cfg)
    assert spawned == [] and not (tmp_path / "run").exists()


def _chattr(flag: str, path) -> None:
    try:
        subprocess.run(["chattr", flag, str(path)], capture_output=True)
    except FileNotFoundError:  # no e2fsprogs here
        pass


def _read_only(path) -> bool:
    """Make ``path`` unwritable for this process: chmod 555, or for root (who writes through
    modes) the immutable attribute; False where neither holds (then there is nothing to test)."""
    path.chmod(0o555)
    if os.geteuid() == 0:
        _chattr("+i", path)
    try:
        (path / "probe").write_text("x")
    except OSError:
        return True
    (path / "probe").unlink()
    return False


def test_read_only_run_directory_is_refused_before_training(tmp_path, capsys):
    """The reported case: a chmod-555 run directory trained all its steps, then lost everything."""
    from parallel4d.tools.cli import main

    run = tmp_path / "ro"
    run.mkdir()
    try:
        if not _read_only(run):
            pytest.skip("this file system lets this user write into a read-only directory")
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(tiny_job(run, steps=2)))
        assert main(["launch", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"train.out_dir='{run}' is not writable" in err, err
    finally:
        _chattr("-i", run)
        run.chmod(0o755)


def test_unwritable_run_directory_is_refused_before_any_worker(tmp_path, capsys, monkeypatch):
    """A run directory that cannot be created (its parent is a file) stops at exit 2 naming
    train.out_dir, before any worker is spawned (the launcher's spawn is never called)."""
    from parallel4d.tools.cli import main

    launch_module = importlib.import_module("parallel4d.launcher.launch")  # the CLI imports it when it runs
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for field, cfg in (("train.out_dir", tiny_job(blocker / "run", steps=2)),
                       ("checkpoint.dir", {**tiny_job(tmp_path / "ok", steps=2),
                                           "checkpoint": {"enabled": True, "dir": str(blocker / "ckpt")}})):
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(cfg))
        spawned = []
        monkeypatch.setattr(launch_module, "spawn", lambda *a, **k: spawned.append(a))
        assert main(["launch", str(path)]) == 2
        err = capsys.readouterr().err
        assert field in err and "not writable" in err and str(blocker) in err, err
        assert spawned == []


# --- the tools' outputs (#45): as careful as launch ---------------------------------------------------

@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    """conftest.small_run's run (2 steps, a checkpoint each), shared by the tool tests: they only read it."""
    from conftest import small_run

    return small_run(tmp_path_factory.mktemp("tools") / "run")


def test_tools_refuse_a_read_only_place_in_one_line(tool_run, tmp_path, capsys):
    """The reported cases, ``parallel4d plot RUN -o ro/c.png`` and ``parallel4d export … ro/exp`` onto a
    read-only directory, ended in OSError tracebacks (``checkpoint gather`` and ``tokenize`` likewise):
    now exit 2, one line naming the flag, the path and why, nothing written. Read-only as this process
    sees it: for root, the immutable attribute (a mode alone does not stop root)."""
    from parallel4d.tools.cli import main

    ro = tmp_path / "ro"
    ro.mkdir()
    try:
        if not _read_only(ro):
            pytest.skip("this file system lets this user write into a read-only directory")
        for argv, flag, out in ((["plot", str(tool_run), "-o"], "-o", ro / "c.png"),
                                (["export", str(tool_run / "checkpoints")], "OUT_DIR", ro / "exp"),
                                (["checkpoint", "gather", str(tool_run / "checkpoints")], "OUT", ro / "model.pt")):
            code = main([*argv, str(out)])
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1, err
            assert err.startswith(f"parallel4d: {flag} {out} cannot be written (") and "choose another" in err, err
        assert list(ro.iterdir()) == []
    finally:
        _chattr("-i", ro)
        ro.chmod(0o755)


def _fail_midway(monkeypatch, tool: str, error: BaseException) -> None:
    """Make ``tool``'s write fail after it has written part of its output."""
    if tool == "export":  # half-way through its (only) safetensors file
        hf = importlib.import_module("parallel4d.models.hf")
        real = hf.write_safetensors

        def write_then_fail(path, *args):
            real(path, *args)
            os.truncate(path, os.path.getsize(path) // 2)
            raise error

        monkeypatch.setattr(hf, "write_safetensors", write_then_fail)
    elif tool == "gather":  # after its first tensor is in the file
        gather = importlib.import_module("parallel4d.checkpoint.gather")
        monkeypatch.setattr(gather._Progress, "advance", lambda self, nbytes: (_ for _ in ()).throw(error))
    else:  # plot: part of an image
        import matplotlib.figure

        def save_half(fig, fname, **kwargs):
            Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n half an image")
            raise error

        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", save_half)


@pytest.mark.parametrize("error, code", [(OSError(28, "No space left on device"), 2), (KeyboardInterrupt(), 130)])
@pytest.mark.parametrize("tool", ["export", "gather", "plot"])
def test_a_tool_failing_midway_leaves_the_earlier_output_and_no_temporary_file(tool_run, tmp_path, monkeypatch,
                                                                                capsys, tool, error, code):
    """A full disk (one line, exit 2) or Ctrl-C (exit 130) while export, gather or plot writes: the
    earlier output is as it was, byte for byte, and nothing else is left — no half-written file (they
    wrote in place), no temporary file (gather's stayed)."""
    from conftest import snapshot
    from parallel4d.tools.cli import main

    out = tmp_path / "out"
    out.mkdir()
    argv = {"export": ["export", str(tool_run / "checkpoints"), str(out / "hf")],
            "gather": ["checkpoint", "gather", str(tool_run / "checkpoints"), str(out / "model.pt")],
            "plot": ["plot", str(tool_run), "-o", str(out / "c.png")]}[tool]
    assert main(argv) == 0  # the earlier output
    before = snapshot(out)
    _fail_midway(monkeypatch, tool, error)
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and (code != 2 or "No space left on device" in err and err.count("\n") == 1), err
    assert snapshot(out) == before


def test_tool_paths_expand_the_home_directory(tool_run, tmp_path, monkeypatch, capsys):
    """``~`` in a path the shell left alone (quoted, or after ``--out=``) is the home directory, as in
    the shell: it made a literal ``./~`` or named no checkpoint (exit 1)."""
    from parallel4d.tools.cli import main

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    shutil.copytree(tool_run, home / "run")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert main(["export", "~/run/checkpoints", "~/hf"]) == 0
    assert main(["checkpoint", "gather", "~/run/checkpoints", "~/model.pt"]) == 0
    assert main(["plot", "~/run", "-o", "~/c.png"]) == 0
    assert main(["generate", "~/hf", "--max-new-tokens", "2"]) == 0
    assert (home / "hf" / "config.json").is_file() and (home / "model.pt").is_file() and (home / "c.png").is_file()
    assert list(cwd.iterdir()) == []
