"""``make gpu-check``: what a GPU can tell us, in one short call, on a machine where torch (with CUDA) is installed.

Never installs anything: it runs with the interpreter it is given (``GPU_PYTHON``) and the working tree on
``PYTHONPATH``; what the machine lacks travels as wheels (docs/benchmarks.md). ``--part`` picks what runs:

* ``default`` (``make gpu-check``): within :data:`DEFAULT_CAP_S` (under 5 minutes on one H100), the most
  telling figures first — the GPU-marked tests; the engine against the plain loop at the Llama-3.2-1B shape
  (``benchmarks/engine_vs_plain.py``); hetero beside plain PyTorch and DeepSpeed on a 1.4B GPT (a short
  form of ``benchmarks/hetero_gpu.py``); the ring's blocks at 8 ranks, s = 32k causal, against one fused
  call (``benchmarks/sequence.py``); the 2D block (``benchmarks/tensor2d.py``'s GPU case, "not available"
  until it exists); then ``parallel4d plan --device`` predictions beside each measured one-GPU step;
* named parts, each within :data:`NAMED_CAP_S` (8 minutes): ``launches`` (one-GPU launches of the example
  configs), ``sweeps`` (the full ring/Ulysses sweep and the full ``hetero_gpu.py``, with predictions),
  ``ladders`` (the largest-model ladders), ``lora`` (LoRA against full fine-tuning, ``benchmarks/lora.py``),
  ``fp8`` (FP8 against bf16: the 8B-shaped block and the 1B launch, ``benchmarks/fp8.py``).

Each step (``benchmarks/gpu_check_steps.py``) runs in a child process of its own session — a fresh interpreter,
forked from this one in the dry run — with its own cap, and records what it finds as it goes (:class:`Record`);
a step past its cap — or past what is left of its part's cap — is stopped with every process it started and
reported ``timed_out`` with what it had recorded, and the next step runs. The part
writes ONE JSON (``benchmarks/results/gpu_check.json``, ``gpu_check_<part>.json`` for a named part): the
machine (GPU, memory, driver, CUDA, cuDNN, host), the versions (python, torch, parallel4d and its commit,
DeepSpeed), every step's status, cap, wall time and figures, and the predictions table (measured / predicted
step and peak memory on the GPU's profile, flagged past 15 %). ``benchmarks/calibrate.py`` refits a device
profile to that JSON.

``--dry-run``: the same orchestration on the CPU at tiny sizes (every step, the caps, the JSON, the
predictions; no GPU figures: the JSON says so), into ``--out`` or ``runs/gpu_check/dry_run/``.
``--plan`` (or no GPU visible): prints what would run and exits 0.

Usage: ``python benchmarks/gpu_check.py [--part default|launches|sweeps|ladders|lora|fp8] [--dry-run | --plan]
[--profile h100|h200|FILE] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "runs" / "gpu_check"
SCHEMA = "parallel4d.gpu_check/2"
STATUSES = ("ok", "failed", "timed_out", "not_available", "skipped", "not_run")
DEFAULT_CAP_S = 285  # the default part all told: with the interpreter's start and the report, within 5 minutes
NAMED_CAP_S = 480  # a named part: within 8 minutes
MIN_STEP_S = 1.0  # a step gets at least this much of its part's time, else it is reported not_run
TINY_SLACK = 2  # --dry-run: each cap × this (the CPU of a shared CI machine, not a GPU)
REQUIRED = ("torch", "pydantic", "yaml", "tqdm", "pytest")  # what every step imports (DeepSpeed is optional)


# --- what runs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One step of a part: ``fn`` (``"module:function"``) called as ``function(ctx, *args)`` in a fresh child
    process; ``cap_s`` bounds it on one GPU; ``estimate_s``: its time on one H100 (a guess until a GPU runs it)."""

    name: str
    fn: str
    cap_s: int
    estimate_s: int
    what: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Part:
    """Steps run one after another within ``cap_s`` all told."""

    name: str
    cap_s: int
    steps: tuple[Step, ...]
    what: str


PREDICTIONS = Step("plan --device predictions", "gpu_check_steps:predictions", 13, 10,
                   "the planner's step and memory for each measured one-GPU step, beside the measure")


def launch_step(config: str) -> Step:
    return Step(f"launch {Path(config).stem} on one GPU", "gpu_check_steps:launch", 60, 20,
                f"parallel4d launch {config}, every parallel size 1, train.device=cuda", (config,))


