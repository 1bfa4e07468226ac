"""Job configuration: pydantic v2 models loaded from YAML, with dotted overrides.

One YAML file is one job. Every section has defaults, so ``Config()`` (or
``Config.model_validate({})``) is a valid small job. Unknown keys are errors.
Cross-field rules are checked here, before any process group exists, and each
message names the fields involved and a value that would work.

The world size is not a field: it is ``pp·dp·sp·tp`` (checked against
``WORLD_SIZE`` at launch under torchrun, against ``train.max_local_workers`` by
:func:`local_job_problems` for a local launch).

Bad input stops here, as a :class:`ConfigError`, never in a worker: types are
strict (``steps: true`` or ``steps: "5"`` is an error, not 1 or 5), floats are
finite, and the YAML reader refuses aliases and duplicated keys.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import stat
import struct
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import (AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticUndefined

from parallel4d.config.hf_fields import mismatches, model_fields_from_hf, positions_short
from parallel4d.data.text_files import corpus_bytes
from parallel4d.data.token_files import token_file_problems
from parallel4d.config.rules import (SCHEDULES, batch_problem, did_you_mean, divisors, grid_side, not_divisible, num_chunks, or_list,
                    pipeline_arg_problems, splits_backward, tensor2d_problems)


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which field to change and how."""


class _Section(BaseModel):
    # strict: YAML has already typed every value, so `true` or "5" in an int field is a mistake, not 1 or 5.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=False)


def _check_path(value: str) -> str:
    if not value:
        raise ValueError("is an empty path; give a directory, or leave the field out for its default")
    if "\0" in value:
        raise ValueError(f"{value!r} contains a NUL byte, which no file system accepts; remove it")
    return _encodes(value)


def _encodes(value: str) -> str:
    """``value`` if it can be a file name here (a lone surrogate such as ``"\\ud800"`` cannot)."""
    try:
        os.fsencode(value)
    except UnicodeEncodeError as e:
        raise ValueError(f"{_short(value)} cannot be written as a file name ({e.reason}: character {e.start}, "
                         f"{value[e.start]!r}); use a path of valid characters") from None
    return value


MAX_SECONDS = 365 * 24 * 3600.0  # a longer timedelta overflows torch's millisecond timers

def _float32(value: float) -> float:
    """A float the step can use: float32 (parameters, optimizer state) holds it, neither overflowing
    to inf nor, when non-zero, rounding to 0."""
    try:
        rounded = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # some Pythons refuse to pack it rather than giving inf
        rounded = math.inf
    if math.isinf(rounded):
        raise ValueError(f"{value!r} is beyond float32's range (±3.4e38), where training computes; use a "
                         "finite float32 value")
    if value != 0 and rounded == 0:
        raise ValueError(f"{value!r} rounds to 0 in float32, where training computes; use a value of at least "
                         "1e-38 (or 0 where the field allows it)")
    return value


Finite = Annotated[float, AllowInfNan(False), AfterValidator(_float32)]
Beta = Annotated[float, AllowInfNan(False), Field(ge=0, lt=1), AfterValidator(_float32)]
Seconds = Annotated[float, AllowInfNan(False), Field(ge=1, le=MAX_SECONDS)]
# Upper bounds a real job stays far below; above them sizes overflow an address space or a counter
# before anything useful runs (and a 10**30 would reach a worker as an OverflowError).
MAX_RANKS = 65536  # along one axis
MAX_STEPS = 10**12
MAX_WIDTH = 2**17  # hidden, heads; the widest released models use 2**14 to 2**15
MAX_LAYERS = 512  # the deepest released models have ~128; `parallel4d plan` dry-runs every block
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]  # data.py multiplies it by 1_000_003; torch seeds are 64-bit
PathStr = Annotated[str, AfterValidator(_check_path)]
Pattern = Annotated[str, AfterValidator(_encodes)]


