"""``make gpu-check``: everything a GPU can tell us, on a machine where torch (with CUDA) is installed.

Never installs or reinstalls anything: it runs with the interpreter it is given (``GPU_PYTHON``) and the
working tree on ``PYTHONPATH``. In two parts, each within 10 minutes on one H100 (``--part 1``, ``--part 2``;
``all``: both, within 20):

1. the GPU-marked tests (``pytest -m gpu`` over the test files that hold one), then one-GPU launches of
   ``configs/quickstart.yaml``, ``llama.yaml``, ``hetero.yaml`` and ``sequence.yaml`` (every parallel size set
   to 1, ``train.device=cuda``, runs under ``runs/gpu_check/``);
2. ``benchmarks/sequence.py`` (ring, hybrid and Ulysses blocks against one SDPA call, s = 16k and 32k) and
   ``benchmarks/hetero_gpu.py`` (1.4B GPT side by side: plain, hetero resident and with half the model data
   on the device, DeepSpeed ZeRO-3 offload — reported as skipped where DeepSpeed is not installed — and
   the ratios issue #46 sets targets for).

``--part ladders`` (not in ``all``: it takes most of a part's time alone): ``benchmarks/hetero_gpu.py
--ladders-only``, the largest model hetero and DeepSpeed each train on this machine (sizes ``parallel4d
plan`` refuses are not tried).

Each part writes ``benchmarks/results/gpu_check_<part>.json``: the machine (GPU, driver, torch, CUDA, cuDNN),
and per step its command, exit status, seconds and figures (test counts; a launch's losses, tokens/s and
device; the benchmarks' own figures, whose full JSON is ``gpu_sequence.json`` / ``gpu_hetero.json`` /
``gpu_hetero_ladders.json``). A step past its budget is stopped with every process it started.
Without a GPU it prints what it would run and exits 0.

Usage: ``python benchmarks/gpu_check.py [--part 1|2|all|ladders] [--dry-run]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "runs" / "gpu_check"
ONE_GPU = ["parallel.pp=1", "parallel.dp=1", "parallel.sp=1", "parallel.tp=1", "train.device=cuda"]
PART_BUDGET_S = 600


@dataclass
class Step:
    """One command of a part: ``budget_s`` bounds it (a step past it is stopped and reported);
    ``estimate_s``: what it takes on one H100; ``figures(output)`` → what goes into the JSON."""

    name: str
    argv: list[str]
    budget_s: int
    estimate_s: int
    figures: object = None  # Callable[[str], dict] | None
    before: list[Path] = field(default_factory=list)  # directories removed first (a fresh run)


def gpu_test_files() -> list[str]:
    """The test files holding a ``@pytest.mark.gpu`` test (collecting only those: another file may need
    an extra the GPU machine lacks)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "@pytest.mark.gpu" in p.read_text())


