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

import math
import os
import re
import struct
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, field_validator, model_validator

from parallel4d.config.checks import cross_field_problems
from parallel4d.config.errors import _short

from parallel4d.config.rules.common import SHAPE_FIELDS
from parallel4d.config.rules.pipeline import SCHEDULES, num_chunks
from parallel4d.config.rules.tensor2d import grid_side
from parallel4d.models.registry import NAMES as FAMILY_NAMES, SPECS, spec


class _Section(BaseModel):
    # strict: YAML has already typed every value, so `true` or "5" in an int field is a mistake, not 1 or 5.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=False)


def expand_home(path: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded, as a shell does: a job file's path fields
    (``PathStr``) mean the home directory there, not a directory named ``~``."""
    return os.path.expanduser(path)


def _check_path(value: str) -> str:
    if not value:
        raise ValueError("is an empty path; give a directory, or leave the field out for its default")
    if "\0" in value:
        raise ValueError(f"{value!r} contains a NUL byte, which no file system accepts; remove it")
    return _encodes(expand_home(value))


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
    """Sizes of the mesh axes. World size = pp·dp·sp·tp; tp = q² for the q×q grid. ``ep`` adds no ranks:
    it is drawn from the ``dp·sp`` data-replica ranks (config/rules/moe.py)."""

    pp: int = Field(1, ge=1, le=MAX_RANKS, description="pipeline stages (ranks along the pp axis)")
    dp: int = Field(1, ge=1, le=MAX_RANKS, description="data-parallel replicas")
    sp: int = Field(1, ge=1, le=MAX_RANKS, description="sequence-parallel ranks (ring attention)")
    tp: int = Field(1, ge=1, le=MAX_RANKS, description="2D tensor-parallel ranks, a perfect square q²")
    ep: int = Field(1, ge=1, le=MAX_RANKS, description="expert-parallel ranks: each MoE layer's experts split over "
                                                       "ep of the dp·sp data-replica ranks (no extra ranks)")

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

    @property
    def sizes(self) -> str:
        """``"pp=1 dp=2 sp=2 tp=1"``, with `` ep=2`` where experts are split (ep > 1)."""
        return f"pp={self.pp} dp={self.dp} sp={self.sp} tp={self.tp}" + (f" ep={self.ep}" if self.ep > 1 else "")


class Tensor2DConfig(_Section):
    overlap: bool = Field(True, description="issue step t+1's broadcast before step t's matmul")


# rules.pipeline.SCHEDULES spelt out, as pydantic and type checkers want (tests/test_rules.py compares them)
ScheduleName = Literal[SCHEDULES]  # the names live in rules.pipeline.SCHEDULES


class PipelineConfig(_Section):
    schedule: ScheduleName = "1f1b"
    microbatches: int = Field(1, ge=1, le=2**20)
    waves: int = Field(1, ge=1, le=MAX_LAYERS, description="Hanayo waves W (2·W·pp chunks)")
    chunks_per_rank: int = Field(2, ge=1, le=MAX_LAYERS, description="model chunks per rank for the interleaved schedule")
    split_backward: bool = Field(False, description="hanayo: split each backward into input-gradient (B) and "
                                                    "weight-gradient (W) actions; zb_h1 and zbv always do")
    hop_cost: Optional[Any] = Field(
        None, description="hanayo, zb_h1, zbv: build the order for this time of one activation hop between pp "
                          "ranks, in forwards of one chunk; auto: measured at start (a short probe agreed on "
                          "every rank); None: an order robust to hops of 0 to 0.5")

    @field_validator("hop_cost")
    @classmethod
    def _hop_cost(cls, value):
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e6:
            raise ValueError(f"pipeline.hop_cost={value!r} is not 'auto' or a number of chunk forwards in [0, 1e6]; "
                             "use auto to measure it, or e.g. 0.5")
        return float(value)

    def num_chunks(self, pp: int) -> int:
        """How many model chunks this schedule cuts the model into for ``pp`` ranks."""
        return num_chunks(self.schedule, pp, self.waves, self.chunks_per_rank)


class SequenceConfig(_Section):
    layout: Literal["contiguous", "zigzag"] = "zigzag"
    causal: bool = True
    ulysses: int = Field(1, ge=1, le=2**20, description="sp ranks per Ulysses group (all-to-all over heads); the "
                                                        "ring runs over sp/ulysses: 1 the ring alone, sp pure Ulysses")
    kernel: Literal["auto", "blockwise"] = Field(
        "auto", description="the attention core: 'auto' PyTorch's SDPA at parallel.sp=1 and the ring's blockwise "
                            "kernel above; 'blockwise' the ring's kernel at sp=1 too (on one rank: the core an sp "
                            "layout computes, e.g. to compare an FP8 run across sp, docs/configuration.md)")


class HeteroConfig(_Section):
    enabled: bool = False
    chunk_elems: Optional[int] = Field(None, ge=1, le=2**40, description="elements per chunk; None = searched")
    device_budget_bytes: Optional[int] = Field(None, ge=1, le=2**50, description="model-data bytes allowed on the compute device")
    policy: Literal["belady", "lru"] = "belady"
    compute_device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    dynamic_budget: bool = Field(False, description="budget = device memory minus the traced non-model peak")
    compute_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = Field(
        None, description="dtype of the parameters and gradients in the device chunks; the master parameters "
                          "and Adam moments stay in the parameters' dtype on the host. None: the autocast dtype "
                          "under train.dtype=bfloat16/float16, else the parameters' dtype")

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


# models.registry.NAMES spelt out: one model family each (models/<family>/spec.py), the first the default
ArchName = Literal[FAMILY_NAMES]


class RopeScaling(_Section):
    """``model.rope_scaling``: a scaled rotary as transformers' ``rope_parameters`` / ``rope_scaling`` state
    it (the parameters each ``rope_type`` reads; the others stay unset)."""

    rope_type: Literal["linear", "dynamic", "yarn", "llama3"]
    factor: Finite = Field(..., gt=0)
    original_max_position_embeddings: Optional[int] = Field(None, ge=1, le=2**24)
    low_freq_factor: Optional[Finite] = None  # llama3
    high_freq_factor: Optional[Finite] = None  # llama3
    beta_fast: Optional[Finite] = None  # yarn
    beta_slow: Optional[Finite] = None  # yarn
    attention_factor: Optional[Finite] = None  # yarn
    mscale: Optional[Finite] = None  # yarn (DeepSeek's form)
    mscale_all_dim: Optional[Finite] = None  # yarn (DeepSeek's form)
    truncate: Optional[bool] = None  # yarn


class LoraConfig(_Section):
    """``model.lora``: low-rank adapters on the named linears, the base frozen (peft's LoRA)."""

    rank: int = Field(..., ge=1, le=2**16, description="the adapters' rank r: lora_A [r, in], lora_B [out, r]")
    alpha: Finite = Field(..., gt=0, description="the adapter's product is scaled by alpha / rank (rslora: "
                          "alpha / √rank), peft's lora_alpha")
    dropout: Finite = Field(0.0, ge=0, lt=1, description="dropout on each adapter's input (peft's lora_dropout)")
    targets: list[str] = Field(..., min_length=1, description="the linears adapted, by peft's target_modules names "
                               "(llama family: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; gpt2: "
                               "c_attn c_proj c_fc)")
    rslora: bool = Field(False, description="rank-stabilised LoRA: scaling alpha / √rank (peft's use_rslora)")
    adapter: Optional[PathStr] = Field(None, description="a peft adapter directory to start from "
                                       "(adapter_config.json + adapter_model.safetensors, as peft's save_pretrained "
                                       "writes it): its r, lora_alpha, target_modules, use_rslora fill rank, alpha, "
                                       "targets, rslora (given ones must agree) and its weights start the adapters")


class ModelConfig(_Section):
    arch: ArchName = Field(FAMILY_NAMES[0], description="; ".join(f"{s.name}: {s.summary}" for s in SPECS))
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
    max_positions: Optional[int] = Field(None, ge=1, le=2**24, description="the positions the model has: gpt2's "
                                         "position table rows (seq_len ≤ it; rows past seq_len kept as they are), "
                                         "llama's max_position_embeddings (what rotary scaling reads); None = seq_len")
    head_dim: Optional[int] = Field(None, ge=1, le=MAX_WIDTH, description="llama: width of one attention head; "
                                                                        "None = hidden/heads (Qwen3 sets it)")
    qk_norm: bool = Field(False, description="llama: RMSNorm over each head's queries and keys before the rotary "
                                             "(Qwen3)")
    rope_scaling: Optional[RopeScaling] = Field(None, description="llama: scaled rotary (linear, dynamic, yarn, "
                                                                  "llama3) with the checkpoint's own parameters")
    dropout: Finite = Field(0.0, ge=0, lt=1, description="dropout on the residual branches in training (never in "
                                                         "evaluation); masks drawn per dense element, so every "
                                                         "layout drops the same elements")
    attention_dropout: Optional[Finite] = Field(None, ge=0, lt=1, description="dropout on the attention "
                                                                              "probabilities; None = model.dropout")
    embedding_dropout: Optional[Finite] = Field(None, ge=0, lt=1, description="dropout on the embedding's output; "
                                                                              "None = model.dropout")
    # mixtures of experts (llama family; docs/models.md), named as transformers' Qwen3-MoE, Qwen2-MoE and Mixtral
    # name them (Mixtral's num_local_experts is num_experts here)
    num_experts: int = Field(0, ge=0, le=2**16, description="llama: routed experts per MoE layer; 0 = no MoE "
                                                            "layers (one dense MLP per block)")
    num_experts_per_tok: Optional[int] = Field(None, ge=1, le=2**16, description="llama: experts each token is "
                                                                                   "routed to (top-k); needed "
                                                                                   "with num_experts")
    moe_intermediate_size: Optional[int] = Field(None, ge=1, le=2**20, description="llama: one expert's SwiGLU "
                                                                                   "width; None = intermediate_size "
                                                                                   "(Mixtral's)")
    shared_expert_intermediate_size: int = Field(0, ge=0, le=2**20, description="llama: Qwen2-MoE's shared "
                                                                                "expert (every token, a sigmoid "
                                                                                "gate) width; 0 = none")
    norm_topk_prob: bool = Field(False, description="llama: the top-k routing weights renormalised to sum to 1 "
                                                    "(Mixtral's routing: a softmax over the top-k logits)")
    decoder_sparse_step: int = Field(1, ge=1, le=MAX_LAYERS, description="llama: layer i (from 0) is an MoE layer "
                                                                         "when (i+1) is a multiple of it and i is "
                                                                         "not in mlp_only_layers")
    mlp_only_layers: list[Annotated[int, Field(ge=0, le=MAX_LAYERS)]] = Field(
        default_factory=list, max_length=MAX_LAYERS, description="llama: layers (from 0) that keep the dense MLP")
    router_aux_loss_coef: Finite = Field(0.001, ge=0, description="llama: the load-balancing loss's weight in the "
                                                                  "training loss (with output_router_logits)")
    output_router_logits: bool = Field(False, description="llama: add router_aux_loss_coef × the load-balancing "
                                                          "loss to the loss, as transformers does when it is true")
    lora: Optional[LoraConfig] = Field(None, description="low-rank adapters (peft's LoRA): the base frozen, only "
                                       "the adapters trained")
    pretrained: Optional[PathStr] = Field(None, description="a Hugging Face model directory (config.json and "
                                                            "*.safetensors): the architecture from it, the weights "
                                                            "loaded, each rank reading its own slices")

    @model_validator(mode="after")
    def _family_defaults(self) -> "ModelConfig":
        for name, value in spec(self.arch).defaults.items():  # e.g. llama's own LM head (tie_embeddings false)
            if name not in self.model_fields_set:
                setattr(self, name, value)
        return self

    @property
    def kv_heads_or_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or self.mlp_ratio * self.hidden

    @property
    def expert_width(self) -> int:
        """One routed expert's SwiGLU width (``moe_intermediate_size``, else the dense MLP's: Mixtral's)."""
        return self.moe_intermediate_size or self.mlp_width

    @property
    def positions(self) -> int:
        """The positions the model has (``max_positions``, else ``seq_len``)."""
        return self.max_positions or self.seq_len

    @property
    def head_size(self) -> int:
        """The width of one attention head (``head_dim``, else ``hidden/heads``)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def attention_p(self) -> float:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def embedding_p(self) -> float:
        return self.dropout if self.embedding_dropout is None else self.embedding_dropout


def model_shape_changes(saved: dict, model: ModelConfig) -> list[str]:
    """The fields whose values in ``saved`` (a checkpoint's ``model:`` section, as stored) give the
    dense model other tensor shapes than ``model`` does: ``"model.hidden=64 there, 128 here"`` each."""
    def get(field: str) -> Any:
        if field == "kv_heads":
            return saved.get("kv_heads") or saved.get("heads")
        if field == "head_dim":  # a checkpoint's model: section written before the field existed has none
            return saved.get("head_dim") or (saved["hidden"] // saved["heads"] if saved.get("hidden") and
                                             saved.get("heads") else None)
        if field == "qk_norm":
            return saved.get("qk_norm", False)
        if field == "intermediate_size":
            return saved.get("intermediate_size") or (saved.get("mlp_ratio") or 0) * (saved.get("hidden") or 0)
        if field == "max_positions":  # None: seq_len (checkpoints from before the field too)
            return saved.get("max_positions") or saved.get("seq_len")
        return saved.get(field)

    ours = {"kv_heads": model.kv_heads_or_heads, "intermediate_size": model.mlp_width, "head_dim": model.head_size,
            "qk_norm": model.qk_norm, "max_positions": model.positions}
    fields = [*SHAPE_FIELDS] + (["max_positions"] if spec(model.arch).learned_positions else [])  # a table of positions
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
    packing: Literal["none", "documents"] = Field(
        "none", description="documents: each sequence holds documents end to end, each ended by data.eod_token; "
                            "attention stays inside a document, positions restart at each, and no token is "
                            "trained to predict the next document's first")
    eod_token: Optional[int] = Field(None, ge=0, le=2**31, description="the end-of-document token id "
                                                                        "(data.packing: documents); None: the "
                                                                        "token file's eos_token_id")


class TrainConfig(_Section):
    steps: int = Field(10, ge=1, le=MAX_STEPS)
    seed: Seed = 0
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = Field(
        "float32", description="the precision preset: float32 or float64 parameters and compute; bfloat16 / "
                               "float16: float32 parameters, forward and backward under that autocast (float16 "
                               "with dynamic loss scaling). param_dtype, autocast_dtype, grad_reduce_dtype say "
                               "each part explicitly")
    param_dtype: Optional[Literal["float32", "float64"]] = Field(
        None, description="parameters and optimizer state (and the tensors between pipeline stages without "
                          "autocast); None: from train.dtype (float64 for float64, else float32)")
    autocast_dtype: Optional[Literal["none", "bfloat16", "float16"]] = Field(
        None, description="compute precision of matmuls and attention (torch.autocast), and the dtype activations "
                          "and their gradients cross pipeline stages in; float16 scales the loss dynamically; None: "
                          "from train.dtype")
    grad_reduce_dtype: Optional[Literal["float32", "float64", "bfloat16"]] = Field(
        None, description="dtype of the data-parallel gradient all-reduce; None: the parameters' dtype")
    tf32: bool = Field(True, description="on CUDA, float32 matmuls and cuDNN kernels use TensorFloat-32 tensor cores "
                                         "(10-bit mantissa products, float32 sums: several times faster on Ampere and "
                                         "later); false: full float32 products. Set per worker process; CPU runs and "
                                         "float64 parameters are unaffected")
    fused: Literal["auto", "apex", "torch", "off"] = Field(
        "off", description="optimizer and norm kernels: torch's fused AdamW and RMSNorm, NVIDIA apex's FusedAdam "
                           "and fused norms, auto (apex when installed, else torch), off (the plain reference ops)")
    loss_scale_init: Finite = Field(65536.0, gt=0, description="float16: the first loss scale; halved on every "
                                                               "step whose gradients overflow (that step skipped "
                                                               "on every rank)")
    loss_scale_window: int = Field(1000, ge=1, le=MAX_STEPS, description="float16: steps without an overflow before the loss "
                                                           "scale doubles")
    fp8: Literal["none", "rowwise"] = Field(
        "none", description="rowwise: every linear of the transformer blocks (attention projections, MLP) computes "
                            "its forward and both backward products in FP8 (e4m3 operands, one power-of-two scale per "
                            "row of the left operand and per column of the right, float32 sums: torchao's rowwise "
                            "recipe); the embedding, the LM head, the master weights and the optimizer unchanged. "
                            "One process only for now; none: the products in train.dtype")
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
    compile: Literal["none", "blocks"] = Field(
        "none", description="blocks: each transformer block's forward compiled on its own by torch.compile "
                            "(inductor; one compilation shared by the blocks), its collectives left eager; "
                            "the first step compiles, later steps reuse it. none: eager")
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

    def shown_yaml(self) -> str:
        """The job as ``parallel4d validate`` prints it: :meth:`to_yaml` with the ``model:`` section
        reduced to the fields its family reads (a llama job shows no ``activation``), each unset one
        that stands for another value showing that value; loading it gives the same model."""
        data = self.model_dump(mode="json")
        data["model"] = spec(self.model.arch).shown(self.model)
        return yaml.safe_dump(data, sort_keys=False)
