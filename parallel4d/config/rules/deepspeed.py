"""The ``deepspeed:`` section's rules that need only its values and parallel4d's fields: the batch
keys, ZeRO stages against the layout, the dtypes, clipping, a second learning-rate schedule, the
keys parallel4d itself decides, and what DeepSpeed cannot run on a CPU. ``integrations/deepspeed``
adds those that need DeepSpeed itself (the keys its parser never reads, its sub-section models,
the optimizer and scheduler types it finds) and calls the ones here that it checks at resolve time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config

DOCS = "see https://www.deepspeed.ai/docs/config-json/"
#: keys DeepSpeed reads that parallel4d's own fields already decide
TAKEN = {"tensor_parallel": "parallel.tp (parallel4d's 2D tensor parallelism replaces DeepSpeed's AutoTP)",
         "pipeline": "parallel.pp and the pipeline: section (parallel4d's executor runs the schedule)",
         # read by deepspeed.initialize (not DeepSpeedConfig): both together build DeepSpeed's own dp × sp mesh
         "sequence_parallel_size": "parallel.sp (parallel4d's ring attention; DeepSpeed would build its own mesh)",
         "data_parallel_size": "parallel.dp (the mesh parallel4d hands DeepSpeed as its mpu)"}
#: DeepSpeed optimizer types that run on torch's code when ``torch_adam`` is set (no compiled op)
TORCH_OPTIMIZERS = ("adam", "adamw")


#: DeepSpeed's batch keys that are one of parallel4d's fields (the micro-batch is derived from both)
OURS = {"train_batch_size": "data.batch_size", "gradient_accumulation_steps": "pipeline.microbatches"}


def deepspeed_batch(cfg: Config) -> dict[str, int]:
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


def section_problems(cfg: Config) -> list[str]:
    """What in ``cfg.deepspeed`` cannot run with the rest of ``cfg``; one message each."""
    ds, p = cfg.deepspeed, cfg.parallel
    if ds is None:
        return []
    out = []
    why = (f"data.batch_size={cfg.data.batch_size}, parallel.dp={p.dp} and pipeline.microbatches="
           f"{cfg.pipeline.microbatches} make it")
    for key, want in deepspeed_batch(cfg).items():
        if key in ds and ds[key] != "auto" and (isinstance(ds[key], bool) or ds[key] != want):
            ours = OURS.get(key) if isinstance(ds[key], int) and not isinstance(ds[key], bool) and ds[key] >= 1 \
                else None
            out.append(f"deepspeed.{key}={ds[key]!r} but {why} {want} (train_batch_size = micro-batch × "
                       f"gradient_accumulation_steps × parallel.dp); set deepspeed.{key}={want}, \"auto\", or "
                       "leave it out" + (f" (for {ds[key]}, set {ours}={ds[key]}: parallel4d's field for it)"
                                         if ours else ""))
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
    if cfg.sequence.ulysses > 1:
        out.append(f"sequence.ulysses={cfg.sequence.ulysses} with a deepspeed: section: the DeepSpeed plugin shards "
                   "the sequence over the ring alone; use sequence.ulysses=1, or train without the deepspeed: section")
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
    steps = ds.get("steps_per_print")  # read with no default to type it: the engine takes the step modulo it
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        out.append(f"deepspeed.steps_per_print={steps!r}: DeepSpeed prints every that many steps (the step modulo "
                   "it, in every worker); write a whole number ≥ 1, e.g. deepspeed.steps_per_print=10, or leave it out")
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


def float16_problems(cfg: Config) -> list[str]:
    """``train.dtype=float16`` beside a ``deepspeed:`` section, whose own fp16 section scales the loss."""
    if cfg.train.autocast == "float16" and cfg.deepspeed is not None:
        return ["train.dtype=float16 with a deepspeed: section: use DeepSpeed's own fp16 section "
                "(deepspeed.fp16.enabled) and train.dtype=float32"]
    return []


def dropout_problem(cfg: Config) -> str | None:
    """Dropout under DeepSpeed, whose loop runs the model without the step and micro-batch its masks
    are drawn from (parallel4d's engine gives them): refused rather than trained without it."""
    m = cfg.model
    active = [f"model.{f}={v}" for f, v in (("dropout", m.dropout), ("attention_dropout", m.attention_p),
                                            ("embedding_dropout", m.embedding_p)) if v]
    if not active:
        return None
    return (f"{', '.join(dict.fromkeys(active))} with DeepSpeed: dropout masks are drawn from the step and each "
            "micro-batch's samples, which only parallel4d's own engine passes; set the model's dropouts to 0 or "
            "train without a deepspeed: section")


def dropout_problems(cfg: Config) -> list[str]:
    """:func:`dropout_problem` for a job with a ``deepspeed:`` section."""
    problem = dropout_problem(cfg) if cfg.deepspeed is not None else None
    return [problem] if problem else []


def taken_key_problems(section: dict) -> list[str]:
    """Keys of the section that parallel4d's own fields decide (:data:`TAKEN`)."""
    return [f"deepspeed.{key}: set by {TAKEN[key]}; remove it" for key in section if key in TAKEN]


def device_problems(section: dict, device_type: str, known_optimizer: Callable[[Any], bool]) -> list[str]:
    """What DeepSpeed cannot run on ``device_type`` (``"cpu"``: fp16, an optimizer it compiles at run
    time). ``known_optimizer(type)``: whether DeepSpeed finds that optimizer type (asked of DeepSpeed)."""
    if device_type != "cpu":
        return []
    out = []
    if isinstance(section.get("fp16"), dict) and section["fp16"].get("enabled") is True:
        out.append("deepspeed.fp16.enabled: DeepSpeed has no fp16 on CPU; use deepspeed.bf16.enabled=true, or "
                   "float32 (no fp16/bf16 section)")
    kind = section.get("optimizer", {}).get("type") if isinstance(section.get("optimizer"), dict) else None
    if known_optimizer(kind) and str(kind).lower() not in TORCH_OPTIMIZERS:
        out.append(f"deepspeed.optimizer.type={kind!r} needs an op DeepSpeed compiles at run time on CPU; use "
                   "type Adam or AdamW (run on torch's code), or remove deepspeed.optimizer to use parallel4d's "
                   "optimizer: section")
    return out