def pytest_figures(output: str) -> dict:
    """``{"passed": n, "failed": n, "skipped": n, …}`` from pytest's last summary line."""
    line = next((ln for ln in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed|error)", ln)), "")
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", line)}


def launch_figures(out_dir: Path):
    def read(_output: str) -> dict:
        path = out_dir / "summary.json"
        if not path.exists():
            return {"summary": f"{path} was not written"}
        s = json.loads(path.read_text())
        last_val = s["validation"][-1]["loss"] if s.get("validation") else None
        return {"device": s["device"], "steps": s["steps"], "first_loss": s["losses"][0], "last_loss": s["losses"][-1],
                "last_validation_loss": last_val, "tokens_per_second": s["tokens_per_second"],
                "model_flops_per_second": s.get("model_flops_per_second"), "seconds": s["seconds"],
                "parameters": s["parameters"], "torch": s["torch"]}
    return read


def launch_step(config: str, budget_s: int, estimate_s: int) -> Step:
    """``parallel4d launch config`` on one GPU, a fresh run in ``runs/gpu_check/<name>``."""
    name = Path(config).stem
    out_dir = RUNS / name
    sets = [*ONE_GPU, f"train.out_dir={out_dir}"]
    argv = [sys.executable, "-m", "parallel4d", "launch", config] + [a for s in sets for a in ("--set", s)]
    return Step(f"launch {name} on one GPU", argv, budget_s, estimate_s, launch_figures(out_dir), [out_dir])


def sequence_figures(_output: str) -> dict:
    path = RESULTS / "gpu_sequence.json"
    if not path.exists():
        return {"json": f"{path} was not written"}
    rows = json.loads(path.read_text())["rows"]
    keys = ("seq", "causal", "ring", "ulysses", "blocks", "merge", "mono_backend", "mono_fwd_bwd_ms",
            "ring_fwd_bwd_ms", "ratio_fwd_bwd")
    return {"json": str(path.relative_to(ROOT)), "rows": [{k: r.get(k) for k in keys} for r in rows]}


def hetero_figures(name: str):
    """The figures of ``benchmarks/hetero_gpu.py``'s JSON ``name``: each run's, the ladders' and the targets."""
    def read(_output: str) -> dict:
        path = RESULTS / name
        if not path.exists():
            return {"json": f"{path} was not written"}
        res = json.loads(path.read_text())
        keys = ("step_s_median", "TFLOPs", "tokens_per_s", "peak_gpu_alloc_GB", "host_rss_bytes_per_param",
                "optimizer_rows_on_device", "optimizer_rows_on_host", "host_update_seconds_per_step", "copy_GBps",
                "skipped", "failed")
        runs = {run: {k: v for k, v in res[run].items() if k in keys}
                for run in ("plain", "hetero_resident", "hetero_half", "deepspeed_zero3_offload") if run in res}
        ladders = {side: {k: v for k, v in lad.items() if k.startswith("largest") or k == "skipped"}
                   for side, lad in res.get("ladders", {}).items() if isinstance(lad, dict)}
        return {"json": str(path.relative_to(ROOT)), "params": res.get("params"),
                "pinned_bandwidth": res.get("pinned_bandwidth"), **runs, **({"ladders": ladders} if ladders else {}),
                "targets": res.get("targets")}
    return read


def parts() -> dict[str, list[Step]]:
    """The steps of each part; the budgets of a part add up to under 10 minutes."""
    py = sys.executable
    return {
        "1": [Step("GPU-marked tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                        *gpu_test_files()], 240, 90, pytest_figures),
              launch_step("configs/quickstart.yaml", 120, 45),
              launch_step("configs/llama.yaml", 70, 20),
              launch_step("configs/hetero.yaml", 70, 25),
              launch_step("configs/sequence.yaml", 70, 20)],
        # cuDNN blocks only (flash's were ~2× slower in every case of the first GPU run), with the merge
        # eager and compiled (the ring's remaining overhead at 8 ranks: #31.4)
        "2": [Step("benchmarks/sequence.py", [py, "benchmarks/sequence.py", "--ulysses", "1", "2", "8",
                                              "--blocks", "cudnn", "--compile-merge",
                                              "--out", str(RESULTS / "gpu_sequence.json")],
                   240, 120, sequence_figures),
              # hetero_gpu.py's estimate is a guess until a GPU runs it: five child processes since issue #46
              # (bandwidth, plain, resident, half, DeepSpeed with its CPUAdam built on first use)
              Step("benchmarks/hetero_gpu.py", [py, "benchmarks/hetero_gpu.py",
                                                "--out", str(RESULTS / "gpu_hetero.json")], 350, 240,
                   hetero_figures("gpu_hetero.json"))],
    }


def optional_parts() -> dict[str, list[Step]]:
    """Parts run only when named (not in ``all``): the largest-model ladders, within one part's time (the
    estimate a guess until a GPU runs it: a few plans, then one size of each side trained, if the plan's largest
    trains)."""
    py = sys.executable
    return {"ladders": [Step("benchmarks/hetero_gpu.py --ladders-only",
                             [py, "benchmarks/hetero_gpu.py", "--ladders-only", "--child-timeout", "420",
                              "--out", str(RESULTS / "gpu_hetero_ladders.json")], 590, 420,
                             hetero_figures("gpu_hetero_ladders.json"))]}


def machine() -> dict:
    """The GPU, its driver, torch, CUDA and cuDNN (asked once the part's steps are done: this process
    holds no CUDA context while they run)."""
    import platform

    import torch

    smi = shutil.which("nvidia-smi")
    driver = None
    if smi:
        q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        driver = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    return {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "driver": driver,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "python": platform.python_version()}


def run_step(step: Step) -> dict:
    for d in step.before:
        shutil.rmtree(d, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"--- {step.name} (budget {step.budget_s}s): {' '.join(step.argv)}", flush=True)
    t0 = time.monotonic()
    # its own session, so that a step past its budget is stopped with every process it started (a benchmark's
    # children hold the GPU and host memory)
    p = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=step.budget_s)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = "timeout"
    output = (out or "") + (err or "")
    wall = time.monotonic() - t0
    figures = step.figures(output) if step.figures and rc == 0 else {}
    print(f"    {'ok' if rc == 0 else 'FAILED'} ({rc}) in {wall:.0f}s {json.dumps(figures)[:300]}", flush=True)
    result = {"name": step.name, "argv": step.argv, "rc": rc, "seconds": round(wall, 1), "figures": figures}
    if rc != 0:
        result["output_tail"] = output[-4000:]
        print(output[-2000:], flush=True)
    return result


def has_gpu() -> bool:
    """Whether torch sees a CUDA GPU, asked through NVML (CUDA is not started here; the steps' own
    processes do not inherit the setting, so they start CUDA as a user's run does)."""
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
    """What the steps import that this interpreter lacks (nothing is installed here: carry them)."""
    import importlib.util

    return [m for m in ("torch", "pydantic", "yaml", "tqdm", "pytest") if importlib.util.find_spec(m) is None]


def print_plan(chosen: dict[str, list[Step]], why: str) -> None:
    print(f"gpu-check: {why}; it would run, with the working tree on PYTHONPATH and nothing installed:")
    for part, steps in chosen.items():
        total = sum(s.estimate_s for s in steps)
        print(f"part {part} (≈{total / 60:.0f} min on one H100, at most {sum(s.budget_s for s in steps) / 60:.1f}):")
        for s in steps:
            print(f"  {s.name} (≈{s.estimate_s}s, at most {s.budget_s}s): {' '.join(s.argv)}")
        print(f"  → benchmarks/results/gpu_check_{part}.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["1", "2", "all", "ladders"], default="all")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    args = ap.parse_args(argv)
    every = {**parts(), **optional_parts()}
    chosen = parts() if args.part == "all" else {args.part: every[args.part]}
    if args.dry_run or not has_gpu():
        print_plan(chosen, "dry run" if args.dry_run else "no CUDA GPU visible to this Python")
        return 0
    missing = missing_modules()
    if missing:
        print(f"gpu-check: this Python ({sys.executable}) lacks {', '.join(missing)}; nothing is installed "
              "here: carry the wheels (pip install --no-deps) or name another interpreter (GPU_PYTHON=…)")
        return 2
    failed = 0
    for part, steps in chosen.items():
        results = [run_step(s) for s in steps]
        failed += sum(r["rc"] != 0 for r in results)
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"gpu_check_{part}.json"
        out.write_text(json.dumps({"part": part, "machine": machine(), "steps": results}, indent=1, default=str))
        print(f"wrote {out.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
