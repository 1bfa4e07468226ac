"""Job configuration: pydantic v2 models loaded from YAML, with dotted overrides.

One YAML file is one job. Every section has defaults, so ``Config()`` (or
``Config.model_validate({})``) is a valid small job. Unknown keys are errors.
Cross-field rules are checked here, before any process group exists, and each
message names the fields involved and a value that would work.

The world size is not a field: it is ``pp·dp·sp·tp`` (checked against
``WORLD_SIZE`` at launch under torchrun).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which field to change and how."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


def _near_divisible(value: int, divisor: int) -> str:
    """'use 68 or 72' — the nearest values of ``value`` that ``divisor`` divides."""
    lo = (value // divisor) * divisor
    hi = lo + divisor
    return f"{lo} or {hi}" if lo > 0 else f"{hi}"


def grid_side(tp: int, field: str = "parallel.tp") -> int:
    """``q`` with ``tp = q²``; ``ValueError`` naming the nearest perfect squares otherwise.

    The single home of this rule: the config, the mesh and tensor2d all call it.
    """
    if int(tp) != tp or tp < 1:
        raise ValueError(f"{field}={tp} must be an integer ≥ 1 (a perfect square q²)")
    q = math.isqrt(tp)
    if q * q != tp:
        raise ValueError(f"{field}={tp} is not a perfect square (2D tensor parallelism runs on a q×q "
                         f"SUMMA grid, tp = q²); use {field}={q * q} or {(q + 1) ** 2}")
    return q


class ParallelConfig(_Section):
    """Sizes of the mesh axes. World size = pp·dp·sp·tp; tp = q² for the q×q grid."""

    pp: int = Field(1, ge=1, description="pipeline stages (ranks along the pp axis)")
    dp: int = Field(1, ge=1, description="data-parallel replicas")
    sp: int = Field(1, ge=1, description="sequence-parallel ranks (ring attention)")
    tp: int = Field(1, ge=1, description="2D tensor-parallel ranks, a perfect square q²")

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


class PipelineConfig(_Section):
    schedule: Literal["gpipe", "1f1b", "interleaved", "hanayo"] = "1f1b"
    microbatches: int = Field(1, ge=1)
    waves: int = Field(1, ge=1, description="Hanayo waves W (2·W·pp chunks)")
    chunks_per_rank: int = Field(2, ge=1, description="model chunks per rank for the interleaved schedule")

    def num_chunks(self, pp: int) -> int:
        """How many model chunks this schedule cuts the model into for ``pp`` ranks."""
        if self.schedule == "hanayo":
            return 2 * self.waves * pp
        if self.schedule == "interleaved":
            return self.chunks_per_rank * pp
        return pp


class SequenceConfig(_Section):
    layout: Literal["contiguous", "zigzag"] = "zigzag"
    causal: bool = True


class HeteroConfig(_Section):
    enabled: bool = False
    chunk_elems: Optional[int] = Field(None, ge=1, description="elements per chunk; None = searched")
    device_budget_bytes: Optional[int] = Field(None, ge=1, description="model-data bytes allowed on the compute device")
    policy: Literal["belady", "lru"] = "belady"
    compute_device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    dynamic_budget: bool = Field(False, description="budget = device memory minus the traced non-model peak")


class OptimizerConfig(_Section):
    name: Literal["adamw", "adam"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="linear warm-up; constant learning rate after")


class ModelConfig(_Section):
    vocab_size: int = Field(256, ge=2)
    seq_len: int = Field(64, ge=1)
    hidden: int = Field(64, ge=1)
    heads: int = Field(4, ge=1)
    layers: int = Field(2, ge=1)
    mlp_ratio: int = Field(4, ge=1)
    tie_embeddings: bool = True
    norm_eps: float = Field(1e-5, gt=0)
    init_std: float = Field(0.02, gt=0)


class DataConfig(_Section):
    source: Literal["synthetic", "text"] = "synthetic"
    batch_size: int = Field(8, ge=1, description="global sequences per step")
    seed: int = 0
    text_root: Optional[str] = Field(None, description="directory of text files; None = Python's standard library")
    max_bytes: int = Field(4_000_000, ge=1024, description="bytes of corpus to read")


class TrainConfig(_Section):
    steps: int = Field(10, ge=1)
    seed: int = 0
    dtype: Literal["float32", "float64", "bfloat16"] = Field(
        "float32", description="parameter dtype; bfloat16 means float32 weights under bf16 autocast")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    grad_clip: Optional[float] = Field(None, gt=0)
    out_dir: str = "runs/default"
    log_every: int = Field(1, ge=1)
    resume: bool = False
    timeout_s: float = Field(300.0, gt=0, description="limit for any one collective / p2p wait")
    job_timeout_s: Optional[float] = Field(None, gt=0, description="kill the whole local job after this many seconds")
    threads_per_worker: Optional[int] = Field(None, ge=1, description="torch threads per local worker; None = cores / workers")


class CheckpointConfig(_Section):
    enabled: bool = True
    every: int = Field(0, ge=0, description="save every N steps (0 = only at the end)")
    dir: Optional[str] = Field(None, description="default: <train.out_dir>/checkpoints")
    keep: int = Field(2, ge=1, description="how many recent checkpoints to keep")


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
    deepspeed: Optional[dict[str, Any]] = Field(None, description="passed through to the DeepSpeed plugin")

    @model_validator(mode="after")
    def _cross_field(self) -> "Config":
        problems = cross_field_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def cross_field_problems(cfg: Config) -> list[str]:
    """Every rule that ties fields together; one readable message per broken rule."""
    p, m, pl = cfg.parallel, cfg.model, cfg.pipeline
    q = p.q
    out = []
    if m.hidden % m.heads:
        good = [h for h in range(1, m.hidden + 1) if m.hidden % h == 0]
        near = min(good, key=lambda h: (abs(h - m.heads), h))
        out.append(f"model.hidden={m.hidden} is not divisible by model.heads={m.heads}; "
                   f"use model.heads={near} or model.hidden={_near_divisible(m.hidden, m.heads)}")
    if q > 1:
        for name, value in (("model.heads", m.heads), ("model.hidden", m.hidden), ("model.vocab_size", m.vocab_size)):
            if value % q:
                out.append(f"{name}={value} is not divisible by q={q} (parallel.tp={p.tp} is a {q}×{q} grid); "
                           f"use {name}={_near_divisible(value, q)} or a smaller parallel.tp")
    if p.sp > 1:
        div = 2 * p.sp if cfg.sequence.layout == "zigzag" else p.sp
        if m.seq_len % div:
            why = f"2·parallel.sp={div} (zigzag cuts the sequence into 2·sp pieces)" if div != p.sp else f"parallel.sp={p.sp}"
            out.append(f"model.seq_len={m.seq_len} is not divisible by {why}; "
                       f"use model.seq_len={_near_divisible(m.seq_len, div)}")
    per_step = p.dp * q * pl.microbatches
    if cfg.data.batch_size % per_step:
        out.append(f"data.batch_size={cfg.data.batch_size} is not divisible by parallel.dp·q·pipeline.microbatches"
                   f" = {p.dp}·{q}·{pl.microbatches} = {per_step}; use data.batch_size="
                   f"{_near_divisible(cfg.data.batch_size, per_step)} or fewer pipeline.microbatches")
    if p.pp > 1:
        from .pipeline.checks import pipeline_arg_problems  # pure arithmetic, no torch

        out += pipeline_arg_problems(m.layers, p.pp, pl.microbatches, pl.schedule, pl.waves, pl.chunks_per_rank)
    if cfg.hetero.enabled and cfg.train.grad_clip and (p.pp > 1 or p.tp > 1):
        out.append("train.grad_clip with hetero.enabled=true needs parallel.pp=1 and parallel.tp=1 (hetero's "
                   "gradient norm covers the data replicas only); unset train.grad_clip or hetero")
    if cfg.hetero.enabled and p.pp > 1 and m.tie_embeddings and pl.schedule != "hanayo":
        out.append(f"hetero.enabled=true with pipeline.schedule={pl.schedule} cannot keep a tied embedding and "
                   "LM head on two pp ranks in step; use pipeline.schedule=hanayo (both ends on rank 0) or "
                   "model.tie_embeddings=false")
    if cfg.data.source == "synthetic" and m.vocab_size < 2:
        out.append("model.vocab_size must be ≥ 2")
    if cfg.data.source == "text" and m.vocab_size < 256:
        out.append(f"data.source=text is byte-level and needs model.vocab_size≥256, got {m.vocab_size}; use 256")
    if cfg.data.source == "text" and cfg.data.text_root and not Path(cfg.data.text_root).is_dir():
        out.append(f"data.text_root={cfg.data.text_root!r} is not a directory; point it at a folder of .py files "
                   "or leave it unset to use Python's standard library")
    return out


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Apply ``["train.steps=50", "parallel.dp=2"]`` to a config dict (values parsed as YAML)."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value, e.g. train.steps=50")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has no field name; use section.field=value")
        _set_dotted(data, key, yaml.safe_load(raw) if raw.strip() else None)
    return data


def _suggest(loc: tuple) -> str:
    """'did you mean model?' for a misspelt key, from the fields valid at that place."""
    import difflib

    model: type[BaseModel] = Config
    for key in loc[:-1]:
        field = model.model_fields.get(str(key))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return "remove it"
        model = ann
    valid = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid fields here: {', '.join(valid)}"


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field '{where}'; {_suggest(e['loc'])}"
        elif e["type"] == "missing":
            msg = f"missing field '{where}'"
        elif where and not msg.startswith(where.split(".")[0]):
            msg = f"{where}: {msg}"
        lines.extend(msg.splitlines())
    return "\n".join(f"  - {line}" for line in lines)


def make_config(data: dict | Config | None = None, overrides: list[str] | None = None) -> Config:
    """Validate a dict (or re-validate a Config) with overrides; ``ConfigError`` on failure."""
    if isinstance(data, Config):
        data = data.model_dump(mode="json")
    data = apply_overrides(dict(data or {}), overrides)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError("invalid configuration:\n" + format_validation_error(err)) from None


def load_config(path: str | Path | Config | dict, overrides: list[str] | None = None) -> Config:
    """Load a YAML job file (or take a dict / Config) and apply dotted ``overrides``."""
    if isinstance(path, (Config, dict)):
        return make_config(path, overrides)
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (parallel:, model:, ...)")
    try:
        return make_config(data, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(cfg.to_yaml())
