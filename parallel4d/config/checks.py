"""The rules that tie fields together, each message naming the fields and a value that works:
cross-field rules, the deepspeed: section's batch and ZeRO rules, model-family fields, sizes, the
text corpus, local and torchrun job limits, and the fused kernels' availability."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional


if TYPE_CHECKING:  # annotations only: the schema imports these rules
    from parallel4d.config.schema import Config, ModelConfig, OptimizerConfig

from parallel4d.data.text_files import corpus_bytes
from parallel4d.data.token_files import token_file_problems
from parallel4d.config.rules import batch_problem, not_divisible, pipeline_arg_problems, splits_backward, tensor2d_problems
from parallel4d.models.registry import spec


def cross_field_problems(cfg: Config) -> list[str]:
    """Every rule that ties fields together; one readable message per broken rule."""
    p, m, pl = cfg.parallel, cfg.model, cfg.pipeline
    q = p.q
    out = tensor2d_problems(q, m.hidden, m.heads, m.vocab_size)
    if p.sp > 1:
        div = 2 * p.sp if cfg.sequence.layout == "zigzag" else p.sp
        why = f"2·parallel.sp={div} (zigzag cuts the sequence into 2·sp pieces)" if div != p.sp else f"parallel.sp={p.sp}"
        out += filter(None, [not_divisible("model.seq_len", m.seq_len, div, why)])
    out += filter(None, [batch_problem(cfg.data.batch_size, pl.microbatches, [("parallel.dp", p.dp), ("q", q)])])
    if p.pp > 1:
        out += pipeline_arg_problems(m.layers, p.pp, pl.microbatches, pl.schedule, pl.waves, pl.chunks_per_rank,
                                     split_backward=pl.split_backward)
    if cfg.hetero.enabled and p.pp > 1 and m.tie_embeddings and pl.schedule not in ("hanayo", "zbv"):
        out.append(f"hetero.enabled=true with pipeline.schedule={pl.schedule} cannot keep a tied embedding and "
                   "LM head on two pp ranks in step; use pipeline.schedule=hanayo or zbv (both ends on rank 0) or "
                   "model.tie_embeddings=false")
    if p.pp > 1 and splits_backward(pl.schedule, pl.split_backward) and cfg.train.activation_checkpointing != "none":
        out.append(f"train.activation_checkpointing={cfg.train.activation_checkpointing} with a split backward "
                   f"(pipeline.schedule={pl.schedule}{', split_backward=true' if pl.schedule == 'hanayo' else ''}) "
                   "would recompute each block once in B and again for every weight matrix in W; use "
                   "train.activation_checkpointing=none, or a schedule that does not split the backward")
    if cfg.hetero.enabled and p.pp > 1 and splits_backward(pl.schedule, pl.split_backward):
        fix = "pipeline.split_backward=false" if pl.schedule == "hanayo" else "pipeline.schedule=hanayo or 1f1b"
        out.append(f"hetero.enabled=true cannot run a split backward yet (pipeline.schedule={pl.schedule}"
                   f"{', pipeline.split_backward=true' if pl.schedule == 'hanayo' else ''}): its chunks are fetched "
                   f"and released for one backward pass per module, and W runs a second; use {fix}, or "
                   "hetero.enabled=false")
    out += _family_problems(m, q)
    out += _size_problems(cfg)
    out += _schedule_problems(cfg.optimizer, cfg.train.steps)
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        out.append("train.tensorboard=true needs the tensorboard package: pip install 'parallel4d[viz]' (make "
                   "installs it), or set train.tensorboard=false (metrics.jsonl is written either way)")
    if cfg.deepspeed is not None:
        out += deepspeed_problems(cfg)
    if cfg.data.source == "synthetic" and m.vocab_size < 2:
        out.append("model.vocab_size must be ≥ 2")
    if cfg.data.source == "text" and m.vocab_size < 256:
        out.append(f"data.source=text is byte-level and needs model.vocab_size≥256, got {m.vocab_size}; use 256")
    if cfg.data.source == "text" and (cfg.data.text_root or cfg.data.text_glob):
        out += _text_root_problems(cfg.data.text_root, cfg.data.text_glob)
    elif cfg.data.text_glob:
        out.append(f"data.text_glob is read with data.source=text, not {cfg.data.source}; remove it")
    if cfg.data.source == "tokens":
        out += (token_file_problems(cfg.data.path, m.vocab_size, m.seq_len) if cfg.data.path else
                ["data.source=tokens needs data.path (a .bin file from `parallel4d tokenize`)"])
    elif cfg.data.path:
        out.append(f"data.path is read with data.source=tokens, not {cfg.data.source}; set data.source=tokens "
                   "or remove data.path")
    out += _validation_problems(cfg)
    out += _precision_problems(cfg)
    return out


def _precision_problems(cfg: "Config") -> list[str]:
    t, out = cfg.train, []
    preset = {"float32": ("float32", "none"), "float64": ("float64", "none"), "bfloat16": ("float32", "bfloat16"),
              "float16": ("float32", "float16")}[t.dtype]
    for field, given, implied in (("param_dtype", t.param_dtype, preset[0]),
                                  ("autocast_dtype", t.autocast_dtype, preset[1])):
        if given is not None and given != implied and "dtype" in t.model_fields_set:
            out.append(f"train.{field}={given} but train.dtype={t.dtype} means {field}={implied}; give one of them "
                       f"(train.dtype is a preset for param_dtype and autocast_dtype)")
    if t.parameters == "float64" and t.autocast != "none":
        out.append(f"train.autocast_dtype={t.autocast} with float64 parameters: autocast computes float32 "
                   "matmuls in half precision only; use param_dtype=float32")
    if t.grad_reduce_dtype and cfg.hetero.enabled and t.grad_reduce != t.parameters:
        out.append(f"train.grad_reduce_dtype={t.grad_reduce_dtype}: hetero reduces gradients in its chunks' dtype "
                   f"({t.parameters}); unset it or hetero")
    out += filter(None, [fused_problem(t.fused)])
    if t.autocast == "float16" and cfg.deepspeed is not None:
        out.append("train.dtype=float16 with a deepspeed: section: use DeepSpeed's own fp16 section "
                   "(deepspeed.fp16.enabled) and train.dtype=float32")
    return out


def _validation_problems(cfg: "Config") -> list[str]:
    d, t, m = cfg.data, cfg.train, cfg.model
    if d.val_path and d.val_fraction:
        return ["data.val_path and data.val_fraction both name validation data; keep one"]
    if d.val_path and d.source != "tokens":
        return [f"data.val_path is a token file, read with data.source=tokens, not {d.source}; use "
                "data.val_fraction to hold out part of the text"]
    if d.val_fraction and d.source == "synthetic":
        return ["data.val_fraction: synthetic data has nothing to hold out (validation draws sequences training "
                "never does); remove data.val_fraction"]
    if (d.val_path or d.val_fraction) and t.eval_every is None:
        return ["data.val_path / data.val_fraction set aside validation data but train.eval_every is unset; set "
                "train.eval_every (e.g. 100) or remove them"]
    if t.eval_every is not None and d.source != "synthetic" and not (d.val_path or d.val_fraction):
        return ["train.eval_every needs held-out data: set data.val_fraction (e.g. 0.05) or, with "
                "data.source=tokens, data.val_path"]
    if t.eval_every is not None and cfg.deepspeed is not None:
        return ["train.eval_every is not supported with a deepspeed: section yet; remove one of them"]
    if d.val_path:
        return token_file_problems(d.val_path, m.vocab_size, m.seq_len, field="data.val_path")
    return []


def _schedule_problems(o: OptimizerConfig, steps: int) -> list[str]:
    out = []
    if o.schedule == "constant":
        given = [f"optimizer.{f}={v}" for f, v in (("min_lr", o.min_lr), ("decay_steps", o.decay_steps)) if v]
        if given:
            out.append(f"{given[0]} applies to a decaying schedule but optimizer.schedule=constant; "
                       "set optimizer.schedule=cosine or linear, or remove it")
        return out
    if o.min_lr > o.lr:
        out.append(f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}; the decay ends at min_lr, so set "
                   "min_lr ≤ lr")
    end = o.decay_steps or steps
    if end <= o.warmup_steps:
        field = f"optimizer.decay_steps={o.decay_steps}" if o.decay_steps else f"train.steps={steps}"
        out.append(f"{field} ends the {o.schedule} decay before optimizer.warmup_steps={o.warmup_steps} ends the "
                   f"warm-up; set it above {o.warmup_steps} or shorten the warm-up")
    return out


# --- the deepspeed: section ---------------------------------------------------------
# Rules that need only the section's values; parallel4d/integrations/deepspeed/ds_config.py
# adds those that need DeepSpeed itself (unknown keys, its own sub-section models) or the device.

def deepspeed_batch(cfg: "Config") -> dict[str, int]:
    """The ds_config batch keys as parallel4d's fields make them. DeepSpeed's "GPU" is a data
    replica (the mpu's data-parallel size is parallel.dp): its micro-batch counts the sequences
    of one replica's micro-batch, which the q×q grid and sp split further."""
    p, m = cfg.parallel, cfg.pipeline.microbatches
    return {"train_batch_size": cfg.data.batch_size, "gradient_accumulation_steps": m,
            "train_micro_batch_size_per_gpu": cfg.data.batch_size // (p.dp * m)}


def deepspeed_zero_stage(section: dict) -> Any:
    zero = section.get("zero_optimization")
    return zero.get("stage", 0) if isinstance(zero, dict) else 0


def _enabled(section: dict, key: str) -> bool:
    value = section.get(key)
    return isinstance(value, dict) and value.get("enabled") is True


def deepspeed_problems(cfg: "Config") -> list[str]:
    """What in ``cfg.deepspeed`` cannot run with the rest of ``cfg``; one message each."""
    ds, p = cfg.deepspeed, cfg.parallel
    out = []
    why = (f"data.batch_size={cfg.data.batch_size}, parallel.dp={p.dp} and pipeline.microbatches="
           f"{cfg.pipeline.microbatches} make it")
    for key, want in deepspeed_batch(cfg).items():
        if key in ds and ds[key] != "auto" and (isinstance(ds[key], bool) or ds[key] != want):
            out.append(f"deepspeed.{key}={ds[key]!r} but {why} {want} (train_batch_size = micro-batch × "
                       f"gradient_accumulation_steps × parallel.dp); set deepspeed.{key}={want}, \"auto\", or "
                       "leave it out")
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    offload = [k for k in ("offload_optimizer", "offload_param")
               if isinstance(zero.get(k), dict) and zero[k].get("device", "none") != "none"]
    if cfg.hetero.enabled:
        what = f"DeepSpeed's zero_optimization.{offload[0]}" if offload else "DeepSpeed's optimizer"
        out.append(f"hetero.enabled=true with a deepspeed: section: one memory manager at a time, and {what} "
                   "would manage the same parameters as hetero's chunks; set hetero.enabled=false (DeepSpeed's "
                   "zero_optimization.offload_optimizer moves optimizer states to the host) or remove deepspeed:")
    stage = deepspeed_zero_stage(ds)
    if isinstance(stage, bool) or not isinstance(stage, int):  # DeepSpeed reads "3" as stage 3: the rules must too
        out.append(f"deepspeed.zero_optimization.stage={stage!r} is not a whole number; write 0, 1, 2 or 3 "
                   "(unquoted)")
    elif p.pp > 1 and stage not in (0, 1):
        out.append(f"deepspeed.zero_optimization.stage={stage!r} with parallel.pp={p.pp}: a pipeline keeps every "
                   "micro-batch's gradients until the step, which ZeRO stages 2 and 3 do not; use stage 0 or 1")
    elif stage == 3 and (p.tp > 1 or p.sp > 1):
        out.append(f"deepspeed.zero_optimization.stage=3 with parallel.tp={p.tp}, parallel.sp={p.sp}: ZeRO-3 "
                   "would partition 2D blocks and ring-attention replicas over the wrong group; use stage 1 or 2, "
                   "which match parallel4d exactly")
    if p.pp > 1 and "managed_gradient_accumulation" in ds:
        out.append("deepspeed.managed_gradient_accumulation with parallel.pp > 1: parallel4d's pipeline executor "
                   "accumulates the micro-batches itself; remove the key")
    if _enabled(ds, "fp16") and p.pp > 1:
        out.append("deepspeed.fp16.enabled with parallel.pp > 1: the pipeline's backward bypasses DeepSpeed's "
                   "loss scaling; use bf16 (deepspeed.bf16.enabled=true)")
    bf16 = _enabled(ds, "bf16") or _enabled(ds, "bfloat16")
    if cfg.train.parameters == "float64":
        out.append("train.dtype=float64 with a deepspeed: section: DeepSpeed trains float32 (or bf16, fp16); "
                   "use train.dtype=float32")
    elif cfg.train.autocast == "bfloat16" and isinstance(ds.get("bf16"), dict) and not bf16:
        out.append("train.dtype=bfloat16 but deepspeed.bf16.enabled is false; set deepspeed.bf16.enabled=true "
                   "(DeepSpeed's bf16) or train.dtype=float32")
    elif cfg.train.autocast == "bfloat16" and _enabled(ds, "fp16"):  # resolve() enables bf16: DeepSpeed refuses both
        out.append("train.dtype=bfloat16 but deepspeed.fp16.enabled is true, and DeepSpeed runs one of bf16 and fp16; "
                   "set train.dtype=float32 (DeepSpeed's fp16) or replace deepspeed.fp16 by deepspeed.bf16.enabled=true")
    clip = ds.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < math.inf):
        out.append(f"deepspeed.gradient_clipping={clip!r} must be a finite number ≥ 0 (0 = no clipping); DeepSpeed "
                   "would fail on it in a worker or, below 0, silently not clip")
    elif cfg.train.grad_clip and clip not in (None, cfg.train.grad_clip):
        out.append(f"train.grad_clip={cfg.train.grad_clip} and deepspeed.gradient_clipping={clip!r} disagree; keep "
                   "one of them (DeepSpeed clips with deepspeed.gradient_clipping)")
    if "scheduler" in ds and cfg.optimizer.warmup_steps:
        out.append(f"deepspeed.scheduler and optimizer.warmup_steps={cfg.optimizer.warmup_steps} are two learning-"
                   "rate schedules; set optimizer.warmup_steps=0 or remove deepspeed.scheduler")
    elif "scheduler" in ds and cfg.optimizer.schedule != "constant":
        out.append(f"deepspeed.scheduler and optimizer.schedule={cfg.optimizer.schedule} are two learning-rate "
                   "schedules; set optimizer.schedule=constant or remove deepspeed.scheduler")
    return out


def _family_problems(m: ModelConfig, q: int) -> list[str]:
    """Fields that belong to another model family, and what this family needs (its spec's rules)."""
    return spec(m.arch).problems(m, q)


MAX_PARAMETERS = 2**45  # ~3.5e13: 128 TiB in float32, twenty times the largest models trained
MAX_WORLD = 2**20


def dense_parameters(m: ModelConfig) -> int:
    """About how many parameters the dense model of ``m`` has (norms and biases left out; its family's count)."""
    return spec(m.arch).dense_parameters(m)


def largest_block(m: ModelConfig, q: int) -> int:
    """Elements of the largest parameter a rank holds: the token table or an MLP matrix, each cut in
    q² blocks by the 2D grid."""
    return max(m.vocab_size * m.hidden, m.hidden * m.mlp_width) // (q * q)


def _size_problems(cfg: "Config") -> list[str]:
    """Sizes that fit no machine: the model, the world, a hetero budget below one chunk."""
    m, p, h, out = cfg.model, cfg.parallel, cfg.hetero, []
    n = dense_parameters(m)
    if n > MAX_PARAMETERS:
        out.append(f"model: {m.layers} layers of hidden {m.hidden}, vocab {m.vocab_size} make about {n:.2e} "
                   f"parameters, more than {MAX_PARAMETERS:.1e} ({4 * MAX_PARAMETERS / 2**40:.0f} TiB in float32), "
                   "which no cluster holds; lower model.hidden, model.layers or model.vocab_size")
    if p.world_size > MAX_WORLD:
        out.append(f"parallel.pp·dp·sp·tp = {p.world_size} ranks is more than {MAX_WORLD}; lower the parallel sizes")
    item = 8 if cfg.train.parameters == "float64" else 4
    largest = largest_block(m, p.q)
    if h.enabled and h.chunk_elems is not None and h.chunk_elems < largest:
        out.append(f"hetero.chunk_elems={h.chunk_elems} is smaller than the largest parameter a rank holds "
                   f"({largest} elements); use hetero.chunk_elems≥{largest} or leave it unset to search")
    chunk = max(largest, h.chunk_elems or 0) * item
    if h.enabled and h.device_budget_bytes is not None and h.device_budget_bytes < chunk:
        out.append(f"hetero.device_budget_bytes={h.device_budget_bytes} cannot hold one chunk: a chunk holds at "
                   f"least the largest parameter a rank holds, {max(largest, h.chunk_elems or 0)} elements × {item} "
                   f"bytes = {chunk}; use hetero.device_budget_bytes≥{chunk} (`parallel4d plan` shows the chunks a "
                   "rank keeps on the device at once), or leave it unset")
    return out


_CORPUS_MIN_BYTES = 1024  # data.read_corpus refuses less


def _text_root_problems(root: str | None, patterns: list[str] | None) -> list[str]:
    """What ``data.read_corpus`` would refuse in a worker: no directory, or too few bytes of its files."""
    where = f"data.text_root={root!r}" if root else "the standard library (data.text_root unset)"
    if root and not Path(root).is_dir():
        return [f"data.text_root={root!r} is not a directory; point it at a folder of text files or leave it "
                "unset to use Python's standard library"]
    found = corpus_bytes(root, patterns, _CORPUS_MIN_BYTES)
    if found >= _CORPUS_MIN_BYTES:
        return []
    if patterns:
        return [f"data.text_glob={patterns} matches {found} bytes of files under {where} and data.source=text "
                f"needs ≥ {_CORPUS_MIN_BYTES}; fix the patterns (relative to data.text_root, e.g. '**/*.md')"]
    return [f"{where} holds {found} bytes of .py files (without data.text_glob the corpus reads .py files only) "
            f"and data.source=text needs ≥ {_CORPUS_MIN_BYTES}; point it at a folder of .py files, set "
            "data.text_glob, or leave data.text_root unset to use Python's standard library"]


def local_job_problems(cfg: Config, cores: int | None = None) -> list[str]:
    """Rules for a job the local launcher spawns itself (not under torchrun) on a machine of ``cores``
    (default: this one's): one message per problem."""
    p, limit, out = cfg.parallel, cfg.train.max_local_workers, []
    if cfg.world_size > limit:
        out.append(f"parallel.pp·dp·sp·tp = {p.pp}·{p.dp}·{p.sp}·{p.tp} = {cfg.world_size} local workers is more "
                   f"than train.max_local_workers={limit}; lower the parallel sizes, raise train.max_local_workers "
                   "if this machine really runs that many processes, or start the job with torchrun")
    cores = cores or os.cpu_count() or 1
    threads = cfg.train.threads_per_worker
    if threads is not None and threads > cores:
        out.append(f"train.threads_per_worker={threads} is more than this machine's {cores} cores; use "
                   f"train.threads_per_worker={max(1, cores // cfg.world_size)} (cores / workers) or leave it unset")
    return out


def torchrun_job_problems(cfg: Config, world_size: int, max_restarts: int) -> list[str]:
    """Rules for a job torchrun started (``WORLD_SIZE`` processes, ``--max-restarts``): one message per problem."""
    p, problems = cfg.parallel, []
    if world_size != cfg.world_size:
        problems.append(f"WORLD_SIZE={world_size} but parallel.pp·dp·sp·tp = {p.pp}·{p.dp}·{p.sp}·{p.tp} = "
                        f"{cfg.world_size}; start {cfg.world_size} processes (torchrun --nnodes × --nproc-per-node) "
                        "or change the parallel sizes")
    if max_restarts > 0 and cfg.checkpoint.enabled and not cfg.train.resume:
        problems.append(f"torchrun --max-restarts {max_restarts} restarts the workers after a failure, and with "
                        "train.resume=false the restarted job would refuse this run's own checkpoints; set "
                        "train.resume=true so that a restart continues from the newest checkpoint")
    return problems


# --- optional fused kernels (train.fused): whether apex is installed is looked up here, not in rules.py

APEX_INSTALL = ("pip install -v --no-build-isolation --config-settings '--build-option=--cpp_ext' "
                "--config-settings '--build-option=--cuda_ext' git+https://github.com/NVIDIA/apex")


def apex_available() -> bool:
    """Whether NVIDIA apex is importable here (looked up, not imported)."""
    return importlib.util.find_spec("apex") is not None


def resolve_fused(choice: str) -> str:
    """``train.fused`` as it runs: ``auto`` is apex when importable, else torch's fused kernels."""
    if choice == "auto":
        return "apex" if apex_available() else "torch"
    return choice


def fused_problem(choice: str) -> Optional[str]:
    """``train.fused=apex`` where apex is not installed: how to install it, or what to use instead."""
    if choice == "apex" and not apex_available():
        return ("train.fused=apex needs NVIDIA apex, which is not installed here (it is not on the package "
                f"index; it builds against CUDA): {APEX_INSTALL} — or use train.fused=torch (torch's fused "
                "AdamW and RMSNorm) or auto (apex when present, else torch)")
    return None
