"""The steps of ``make gpu-check`` (``benchmarks/gpu_check.py``): each runs in a child process of its own and
records what it finds as it goes (``gpu_check.Record``), so a step stopped at its cap leaves what it had.

Default part, most telling first: (a) :func:`gpu_tests`, (b) :func:`engine_vs_plain_1b`, (c)
:func:`hetero_side_by_side`, (d) :func:`ring_8_ranks`, (e) :func:`tensor2d_block`, then :func:`predictions`.
Named parts: :func:`launch`, :func:`sequence_sweep`, :func:`hetero_full`, :func:`ladders`. Each takes the
``gpu_check.Context``; ``ctx.tiny`` (``--dry-run``) runs it on the CPU at tiny sizes. The benchmarks are called
through their own ``main(argv)`` (or their child runs, for ``hetero_gpu.py``), never copied here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_check import RESULTS, ROOT, Context

ONE_GPU = ["parallel.pp=1", "parallel.dp=1", "parallel.sp=1", "parallel.tp=1", "train.device=cuda"]


def _benchmark(name: str):
    """A benchmark script of this directory, imported (this directory is on ``sys.path``: the child runs
    this file)."""
    return importlib.import_module(name)


def gpu_test_files() -> list[str]:
    """The test files holding a ``@pytest.mark.gpu`` test (collecting only those: another file may need an
    extra the GPU machine lacks)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "@pytest.mark.gpu" in p.read_text())


class _Counts:
    """A pytest plugin: the session's outcomes, counted."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def pytest_terminal_summary(self, terminalreporter):
        for key in ("passed", "failed", "error", "skipped", "deselected", "xfailed", "xpassed"):
            if terminalreporter.stats.get(key):
                self.counts[key] = len(terminalreporter.stats[key])


def gpu_tests(ctx: Context) -> None:
    """(a) ``pytest -m gpu`` in this process (dry run: the first such file only; its GPU tests skip on the CPU)."""
    import pytest

    files = gpu_test_files()[:1] if ctx.tiny else gpu_test_files()
    argv = ["-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    ctx.record.figure("command", "pytest " + " ".join(argv))
    counts = _Counts()
    rc = int(pytest.main(argv, plugins=[counts]))
    ctx.record.figure("tests", counts.counts)
    ctx.record.headline(", ".join(f"{n} {k}" for k, n in counts.counts.items() if k != "deselected") or "no tests")
    if rc != 0:
        ctx.record.status("failed", f"pytest exited {rc}: {counts.counts}")


ENGINE_GPU_ARGV = ["--rounds", "4", "--steps", "4"]  # the Llama-3.2-1B shape at its default batch
ENGINE_TINY_ARGV = ["--quick", "--cpu", "--rounds", "1", "--steps", "1"]


def engine_vs_plain_1b(ctx: Context) -> None:
    """(b) ``benchmarks/engine_vs_plain.py`` as it is (its ``main``), then its figures and both steps."""
    _engine_vs_plain(ctx, compiled=False)


def engine_vs_plain_compiled(ctx: Context) -> None:
    """The same with ``train.compile: blocks`` and the plain loop's blocks compiled (``--compile``)."""
    _engine_vs_plain(ctx, compiled=True)