class ParallelConfig(_Section):
    """Sizes of the mesh axes. World size = pp·dp·sp·tp; tp = q² for the q×q grid."""

    pp: int = Field(1, ge=1, le=MAX_RANKS, description="pipeline stages (ranks along the pp axis)")
    dp: int = Field(1, ge=1, le=MAX_RANKS, description="data-parallel replicas")
    sp: int = Field(1, ge=1, le=MAX_RANKS, description="sequence-parallel ranks (ring attention)")
    tp: int = Field(1, ge=1, le=MAX_RANKS, description="2D tensor-parallel ranks, a perfect square q²")

    @field_validator("tp")
    @classmethod
    def _square(cls, tp: int) -> int:
        grid_side(tp)
        return tp

    @property
    def q(self) -> int:
        return math.isqrt(self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp


class Tensor2DConfig(_Section):
    overlap: bool = Field(True, description="issue step t+1's broadcast before step t's matmul")


# rules.SCHEDULES spelt out, as pydantic and type checkers want (tests/test_rules.py compares them)
ScheduleName = Literal[SCHEDULES]  # the names live in rules.SCHEDULES


class PipelineConfig(_Section):
    schedule: ScheduleName = "1f1b"
    microbatches: int = Field(1, ge=1, le=2**20)
    waves: int = Field(1, ge=1, le=MAX_LAYERS, description="Hanayo waves W (2·W·pp chunks)")
    chunks_per_rank: int = Field(2, ge=1, le=MAX_LAYERS, description="model chunks per rank for the interleaved schedule")
    split_backward: bool = Field(False, description="hanayo: split each backward into input-gradient (B) and "
                                                    "weight-gradient (W) actions; zb_h1 and zbv always do")

    def num_chunks(self, pp: int) -> int:
        """How many model chunks this schedule cuts the model into for ``pp`` ranks."""
        return num_chunks(self.schedule, pp, self.waves, self.chunks_per_rank)


class SequenceConfig(_Section):
    layout: Literal["contiguous", "zigzag"] = "zigzag"
    causal: bool = True


class HeteroConfig(_Section):
    enabled: bool = False
    chunk_elems: Optional[int] = Field(None, ge=1, le=2**40, description="elements per chunk; None = searched")
    device_budget_bytes: Optional[int] = Field(None, ge=1, le=2**50, description="model-data bytes allowed on the compute device")
    policy: Literal["belady", "lru"] = "belady"
    compute_device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    dynamic_budget: bool = Field(False, description="budget = device memory minus the traced non-model peak")

    @field_validator("compute_device")
    @classmethod
    def _device(cls, spec: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", spec):
            raise ValueError(f"hetero.compute_device={spec!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N' "
                             "(N = a GPU index); use hetero.compute_device=auto")
        return spec


class OptimizerConfig(_Section):
    name: Literal["adamw", "adam"] = "adamw"
    lr: Finite = Field(1e-3, gt=0)
    # strict=False for the tuple only, so a YAML list is accepted; each beta stays strict and finite.
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), strict=False, description="each finite, 0 ≤ β < 1")
    eps: Finite = Field(1e-8, gt=0)
    weight_decay: Finite = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="linear warm-up from lr/warmup_steps to lr")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="after the warm-up: lr throughout, or a cosine / linear decay to min_lr")
    min_lr: Finite = Field(0.0, ge=0, description="cosine / linear: the learning rate at decay_steps and after")
    decay_steps: Optional[int] = Field(None, ge=1, le=MAX_STEPS, description="cosine / linear: the step the decay reaches "
                                                               "min_lr; None = train.steps")
    decay_norms_and_biases: bool = Field(False, description="weight decay on norm gains and biases too")
    decay_embeddings: bool = Field(False, description="weight decay on the token and position tables too")


class ModelConfig(_Section):
    arch: Literal["gpt2", "llama"] = Field("gpt2", description="gpt2: LayerNorm, learned positions, GELU MLP; "
                                                               "llama: RMSNorm, rotary, SwiGLU, grouped-query "
                                                               "attention (Llama, Mistral, Qwen2)")
    vocab_size: int = Field(256, ge=2, le=2**32, description="token ids: a token file stores them as uint16 or "
                                                               "uint32")
    seq_len: int = Field(64, ge=1, le=2**24)
    hidden: int = Field(64, ge=1, le=MAX_WIDTH)
    heads: int = Field(4, ge=1, le=MAX_WIDTH)
    kv_heads: Optional[int] = Field(None, ge=1, le=MAX_WIDTH, description="llama: key/value heads (grouped-query attention); "
                                                             "None = heads")
    layers: int = Field(2, ge=1, le=MAX_LAYERS)
    mlp_ratio: int = Field(4, ge=1, le=64)
    intermediate_size: Optional[int] = Field(None, ge=1, le=2**20, description="MLP width; None = mlp_ratio·hidden")
    tie_embeddings: bool = Field(True, description="the LM head is the token table; default true for gpt2, "
                                                   "false for llama")
    norm_eps: Finite = Field(1e-5, gt=0)
    init_std: Finite = Field(0.02, gt=0)
    rope_theta: Finite = Field(10000.0, gt=0, description="llama: rotary base")
    qkv_bias: bool = Field(False, description="llama: biases on the q, k, v projections (Qwen2)")
    activation: Literal["gelu", "gelu_tanh"] = Field("gelu", description="gpt2: the MLP's GELU, exact or the "
                                                                         "tanh form of GPT-2 checkpoints")
    pretrained: Optional[PathStr] = Field(None, description="a Hugging Face model directory (config.json and "
                                                            "*.safetensors): the architecture from it, the weights "
                                                            "loaded, each rank reading its own slices")

    @model_validator(mode="after")
    def _family_defaults(self) -> "ModelConfig":
        if self.arch == "llama" and "tie_embeddings" not in self.model_fields_set:
            self.tie_embeddings = False  # Llama, Mistral and Qwen2 have their own LM head
        return self

    @property
    def kv_heads_or_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or self.mlp_ratio * self.hidden