PARTS = {
    "default": Part("default", DEFAULT_CAP_S, (
        Step("GPU-marked tests", "gpu_check_steps:gpu_tests", 40, 35,
             "pytest -m gpu over the files holding a GPU test"),
        Step("engine vs plain (Llama-3.2-1B shape)", "gpu_check_steps:engine_vs_plain_1b", 90, 60,
             "benchmarks/engine_vs_plain.py: the engine at every size 1 against the plain loop, bf16, seq 2048"),
        Step("hetero side by side (1.4B GPT)", "gpu_check_steps:hetero_side_by_side", 55, 45,
             "benchmarks/hetero_gpu.py, 1 warm-up and 3 timed steps: plain, hetero resident and half, DeepSpeed"),
        Step("ring at 8 ranks (s = 32k, causal)", "gpu_check_steps:ring_8_ranks", 50, 30,
             "benchmarks/sequence.py --ring-check --ring 8: the ring's blocks at N = 8, s = 16k and 32k causal, "
             "against one fused SDPA call, cuDNN blocks"),
        Step("2D block (8B shape)", "gpu_check_steps:tensor2d_block", 25, 20,
             "benchmarks/tensor2d.py's GPU case: one 8B-shaped block at q = 2 and 4 against the dense block"),
        Step("MoE layer (Qwen3-30B-A3B shape)", "gpu_check_steps:moe_layer", 12, 10,
             "benchmarks/moe_layer.py: 128 experts, top-8, grouped products against the loop over experts"),
        PREDICTIONS), "the most telling figures, within 5 minutes on one H100"),
    "launches": Part("launches", NAMED_CAP_S, tuple(launch_step(f"configs/{n}.yaml")
                                                    for n in ("quickstart", "llama", "hetero", "sequence")),
                     "one-GPU launches of the example configs (launch overhead: the models are tiny)"),
    "sweeps": Part("sweeps", NAMED_CAP_S, (
        Step("ring / Ulysses sweep", "gpu_check_steps:sequence_sweep", 200, 90,
             "benchmarks/sequence.py --ulysses 1 2 8 --blocks cudnn --compile-merge, s = 16k and 32k"),
        Step("hetero_gpu.py in full", "gpu_check_steps:hetero_full", 240, 120,
             "benchmarks/hetero_gpu.py (2 warm-up, 5 timed steps each) → gpu_hetero.json"),
        PREDICTIONS), "the full sweeps behind the default part's figures"),
    "compile": Part("compile", NAMED_CAP_S, (
        Step("engine vs plain compiled (Llama-3.2-1B shape)", "gpu_check_steps:engine_vs_plain_compiled", 300, 180,
             "benchmarks/engine_vs_plain.py --compile: train.compile: blocks against the plain loop's blocks compiled"),
        PREDICTIONS), "torch.compile's blocks in both loops (inductor's compile time included)"),
    "lora": Part("lora", NAMED_CAP_S, (
        Step("LoRA vs full fine-tuning (Llama-3.2-1B shape)", "gpu_check_steps:lora", 300, 120,
             "benchmarks/lora.py --gpu: full fine-tuning and LoRA (rank 16, every linear), plain and under hetero, "
             "bf16, seq 1024: tokens/s, the device's peak, hetero's host bytes per (frozen) parameter"),),
        "LoRA against full fine-tuning of one model (issue 49)"),
    "fp8": Part("fp8", NAMED_CAP_S, (
        Step("FP8 block (8B shape)", "gpu_check_steps:fp8_block", 90, 40,
             "benchmarks/fp8.py's block: one 8B-shaped llama block, forward + backward, train.fp8 rowwise against "
             "bf16, dense (target >= 1.3x) and as the 4 ranks of a 2x2 grid on the one GPU"),
        Step("FP8 engine (Llama-3.2-1B shape)", "gpu_check_steps:fp8_engine", 300, 150,
             "benchmarks/fp8.py's engine: the 1B launch with train.fp8 rowwise against none, seq 2048, batch 4: "
             "tokens/s, MFU in bf16's and FP8's peak"),),
        "FP8 products against bf16 (issue 50)"),
    "ladders": Part("ladders", NAMED_CAP_S, (
        Step("largest-model ladders", "gpu_check_steps:ladders", 470, 420,
             "benchmarks/hetero_gpu.py --ladders-only: the largest model hetero and DeepSpeed each train"),),
        "the largest model hetero and DeepSpeed each train on this machine"),
}


def cap_of(step: Step, tiny: bool) -> float:
    return step.cap_s * (TINY_SLACK if tiny else 1)