def _engine_vs_plain(ctx: Context, compiled: bool) -> None:
    out = ctx.scratch / "engine_vs_plain.json"
    out.unlink(missing_ok=True)
    argv = [*(ENGINE_TINY_ARGV if ctx.tiny else ENGINE_GPU_ARGV), *(["--compile"] if compiled else []), "--out", str(out)]
    _benchmark("engine_vs_plain").main(argv)
    res = json.loads(out.read_text())
    r, job, model = res["results"], res["config"], res["config"]["model"]
    ctx.record.figure("device", res["device"])
    ctx.record.figure("model", {k: model.get(k) for k in ("arch", "hidden", "layers", "heads", "kv_heads",
                                                         "intermediate_size", "vocab_size", "seq_len")}
                      | {"batch": job["data"]["batch_size"], "batch_searched": res.get("batch_searched"),
                         "dtype": job["train"]["dtype"], "compile": job["train"]["compile"]})
    for mode in ("plain", "engine"):
        m = r[mode]
        ctx.record.figure(mode, {k: m.get(k) for k in ("step_s", "tokens_per_s", "mfu", "peak_memory_bytes",
                                                       "resident_bytes")})
        # one mode's own peak: what it keeps between steps and its steps' rise over that (both share the GPU)
        ctx.record.one_gpu_step(f"{mode} loop{' compiled' if compiled else ''}, {model['arch']} h{model['hidden']} "
                                f"L{model['layers']}", job, m["step_s"], m.get("peak_memory_bytes"))
    for key in ("ratio_engine_over_plain", "memory_engine_over_plain", "targets", "first_loss"):
        ctx.record.figure(key, r.get(key, res.get(key)))
    mfu, t = r["engine"].get("mfu"), r["targets"]
    ctx.record.headline(f"engine / plain {r['ratio_engine_over_plain']:.3f}× (target ≥ {t['ratio_at_least']}), memory "
                        f"{r['memory_engine_over_plain']:.3f}× (≤ {t['memory_at_most']}), engine "
                        f"{r['engine']['step_s']:.3f} s/step" + (f", MFU {mfu:.1%}" if mfu else ""))


HETERO_KEYS = ("step_s_median", "TFLOPs", "tokens_per_s", "peak_gpu_alloc_GB", "host_rss_bytes_per_param",
               "optimizer_rows_on_device", "optimizer_rows_on_host", "host_update_seconds_per_step", "copy_GBps",
               "device_budget_bytes", "skipped", "failed")


def _hetero_in_process(spec, args) -> dict:
    """A run of ``hetero_gpu.py`` in this process on the CPU (the dry run: no child of its own)."""
    import torch

    hg = _benchmark("hetero_gpu")
    from parallel4d.config.load import make_config

    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    try:
        return hg.RUNS[spec.run](make_config(spec.job), torch.device("cpu"), spec)
    except Exception as e:  # as hetero_gpu's child reports it
        return {"failed": f"{type(e).__name__}: {str(e)[:600]}"}


def _targets_line(targets: list[dict]) -> str:
    """Issue #46's ratios in one line ("—": not measured)."""
    return "; ".join(f"{t['name']} " + ("—" if t["value"] is None else f"{t['value']:.2f}") for t in targets)


def _deepspeed_skipped(tiny: bool) -> str | None:
    """Why the DeepSpeed run is skipped (None: it runs)."""
    import importlib.util

    if tiny:
        return "dry run: DeepSpeed is measured on a GPU only"
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not importable: carry its wheel (docs/benchmarks.md, 'What the GPU machine lacks')"
    return None