def model_shape_changes(saved: dict, model: ModelConfig) -> list[str]:
    """The fields whose values in ``saved`` (a checkpoint's ``model:`` section, as stored) give the
    dense model other tensor shapes than ``model`` does: ``"model.hidden=64 there, 128 here"`` each."""
    def get(field: str) -> Any:
        if field == "kv_heads":
            return saved.get("kv_heads") or saved.get("heads")
        if field == "intermediate_size":
            return saved.get("intermediate_size") or (saved.get("mlp_ratio") or 0) * (saved.get("hidden") or 0)
        return saved.get(field)

    ours = {"kv_heads": model.kv_heads_or_heads, "intermediate_size": model.mlp_width}
    fields = ["arch", "vocab_size", "hidden", "heads", "kv_heads", "layers", "intermediate_size", "tie_embeddings",
              "qkv_bias"] + (["seq_len"] if model.arch == "gpt2" else [])  # gpt2 learns a table of positions
    return [f"model.{f}={get(f)!r} there, {ours.get(f, getattr(model, f))!r} here" for f in fields
            if get(f) is not None and get(f) != ours.get(f, getattr(model, f))]


class DataConfig(_Section):
    source: Literal["synthetic", "text", "tokens"] = Field(
        "synthetic", description="synthetic sequences, bytes of .py files, or a token file (data.path)")
    path: Optional[PathStr] = Field(None, description="tokens: the .bin file `parallel4d tokenize` wrote (its "
                                                      ".json sidecar beside it)")
    batch_size: int = Field(8, ge=1, le=2**24, description="global sequences per step")
    seed: Seed = 0
    text_root: Optional[PathStr] = Field(None, description="directory of .py files (≥ 1024 bytes of them); "
                                                            "None = Python's standard library")
    max_bytes: int = Field(4_000_000, ge=1024, le=2**40, description="bytes of corpus to read")
    text_glob: Optional[list[Pattern]] = Field(None, description="text: glob patterns under data.text_root (or the "
                                                             "standard library), e.g. ['**/*.md', 'src/**/*.txt']; "
                                                             "None = every .py file")
    val_path: Optional[PathStr] = Field(None, description="validation token file (data.source: tokens), its "
                                                          "sidecar beside it")
    val_fraction: Optional[float] = Field(None, gt=0, lt=1, description="hold out the last fraction of the text "
                                                                        "or token file for validation")