# --- inside a step's child process ------------------------------------------------------------------
class Record:
    """What a step has found so far, in its file: rewritten whole (atomically) after every change, so a
    step stopped at its cap leaves what it had."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.data: dict = {"figures": {}, "one_gpu_steps": [], "measured_rates": {}}
        self._flush()

    def _flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def figure(self, key: str, value) -> None:
        self.data["figures"][key] = value
        self._flush()

    def headline(self, text: str) -> None:
        self.data["headline"] = text
        self._flush()

    def status(self, status: str, reason: str) -> None:
        """``not_available``, ``skipped`` or ``failed``, and why (a step that returns without one is ``ok``)."""
        if status not in STATUSES:
            raise ValueError(f"a step's status is one of {STATUSES}, not {status!r}")
        self.data.update(status=status, reason=reason)
        self._flush()

    def one_gpu_step(self, name: str, job: dict, step_s: float, peak_bytes: float | None = None,
                     host_update_s: float | None = None) -> None:
        """A measured one-GPU training step of ``job`` (a config mapping), for the predictions."""
        self.data["one_gpu_steps"].append({"name": name, "job": job, "step_s": step_s, "peak_bytes": peak_bytes,
                                           "host_update_s": host_update_s})
        self._flush()

    def measured_rate(self, key: str, value: float) -> None:
        """A machine rate measured directly (``host_link_bytes_per_s``), for ``benchmarks/calibrate.py``."""
        self.data["measured_rates"][key] = value
        self._flush()


@dataclass
class Context:
    record: Record
    tiny: bool  # --dry-run: the CPU, tiny sizes
    scratch: Path  # the part's directory for the benchmarks' own JSON
    report: Path | None  # the part's report so far (what the steps before this one found)
    profile: str | None  # --profile: the device profile to predict on (None: the GPU's)


# --- the parent: machine, versions, steps under their caps, the report -------------------------------
def _query(argv: list[str]) -> str | None:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else None


def host_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def machine(tiny: bool) -> dict:
    """The GPU (``nvidia-smi``: this process never starts CUDA, so the steps own the GPU), its memory, the
    driver, torch's CUDA and cuDNN, the host."""
    out = {"gpu": None, "gpus": 0, "gpu_memory_bytes": None, "driver": None, "cuda": None, "cudnn": None,
           "host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "host_memory_bytes": host_memory_bytes()}
    smi = shutil.which("nvidia-smi")
    line = None if tiny or smi is None else _query(
        [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"])
    if line:
        rows = [[c.strip() for c in ln.split(",")] for ln in line.splitlines()]
        out.update(gpu=rows[0][0], gpus=len(rows), gpu_memory_bytes=int(float(rows[0][1]) * 2**20), driver=rows[0][2])
    import torch

    out["cuda"] = torch.version.cuda
    if not tiny and torch.version.cuda:
        out["cudnn"] = torch.backends.cudnn.version()
    if tiny:
        out["note"] = "dry run on the CPU at tiny sizes: no GPU figures"
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """python, torch, DeepSpeed, parallel4d and its commit (``git``, else ``$PARALLEL4D_COMMIT`` for a copy of
    the tree without its ``.git``)."""
    commit = _query(["git", "-C", str(ROOT), "rev-parse", "HEAD"]) or os.environ.get("PARALLEL4D_COMMIT")
    dirty = _query(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]) if commit else None
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "parallel4d": _version("parallel4d"),
            "commit": commit, "uncommitted_changes": bool(dirty), "deepspeed": _version("deepspeed"),
            "pydantic": _version("pydantic")}


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


# what a dry run imports once, before it forks its steps (a torch import per step would take most of its time)
WARM = ("torch", "pytest", "parallel4d.engine.compose", "parallel4d.hetero", "parallel4d.planning.refit",
        "gpu_check_steps", "engine_vs_plain", "hetero_gpu", "sequence", "tensor2d", "calibrate")


class Forked:
    """A step forked from this process in a session of its own, its output into ``log``; waited for as a
    :class:`subprocess.Popen` is. The dry run's way: this process imported :data:`WARM` once and never
    touches a GPU. A GPU run starts every step as a fresh interpreter instead (no step inherits another's
    CUDA state)."""

    def __init__(self, child_argv: list[str], log: Path, env: dict):
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid, self.returncode = os.fork(), None
        if self.pid == 0:  # the child: never returns
            rc = 1
            try:
                os.setsid()
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                # Python's streams onto them too (whoever forks may have replaced sys.stdout, as pytest does)
                sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 — closed by os._exit
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                os.environ.clear()
                os.environ.update(env)
                rc = main(child_argv) or 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 — reported in the log, as an interpreter would
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if end is None else os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"step {self.pid}", timeout)
            else:
                time.sleep(0.02)
        return self.returncode


