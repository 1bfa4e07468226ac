"""Heterogeneous memory on one GPU, side by side in one run: plain PyTorch, hetero resident, hetero with
half the model data on the device, DeepSpeed ZeRO-3 with CPU offload; optionally both largest-model ladders.

The default run (``make gpu-check PART=sweeps``; ``make gpu-check`` runs a short form of it), a GPT of 1.42B
parameters (h2048, L24, 16 heads, vocab 50304, seq 1024, untied head), micro-batch 8, bf16:

* ``plain``: PyTorch alone, float32 parameters on the GPU, bf16 autocast, ``AdamW(fused=True)``;
* ``hetero_resident``: ``parallel4d.hetero`` without a device budget: bf16 chunks (parameters and
  gradients) and every row's float32 master with both Adam moments on the GPU, stepped there;
* ``hetero_half``: a static device budget of half the *model data* — everything hetero keeps per
  parameter for training: the bf16 chunks (4 B) and the float32 master and moments (12 B), 16 B per
  parameter (the resident run's ``model_data_bytes`` plus its optimizer bytes). The compute chunks take
  their quarter first, the first rows in forward order keep their master state in what is left (a third
  of the rows), the rest are updated on the host by hetero's worker (placement from ``opt.stats()``);
* ``deepspeed_zero3_offload``: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to pinned host
  memory, stepped by its CPUAdam (skipped, with the reason, where ``deepspeed`` does not import);

each after ``--warmup`` steps, ``--iters`` timed (median). TFLOP/s by the Megatron convention
``6·P_nonemb·T + 12·L·s·h·T`` (P_nonemb: the blocks, the LM head and the final norm). Then the ratios
issue #46 sets targets for (resident / plain ≥ 0.9, half / plain ≥ 0.5, half / DeepSpeed ≥ 3).

``--ladders`` (``make gpu-check PART=ladders``, or ``--ladders-only``): the largest model each of hetero
and DeepSpeed trains (three steps, activation checkpointing per block) on this machine, from the sizes of
``--ladder`` (h4096, growing depth). A size is tried only if ``parallel4d plan`` accepts it — hetero's:
the job's dry run (``planning.dry_run.plan``, hetero's static budget ``--ladder-budget-frac`` of the GPU)
needs at most 90 % of the GPU and at most the host's memory; DeepSpeed's: its own estimator, as ``plan
--largest`` asks it — so the first try is the largest size plan accepts, then smaller ones until one
trains (``--beyond-plan`` also tries the sizes above). Targets: largest hetero ≥ 2× DeepSpeed's, at
≥ 100 TFLOP/s.

Every measured run is a fresh child process of this script, so each one's host memory is its own: host
RSS is the child's peak resident set above its baseline (taken once CUDA is up, before the model is
built), per parameter of the model; the parent stops a child whose resident set passes
``--host-limit-frac`` of the host's memory (reported, never left to the kernel's OOM killer).

``--dry-run`` runs every path on the CPU with a tiny model (no GPU numbers: the JSON says so and goes to a
temporary file unless ``--out`` is given; DeepSpeed, where it imports, on gloo with torch's AdamW instead
of its CPUAdam build). Nothing here invents numbers: a path that cannot run is reported as skipped or
failed, with the reason.

Usage: ``python benchmarks/hetero_gpu.py [--dry-run] [--ladders | --ladders-only] [--budget-frac 0.5]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.config.rules.common import human_bytes as human  # noqa: E402
from parallel4d.models.gpt2.model import GPTShape, build_gpt, shape_from_config  # noqa: E402
from parallel4d.models.stages import cross_entropy  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GB = 1e9
RESULT = "RESULT "  # a child's line of JSON
# issue #46's targets: (name, numerator run, denominator run, at least)
TARGETS = (("resident / plain", "hetero_resident", "plain", 0.9),
           ("half / plain", "hetero_half", "plain", 0.5),
           ("half / DeepSpeed", "hetero_half", "deepspeed_zero3_offload", 3.0))
LARGEST_RATIO_TARGET, LARGEST_TFLOPS_TARGET = 2.0, 100.0


# --- the job of a run: a config mapping the child rebuilds (and the ladders' plan judges) ------------
def job(args, hidden: int, layers: int, heads: int, budget: int | None = None, ckpt: bool = False) -> dict:
    """The config mapping of one run: the GPT, the micro-batch, bf16 (float32 master), AdamW, hetero's
    static device budget (None: everything on the device)."""
    return {"model": {"arch": "gpt2", "vocab_size": args.vocab, "seq_len": args.seq, "hidden": hidden,
                      "heads": heads, "layers": layers, "tie_embeddings": False},
            "data": {"batch_size": args.batch},
            "train": {"dtype": "bfloat16", "activation_checkpointing": "blocks" if ckpt else "none"},
            "optimizer": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.01},
            "hetero": {"enabled": True, "device_budget_bytes": budget}}


@dataclass
class Spec:
    """What a child runs: ``run`` (plain, hetero, deepspeed, bandwidth) on the model of ``job``."""

    run: str
    job: dict
    warmup: int = 2
    iters: int = 5
    dry_run: bool = False


def flops_per_step(shape: GPTShape, tokens: int) -> float:
    h, L, s = shape.hidden, shape.layers, shape.seq_len
    per_layer = 4 * h * h + 4 * h + 2 * shape.mlp_ratio * h * h + (shape.mlp_ratio + 1) * h + 4 * h
    p_nonemb = L * per_layer + shape.vocab_size * h + 2 * h  # blocks + LM head + final LayerNorm
    return 6 * p_nonemb * tokens + 12 * L * s * h * tokens


def param_count(shape: GPTShape) -> int:
    h = shape.hidden
    per_layer = 4 * h * h + 4 * h + 2 * shape.mlp_ratio * h * h + (shape.mlp_ratio + 1) * h + 4 * h
    emb = shape.vocab_size * h + shape.seq_len * h
    head = 0 if shape.tie_embeddings else shape.vocab_size * h
    return shape.layers * per_layer + emb + head + 2 * h


# --- host memory -------------------------------------------------------------------------------
def _status_bytes(field: str, pid: str = "self") -> int | None:
    """``VmRSS`` / ``VmHWM`` of ``/proc/PID/status`` in bytes (None where the kernel does not say)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostPeak:
    """This process's peak resident set above the baseline at construction: the kernel's high-water mark
    reset there (``/proc/self/clear_refs``) where it can be, else ``ru_maxrss`` before and after (the
    import's own peak then hides up to its size of the run's)."""

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM reset at the baseline"
        except OSError:
            self.method = "ru_maxrss before and after"
        self.base = self._peak() if self.method.startswith("ru_") else _status_bytes("VmRSS")

    def _peak(self) -> int:
        if self.method.startswith("ru_"):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return _status_bytes("VmHWM")

    def above(self) -> int:
        return max(0, self._peak() - self.base)


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) * 1024