class TrainConfig(_Section):
    steps: int = Field(10, ge=1, le=MAX_STEPS)
    seed: Seed = 0
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = Field(
        "float32", description="the precision preset: float32 or float64 parameters and compute; bfloat16 / "
                               "float16: float32 parameters, forward and backward under that autocast (float16 "
                               "with dynamic loss scaling). param_dtype, autocast_dtype, grad_reduce_dtype say "
                               "each part explicitly")
    param_dtype: Optional[Literal["float32", "float64"]] = Field(
        None, description="parameters, optimizer state and the tensors between pipeline stages; None: from "
                          "train.dtype (float64 for float64, else float32)")
    autocast_dtype: Optional[Literal["none", "bfloat16", "float16"]] = Field(
        None, description="compute precision of matmuls and attention (torch.autocast); float16 scales the loss "
                          "dynamically; None: from train.dtype")
    grad_reduce_dtype: Optional[Literal["float32", "float64", "bfloat16"]] = Field(
        None, description="dtype of the data-parallel gradient all-reduce; None: the parameters' dtype")
    fused: Literal["auto", "apex", "torch", "off"] = Field(
        "off", description="optimizer and norm kernels: torch's fused AdamW and RMSNorm, NVIDIA apex's FusedAdam "
                           "and fused norms, auto (apex when installed, else torch), off (the plain reference ops)")
    loss_scale_init: Finite = Field(65536.0, gt=0, description="float16: the first loss scale; halved on every "
                                                               "step whose gradients overflow (that step skipped "
                                                               "on every rank)")
    loss_scale_window: int = Field(1000, ge=1, le=MAX_STEPS, description="float16: steps without an overflow before the loss "
                                                           "scale doubles")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    grad_clip: Optional[Finite] = Field(None, gt=0)
    out_dir: PathStr = "runs/default"
    log_every: int = Field(1, ge=1, le=MAX_STEPS, description="a progress line and a metrics.jsonl record every this many steps")
    tensorboard: bool = Field(False, description="also write TensorBoard scalars under <out_dir>/tensorboard "
                                                 "(needs the tensorboard package: pip install 'parallel4d[viz]')")
    resume: bool = False
    activation_checkpointing: Literal["none", "blocks"] = Field(
        "none", description="blocks: keep only each transformer block's input and recompute the block in the "
                            "backward (less activation memory, about a third more compute)")
    eval_every: Optional[int] = Field(None, ge=1, le=MAX_STEPS, description="validation loss every this many steps (and at the "
                                                             "last); None: no validation")
    eval_batches: int = Field(4, ge=1, le=2**20, description="batches of data.batch_size in each validation (the same ones "
                                                   "each time)")
    timeout_s: Seconds = Field(300.0, description="limit for any one collective / p2p wait, in seconds: at least 1 "
                                                   "(less fails healthy collectives on a busy host), at most a year")
    join_timeout_s: Seconds = Field(600.0, description="under torchrun, how long the ranks of one attempt may take "
                                                       "to join (start, imports, first connections), in seconds: "
                                                       "their start-up can differ by far more than one collective")
    job_timeout_s: Optional[Seconds] = Field(None, description="kill the whole local job after this many seconds "
                                                               "(1 s to a year); None = a week")
    threads_per_worker: Optional[int] = Field(None, ge=1, le=4096, description="torch threads per local worker, at "
                                                                         "most the machine's cores; None = cores / "
                                                                         "workers")
    dp_bucket_mb: Finite = Field(25.0, gt=0, le=2**20, description="MiB of gradients per data-parallel all-reduce; buckets "
                                                          "are posted during the backward as their gradients are "
                                                          "ready")
    max_local_workers: int = Field(64, ge=1, le=MAX_RANKS, description="a local (non-torchrun) launch refuses a world size "
                                                         "pp·dp·sp·tp above this; raise it only for a machine that "
                                                         "really runs that many processes")

    @property
    def parameters(self) -> str:
        """The parameters' dtype name (``param_dtype``, or what ``dtype`` implies)."""
        return self.param_dtype or ("float64" if self.dtype == "float64" else "float32")

    @property
    def autocast(self) -> str:
        """The autocast dtype name, ``"none"`` without autocast (``autocast_dtype``, or ``dtype``'s)."""
        return self.autocast_dtype or (self.dtype if self.dtype in ("bfloat16", "float16") else "none")

    @property
    def grad_reduce(self) -> str:
        """The data-parallel gradient all-reduce's dtype name."""
        return self.grad_reduce_dtype or self.parameters


class CheckpointConfig(_Section):
    enabled: bool = True
    every: int = Field(0, ge=0, le=MAX_STEPS, description="save every N steps (0 = only at the end)")
    dir: Optional[PathStr] = Field(None, description="default: <train.out_dir>/checkpoints")
    keep: int = Field(2, ge=1, le=2**20, description="how many recent checkpoints to keep")