def _stop(p) -> None:
    """``p`` and every process it started (its session)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def run_step(step: Step, cap: float, scratch: Path, tiny: bool, report: Path, profile: str | None,
             env: dict, fork: bool = False) -> dict:
    """``step`` in a child of its own session (``fork``: forked from this process, else a fresh interpreter),
    stopped at ``cap`` seconds; its status, wall time and what it recorded."""
    record, log = scratch / f"{_slug(step.name)}.record.json", scratch / f"{_slug(step.name)}.log"
    record.unlink(missing_ok=True)
    child = ["--child", step.fn, "--record", str(record), "--scratch", str(scratch), "--report", str(report),
             *(["--tiny"] if tiny else []), *(["--profile", profile] if profile else []),
             *[x for a in step.args for x in ("--arg", a)]]
    print(f"--- {step.name} (cap {cap:.0f} s)", flush=True)
    t0 = time.monotonic()
    if fork:
        p = Forked(child, log, env)
    else:
        with open(log, "w") as out:
            p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *child], cwd=ROOT, env=env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = p.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        _stop(p)
        rc = None
    wall = time.monotonic() - t0
    found = json.loads(record.read_text()) if record.exists() else {}
    status = "timed_out" if rc is None else "failed" if rc else found.get("status", "ok")
    res = {"name": step.name, "fn": step.fn, "args": list(step.args), "status": status, "cap_s": round(cap, 1),
           "wall_s": round(wall, 1), "headline": found.get("headline"), "reason": found.get("reason"),
           "figures": found.get("figures", {}), "one_gpu_steps": found.get("one_gpu_steps", []),
           "measured_rates": found.get("measured_rates", {})}
    if rc is None:
        res["reason"] = f"stopped at its cap of {cap:.0f} s; the figures are what it had recorded"
    if status in ("failed", "timed_out"):
        res["output_tail"] = log.read_text(errors="replace")[-3000:]
    print(f"    {status} in {wall:.1f} s" + (f": {res['headline']}" if res["headline"] else "")
          + (f" ({res['reason'][:200]})" if res["reason"] and status != "ok" else ""), flush=True)
    return res


def run_part(part: Part, out: Path, tiny: bool, profile: str | None = None, cap_s: float | None = None,
             fork: bool | None = None) -> dict:
    """Every step of ``part``, each within its cap and all within the part's (``cap_s``: another); the report
    rewritten at ``out`` after each step (a step reads what the steps before it found). ``fork`` (default: the
    dry run's way) forks the steps from this process (:class:`Forked`)."""
    fork = tiny if fork is None else fork
    t0, started = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    total = cap_s if cap_s is not None else part.cap_s * (TINY_SLACK if tiny else 1)
    scratch = RUNS / (("dry_run_" if tiny else "") + part.name)
    scratch.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, even on a GPU machine
        for name in WARM if fork else ():
            importlib.import_module(name)
    report = {"schema": SCHEMA, "part": part.name, "dry_run": tiny, "started": started, "cap_s": total,
              "machine": machine(tiny), "versions": versions(), "steps": []}
    _write(out, report)
    for step in part.steps:
        left = total - (time.monotonic() - t0)
        cap = min(cap_of(step, tiny), left)
        if cap < MIN_STEP_S:
            report["steps"].append({"name": step.name, "fn": step.fn, "status": "not_run", "cap_s": 0, "wall_s": 0,
                                    "reason": f"the part's cap of {total:.0f} s was spent", "figures": {},
                                    "one_gpu_steps": [], "measured_rates": {}})
            print(f"--- {step.name}: not run (the part's {total:.0f} s are spent)", flush=True)
        else:
            report["steps"].append(run_step(step, cap, scratch, tiny, out, profile, env, fork))
        _write(out, report)
    pred = next((s for s in report["steps"] if s["fn"] == PREDICTIONS.fn), None)
    if pred is not None:
        report["predictions"] = {k: pred["figures"].get(k) for k in ("profile", "tolerance", "note", "rows")}
    report["wall_s"] = round(time.monotonic() - t0, 1)
    _write(out, report)
    return report


# --- printing -------------------------------------------------------------------------------------
def _s(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _gb(x: float | None) -> str:
    return "—" if not x else f"{x / 1e9:.1f} GB"


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def summary(report: dict) -> list[str]:
    """The steps' table, then the predictions beside the measures."""
    m, v = report["machine"], report["versions"]
    lines = [f"gpu-check {report['part']}{' (dry run on the CPU)' if report['dry_run'] else ''} on "
             f"{m['gpu'] or m['cpu']} (driver {m['driver']}, CUDA {m['cuda']}, torch {v['torch']}, commit "
             f"{(v['commit'] or '?')[:10]}): {report['wall_s']:.0f} s of {report['cap_s']:.0f}",
             f"  {'step':<38}{'status':<15}{'wall':>8}{'cap':>7}  headline"]
    for s in report["steps"]:
        lines.append(f"  {s['name']:<38}{s['status']:<15}{s['wall_s']:>7.0f}s{s['cap_s']:>6.0f}s  "
                     + (s.get("headline") or s.get("reason") or "")[:120])
    pred = report.get("predictions")
    if pred and pred.get("rows"):
        lines.append(f"predicted on {pred['profile']} (parallel4d plan --device {pred['profile']}) beside measured; "
                     f"ratio = measured / predicted, * off by more than {pred['tolerance']:.0%}")
        lines.append(f"  {'one-GPU step':<44}{'measured':>10}{'predicted':>11}{'ratio':>9}"
                     f"{'peak mem':>11}{'predicted':>11}{'ratio':>9}")
        for r in pred["rows"]:
            star = lambda k: "*" if k in r["flagged"] else " "  # noqa: E731
            lines.append(f"  {r['name'][:43]:<44}{_s(r['measured_step_s']):>10}{_s(r['predicted_step_s']):>11}"
                         f"{_r(r['step_ratio']):>8}{star('step')}{_gb(r['measured_peak_bytes']):>11}"
                         f"{_gb(r['predicted_peak_bytes']):>11}{_r(r['memory_ratio']):>8}{star('memory')}")
        if pred.get("note"):
            lines.append(f"  ({pred['note']})")
    return lines


def print_plan(part: Part, why: str) -> None:
    print(f"gpu-check: {why}; it would run, with the working tree on PYTHONPATH and nothing installed:")
    print(f"part {part.name} ({part.what}): ≈{sum(s.estimate_s for s in part.steps) / 60:.1f} min on one H100 "
          f"(a guess until a GPU runs it), at most {part.cap_s / 60:.2f} min")
    for s in part.steps:
        print(f"  {s.name} (≈{s.estimate_s}s, at most {s.cap_s}s): {s.what}")
    print(f"  → {output_path(part.name, False).relative_to(ROOT)}")


# --- entry points -----------------------------------------------------------------------------------
def has_gpu() -> bool:
    """Whether torch sees a CUDA GPU, asked through NVML (no CUDA context here: the steps own the GPU)."""
    try:
        import torch
    except ImportError:
        return False
    before = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if before is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = before


def missing_modules() -> list[str]:
    """What every step needs that this interpreter cannot import (nothing is installed here: carry it). Imported,
    not only found: a carried wheel built for another Python or platform fails here, not in a step."""
    missing = []
    for m in REQUIRED:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 — an ABI mismatch raises ImportError's kin or worse
            missing.append(f"{m} ({type(e).__name__}: {str(e)[:120]})")
    return missing


def output_path(part: str, tiny: bool) -> Path:
    if tiny:
        return RUNS / "dry_run" / "gpu_check.json"
    return RESULTS / ("gpu_check.json" if part == "default" else f"gpu_check_{part}.json")


def child_main(args) -> int:
    module, function = args.child.split(":")
    ctx = Context(Record(Path(args.record)), args.tiny, Path(args.scratch), Path(args.report) if args.report else None,
                  args.profile)
    getattr(importlib.import_module(module), function)(ctx, *args.arg)
    return 1 if ctx.record.data.get("status") == "failed" else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=list(PARTS), default="default")
    ap.add_argument("--dry-run", action="store_true", help="the whole orchestration on the CPU at tiny sizes")
    ap.add_argument("--plan", action="store_true", help="print what would run, run nothing")
    ap.add_argument("--profile", default=None, help="the device profile to predict on (default: the GPU's)")
    ap.add_argument("--out", default=None, help="the report (default benchmarks/results/gpu_check[_PART].json)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--report", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arg", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args)
    part = PARTS[args.part]
    if args.plan or (not args.dry_run and not has_gpu()):
        print_plan(part, "plan only" if args.plan else "no CUDA GPU visible to this Python")
        return 0
    missing = missing_modules()
    if missing:
        print(f"gpu-check: this Python ({sys.executable}) cannot import {'; '.join(missing)}. Nothing is installed "
              "here: carry the wheels (docs/benchmarks.md, 'What the GPU machine lacks') or name another "
              "interpreter (GPU_PYTHON=…)")
        return 2
    out = Path(args.out) if args.out else output_path(part.name, args.dry_run)
    report = run_part(part, out, args.dry_run, args.profile)
    print("\n".join(summary(report)))
    print(f"wrote {out}")
    return 1 if any(s["status"] in ("failed", "timed_out") for s in report["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