def hetero_side_by_side(ctx: Context) -> None:
    """(c) hetero's side by side, short: each run a fresh child of ``hetero_gpu.py`` as that script makes them
    (in this process on the CPU for the dry run), one warm-up and three timed steps; no ladders. The targets
    are recorded after every run (DeepSpeed last: its CPU-Adam build on first use may take the rest of the cap)."""
    from parallel4d.config.load import make_config
    from parallel4d.models.gpt2.model import shape_from_config

    hg = _benchmark("hetero_gpu")
    args = hg.parse_args(["--dry-run"] if ctx.tiny else ["--warmup", "1", "--iters", "3", "--child-timeout", "60"])
    run = (lambda spec: _hetero_in_process(spec, args)) if ctx.tiny else (lambda spec: hg.in_child(spec, args))
    main_job = hg.job(args, args.hidden, args.layers, args.heads)
    n_params = hg.param_count(shape_from_config(make_config(main_job).model))
    res = {"dry_run": ctx.tiny, "params": n_params}
    ctx.record.figure("model", {"params": n_params, "hidden": args.hidden, "layers": args.layers, "seq": args.seq,
                                "batch": args.batch, "vocab": args.vocab})
    if not ctx.tiny:
        bw = run(hg.Spec("bandwidth", main_job))
        ctx.record.figure("pinned_bandwidth", bw)
        if "h2d_GBps" in bw:
            ctx.record.measured_rate("host_link_bytes_per_s", min(bw["h2d_GBps"], bw["d2h_GBps"]) * hg.GB)

    def attempt(name: str, run_kind: str, job: dict, planned: dict | None) -> dict:
        """One run; ``planned``: the job the planner predicts for it (None: not parallel4d's, DeepSpeed)."""
        res[name] = out = run(hg.Spec(run_kind, job, args.warmup, args.iters, args.dry_run))
        ctx.record.figure(name, {k: v for k, v in out.items() if k in HETERO_KEYS})
        if planned is not None and "step_s_median" in out:
            peak = out.get("peak_gpu_alloc_GB")
            ctx.record.one_gpu_step(f"hetero_gpu {name}, GPT {n_params / 1e9:.2f}B", planned, out["step_s_median"],
                                    None if peak is None else peak * hg.GB, out.get("host_update_seconds_per_step"))
        ctx.record.figure("targets", hg.targets(res))
        return out

    attempt("plain", "plain", main_job, {**main_job, "hetero": {"enabled": False}})  # run_plain: no hetero
    resident = attempt("hetero_resident", "hetero", main_job, main_job)
    half_job = hg.job(args, args.hidden, args.layers, args.heads, hg.half_budget(args, resident, n_params)[0])
    attempt("hetero_half", "hetero", half_job, half_job)
    why = _deepspeed_skipped(ctx.tiny)
    if why is None:
        attempt("deepspeed_zero3_offload", "deepspeed", main_job, None)
    else:
        res["deepspeed_zero3_offload"] = {"skipped": why}
        ctx.record.figure("deepspeed_zero3_offload", res["deepspeed_zero3_offload"])
        ctx.record.figure("targets", hg.targets(res))
    ctx.record.headline(_targets_line(hg.targets(res)))


# The ring at 8 ranks (issue #47, point 2): benchmarks/sequence.py's --ring-check at N = 8 (s = 16k and 32k causal,
# cuDNN blocks, the targets beside; N = 4 is in PART=sweeps; --quick on the CPU: the same path at tiny sizes).
def ring_at_8(tiny: bool, out: Path) -> dict:
    """The ring's blocks at 8 (and 4) ranks against one fused call: ``sequence.py``'s result."""
    tiny_argv = ["--quick", "--seq", "64", "--heads", "2", "--dim", "16", "--blocks", "cpu_flash"]
    return _benchmark("sequence").main(["--ring-check", "--ring", "8", *(tiny_argv if tiny else []), "--out", str(out)])


RING_KEYS = ("seq", "causal", "ring", "ulysses", "blocks", "merge", "mono_backend", "mono_fwd_bwd_ms",
             "ring_fwd_bwd_ms", "ratio_fwd_bwd", "out_rel_err_vs_mono")


def _ring_line(rows: list[dict]) -> str:
    """The best ratio of the rows at 8 ranks (any, where none is), causal where there is one."""
    at8 = [r for r in rows if r["ring"] == 8 and r["causal"]] or rows
    best = min(at8, key=lambda r: r["ratio_fwd_bwd"], default=None)
    return "no row" if best is None else (f"{best['ratio_fwd_bwd']:.2f}× one {best['mono_backend']} call at "
                                          f"N = {best['ring']}, U = {best['ulysses']}, s = {best['seq']}"
                                          f"{' causal' if best['causal'] else ''} (target ≤ 1.25 at N = 8, 32k)")


def ring_8_ranks(ctx: Context) -> None:
    """(d) the ring at 8 ranks."""
    res = ring_at_8(ctx.tiny, ctx.scratch / "sequence.json")
    rows = [{k: r.get(k) for k in RING_KEYS} for r in res["rows"]]
    ctx.record.figure("device", res["device"])
    ctx.record.figure("rows", rows)
    ctx.record.headline(_ring_line(rows))


def tensor2d_at_8b(tiny: bool, out: Path) -> dict:
    """The 2D block on one GPU (issue #47, point 3): ``tensor2d.gpu_block`` (per q: block and dense seconds,
    efficiency per FLOP)."""
    return _benchmark("tensor2d").gpu_block(tiny=tiny, out=str(out))