class Config(_Section):
    """A whole job. ``Config()`` is a valid small job on one process."""

    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    tensor2d: Tensor2DConfig = Field(default_factory=Tensor2DConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    sequence: SequenceConfig = Field(default_factory=SequenceConfig)
    hetero: HeteroConfig = Field(default_factory=HeteroConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    deepspeed: Optional[dict[str, Any]] = Field(None, description="a DeepSpeed config (ds_config) for training "
                                                                  "inside DeepSpeed (the deepspeed extra); None = "
                                                                  "parallel4d's own engine")

    @model_validator(mode="after")
    def _cross_field(self) -> "Config":
        problems = cross_field_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.dir``, or ``<train.out_dir>/checkpoints`` when unset."""
        return Path(self.checkpoint.dir or Path(self.train.out_dir) / "checkpoints")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


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
    """Fields that belong to one model family, and what that family needs."""
    out = []
    # a value other than the default in another family's field (a dumped config holds every field)
    defaults = ModelConfig.model_fields
    if m.arch == "gpt2":
        if m.kv_heads not in (None, m.heads):
            out.append(f"model.kv_heads={m.kv_heads} with model.arch=gpt2: grouped-query attention is llama's; "
                       "remove model.kv_heads or set model.arch=llama")
        out += [f"model.{f}={getattr(m, f)} is a llama field and model.arch=gpt2 does not read it; remove it or "
                "set model.arch=llama" for f in ("rope_theta", "qkv_bias") if getattr(m, f) != defaults[f].default]
        if m.intermediate_size not in (None, m.mlp_ratio * m.hidden):
            out.append(f"model.intermediate_size={m.intermediate_size} with model.arch=gpt2: its MLP is "
                       f"model.mlp_ratio·hidden = {m.mlp_ratio * m.hidden} wide; set model.mlp_ratio or remove "
                       "model.intermediate_size")
        return out
    if m.activation != defaults["activation"].default:
        out.append(f"model.activation={m.activation} is gpt2's (llama's MLP is SwiGLU); remove it")
    kv = m.kv_heads_or_heads
    if m.heads % kv:
        out.append(f"model.kv_heads={kv} must divide model.heads={m.heads} (each key/value head serves a group of "
                   f"query heads); use {or_list(d for d in divisors(m.heads) if d <= m.heads)}")
    if m.hidden % m.heads == 0 and (m.hidden // m.heads) % 2:
        out.append(f"model.hidden/model.heads = {m.hidden // m.heads} is odd, and rotary embeddings rotate pairs of "
                   "dimensions; use an even head size")
    by = f"q={q} (parallel.tp={q * q} is a {q}×{q} grid: each grid column holds whole key/value heads and an MLP block)"
    out += filter(None, [not_divisible("model.kv_heads", kv, q, by),
                         not_divisible("model.intermediate_size", m.mlp_width, q, by)])
    return out


MAX_PARAMETERS = 2**45  # ~3.5e13: 128 TiB in float32, twenty times the largest models trained
MAX_WORLD = 2**20


def dense_parameters(m: ModelConfig) -> int:
    """About how many parameters the dense model of ``m`` has (norms and biases left out)."""
    h, kv = m.hidden, m.kv_heads_or_heads
    tables = m.vocab_size * h * (1 if m.tie_embeddings else 2)
    if m.arch == "gpt2":
        return tables + m.seq_len * h + m.layers * (4 * h * h + 2 * h * m.mlp_width)
    return tables + m.layers * (2 * h * h + 2 * h * (h // m.heads) * kv + 3 * h * m.mlp_width)


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


MAX_YAML_DEPTH = 32


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML that a job file may not use (an alias, a duplicated key)."""


class _YamlLoader(yaml.SafeLoader):
    """``yaml.safe_load`` hardened for job files and ``--set`` values.

    Aliases are refused: a 300-byte alias bomb expands to gigabytes once walked, and a config
    needs none. A duplicated key is an error (PyYAML silently keeps the last). Plain scalars are
    typed by YAML 1.2's core schema, not PyYAML's YAML 1.1 one (:data:`CORE_SCHEMA`): ``yes``,
    ``on``, ``1:30``, ``017``, ``1_000`` and ``2001-12-14`` stay strings, which the strict fields
    refuse with a hint (:func:`yaml11_hint`), instead of becoming true, 90, 15, 1000 and a date.
    """

    depth = 0
    yaml_implicit_resolvers: dict = {}  # replaced below by CORE_SCHEMA's, never PyYAML's YAML 1.1 set

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(problem=f"YAML aliases (*{event.anchor}) are not accepted in a config; "
                                   "write the value out in full", problem_mark=event.start_mark)
        if self.depth >= MAX_YAML_DEPTH:  # deeper input would end in a RecursionError here or when dumped
            raise _Refused(problem=f"more than {MAX_YAML_DEPTH} levels of nesting; a job file is a few levels "
                                   "of sections: write it so (see configs/)", problem_mark=event.start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise _Refused(problem=f"duplicate key {key!r}; keep only one of them",
                                   problem_mark=key_node.start_mark)
                seen.add(key)
            except TypeError:  # an unhashable key: SafeConstructor reports it
                pass
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        """A core-schema integer: decimal, ``0o`` octal or ``0x`` hexadecimal, of any length (the
        field's bound then refuses it by name; ``int()`` alone refuses 4300+ digits with a traceback)."""
        text = self.construct_scalar(node)
        digits = text.lstrip("+-")
        base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
        value = _parse_int(digits[2:] if base != 10 else digits, base)
        return -value if text.startswith("-") else value


def _parse_int(digits: str, base: int, piece: int = 1000) -> int:
    """``int(digits, base)`` a ``piece`` of digits at a time, so that no conversion meets Python's
    limit on the digits of one string."""
    value = 0
    for start in range(0, len(digits), piece):
        part = digits[start:start + piece]
        value = value * base ** len(part) + int(part, base)
    return value


#: YAML 1.2's core schema: (tag, pattern, first characters)
CORE_SCHEMA = (
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?(?:0|[1-9][0-9]*)|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    # a dot or an exponent, as 1.2 floats that are not also integers (017 stays a string, see _YAML11)
    ("float", r"[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*|[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+)|[-+]?\.(?:inf|Inf|INF)"
              r"|\.(?:nan|NaN|NAN)", "-+0123456789."),
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
)
for _tag, _pattern, _first in CORE_SCHEMA:
    _YamlLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_pattern})$"), list(_first))
_YamlLoader.add_constructor("tag:yaml.org,2002:int", _YamlLoader.construct_yaml_int)

_YAML11_BOOL = (re.compile(r"(?i)yes|no|on|off|y|n"), "YAML 1.1 read it as a boolean; write true or false")
_YAML11 = ((re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"),
            "YAML 1.1 read it as a base-60 number; write the number itself, e.g. 90 for 1:30"),
           (re.compile(r"[-+]?0[0-9_]+"), "YAML 1.1 read a leading 0 as octal; write the number without it"),
           (re.compile(r"[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?"),
            "write the number without underscores"),
           (re.compile(r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}.*"), "YAML 1.1 read it as a date; write a number"))


def yaml11_hint(value: Any, boolean: bool) -> str | None:
    """Why a string a job file gave for a ``boolean`` (else numeric) field would have been one under
    YAML 1.1 (which parallel4d does not follow), and what to write; None for any other value."""
    if not isinstance(value, str):
        return None
    hints = (_YAML11_BOOL,) if boolean else _YAML11
    return next((hint for pattern, hint in hints if pattern.fullmatch(value)), None)


def _parse_yaml(text: str, what: str, fix: str) -> Any:
    """``text`` parsed by :class:`_YamlLoader`; ``ConfigError`` naming ``what`` and the place otherwise."""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        context = f" ({e.context})" if getattr(e, "context", None) else ""
        if isinstance(e, _Refused):  # the problem says what to do
            raise ConfigError(f"{what}: {where}{problem}") from None
        raise ConfigError(f"{what} is not valid YAML: {where}{problem}{context}; {fix}") from None
    except RecursionError:
        raise ConfigError(f"{what} nests too deeply to be a config") from None


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {_short(dotted)}: {_short(k)} is not a section; write section.field=value")
        node = nxt
    node[keys[-1]] = value


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Apply ``["train.steps=50", "parallel.dp=2"]`` to a config dict (values parsed as YAML)."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {_short(item)} must look like section.field=value; write it so, e.g. "
                              "train.steps=50")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {_short(item)} has no field name; use section.field=value")
        fix = "write a YAML value such as 64, 0.001, true, [0.9, 0.95] or a quoted string"
        value = _parse_yaml(raw, f"override {_short(item)}: the value {_short(raw)}", fix) if raw.strip() else None
        _set_dotted(data, key, value)
    return data


def _model_at(keys: tuple) -> Optional[type[BaseModel]]:
    """The section model at the path ``keys`` (``()`` = Config), or None past a plain field."""
    model: type[BaseModel] = Config
    for key in keys:
        ann = getattr(model.model_fields.get(str(key)), "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _suggest(loc: tuple) -> str:
    """'did you mean model?' for a misspelt key, from the fields valid at that place."""
    model = _model_at(loc[:-1])
    if model is None:
        return "remove it"
    valid = list(model.model_fields)
    return f"{did_you_mean(loc[-1], valid)}valid fields here: {', '.join(valid)}"


_WANT = {"int_type": "a whole number", "float_type": "a finite number", "finite_number": "a finite number",
         "bool_type": "true or false", "string_type": "a string (quote it if YAML reads it as a number)"}


def _short(text: Any, width: int = 80) -> str:
    """``repr(text)`` cut to ``width`` characters: a message must not echo a 5,000-digit value."""
    shown = repr(text)
    return shown if len(shown) <= width else shown[:width - 3] + "..."


def _shown(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, int) and abs(value).bit_length() > 100:  # repr() of 4300+ digits raises
        return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    return ("the string " if isinstance(value, str) else "") + _short(value)


def _field_default(loc: tuple) -> Any:
    """The default of the field at ``loc`` (an item of a list or tuple: the field's); PydanticUndefined
    past a plain field or without one."""
    loc = tuple(k for k in loc if not isinstance(k, int))
    model = _model_at(loc[:-1]) if loc else None
    field = model.model_fields.get(loc[-1]) if model else None
    return getattr(field, "default", PydanticUndefined)


def _example(loc: tuple, where: str, ok=lambda v: True) -> str:
    """', e.g. train.steps=10' from the field's default when ``ok(default)``, else ''."""
    default = _field_default(loc)
    if default is None or default is PydanticUndefined or isinstance(default, dict):
        return ""
    if isinstance(default, (tuple, list)):  # the whole list, under the field's own name
        return f", e.g. {where.split('[')[0]}=[{', '.join(map(str, default))}]"
    if not ok(default):
        return ""
    return f", e.g. {where}={default if isinstance(default, str) else _shown(default)}"


_BOUNDS = {"greater_than_equal": ("ge", "≥", lambda v, b: v >= b), "greater_than": ("gt", ">", lambda v, b: v > b),
           "less_than_equal": ("le", "≤", lambda v, b: v <= b), "less_than": ("lt", "<", lambda v, b: v < b)}


def _bound_fix(kind: str, bound: Any, loc: tuple, where: str) -> str:
    """'; use parallel.pp=1 or more' for an integer field, '; use a value > 0, e.g. optimizer.lr=0.001'."""
    key, sign, holds = _BOUNDS[kind]
    if isinstance(bound, int) and not isinstance(_field_default(loc), float):
        closest = bound + {"gt": 1, "lt": -1}.get(key, 0)
        return f"; use {where}={closest} or {'more' if key in ('ge', 'gt') else 'less'}"
    return f"; use a value {sign} {bound}{_example(loc, where, lambda v: holds(v, bound))}"


def _fix(e: dict, loc: tuple, where: str) -> str:
    """What to write instead, for pydantic's generic errors (our own value errors carry their fix)."""
    kind, ctx = e["type"], e.get("ctx") or {}
    yaml11 = yaml11_hint(e.get("input"), kind == "bool_type") if kind in _WANT else None
    if yaml11:
        return f" ({yaml11})"
    if kind in _WANT:
        return f"; write {_WANT[kind]}{_example(loc, where)}"
    if kind in _BOUNDS:
        return _bound_fix(kind, ctx.get(_BOUNDS[kind][0]), loc, where)
    if kind == "literal_error":
        return f"; {did_you_mean(str(e.get('input')), _literal_choices(ctx))}use one of those{_example(loc, where)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"; write {where} as a mapping of its fields (field: value on indented lines below it)"
    if kind in ("tuple_type", "list_type", "too_short", "too_long", "missing"):
        example = _example(loc, where)
        return f"; write the whole list{example}" if example else "; write it as a YAML list"
    return ""


def _literal_choices(ctx: dict) -> list[str]:
    """``"'gpt2' or 'llama'"`` → ``["gpt2", "llama"]``."""
    return re.findall(r"'([^']*)'", str(ctx.get("expected", "")))


def format_validation_error(err: ValidationError, prefix: tuple = ()) -> str:
    """One ``  - `` line per error, naming the field as in the job file and the fix; ``prefix``:
    where the validated model sits in :class:`Config` (``("hetero",)`` for a section alone)."""
    lines = []
    for e in err.errors():
        loc = (*prefix, *e["loc"])
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field '{where}'; {_suggest(loc)}"
        elif e["type"] == "missing":
            msg = f"missing field '{where}'" if not isinstance(loc[-1], int) else f"{where} is missing"
        elif where and not msg.startswith(where.split(".")[0]):
            msg = f"{where}: {msg}"
        if e["type"] not in ("value_error", "extra_forbidden", "missing") and not isinstance(e.get("input"), dict):
            msg += f", got {_shown(e['input'])}"  # strict types: say what YAML made of the value
        lines.extend((msg + _fix(e, loc, where)).splitlines())
    return "\n".join(f"  - {line}" for line in lines)


def make_config(data: dict | Config | None = None, overrides: list[str] | None = None) -> Config:
    """Validate a dict (or re-validate a Config) with overrides; ``ConfigError`` on failure."""
    if isinstance(data, Config):
        data = data.model_dump(mode="json")
    data = _pretrained_fields(apply_overrides(dict(data or {}), overrides))
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError("invalid configuration:\n" + format_validation_error(err)) from None


def _pretrained_fields(data: dict) -> dict:
    """``model:`` completed from ``model.pretrained``'s config.json; a field the job also gives
    must agree with it (ConfigError naming both)."""
    model = data.get("model")
    where = model.get("pretrained") if isinstance(model, dict) else None
    if not isinstance(where, str) or not where:
        return data  # absent, or refused by the field's own validation
    path = Path(where) / "config.json"
    try:
        hf = json.loads(path.read_text())
        if not isinstance(hf, dict):
            raise ValueError(f"holds a JSON {type(hf).__name__}, not the mapping of a model's settings; point "
                             "model.pretrained at a Hugging Face model directory")
        fields = model_fields_from_hf(hf)
    except OSError as e:
        raise ConfigError(f"model.pretrained={where!r}: cannot read {path} ({e.strerror or e}); point it at a "
                          "Hugging Face model directory (config.json and *.safetensors)") from None
    except ValueError as e:  # a JSON error or a model the dense references cannot be
        raise ConfigError(f"model.pretrained={where!r}: {path}: {e}") from None
    disagree = [f"model.{k}={ours!r} but {path} makes it {theirs!r}" for k, ours, theirs in mismatches(fields, model)]
    positions = positions_short(hf, fields["arch"], model.get("seq_len", 0))
    if positions is not None:
        disagree.append(f"model.seq_len={model['seq_len']} is longer than the checkpoint's {positions} learned "
                        "positions (n_positions)")
    if disagree:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {d}; remove the field or change it"
                                                                  for d in disagree))
    return {**data, "model": {**fields, **model}}


MAX_CONFIG_BYTES = 1 << 20  # a job file is a few hundred bytes; refuse reading a huge one into memory

_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _config_kind(path: Path) -> Optional[str]:
    """What ``path`` is when it is not a regular file (it is never opened: a FIFO would block)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            return "a broken symbolic link"
        raise ConfigError(f"config file {str(path)!r} not found; check the path (the shipped jobs are in configs/)") \
            from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise ConfigError(f"config file {str(path)!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _NOT_FILES if test(mode)), "not a regular file")


def _read_config_text(path: Path) -> str:
    """The text of a job file; ``ConfigError`` saying what ``path`` is when it is not small UTF-8 text."""
    name = repr(str(path))
    kind = _config_kind(path)
    if kind:
        raise ConfigError(f"config file {name} is {kind}, not a YAML file; pass a job file such as "
                          "configs/quickstart.yaml")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config file {name} cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {name} is larger than {MAX_CONFIG_BYTES} bytes; a job file is a small YAML "
                          "file (see configs/)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {name} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                          "a binary file or a legacy encoding such as Latin-1; save the YAML as UTF-8") from None
    if "\0" in text:
        raise ConfigError(f"config file {name} is a binary file (it holds NUL bytes), not UTF-8 YAML text; pass a "
                          "job file such as configs/quickstart.yaml")
    return text


def load_config(path: str | Path | Config | dict, overrides: list[str] | None = None) -> Config:
    """Load a YAML job file (or take a dict / Config) and apply dotted ``overrides``."""
    if isinstance(path, (Config, dict)):
        return make_config(path, overrides)
    path = Path(path)
    data = _parse_yaml(_read_config_text(path), str(path), "fix the file at that place")
    if data is None:  # an empty file: all defaults
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (parallel:, model:, ...); write the "
                          "job as sections, e.g. 'train: {steps: 10}' (see configs/)")
    try:
        return make_config(data, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(cfg.to_yaml())


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
