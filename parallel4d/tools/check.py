"""``parallel4d check JOB.yaml``: the job's own layout, shrunk to a laptop, against one process.

A user's job is their own combination of layout and features; each technique being exact alone does
not prove them exact together. The check keeps the layout (pp, dp, sp, tp, or the largest sub-layout
with every axis that was > 1 still > 1 when the world exceeds the local limit) and every feature the
config names (schedule, waves, split backward, hop cost, ring layout, Ulysses, hetero at the same
budget ratio, ZeRO, activation checkpointing, the model family and its options, tied head, packing,
evaluation), shrinks the model to the smallest shape the config's own rules accept, and trains a few
steps on CPU over gloo in float64. The reference is the same job on one process with none of the
techniques: plain layers, no pipeline, no ring, no chunks. Equal means every step's loss and every
parameter within the run's :class:`Tolerance` (:func:`tolerance`): in float64 :data:`FLOAT64`; a job with
``train.fp8`` runs its FP8 products on both sides, over float32 parameters (FP8 never runs in float64),
against :data:`FP8`.

:func:`shrunk` (pure: configs in, overrides out), :func:`run_check` (runs both, compares) and
:func:`format_report` are apart, so the fuzzer in the suite runs draws through the same code.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from parallel4d.checkpoint.gather import gather, with_tied_head
from parallel4d.checkpoint.steps import step_name
from parallel4d.config.checks import dense_parameters
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config
from parallel4d.config.rules.hetero import chunk_step
from parallel4d.config.schema import Config
from parallel4d.engine.compose import job_schedule, pipeline_cut
from parallel4d.launcher import launch as launch_module
from parallel4d.models.lora import is_adapter
from parallel4d.models.moe.spec import MoeShape
from parallel4d.planning.dry_run import plan


@dataclass(frozen=True)
class Tolerance:
    """What equal means for a check: every loss within ``loss`` relative; every parameter within ``param``
    relative, an entry under ``param_atol / param`` in size within ``param_atol`` absolute instead (a key
    bias's gradient is zero in exact arithmetic: its entries are rounding noise)."""

    loss: float
    param: float
    param_atol: float
    #: the share of the parameters' elements that may be further off, each within 2⁻⁴ of what AdamW can move it in
    #: the run (lr per step): FP8's roundings flipped by a float32 reordering (:data:`FP8`)
    flips: float = 0.0

    def describe(self) -> str:
        flips = (f"; at most {self.flips:g} of the elements further off, each within 2⁻⁴·lr·steps (a flipped e4m3 "
                 "rounding)") if self.flips else ""
        return (f"every loss within {self.loss:g}, every parameter within {self.param:g} (relative; entries under "
                f"{self.param_atol / self.param:g} within {self.param_atol:g} absolute{flips})")

    def flip_limit(self, cfg: Config) -> float:
        """How far a flipped element may be off: 2⁻⁴ (e4m3's step, what a flip changes an operand by) of the most
        AdamW moves a parameter in ``cfg``'s run, about ``optimizer.lr`` per step."""
        return 2 ** -4 * cfg.optimizer.lr * cfg.train.steps


#: float64 on both sides: the techniques reorder float64 sums only
FLOAT64 = Tolerance(loss=1e-10, param=1e-9, param_atol=1e-12)
#: ``train.fp8`` on both sides over float32 parameters: the same scales (#50.3), so what differs is float32's
#: reordering of sums (the products' own sums and the reductions across ranks). Losses: the issue's 1e-6. A
#: parameter after n AdamW steps carries n float32 roundings of its own (n·2⁻²⁴ ≈ 2e-7) and the update's share
#: of a reordered gradient: AdamW's update is about lr whatever the gradient's scale, so a gradient off by γ
#: moves it by about 2γ·lr, γ ≈ √K·2⁻²⁴ for a sum of K terms (K ≤ 2048 tokens here: 3e-6), lr ≤ 1e-3: ~1e-8
#: absolute, under 1e-5 of entries above 1e-2. Below 1e-2 (biases that start at 0; a key bias's gradient is only
#: rounding noise η, which AdamW turns into lr·η/(η+ε)), 1e-7 absolute. FP8 against no FP8 moves parameters by
#: 5e-3 and more (e4m3 rounds to 2⁻⁴): the check tells them apart (tests/test_check.py). Flips: FP8's rounding is
#: discontinuous, so a float32 reordering that moves an operand element across an e4m3 rounding boundary changes it
#: by one e4m3 step, and the parameters it reaches part by more than float32's reordering — rarely (measured: 2 of
#: 48 fuzzer draws, both tp=4 × sp=2, one element each, 1.7e-7 and 1.1e-7 off), within 2⁻⁴ of AdamW's reach; at
#: most one element in a thousand, as the spawned FP8 tests allow. A layout's mistake moves whole tensors.
FP8 = Tolerance(loss=1e-6, param=1e-5, param_atol=1e-7, flips=1e-3)
AXES = ("pp", "dp", "sp", "tp")  # the mesh's axes (their product is the world); ep adds no ranks

# What the check fixes whatever the job says: float64 on CPU, a short run, a checkpoint at its end
RUN = ["train.dtype=float64", "train.param_dtype=null", "train.autocast_dtype=null", "train.fp8=none",
       "train.grad_reduce_dtype=null", "train.device=cpu", "train.compile=none", "train.fused=torch",
       "train.log_every=1000", "train.tensorboard=false", "train.resume=false", "train.threads_per_worker=1",
       "train.job_timeout_s=null", "train.grad_clip=null", "checkpoint.enabled=true", "checkpoint.every=0",
       "checkpoint.dir=null", "hetero.compute_device=cpu", "hetero.dynamic_budget=false",
       "model.dropout=0.0", "model.attention_dropout=null", "model.embedding_dropout=null"]


#: AdamW's eps under FP8 (at least): float32 noise in a gradient that is zero in exact arithmetic (GPT-2's key bias:
#: softmax ignores what every key adds alike) is ~1e-12 at the check's shapes, and AdamW moves the parameter by
#: lr·η/(|η|+eps) — lr·1e-4 at eps 1e-8, and another η in each sum order. At 1e-5 that is lr·1e-7, under the
#: tolerance; a real gradient (≳1e-4 here) steps as it did. Measured on 24 fuzzer-like FP8 draws over sp: at eps 1e-8
#: GPT-2's key biases 1.05e-5 to 1.53e-5 apart (relative) in 5 of the 11 GPT-2 draws, beyond FP8's 1e-5; at 1e-5 every
#: parameter of every draw within 3.0e-7.
FP8_EPS = 1e-5


def fixed_run(cfg: Config) -> list[str]:
    """:data:`RUN`; for a job with ``train.fp8``, its FP8 kept over float32 parameters (FP8 never runs in
    float64: config/rules/fp8.py), on both sides of the comparison, and AdamW's eps at least :data:`FP8_EPS`."""
    if cfg.train.fp8 == "none":
        return RUN
    return [*RUN, "train.dtype=float32", f"train.fp8={cfg.train.fp8}",
            f"optimizer.eps={max(cfg.optimizer.eps, FP8_EPS)!r}"]


def tolerance(cfg: Config) -> Tolerance:
    """What equal means for the check's run ``cfg``: :data:`FP8` where its products are FP8, else :data:`FLOAT64`."""
    return FLOAT64 if cfg.train.fp8 == "none" else FP8


# The reference: one process, none of the techniques (the model and the data as the check's)
REFERENCE = ["parallel.pp=1", "parallel.dp=1", "parallel.sp=1", "parallel.tp=1", "parallel.ep=1", "pipeline.schedule=1f1b",
             "pipeline.waves=1", "pipeline.split_backward=false", "pipeline.hop_cost=null",
             "sequence.ulysses=1", "hetero.enabled=false", "train.activation_checkpointing=none"]


@dataclass
class Plan:
    """What the check runs: the job's overrides followed by ``overrides``; ``notes`` say what changed."""

    overrides: list[str]
    cfg: Config
    notes: list[str] = field(default_factory=list)

    def reference(self, path, job_overrides: list[str]) -> Config:
        return load_config(path, [*job_overrides, *self.overrides, *REFERENCE, *reference_kernel(self.cfg)])


def reference_kernel(cfg: Config) -> list[str]:
    """The reference's attention core: PyTorch's SDPA (code nobody here wrote); for an FP8 job over
    ``parallel.sp`` the ring's blockwise kernel on one rank, the core the layout computes. FP8's rounding is
    discontinuous: SDPA's float32 roundings differ from the ring's by ~1e-7, which can flip an e4m3 rounding
    and part the runs at FP8's precision — a difference of kernels, not of the layout (docs/check.md)."""
    return ["sequence.kernel=blockwise"] if cfg.train.fp8 != "none" and cfg.parallel.sp > 1 else []


# --- the sub-layout -----------------------------------------------------------------------------

def sub_layouts(cfg: Config, limit: int) -> list[dict[str, int]]:
    """Layouts of at most ``limit`` ranks, largest first: each axis at most the job's, an axis > 1 kept
    > 1, tp a square (its side at least 2 where the job's is), and ``ep`` (experts over ep of the dp·sp
    replicas: no ranks of its own) at most the job's and > 1 where the job's is — whether it divides the
    replicas and the experts is the config's rule (``config/rules/moe.py``), applied when each is loaded.
    The job's own first when it fits."""
    p = cfg.parallel
    want = {a: getattr(p, a) for a in (*AXES, "ep")}
    choices = {a: [v for v in range(2 if want[a] > 1 else 1, want[a] + 1)] for a in ("pp", "dp", "sp")}
    choices["tp"] = [k * k for k in range(2 if want["tp"] > 1 else 1, math.isqrt(want["tp"]) + 1)]
    out = []
    for combo in itertools.product(*(choices[a] for a in AXES)):
        replicas = combo[1] * combo[2]
        if math.prod(combo) <= limit:
            out += [dict(zip(AXES, combo), ep=ep) for ep in range(2 if want["ep"] > 1 else 1, want["ep"] + 1)
                    if ep <= replicas]  # drawn from the replicas: never more than they are
    # the largest world, then the job's own sizes where they tie (pp, then tp, sp, dp kept closest), ep largest
    return sorted(out, key=lambda d: (-world(d), *(-d[a] for a in ("pp", "tp", "sp", "dp", "ep"))))


def world(layout: dict[str, int]) -> int:
    """The ranks of a layout of :func:`sub_layouts` (``ep`` draws on the data replicas: none of its own)."""
    return math.prod(layout[a] for a in AXES)


# --- the smallest model the rules accept -------------------------------------------------------

def _shape_steps(cfg: Config) -> list[tuple[str, Callable[[], Iterator[list[str]]]]]:
    """Per dimension, its candidate overrides smallest first (the job's own value last, always valid
    as to that dimension)."""
    m, p, pl = cfg.model, cfg.parallel, cfg.pipeline
    group = m.heads // m.kv_heads if m.kv_heads else 1  # GQA kept: heads per key/value head

    def layers():
        first = max(1, pl.num_chunks(p.pp) - 2)
        if cfg.hetero.enabled and cfg.hetero.device_budget_bytes is not None:
            first += 3  # more chunks than the least budget holds: the check moves them (one layer fits it)
        for n in [*range(first, min(m.layers, first + 4)), m.layers]:
            kinds = _layer_kinds(m, n)
            if kinds is not None:
                yield [f"model.layers={n}", *kinds]

    # Qwen3's heads are wider than hidden/heads: the same ratio kept (hidden ≠ heads·head_dim is an option)
    ratio = (m.hidden, m.heads * m.head_dim) if m.head_dim else (1, 1)

    def heads():
        # a head at least 4 wide, a model at least 8: narrower ones make norms and attention degenerate
        for kv, d in sorted(itertools.product(range(1, 17), (4, 8)), key=lambda x: x[0] * group * x[1]):
            h = kv * group
            width, rest = divmod(h * d * ratio[0], ratio[1])
            if h > m.heads or h < min(2, m.heads) or width < 8 or rest:  # 2 heads: their split is part of the layout
                continue
            out = [f"model.heads={h}", f"model.hidden={width}"]
            out += [f"model.kv_heads={kv}"] if m.kv_heads else []
            out += [f"model.head_dim={d}"] if m.head_dim else []
            out += [f"model.intermediate_size={2 * h * d}"] if m.intermediate_size else []
            yield out
        yield []  # the job's own

    def seq():
        for s in sorted({p.sp * k for k in range(1, 17)} | {m.seq_len}):
            if min(8, m.seq_len) <= s <= m.seq_len:  # 8 tokens at least: a causal mask with rows to mask
                yield [f"model.seq_len={s}"] + ([f"model.max_positions={s}"] if m.max_positions else [])

    def batch():
        base = p.dp * math.isqrt(p.tp) * pl.microbatches
        for b in sorted({base * k for k in range(1, 5)} | {cfg.data.batch_size}):
            if b <= cfg.data.batch_size:
                yield [f"data.batch_size={b}"]

    def experts():
        # at least 2 experts per ep rank (routing within a rank is part of the layout) and more than the job's
        # top-k where the job's router chooses (a top-k of every expert routes nothing: the load-balancing loss
        # could not tell which tokens share a micro-batch); which counts split over ep: the config's rule
        # (config/rules/moe.py), as the candidates load
        k = m.num_experts_per_tok or 1
        for e in range(max(2 * p.ep, k + 1 if k < m.num_experts else k), m.num_experts):
            yield [f"model.num_experts={e}"]
        yield []  # the job's own (none without experts)

    def widths():
        # an expert (and the shared expert) at least 8 wide, as the model; only the widths the job sets
        fields = [f for f in ("moe_intermediate_size", "shared_expert_intermediate_size") if getattr(m, f)]
        for w in (8, 12, 16, 24, 32, 48, 64):
            yield [f"model.{f}={w}" for f in fields if w < getattr(m, f)]
        yield []

    return [("layers", layers), ("heads", heads), ("experts", experts), ("expert widths", widths),
            ("seq_len", seq), ("batch", batch)]


def _layer_kinds(m, n: int) -> Optional[list[str]]:
    """At ``n`` of the job's ``m.layers`` layers, the overrides that keep its kinds of layer (MoE layers,
    and dense ones where it has them: ``decoder_sparse_step`` applies as it is): ``mlp_only_layers``
    cut to the ``n`` layers, else with its layers past them moved to the last, else one dense layer of
    the ``n``; None when none keeps both kinds."""
    moe = MoeShape.of(m)
    if moe is None or n == m.layers:
        return []
    kinds = {moe.is_sparse(i) for i in range(m.layers)}
    candidates = [[i for i in m.mlp_only_layers if i < n], sorted({min(i, n - 1) for i in m.mlp_only_layers}),
                  *([i] for i in range(n))] if m.mlp_only_layers else [[]]
    for dense in candidates:
        small = dataclasses.replace(moe, mlp_only_layers=tuple(dense))
        if {small.is_sparse(i) for i in range(n)} == kinds:
            return [f"model.mlp_only_layers={json.dumps(dense)}"] if m.mlp_only_layers else []
    return None


def _first_valid(path, fixed: list[str], options: Iterator[list[str]]) -> Optional[list[str]]:
    for extra in options:
        try:
            load_config(path, [*fixed, *extra])
            return extra
        except ConfigError:
            continue
    return None


def _features(path, job: list[str], cfg: Config, own: list[str]) -> Optional[tuple[list[str], list[str]]]:
    """Overrides that keep the job's features at the shape ``own`` gives, and notes on what is not kept
    as it is; None when the rules refuse the hetero budget however it is scaled."""
    out, notes = [], []
    if cfg.train.eval_every is not None:
        out.append("train.eval_every=2")
    if cfg.data.source == "tokens" and cfg.data.path and not Path(cfg.data.path).exists():
        out += ["data.source=synthetic", "data.path=null", "data.val_path=null", "data.packing=none"]
        notes.append(f"data.path={cfg.data.path} is not on this machine: synthetic tokens instead")
    if cfg.train.compile != "none":
        notes.append("train.compile: not checked (compiles nothing on CPU in float64)")
    if cfg.train.fp8 != "none" and cfg.train.dtype != "float32":  # fixed_run: FP8 over float32 parameters
        notes.append(f"train.fp8={cfg.train.fp8}: checked in float32 (train.dtype={cfg.train.dtype}: its FP8 "
                     "products the same, their outputs and the parameters in float32 on both sides)")
    if cfg.train.fp8 != "none" and cfg.optimizer.eps < FP8_EPS:
        notes.append(f"optimizer.eps={cfg.optimizer.eps:g}: checked at {FP8_EPS:g} on both sides (FP8 over float32: "
                     "AdamW would turn the float32 noise of a gradient that is zero in exact arithmetic, such as a key "
                     "bias's, into steps that differ with the order of every sum)")
    if reference_kernel(cfg):
        notes.append(f"train.fp8={cfg.train.fp8} with parallel.sp={cfg.parallel.sp}: the reference runs the ring's "
                     "attention kernel (sequence.kernel=blockwise), the core the layout computes: against SDPA's "
                     "float32 roundings an e4m3 rounding may flip, and the runs part at FP8's precision (docs/check.md)")
    if cfg.model.lora is not None and cfg.model.lora.dropout:  # as model.dropout (RUN)
        out.append("model.lora.dropout=0.0")
        notes.append(f"model.lora.dropout={cfg.model.lora.dropout}: not checked (dropout off, as model.dropout)")
    if cfg.hetero.enabled and cfg.hetero.dynamic_budget:
        notes.append("hetero.dynamic_budget: not checked (a CPU has no device memory to measure)")
    hetero = _hetero_kept(path, [*job, *own, *out], cfg, notes)
    return None if hetero is None else ([*out, *hetero], notes)


def _hetero_kept(path, fixed: list[str], cfg: Config, notes: list[str]) -> Optional[list[str]]:
    """The job's hetero budget and chunk as the same share of the model's bytes at the shape ``fixed``
    gives (raised to what the rules and the chunk layout accept); None when the rules refuse it."""
    h = cfg.hetero
    if not h.enabled or (h.device_budget_bytes is None and h.chunk_elems is None):
        return []
    small = load_config(path, fixed)
    # the same share of the model data on the device: bytes scale with the weights and the dtype's size (the
    # check's: float64, or float32 under FP8)
    scale = dense_parameters(small.model) / max(1, dense_parameters(cfg.model)) * _element_bytes(small) \
        / _element_bytes(cfg)
    step = chunk_step(small.parallel.dp * small.parallel.sp)
    for factor in (2 ** k for k in range(40)):
        hetero = [f"hetero.device_budget_bytes={max(1, int(h.device_budget_bytes * scale * factor))}"] \
            if h.device_budget_bytes is not None else []
        hetero += [f"hetero.chunk_elems={-(-int(h.chunk_elems * scale * factor) // step) * step}"] \
            if h.chunk_elems is not None else []
        if _first_valid(path, fixed, iter([hetero])) is not None:
            if factor > 1:
                notes.append(f"hetero: {factor}× the job's budget ratio, the least the rules accept at this shape")
            return _at_least_the_layouts(load_config(path, [*fixed, *hetero]), hetero, notes)
        if scale * factor > _element_bytes(small) / _element_bytes(cfg):
            return None
    return None


def _at_least_the_layouts(cfg: Config, hetero: list[str], notes: list[str]) -> list[str]:
    """``hetero`` with the device budget raised to the least the chunk layout runs with, where it is
    below: what a module and the optimizer pin at once depends on how the parameters pack into chunks,
    which only the model knows (:func:`~parallel4d.planning.dry_run.plan` builds it, on fake tensors)."""
    if cfg.hetero.device_budget_bytes is None:
        return hetero
    resident = cfg.model_copy(update={"hetero": cfg.hetero.model_copy(update={"device_budget_bytes": None})})
    least = max(r.hetero_min_budget for r in plan(resident))
    if least <= cfg.hetero.device_budget_bytes:
        return hetero
    notes.append(f"hetero: the chunk layout's least budget, {least:,} bytes (the job's ratio gives "
                 f"{cfg.hetero.device_budget_bytes:,})")
    return [o for o in hetero if not o.startswith("hetero.device_budget_bytes")] + \
        [f"hetero.device_budget_bytes={least}"]


def _element_bytes(cfg: Config) -> int:
    """Bytes of one parameter element as the job keeps them (the config's own rule: ``train.parameters``)."""
    return 8 if cfg.train.parameters == "float64" else 4


def shrunk(path, job_overrides: list[str], steps: int = 3, max_workers: Optional[int] = None) -> Plan:
    """The check's overrides for the job ``path`` + ``job_overrides``: its layout (or the largest
    sub-layout of at most ``max_workers`` ranks, default ``train.max_local_workers``), each model and
    batch dimension cut to the smallest value the rules accept, the run fixed (:func:`fixed_run`)."""
    cfg = load_config(path, job_overrides)
    if cfg.deepspeed is not None:
        raise ConfigError("deepspeed: parallel4d check runs parallel4d's own engine; DeepSpeed's is checked "
                          "against ours by tests/test_deepspeed.py. Remove the deepspeed: section to check the "
                          "same layout on our engine")
    limit = max_workers or cfg.train.max_local_workers
    run = [*fixed_run(cfg), f"train.steps={steps}", f"train.max_local_workers={limit}"]
    weights = random_weights(cfg)
    job, refusals = [*job_overrides, *weights], []
    for layout in sub_layouts(cfg, limit):
        try:
            plan = _shrunk_at(path, job, cfg, [*run, *(f"parallel.{a}={v}" for a, v in layout.items())])
        except ConfigError as e:
            refusals.append(e)
            continue
        plan.overrides[:0] = weights  # first: the shape's overrides come after them
        if weights:
            plan.notes.insert(0, "model.pretrained: random weights at the family's options (the shape is shrunk)")
        if world(layout) < cfg.world_size:
            plan.notes.insert(0, f"world size {cfg.world_size} > {limit} local workers: the sub-layout "
                                 f"{plan.cfg.parallel.sizes}")
        return plan
    if cfg.world_size <= limit:  # the job's own layout was tried first: more workers would not help
        raise ConfigError(f"the check's run of this job ({_precision(cfg)} on CPU, the shape shrunk) is refused: "
                          f"{refusals[0]}")
    raise ConfigError(f"parallel: no layout of at most {limit} ranks keeps every axis of {cfg.parallel.sizes} "
                      "above 1 under this config's rules; raise --max-workers")


def _precision(cfg: Config) -> str:
    """What the check computes ``cfg``'s job in (:func:`fixed_run`), in words."""
    return "float64" if cfg.train.fp8 == "none" else f"FP8 ({cfg.train.fp8}) over float32 parameters"


def random_weights(cfg: Config) -> list[str]:
    """For a job with ``model.pretrained``: overrides that drop it and write out every ``model:`` field
    its config.json filled, so that the check shrinks the family and its options freely (a shrunk
    shape would contradict config.json); none for any other job."""
    if cfg.model.pretrained is None:
        return []
    fields = cfg.model.model_dump(mode="json", exclude={"pretrained"})
    return ["model.pretrained=null", *(f"model.{k}={json.dumps(v)}" for k, v in fields.items())]


def nothing_to_compare(path, job_overrides: list[str]) -> Optional[str]:
    """The line ``parallel4d check`` prints for a job that is its own reference (one process, no
    hetero, no recomputation: what the reference drops is what a single process runs), else None."""
    cfg = load_config(path, job_overrides)
    if cfg.world_size > 1 or cfg.hetero.enabled or cfg.train.activation_checkpointing != "none":
        return None
    return (f"parallel4d check {path}: one process (pp=1 dp=1 sp=1 tp=1) without hetero or activation "
            "checkpointing is the reference itself: nothing to compare (set parallel.dp/sp/tp/pp to check a layout)")


def _shrunk_at(path, job: list[str], cfg: Config, own: list[str]) -> Plan:
    """The smallest shape at the layout ``own`` names; ConfigError saying why when the rules refuse it."""
    at = load_config(path, [*job, *own])
    for name, options in _shape_steps(at):
        found = _first_valid(path, [*job, *own], options())
        if found is None:
            raise ConfigError(f"model: no {name} the rules accept at this layout")
        own = [*own, *found]
    kept = _features(path, job, cfg, own)
    if kept is None:
        raise ConfigError("hetero: no device budget the rules accept at the shrunk shape, however the job's "
                          "share is scaled; check the layout with hetero.enabled=false")
    return Plan([*own, *kept[0]], load_config(path, [*job, *own, *kept[0]]), kept[1])


# --- running and comparing ---------------------------------------------------------------------

@dataclass
class Difference:
    """The first tensor (in the model's order) beyond the tolerance, and its worst entry."""

    name: str
    index: tuple
    got: float
    want: float
    where: str

    def describe(self) -> str:
        rel = abs(self.got - self.want) / max(abs(self.want), 1e-300)
        return (f"{self.name}{list(self.index)}: {self.got!r} against one process's {self.want!r} "
                f"(relative {rel:.1e}){self.where}")


@dataclass
class Outcome:
    """Both runs' losses, the parameters' largest relative difference and the first that differs."""

    losses: list[float]
    reference_losses: list[float]
    validation: list[tuple[float, float]]
    tensors: int
    worst: tuple[str, float]
    first_loss_step: Optional[int]
    first_tensor: Optional[Difference]
    hetero_moved: Optional[int] = None  # rank 0's bytes moved host ↔ device per step: the budget bites
    adapters: Optional[tuple[int, float]] = None  # model.lora: (adapter tensors, their largest relative difference)
    tolerance: Tolerance = FLOAT64  # what equal meant (:func:`tolerance`)
    fp8: Optional[tuple[int, int]] = None  # train.fp8: the linears computing in FP8 (the layout's ranks, one process)
    flipped: Optional[tuple[int, int, float]] = None  # FP8: (elements beyond float32's tolerance, all, the farthest)

    @property
    def equal(self) -> bool:
        return self.first_loss_step is None and self.first_tensor is None


def run_check(path, job_overrides: list[str], plan: Plan, out_dir, train: Optional[Callable] = None,
              resume_at: Optional[int] = None) -> Outcome:
    """Trains the check's job and its one-process reference into ``out_dir`` (``train(cfg) → summary``,
    default :func:`~parallel4d.launcher.launch.launch`), then compares them. ``resume_at``: the job
    is stopped after that step (its checkpoint then) and resumed to the end, as after an interruption."""
    train = train or launch_module.launch  # read when called: a test may stand in for it
    out = Path(out_dir)
    if resume_at is None:
        got = train(into(plan.cfg, out / "layout"))
    else:
        got = _resumed(plan.cfg, out, resume_at, train)
    want = train(into(plan.reference(path, job_overrides), out / "one"))
    return compare(plan.cfg, got, want, out / "layout" / "checkpoints", out / "one" / "checkpoints")


def into(cfg: Config, out, **train) -> Config:
    """``cfg`` writing into ``out`` (``train.out_dir``), with any other ``train`` fields given."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"out_dir": str(out), **train})})


def _resumed(cfg: Config, out: Path, step: int, train: Callable) -> dict:
    """The job run to the end from its step-``step`` checkpoint (saved by a run that went on past it)."""
    if not 1 <= step < cfg.train.steps:
        raise ConfigError(f"--resume-at {step}: resume after a step within the run, 1 ≤ step < {cfg.train.steps}")
    first = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"every": step,
                                                                                   "keep": cfg.train.steps})})
    train(into(first, out / "interrupted"))
    (out / "layout" / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "interrupted" / "checkpoints" / step_name(step), out / "layout" / "checkpoints" / step_name(step))
    got = train(into(cfg, out / "layout", resume=True))
    if got.get("resumed_from") != step:
        raise RuntimeError(f"the resumed run started from step {got.get('resumed_from')}, not {step}")
    return got


def _dense(checkpoints: Path, tied: bool) -> dict:
    target = checkpoints.parent / "dense.pt"
    gather(checkpoints, target, progress=False)
    return with_tied_head(torch.load(target, weights_only=True)["model"], tied)


def compare(cfg: Config, got: dict, want: dict, got_ckpt: Path, want_ckpt: Path) -> Outcome:
    """The runs' summaries and final checkpoints against ``cfg``'s :func:`tolerance`."""
    tol = tolerance(cfg)
    a, b = got["losses"], want["losses"]
    bad = [i for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > tol.loss * abs(y)]
    bad += [min(len(a), len(b))] if len(a) != len(b) else []
    first_step = bad[0] + 1 if bad else None
    val = [(x["loss"], y["loss"]) for x, y in zip(got.get("validation", []), want.get("validation", []))]
    if any(abs(x - y) > tol.loss * abs(y) for x, y in val) and first_step is None:
        first_step = 0  # a validation loss differs
    mine, ref = _dense(got_ckpt, cfg.model.tie_embeddings), _dense(want_ckpt, cfg.model.tie_embeddings)
    params = compare_parameters(cfg, tol, mine, ref)
    moved = (got.get("hetero") or {}).get("device_bytes_moved_per_step")
    if cfg.model.lora is not None and not params.adapters:  # what LoRA trains must be what is compared
        raise RuntimeError("model.lora: the checkpoints hold no adapter to compare")
    lora = (len(params.adapters), max(params.adapters)) if cfg.model.lora is not None else None
    return Outcome(a, b, val, len(ref), params.worst, first_step, params.first, moved, lora, tol,
                   _fp8_linears(cfg, got, want), params.flipped)


@dataclass
class Parameters:
    """:func:`compare_parameters`' findings: the largest relative difference (name, value), the first tensor beyond
    the tolerance (None: equal), each adapter's largest relative difference, FP8's flipped elements (or None)."""

    worst: tuple[str, float]
    first: Optional[Difference]
    adapters: list[float]
    flipped: Optional[tuple[int, int, float]]


def compare_parameters(cfg: Config, tol: Tolerance, mine: dict, ref: dict) -> Parameters:
    """The dense parameters ``mine`` (the layout's) against ``ref`` (one process's) at ``tol``, in the model's
    order. Under :data:`FP8` the elements beyond the tolerance may be up to ``tol.flips`` of them all, each within
    :meth:`Tolerance.flip_limit`: then equal, and counted in ``flipped``."""
    worst, first, adapters = ("", 0.0), None, []
    beyond, elements, farthest = 0, 0, 0.0  # the elements beyond the tolerance, all, the farthest one's difference
    for name in sorted(ref, key=lambda n: _stage(cfg, n)):  # the model's order (stable within a stage)
        r = ref[name]
        x = mine[name].to(torch.float64)
        diff = (x - r).abs()
        excess = diff - tol.param * r.abs() - tol.param_atol
        rel = (diff / r.abs().clamp_min(tol.param_atol / tol.param)).max().item() if diff.numel() else 0.0
        worst = max(worst, (name, rel), key=lambda t: t[1])
        adapters += [rel] if is_adapter(name) else []
        off = excess > 0
        beyond, elements = beyond + int(off.sum()), elements + diff.numel()
        farthest = max(farthest, diff[off].max().item() if off.any() else 0.0)
        if first is None and off.any():
            i = tuple(int(k) for k in torch.unravel_index(excess.argmax(), excess.shape))
            first = Difference(name, i, x[i].item(), r[i].item(), _where(cfg, name))
    flipped = None
    if first is not None and beyond <= tol.flips * elements and farthest <= tol.flip_limit(cfg):
        first, flipped = None, (beyond, elements, farthest)  # FP8's flipped roundings (:data:`FP8`)
    return Parameters(worst, first, adapters, flipped)


def _fp8_linears(cfg: Config, got: dict, want: dict) -> Optional[tuple[int, int]]:
    """``train.fp8``: the linears that computed in FP8 on all the layout's ranks and in one process (summary.json's
    ``fp8``). The one process must have some — else both sides could be the same non-FP8 run and equal; a layout
    whose products were not FP8 against it differs by far more than :data:`FP8` (e4m3 rounds to 2⁻⁴)."""
    if cfg.train.fp8 == "none":
        return None
    layout, one = (sum((s.get("fp8") or {}).get("linears_per_rank", [])) for s in (got, want))
    if one == 0:
        raise RuntimeError(f"train.fp8={cfg.train.fp8}: the one-process run computed no linear in FP8 (its "
                           "summary.json has no fp8 linears): there is no FP8 reference to compare with")
    return layout, one


def _stage(cfg: Config, name: str) -> int:
    """The dense stage a dense tensor belongs to: 0 the embedding, ``k + 1`` block ``k``, then the head."""
    parts = name.split(".")
    return 0 if parts[0] == "embed" else int(parts[1]) + 1 if parts[0] == "blocks" else cfg.model.layers + 1


def _where(cfg: Config, name: str) -> str:
    """The pipeline rank that holds the dense tensor ``name`` (its stage's chunk), when pp > 1."""
    if cfg.parallel.pp == 1:
        return ""
    schedule = job_schedule(cfg)
    stage = _stage(cfg, name)
    chunk = next(c for c, r in enumerate(pipeline_cut(cfg, schedule.num_chunks)) if stage in r)
    return f"; stage {stage} is in chunk {chunk}, on pp rank {schedule.owner(chunk)}"


def _experts_line(m) -> str:
    """The MoE shape in the report's model line (nothing for a dense model)."""
    if not m.num_experts:
        return ""
    return (f" experts={m.num_experts} top_k={m.num_experts_per_tok} moe_intermediate_size={m.expert_width}"
            + (f" shared={m.shared_expert_intermediate_size}" if m.shared_expert_intermediate_size else "")
            + (f" mlp_only_layers={m.mlp_only_layers}" if m.mlp_only_layers else "")
            + (f" aux={m.router_aux_loss_coef:g}" if m.output_router_logits else ""))


def _lora_line(m) -> str:
    """The adapters in the report's model line (nothing without ``model.lora``)."""
    if m.lora is None:
        return ""
    return (f" lora: rank={m.lora.rank} alpha={m.lora.alpha:g}{' rslora' if m.lora.rslora else ''} "
            f"targets={','.join(m.lora.targets)}")


def _fp8_said(c: Config, outcome: Outcome) -> str:
    """The verdict's words on FP8 (nothing without ``train.fp8``): on both sides, or in one process only."""
    if outcome.fp8 is None:
        return ""
    where = "on both sides" if outcome.fp8[0] else "in one process only (no linear of the layout's)"
    return f"FP8 ({c.train.fp8}) {where}, float32 parameters: "


def format_report(path, plan: Plan, outcome: Outcome) -> list[str]:
    """The table ``parallel4d check`` prints."""
    c, p = plan.cfg, plan.cfg.parallel
    lines = [f"parallel4d check {path}: {c.world_size} ranks ({p.sizes}), "
             f"{c.train.steps} steps in {_precision(c)} on CPU against one process",
             f"  model {c.model.arch}: layers={c.model.layers} hidden={c.model.hidden} heads={c.model.heads}"
             + (f" kv_heads={c.model.kv_heads}" if c.model.kv_heads else "")
             + (f" head_dim={c.model.head_dim}" if c.model.head_dim else "")
             + _experts_line(c.model) + _lora_line(c.model) + f" seq_len={c.model.seq_len} batch={c.data.batch_size}",
             *(f"  note: {n}" for n in plan.notes),
             f"  {'step':>4}  {'loss (layout)':>22}  {'loss (one process)':>22}  {'relative':>8}"]
    for i, (x, y) in enumerate(zip(outcome.losses, outcome.reference_losses), 1):
        lines.append(f"  {i:>4}  {x:>22.16f}  {y:>22.16f}  {abs(x - y) / abs(y):8.1e}")
    for x, y in outcome.validation:
        lines.append(f"  {'val':>4}  {x:>22.16f}  {y:>22.16f}  {abs(x - y) / abs(y):8.1e}")
    lines.append(f"  parameters: {outcome.tensors} tensors, largest relative difference {outcome.worst[1]:.1e}"
                 + (f" ({outcome.worst[0]})" if outcome.worst[0] else ""))
    if outcome.adapters is not None:
        lines.append(f"  adapters (model.lora): {outcome.adapters[0]} tensors, largest relative difference "
                     f"{outcome.adapters[1]:.1e}; the base frozen")
    if outcome.fp8 is not None:
        lines.append(f"  fp8: {outcome.fp8[0]} linears computed in FP8 ({c.train.fp8}) over the layout's ranks, "
                     f"{outcome.fp8[1]} in one process")
    if outcome.flipped is not None:
        k, n, far = outcome.flipped
        lines.append(f"  fp8: {k} of {n:,} parameter elements beyond float32's reordering, at most {far:.1e} off "
                     f"(within 2⁻⁴·lr·steps = {outcome.tolerance.flip_limit(c):.1e}): e4m3 roundings that a float32 "
                     "reordering flipped (docs/check.md)")
    if outcome.hetero_moved is not None:
        lines.append(f"  hetero: {outcome.hetero_moved:,} bytes moved between host and device per step on rank 0")
    applied = _fp8_said(c, outcome) + outcome.tolerance.describe()
    if outcome.equal:
        lines.append(f"EQUAL: {applied}")
    else:
        lines.append(f"  tolerances: {applied}")
        if outcome.first_loss_step is not None:
            lines.append(f"DIFFERS: the loss of step {outcome.first_loss_step} first" if outcome.first_loss_step
                         else "DIFFERS: a validation loss")
        if outcome.first_tensor is not None:
            lines.append(f"DIFFERS: first tensor {outcome.first_tensor.describe()}")
    return lines