def tensor2d_block(ctx: Context) -> None:
    """(e) the 2D block: its figures."""
    figures = tensor2d_at_8b(ctx.tiny, ctx.scratch / "tensor2d_gpu.json")
    ctx.record.figure("block", figures)
    ctx.record.headline(str(figures.get("headline", "measured")))


def moe_layer(ctx: Context) -> None:
    """(f) issue #48's figure: a Qwen3-30B-A3B-shaped MoE layer, grouped experts against the loop."""
    res = _benchmark("moe_layer").gpu_moe(tiny=ctx.tiny, out=str(ctx.scratch / "moe_layer.json"))
    ctx.record.figure("moe_layer", {k: res[k] for k in ("shape", "tokens", "dtype", "grouped_usable", "results")})
    ctx.record.headline(res["headline"])


def lora(ctx: Context) -> None:
    """Issue #49's figure: LoRA against full fine-tuning of the Llama-3.2-1B shape, plain and under hetero."""
    res = _benchmark("lora").gpu_lora(tiny=ctx.tiny, out=str(ctx.scratch / "lora.json"))
    ctx.record.figure("lora", {k: res[k] for k in ("config", "lora", "steps", "runs", "lora_over_full_tokens_per_s")})
    ctx.record.headline(res["headline"])


def fp8_block(ctx: Context) -> None:
    """Issue #50's block figure: the 8B-shaped block in FP8 against bf16, dense and as 2D blocks."""
    res = _benchmark("fp8").gpu_fp8_block(tiny=ctx.tiny, out=str(ctx.scratch / "fp8_block.json"))
    ctx.record.figure("block", res["block"])
    ctx.record.headline(res["headline"])


def fp8_engine(ctx: Context) -> None:
    """Issue #50's launch figure: the engine's 1B model in FP8 against bf16 (tokens/s, MFU in both peaks)."""
    res = _benchmark("fp8").gpu_fp8_engine(tiny=ctx.tiny, out=str(ctx.scratch / "fp8_engine.json"))
    ctx.record.figure("engine", res["engine"])
    ctx.record.headline(res["headline"])  # no one_gpu_step: the planner's matmul rate is bf16's, not FP8's


def predictions(ctx: Context) -> None:
    """The planner's step and memory (``parallel4d plan --device``) beside each one-GPU step measured so far."""
    calibrate = _benchmark("calibrate")
    from parallel4d.planning import profiles
    from parallel4d.planning.refit import TOLERANCE, side_by_side

    report = json.loads(ctx.report.read_text())
    gpu = report["machine"].get("gpu")
    name = ctx.profile or calibrate.profile_for(gpu) or "h100"
    profile = profiles.load(name)
    ctx.record.figure("profile", name)
    ctx.record.figure("tolerance", TOLERANCE)
    if not ctx.profile and calibrate.profile_for(gpu) is None:
        dry = " (dry run: CPU steps against a GPU's profile, every row off)" if ctx.tiny else ""
        ctx.record.figure("note", f"no shipped profile for {gpu or 'this machine'}: h100's{dry}")
    rows = []
    for step in calibrate.measured_steps(report):
        rows.append(side_by_side(step, profile))
        ctx.record.figure("rows", rows)
    flagged = sum(bool(r["flagged"]) for r in rows)
    ctx.record.headline(f"{len(rows)} steps on {profile.name}, {flagged} off by more than {TOLERANCE:.0%}")


# --- named parts' steps -----------------------------------------------------------------------------
def _run(ctx: Context, argv: list[str]) -> subprocess.CompletedProcess:
    ctx.record.figure("command", " ".join(argv[1:]))
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        ctx.record.status("failed", f"exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")
    return p