# --- inside a child: the contenders -------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(shape, batch, device, n):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randint(0, shape.vocab_size, (batch, shape.seq_len), generator=g).to(device)
        yield x, torch.roll(x, -1, dims=1)


def timed_training(step, shape, batch, device, warmup, iters, timed_start=None) -> dict:
    """``warmup`` steps, then ``iters`` timed ones (``timed_start()`` called between)."""
    data = batches(shape, batch, device, warmup + iters)
    for _, (x, y) in zip(range(warmup), data):
        step(x, y)
    sync(device)
    if timed_start is not None:
        timed_start()
    times = []
    for x, y in data:
        t = time.perf_counter()
        loss = step(x, y)
        sync(device)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    tokens = batch * shape.seq_len
    out = {"step_s_median": med, "step_s_min": min(times), "step_s_max": max(times), "steps": warmup + iters,
           "tokens_per_s": tokens / med, "TFLOPs": flops_per_step(shape, tokens) / med / 1e12,
           "final_loss": float(loss)}
    if device.type == "cuda":
        out["peak_gpu_alloc_GB"] = torch.cuda.max_memory_allocated(device) / GB
    return out


def amp(device, cache: bool = True):
    """bf16 autocast; ``cache=False`` under hetero (its parameters are bf16 already: as the engine runs it)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)


def build_on(shape, device, ckpt: bool = False):
    """The seeded GPT on ``device``; ``ckpt``: activation checkpointing per block."""
    with torch.device(device):
        model = build_gpt(shape, seed=0)
    if ckpt:
        from torch.utils.checkpoint import checkpoint
        for blk in model.blocks:
            blk.forward = (lambda f: (lambda x: checkpoint(f, x, use_reentrant=False)))(blk.forward)
    return model


def run_plain(cfg, device, spec: Spec) -> dict:
    shape = shape_from_config(cfg.model)
    model = build_on(shape, device, cfg.train.activation_checkpointing == "blocks")
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                            fused=True)

    def step(x, y):
        with amp(device):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return timed_training(step, shape, cfg.data.batch_size, device, spec.warmup, spec.iters)


PLACEMENT = ("model_data_bytes", "device_budget_bytes", "arena_bytes", "host_bytes", "host_bytes_per_param",
             "optimizer_rows_on_device", "optimizer_rows_on_host", "optimizer_device_bytes", "optimizer_host_bytes",
             "staging_bytes", "chunk_bytes", "chunks", "pinned_host", "trace_divergences",
             "min_feasible_budget_bytes", "peak_resident_bytes")


def run_hetero(cfg, device, spec: Spec) -> dict:
    from parallel4d.hetero import wrap

    shape = shape_from_config(cfg.model)
    model = build_on(shape, device, cfg.train.activation_checkpointing == "blocks")  # copied into chunks by wrap
    model, opt = wrap(model, cfg.optimizer, cfg.hetero, compute_dtype=torch.bfloat16)
    rt = model._hetero_runtime
    rt.mgr.transfers.profile = device.type == "cuda"

    def step(x, y):
        with amp(device, cache=False):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = {}
    out = timed_training(step, shape, cfg.data.batch_size, device, spec.warmup, spec.iters,
                         timed_start=lambda: before.update(opt.stats()))
    rt.updates.wait_all()  # the last step's host updates, which the next forward would have waited for
    st = opt.stats()
    out.update({k: st[k] for k in PLACEMENT})
    out["host_update_seconds_per_step"] = (st["host_update_seconds"] - before["host_update_seconds"]) / spec.iters
    last = st["last_iteration"]
    out.update(moved_bytes_per_step=last["moved_bytes"], load_bytes_per_step=last["load_bytes"],
               writeback_bytes_per_step=last["writeback_bytes"])
    if last["copy_seconds"] > 0:
        out["copy_seconds_per_step"] = last["copy_seconds"]
        out["copy_GBps"] = last["moved_bytes"] / last["copy_seconds"] / GB
    return out


def deepspeed_config(batch: int, offload: bool = True, pin: bool = True, cpu_adam: bool = True,
                     adamw: dict | None = None) -> dict:
    """ZeRO-3 with parameters and optimizer offloaded to (pinned) host memory (``offload``), bf16; the
    offloaded optimizer is DeepSpeed's CPUAdam unless ``cpu_adam=False`` (torch's AdamW: no C++ build);
    ``adamw``: its hyper-parameters (lr, betas, eps, weight_decay; default lr 1e-4)."""
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7, "sub_group_size": 1e9}
    if offload:
        zero.update(offload_param={"device": "cpu", "pin_memory": pin},
                    offload_optimizer={"device": "cpu", "pin_memory": pin})
    params = {**(adamw or {"lr": 1e-4}), **({} if cpu_adam else {"torch_adam": True})}
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero}


def deepspeed_engine(shape, cfg: dict, optimizer=None, device=None, ckpt: bool = False):
    """DeepSpeed's engine over the GPT with its own seeded initialisation (``build_gpt``, on ``device``: the
    host by default), which ZeRO-3 partitions inside ``initialize``. Built under ``deepspeed.zero.Init``
    instead, each module's parameters are partitioned as soon as it is constructed, so the GPT's
    initialisation writes into empty shards and the weights keep torch's defaults (or garbage: a NaN LM
    head). ``optimizer``: a callable of the parameters (else ``cfg``'s)."""
    import deepspeed

    model = build_on(shape, device or torch.device("cpu"), ckpt)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                           config=cfg)
    return engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deepspeed(cfg, device, spec: Spec) -> dict:
    try:
        import deepspeed
    except Exception as e:  # not installed here (the GPU machine has no package index): say so, never guess
        return {"skipped": f"deepspeed not importable: {type(e).__name__}: {e}"}
    from parallel4d.integrations.deepspeed import avoid_compiled_ops

    cuda = device.type == "cuda"
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(k, v)
    avoid_compiled_ops()  # its shared-memory all-reduce (the CPU accelerator's): not what is measured
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    shape = shape_from_config(cfg.model)
    o = cfg.optimizer
    ds_cfg = deepspeed_config(cfg.data.batch_size, pin=cuda, cpu_adam=cuda,
                              adamw={"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay})
    engine = deepspeed_engine(shape, ds_cfg, device=device, ckpt=cfg.train.activation_checkpointing == "blocks")

    def step(x, y):
        loss = cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    out = timed_training(step, shape, cfg.data.batch_size, device, spec.warmup, spec.iters)
    out["optimizer_class"] = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
    out["deepspeed"] = deepspeed.__version__
    return out


def run_bandwidth(cfg, device, spec: Spec, mib=256, repeats=10) -> dict:
    """The device, and the median GB/s of pinned H2D and D2H copies of ``mib`` MiB."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    props = torch.cuda.get_device_properties(device)
    out = {"device": props.name, "gpu_total_bytes": props.total_memory, "cuda": torch.version.cuda}
    n = mib * 2 ** 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[f"{name}_GBps"] = n / statistics.median(times) / GB
    return out


RUNS = {"plain": run_plain, "hetero": run_hetero, "deepspeed": run_deepspeed, "bandwidth": run_bandwidth}


def preload(run: str) -> None:
    """The run's libraries imported before the baseline: their code is not the run's memory."""
    try:
        importlib.import_module({"hetero": "parallel4d.hetero", "deepspeed": "deepspeed"}.get(run, "torch"))
    except Exception:  # reported by the run itself
        pass


def child_main(spec: Spec) -> None:
    """One run in this fresh process; prints its result as one ``RESULT {json}`` line."""
    if spec.dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # a tiny model: more threads only wait on each other (and on a busy machine, long)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.zeros(1, device=device)  # the CUDA context before the baseline: not the model's memory
    cfg = make_config(spec.job)
    preload(spec.run)
    peak = HostPeak()
    try:
        out = RUNS[spec.run](cfg, device, spec)
    except Exception as e:
        out = {"failed": f"{type(e).__name__}: {str(e)[:600]}", "trace": traceback.format_exc()[-1500:]}
    if "skipped" not in out and spec.run != "bandwidth":
        params = param_count(shape_from_config(cfg.model))
        above = peak.above()
        out.update(params=params, host_rss_above_baseline_bytes=above, host_rss_bytes_per_param=above / params,
                   host_rss_method=peak.method)
    print(RESULT + json.dumps(out, default=str), flush=True)


# --- the parent: children, ladders, ratios ---------------------------------------------------------
def in_child(spec: Spec, args) -> dict:
    """``spec`` run by a fresh child process; stopped when its resident set passes ``--host-limit-frac`` of
    the host's memory or it runs past ``--child-timeout``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(asdict(spec))]
    limit = args.host_limit_frac * mem_total()
    t0, peak_seen, stopped = time.monotonic(), 0, None
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        try:
            stdout, stderr = p.communicate(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            rss = _status_bytes("VmRSS", str(p.pid)) or 0
            peak_seen = max(peak_seen, rss)
            if rss > limit:
                stopped = f"stopped: resident set {rss / 2**30:.1f} GiB passed {limit / 2**30:.1f} GiB of host memory"
            elif time.monotonic() - t0 > args.child_timeout:
                stopped = f"stopped: ran past {args.child_timeout} s"
            if stopped:
                p.kill()
                stdout, stderr = p.communicate()
                break
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    res = json.loads(lines[-1][len(RESULT):]) if lines and not stopped else {
        "failed": stopped or f"exit {p.returncode}" + (" (killed: likely host memory)" if p.returncode == -9 else ""),
        "stderr_tail": (stderr or "")[-1500:]}
    res.update(wall_s=time.monotonic() - t0, parent_seen_rss_peak_bytes=peak_seen)
    return res


def half_budget(args, resident: dict, n_params: int) -> tuple[int, str]:
    """``--budget-frac`` of the model data: the resident run's chunks and master state, else 16 B/param."""
    if "model_data_bytes" in resident:
        data = resident["model_data_bytes"] + resident["optimizer_device_bytes"] + resident["optimizer_host_bytes"]
        return int(args.budget_frac * data), "the resident run's chunks + master state"
    return int(args.budget_frac * 16 * n_params), "16 B per parameter (the resident run gave no stats)"


def ratio(a: dict, b: dict) -> float | None:
    return a["TFLOPs"] / b["TFLOPs"] if "TFLOPs" in a and "TFLOPs" in b else None


def targets(res: dict) -> list[dict]:
    """Each of issue #46's targets: the measured value, the target, whether it is met (None: not measured)."""
    rows = [{"name": name, "value": ratio(res.get(a, {}), res.get(b, {})), "target": t}
            for name, a, b, t in TARGETS]
    lad = res.get("ladders")
    if lad:
        ours, theirs = (lad.get(side, {}).get("largest_params") for side in ("hetero", "deepspeed"))
        rows.append({"name": "largest hetero / largest DeepSpeed", "target": LARGEST_RATIO_TARGET,
                     "value": ours / theirs if ours and theirs else None})
        rows.append({"name": "largest hetero TFLOP/s", "target": LARGEST_TFLOPS_TARGET,
                     "value": lad.get("hetero", {}).get("largest_TFLOPs")})
    for r in rows:
        r["met"] = None if r["value"] is None or res["dry_run"] else r["value"] >= r["target"]
    return rows


# --- the ladders ------------------------------------------------------------------------------
def hetero_gate(cfg, memory) -> dict:
    """``parallel4d plan``'s verdict on ``cfg`` (its dry run): the device bytes within 90 % of the GPU and
    the host bytes within the host's memory; a refusal of the plan itself is a ``no``."""
    from parallel4d.planning.dry_run import HEADROOM, plan
    from parallel4d.tools.largest import job_host_bytes

    try:
        ranks = plan(cfg)
    except Exception as e:  # the plan refuses the job (a budget too small, too many block passes, …)
        return {"accepted": False, "reason": f"plan refused it: {type(e).__name__}: {str(e)[:300]}"}
    device, host = max(r.device_bytes for r in ranks), job_host_bytes(ranks, cfg)
    ok = device <= HEADROOM * memory.gpu and host <= memory.host
    return {"accepted": ok, "device_bytes": device, "host_bytes": host,
            "host_bytes_per_param": ranks[0].host_bytes_per_param,
            **({} if ok else {"reason": f"plan: {human(device)} device (≤ {HEADROOM:.0%} of {human(memory.gpu)}), "
                                        f"{human(host)} host (≤ {human(memory.host)})"})}


def deepspeed_gate(cfg, memory) -> dict:
    """DeepSpeed's own estimator, as ``parallel4d plan --largest`` asks it (per-CPU and per-GPU bytes)."""
    from parallel4d.tools.largest import deepspeed_estimate

    cpu, gpu = deepspeed_estimate(cfg)
    ok = cpu <= memory.host and gpu <= memory.gpu
    return {"accepted": ok, "device_bytes": gpu, "host_bytes": cpu,
            **({} if ok else {"reason": f"DeepSpeed's estimator: {human(cpu)} per CPU (≤ {human(memory.host)}), "
                                        f"{human(gpu)} per GPU (≤ {human(memory.gpu)})"})}


def largest_accepted(n: int, accepted) -> int:
    """The last index of ``n`` growing sizes that ``accepted(i)`` admits (-1: none), by bisection (a size
    refused refuses every larger one)."""
    lo, hi = -1, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if accepted(mid) else (lo, mid)
    return lo


def ladder(side: str, args, memory, report=lambda partial: None) -> dict:
    """``side`` (hetero or deepspeed): the largest size of ``--ladder`` that trains three steps, tried from
    the largest ``parallel4d plan`` accepts downwards (each in a fresh child); ``report`` gets the rows so
    far after each."""
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.ladder.split(",")]
    budget = int(args.ladder_budget_frac * memory.gpu)
    jobs = [job(args, h, L, max(1, h // 128), budget if side == "hetero" else None, ckpt=True) for h, L in sizes]
    gate = hetero_gate if side == "hetero" else deepspeed_gate
    verdicts: dict[int, dict] = {}

    def accepted(i):
        verdicts[i] = gate(make_config(jobs[i]), memory)
        return verdicts[i]["accepted"]

    if side == "deepspeed":
        try:
            importlib.import_module("deepspeed")
        except Exception as e:
            return {"skipped": f"deepspeed not importable: {type(e).__name__}: {e}"}
    top = largest_accepted(len(sizes), accepted)
    rows = []

    def attempt(i):
        h, L = sizes[i]
        r = in_child(Spec("hetero" if side == "hetero" else "deepspeed", jobs[i], warmup=1, iters=2,
                          dry_run=args.dry_run), args)
        r.update(hidden=h, layers=L, plan=verdicts.get(i) or gate(make_config(jobs[i]), memory))
        rows.append(r)
        report({"tried": rows})
        print(f"  {side} ladder h{h} L{L}: {_line(r)}", flush=True)
        return r if "TFLOPs" in r else None

    best = next((r for r in map(attempt, range(top, -1, -1)) if r is not None), None)  # downwards to one that trains
    if args.beyond_plan and best is not None and best is rows[0]:
        for i in range(top + 1, len(sizes)):  # upwards past the plan, to the first size that fails
            best = attempt(i) or best
            if rows[-1] is not best:
                break
    refused = [{"hidden": sizes[i][0], "layers": sizes[i][1], "plan": v} for i, v in sorted(verdicts.items())
               if not v["accepted"]]
    return {"sizes": args.ladder, "hetero_device_budget_bytes": budget if side == "hetero" else None,
            "tried": rows, "refused_by_plan": refused, "largest_params": best["params"] if best else 0,
            "largest_TFLOPs": best["TFLOPs"] if best else None,
            "largest_host_rss_bytes_per_param": best["host_rss_bytes_per_param"] if best else None,
            "largest_shape": f"h{best['hidden']} L{best['layers']}" if best else None}


# --- printing ----------------------------------------------------------------------------------
def _line(r: dict) -> str:
    if "TFLOPs" not in r:
        return r.get("skipped") or r.get("failed") or "?"
    rss = r.get("host_rss_bytes_per_param")
    return (f"{r['step_s_median']:.3f} s/step  {r['TFLOPs']:.1f} TFLOP/s  {r['params'] / 1e9:.3f}B params"
            + (f"  host RSS {rss:.1f} B/param" if rss is not None else ""))


def table(res: dict) -> list[str]:
    head = f"{'run':<26}{'s/step':>8}{'TFLOP/s':>9}{'tokens/s':>10}{'GPU GB':>8}{'host B/p':>9}" \
           f"{'master rows dev/host':>22}{'host upd s/step':>17}{'moved GB/step':>15}"
    lines = [head]
    for name in ("plain", "hetero_resident", "hetero_half", "deepspeed_zero3_offload"):
        r = res.get(name)
        if r is None:
            continue
        if "TFLOPs" not in r:
            lines.append(f"{name:<26}{r.get('skipped') or r.get('failed')}")
            continue
        rows = (f"{r['optimizer_rows_on_device']}/{r['optimizer_rows_on_host']}" if "optimizer_rows_on_device" in r
                else "—")
        upd = f"{r['host_update_seconds_per_step']:.3f}" if "host_update_seconds_per_step" in r else "—"
        gpu = f"{r['peak_gpu_alloc_GB']:.1f}" if "peak_gpu_alloc_GB" in r else "—"
        moved = f"{r['moved_bytes_per_step'] / GB:.2f}" if "moved_bytes_per_step" in r else "—"
        lines.append(f"{name:<26}{r['step_s_median']:>8.3f}{r['TFLOPs']:>9.1f}{r['tokens_per_s']:>10.0f}{gpu:>8}"
                     f"{r['host_rss_bytes_per_param']:>9.1f}{rows:>22}{upd:>17}{moved:>15}")
    for side, lad in ((k, v) for k, v in res.get("ladders", {}).items() if isinstance(v, dict)):
        if "skipped" in lad or "largest_params" not in lad:
            lines.append(f"largest {side}: {lad.get('skipped', 'not finished')}")
            continue
        refused = ", ".join(f"h{r['hidden']} L{r['layers']}" for r in lad["refused_by_plan"]) or "none"
        tflops = f"{lad['largest_TFLOPs']:.1f} TFLOP/s" if lad["largest_TFLOPs"] is not None else "—"
        rss = lad["largest_host_rss_bytes_per_param"]
        lines.append(f"largest {side}: {lad['largest_shape']} {lad['largest_params'] / 1e9:.2f}B, {tflops}, host RSS "
                     + (f"{rss:.1f} B/param" if rss is not None else "—") + f"; refused by the plan: {refused}")
    lines.append("targets (issue #46)" + (" — dry run on the CPU: no verdict" if res["dry_run"] else ""))
    for t in res["targets"]:
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        verdict = "" if t["met"] is None else ("  met" if t["met"] else "  NOT met")
        lines.append(f"  {t['name']:<38}{value:>14}  (target ≥ {t['target']}){verdict}")
    return lines


# --- main -------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: exercise every path, no GPU numbers")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-frac", type=float, default=0.5, help="hetero_half: budget = frac · model data")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--ladders", action="store_true", help="also both largest-model ladders (minutes)")
    ap.add_argument("--ladders-only", action="store_true", help="the ladders alone")
    ap.add_argument("--ladder", default=",".join(f"4096x{L}" for L in range(8, 65, 4)),
                    help="hidden x layers, growing (h4096: L20 4.44B, L32 6.86B, L44 9.28B, L56 11.7B)")
    ap.add_argument("--ladder-budget-frac", type=float, default=0.6,
                    help="hetero's static device budget on the ladder, as a share of the GPU's memory")
    ap.add_argument("--beyond-plan", action="store_true",
                    help="after the largest size plan accepts, also try larger ones until one fails")
    ap.add_argument("--host-limit-frac", type=float, default=0.92,
                    help="a child whose resident set passes this share of host memory is stopped")
    ap.add_argument("--child-timeout", type=int, default=900)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.dry_run:  # tiny: every path, the ladders included, in a minute or two
        args.hidden, args.layers, args.heads, args.vocab, args.seq, args.batch = 64, 2, 4, 256, 32, 2
        args.warmup, args.iters, args.ladders = 1, 2, True
        args.ladder = "64x2,64x4,64x8,64x64"
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child is not None:
        return child_main(Spec(**json.loads(args.child)))
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the GPU machine, or use --dry-run to check the script on the CPU")
    main_job = job(args, args.hidden, args.layers, args.heads)
    shape = shape_from_config(make_config(main_job).model)
    n_params = param_count(shape)
    res = {"benchmark": "hetero_gpu", "dry_run": args.dry_run, "torch": torch.__version__,
           "python": platform.python_version(), "config": vars(args), "params": n_params,
           "flops_per_step": flops_per_step(shape, args.batch * args.seq), "host_memory_bytes": mem_total()}
    bw = in_child(Spec("bandwidth", main_job, dry_run=args.dry_run), args) if not args.dry_run else {
        "skipped": "no CUDA device"}
    res["device"] = bw.get("device", "cpu (dry run, not GPU numbers)" if args.dry_run else "?")
    res["pinned_bandwidth"] = bw
    print(f"GPT h{args.hidden} L{args.layers} vocab {args.vocab} seq {args.seq}: {n_params / 1e9:.3f}B params, "
          f"batch {args.batch} on {res['device']}; pinned bandwidth {bw}", flush=True)

    out = args.out or (os.path.join(tempfile.gettempdir(), "hetero_gpu_dryrun.json") if args.dry_run
                       else os.path.join(RESULTS, "gpu_hetero.json"))

    def save():  # after every run: a run stopped from outside (gpu-check's budget) leaves what it measured
        res["targets"] = targets(res)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    def attempt(name, spec):
        res[name] = in_child(spec, args)
        save()
        print(f"{name:>24}: {_line(res[name])}", flush=True)

    def reporter(side):
        def report(partial):
            res["ladders"][side] = partial
            save()
        return report

    if not args.ladders_only:
        attempt("plain", Spec("plain", main_job, args.warmup, args.iters, args.dry_run))
        attempt("hetero_resident", Spec("hetero", main_job, args.warmup, args.iters, args.dry_run))
        budget, source = half_budget(args, res["hetero_resident"], n_params)
        attempt("hetero_half", Spec("hetero", job(args, args.hidden, args.layers, args.heads, budget),
                                    args.warmup, args.iters, args.dry_run))
        res["hetero_half"].update(budget_frac=args.budget_frac, budget_from=source)
        if not args.skip_deepspeed:
            attempt("deepspeed_zero3_offload", Spec("deepspeed", main_job, args.warmup, args.iters, args.dry_run))
    if args.ladders or args.ladders_only:
        from parallel4d.tools.largest import Memory

        # dry run: a make-believe 4 MiB GPU and 32 MiB host, so that each ladder's last size is refused
        gpu = bw.get("gpu_total_bytes") or (0 if args.dry_run else torch.cuda.get_device_properties(0).total_memory)
        memory = Memory(4 * 2**20, 32 * 2**20) if args.dry_run else Memory(gpu, mem_total())
        res["ladders"] = {"gpu_memory_bytes": memory.gpu, "host_memory_bytes": memory.host}
        for side in ("hetero", "deepspeed"):
            res["ladders"][side] = ladder(side, args, memory, reporter(side))
            save()
    save()
    print("\n".join(table(res)), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