def launch(ctx: Context, config: str) -> None:
    """``parallel4d launch config`` on one GPU (dry run: two steps on the CPU), a fresh run; its summary."""
    out_dir = ctx.scratch / Path(config).stem
    shutil.rmtree(out_dir, ignore_errors=True)
    sets = [*ONE_GPU[:-1], "train.device=cpu" if ctx.tiny else ONE_GPU[-1], f"train.out_dir={out_dir}",
            *(["train.steps=2"] if ctx.tiny else [])]
    if _run(ctx, [sys.executable, "-m", "parallel4d", "launch", config, *[a for s in sets for a in ("--set", s)]]
            ).returncode:
        return
    s = json.loads((out_dir / "summary.json").read_text())
    for k in ("device", "steps", "tokens_per_second", "model_flops_per_second", "seconds", "parameters"):
        ctx.record.figure(k, s.get(k))
    ctx.record.figure("losses", [s["losses"][0], s["losses"][-1]])
    ctx.record.headline(f"{s['steps']} steps, loss {s['losses'][0]:.2f} → {s['losses'][-1]:.2f}, "
                        f"{s['tokens_per_second']:,.0f} tokens/s")


def sequence_sweep(ctx: Context) -> None:
    out = (ctx.scratch if ctx.tiny else RESULTS) / "gpu_sequence.json"
    argv = ["--quick"] if ctx.tiny else ["--ulysses", "1", "2", "8", "--blocks", "cudnn", "--compile-merge"]
    res = _benchmark("sequence").main([*argv, "--out", str(out)])
    ctx.record.figure("json", str(out))
    rows = [{k: r.get(k) for k in RING_KEYS} for r in res["rows"]]
    ctx.record.figure("rows", rows)
    ctx.record.headline(f"{len(rows)} rows; " + _ring_line(rows))


def _hetero_figures(ctx: Context, path: Path) -> None:
    """``hetero_gpu.py``'s JSON: each run's figures and step, the ladders, the targets."""
    res = json.loads(path.read_text())
    ctx.record.figure("json", str(path))
    args = argparse.Namespace(**res["config"])
    hg = _benchmark("hetero_gpu")
    for name in ("plain", "hetero_resident", "hetero_half", "deepspeed_zero3_offload"):
        if name in res:
            ctx.record.figure(name, {k: v for k, v in res[name].items() if k in HETERO_KEYS})
        if name.startswith("hetero") and "step_s_median" in res.get(name, {}):
            r = res[name]
            budget = r.get("device_budget_bytes") if name == "hetero_half" else None  # resident: none set
            job = hg.job(args, args.hidden, args.layers, args.heads, budget)
            ctx.record.one_gpu_step(f"hetero_gpu {name}", job, r["step_s_median"], r.get("peak_gpu_alloc_GB", 0) * hg.GB
                                    or None, r.get("host_update_seconds_per_step"))
    if "step_s_median" in res.get("plain", {}):
        job = {**hg.job(args, args.hidden, args.layers, args.heads), "hetero": {"enabled": False}}
        ctx.record.one_gpu_step("hetero_gpu plain", job, res["plain"]["step_s_median"],
                                res["plain"].get("peak_gpu_alloc_GB", 0) * hg.GB or None)
    bw = res.get("pinned_bandwidth", {})
    if "h2d_GBps" in bw:
        ctx.record.measured_rate("host_link_bytes_per_s", min(bw["h2d_GBps"], bw["d2h_GBps"]) * hg.GB)
    if "ladders" in res:
        ctx.record.figure("ladders", {side: {k: v for k, v in lad.items() if k.startswith("largest") or k == "skipped"}
                                      for side, lad in res["ladders"].items() if isinstance(lad, dict)})
    ctx.record.figure("targets", res.get("targets"))
    ctx.record.headline(_targets_line(res.get("targets") or []))


def hetero_full(ctx: Context) -> None:
    out = (ctx.scratch if ctx.tiny else RESULTS) / "gpu_hetero.json"
    argv = ["--dry-run", "--skip-deepspeed"] if ctx.tiny else []
    if not _run(ctx, [sys.executable, "benchmarks/hetero_gpu.py", *argv, "--out", str(out)]).returncode:
        _hetero_figures(ctx, out)


def ladders(ctx: Context) -> None:
    out = (ctx.scratch if ctx.tiny else RESULTS) / "gpu_hetero_ladders.json"
    argv = ["--dry-run", "--skip-deepspeed"] if ctx.tiny else ["--child-timeout", "400"]
    if not _run(ctx, [sys.executable, "benchmarks/hetero_gpu.py", "--ladders-only", *argv, "--out", str(out)]
                ).returncode:
        _hetero_figures(ctx, out)
