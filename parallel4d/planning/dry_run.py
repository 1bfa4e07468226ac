"""``parallel4d plan CONFIG``: what every rank will hold and send, before anything runs.

The plan is a dry run of the job's own code, one rank per pipeline position (the ranks along
dp, sp and the tensor grid of a position hold the same amounts). In this process, under torch's
fake process group (every collective returns at once) and fake tensors (shapes and dtypes, no
values, no memory), it builds that rank's model with :func:`.engine.compose` and runs one
step's forward and backward of a global batch with :meth:`.engine.Engine.measure_gradients`.
So the numbers follow the code's own rules — the 2D pieces, the ring's buffers, the schedule's
micro-batches in flight, hetero's chunks, activation checkpointing — rather than a second copy
of them as formulas, and a 7B model costs no memory to plan. A training run measures the same
quantities on its first step (``summary.json``'s ``memory``, :mod:`.memory`'s rules);
``tests/test_plan.py`` holds the two within 10 % on the example configs.

``train.compile: blocks`` is planned with eager blocks (torch.compile does not run on this dry run's
fake tensors): a compiled block's saved activations can differ from eager's (AOTAutograd's
partitioner chooses what to save and what to recompute in the backward). ``pipeline.hop_cost: auto``
is planned with the order for free transfers (nothing to measure here). ``data.packing: documents``
is dry-run on rows of one document each, the most work and bytes (every ring block pair runs); its
documents are computed for real inside the fake step. Mixture-of-experts layers route under an assumed
uniform load, ``T·k/E`` rows per expert (:mod:`.moe`: which experts a token reaches depends on values fake
tensors lack); a deep model mixing MoE and dense layers is dry-run whole, not extrapolated from two blocks.

Under hetero the dry run also counts every tensor the rank holds at once (:mod:`.live`), from the
model's build through two steps and a checkpoint's save: the host memory its process grows by
(:meth:`RankPlan.host_rss_bytes`, ``summary.json``'s ``hetero.host_rss_bytes``).

Not counted: the CUDA context, the allocator's fragmentation, kernels' temporaries (an op's
workspace, the logits' softmax while the loss is computed), communication buffers, and the
one block that activation checkpointing recomputes during its backward. :data:`HEADROOM` of
the device is left for them when the plan says whether a job fits.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from parallel4d.config.errors import ConfigError
from parallel4d.config.rules.common import human_bytes as human
from parallel4d.config.load import load_config
from parallel4d.config.schema import Config
from parallel4d.engine.model import parameter_dtype
from parallel4d.engine.compose import compose
from parallel4d.models.moe.layer import SparseMoE
from parallel4d.models.moe.spec import MoeShape
from parallel4d.distributed.mesh import AXES, init_mesh, mesh_shape
from parallel4d.engine.memory import SavedActivations, tensor_bytes
from parallel4d.planning.live import LiveTensors
from parallel4d.planning.moe import (UniformLoad, expert_parameters, is_uniform_depth, routed_tokens,
                                     stand_in_dispatchers)
from parallel4d.planning.trace import Op, OpTrace

HEADROOM = 0.9  # a job fits when its largest rank needs at most this share of the device's memory


@dataclass
class RankPlan:
    """What the rank at ``(pp=pp_rank, dp=0, sp=0, 0, 0)`` holds (bytes) and sends per step."""

    pp_rank: int
    global_rank: int
    parameters: int
    gradients: int | None  # None under hetero: in its chunks (hetero_host, hetero_device)
    optimizer_state: int | None
    activations: int
    hetero_device: int | None = None  # the chunk arena (model data on the device) under hetero
    hetero_host: int | None = None  # the chunks' host copies: parameters, gradients, Adam moments
    sent_by_axis: dict[str, int] = field(default_factory=dict)
    hetero_moved: int | None = None  # host↔device bytes a steady step moves (loads + write-backs)
    hetero_params: int | None = None  # parameters in this rank's chunks
    hetero_min_budget: int | None = None  # the smallest static device budget that runs what the steps pinned
    calls_by_axis: dict[str, int] = field(default_factory=dict)  # the collectives and messages behind sent_by_axis
    ops: Counter[Op] | None = None  # timed dry runs: every op of one whole step (planning.trace)
    calls: list[Op] | None = field(default=None, repr=False)  # the same in order (timed dry runs only)
    # hetero: the most bytes the rank's tensors held at once from its model's build on, through two steps and
    # (checkpoint.enabled) a save (planning.live): what a process computing on the CPU grows by
    host_peak: int | None = None
    save_bytes: int | None = None  # hetero: what a checkpoint's save holds on top of the steps' state (0: none)
    hetero_host_transient: int | None = None  # hetero's largest host temporary (its stats' host_transient_bytes)
    # hetero under 16-bit chunks: where the master state is (its stats' optimizer_rows_on_device, ..._on_host,
    # optimizer_device_bytes, optimizer_host_bytes); None otherwise
    master_placement: dict[str, int] | None = None
    expert_parameters: int | None = None  # MoE layers: the bytes of this rank's routed experts' weights (planning.moe)

    @property
    def host_bytes_per_param(self) -> float | None:
        return self.hetero_host / self.hetero_params if self.hetero_params else None

    @property
    def device_bytes(self) -> int:
        """What the compute device holds at the step's peak (counted parts only: see the module); under
        hetero the chunk arena, the master state of the rows placed on the device, the activations."""
        if self.hetero_device is not None:
            master = (self.master_placement or {}).get("optimizer_device_bytes") or 0
            return self.hetero_device + master + self.activations
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def host_rss_bytes(self, on_cpu: bool) -> int | None:
        """hetero: what the rank's process grows by from just before its model is built to the end of the
        run (``summary.json``'s ``hetero.host_rss_bytes``; None without hetero). Computing on the CPU, every
        tensor it holds is host memory: :attr:`host_peak`. With the compute on a GPU, the host's part:
        hetero's host memory (chunk backings, the host rows' master state, the staging ring) and the most
        it adds at once, a temporary of its own or a checkpoint's gathered state."""
        if self.host_peak is None:
            return None
        if on_cpu:
            return self.host_peak
        return self.hetero_host + max(self.hetero_host_transient or 0, self.save_bytes or 0)

    def host_rss_bytes_per_param(self, on_cpu: bool) -> float | None:
        """:meth:`host_rss_bytes` over the rank's parameters (``summary.json``'s
        ``hetero.host_rss_bytes_per_param``)."""
        rss = self.host_rss_bytes(on_cpu)
        return None if rss is None else rss / self.hetero_params

    @property
    def host_bytes(self) -> int:
        """The host memory the rank needs at its peak with its compute on a GPU (0 without hetero: the
        host's share is not planned then)."""
        return self.host_rss_bytes(on_cpu=False) or 0


@contextmanager
def _fake_world(rank: int, world: int):
    """A process group of ``world`` stand-in ranks, this process being ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("parallel4d plan runs its dry run in a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """Stages built directly in the parameters' dtype: a fake tensor cannot be converted in place
    (``Module.to`` swaps it), and the tensors a run converts end the same."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def dry_run(cfg: Config, pp_rank: int = 0, timed: bool = False) -> RankPlan:
    """One step's forward and backward of the rank at pipeline position ``pp_rank`` (its other
    coordinates 0), on fake tensors in this process (see the module docstring). ``timed``: the
    whole step (the optimizer's too), its ops traced into :attr:`RankPlan.ops` for the time model."""
    p = cfg.parallel
    shape = mesh_shape(p.pp, p.dp, p.sp, p.tp)
    rank = pp_rank * math.prod(shape[1:])
    if cfg.model.pretrained:  # its shapes are in the model fields already; its weights are not needed
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"pretrained": None})})
    if cfg.train.compile != "none":  # eager blocks: torch.compile does not run on this dry run's fake tensors
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": "none"})})
    if cfg.pipeline.hop_cost == "auto":  # nothing to measure on fake tensors: the order for free transfers
        cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"hop_cost": None})})
    with _fake_world(rank, cfg.world_size):
        mesh = init_mesh(p.pp, p.dp, p.sp, p.tp, timeout_s=cfg.train.timeout_s)
        with FakeTensorMode(allow_non_fake_inputs=True), _default_dtype(parameter_dtype(cfg)), \
                UniformLoad() if cfg.model.num_experts else nullcontext():
            trace = OpTrace() if timed else None
            held, optimizer = _one_step(cfg, mesh, trace)
    return RankPlan(pp_rank, rank, held["parameters"], held["gradients"], optimizer, held["activations"],
                    held.get("hetero_device"), held.get("hetero_host"), held["sent_by_axis"],
                    held.get("hetero_moved"), held.get("hetero_params"), held.get("hetero_min_budget"),
                    held["calls_by_axis"], trace.ops() if trace else None, trace.calls() if trace else None,
                    held.get("host_peak"), held.get("save_bytes"), held.get("hetero_host_transient"),
                    held.get("master_placement"), held.get("expert_parameters"))


def _composed(cfg: Config, mesh):
    """The rank's engine, its MoE layers' expert-parallel dispatchers replaced by their uniform-load stand-ins
    (:mod:`.moe`)."""
    engine = compose(cfg, mesh)
    stand_in_dispatchers(engine.model)
    return engine


def _with_experts(memory: dict, engine) -> dict:
    """``memory`` with the bytes of the rank's routed experts' weights (MoE layers only)."""
    experts = expert_parameters(engine.model)
    if experts:
        memory["expert_parameters"] = tensor_bytes(experts)
    return memory


def _one_step(cfg: Config, mesh, trace: OpTrace | None) -> tuple[dict, int]:
    """(:attr:`.engine.Engine.memory` after one forward and backward, the optimizer state's bytes).
    Under hetero two whole steps: the second, with the first's chunk trace to replay, moves what
    every later step moves (``hetero_moved``, with ``hetero_params``: the parameters its chunks hold);
    and, in :class:`.live.LiveTensors`, the most bytes the rank's tensors held at once from the model's
    build on, a checkpoint's state included where the job saves (``host_peak``).
    ``trace``: entered around a whole step (the steady second one under hetero)."""
    if cfg.hetero.enabled:
        return _hetero_steps(cfg, mesh, trace)
    engine = _composed(cfg, mesh)
    tokens = _tokens(cfg, engine)
    if trace is None:
        engine.measure_gradients(tokens, tokens)
    else:
        with trace:
            engine.train_step(tokens, tokens, measure_memory=True)
    return _with_experts(engine.memory, engine), engine.store.expected_optimizer_state_bytes()


def _tokens(cfg: Config, engine) -> torch.Tensor:
    with unset_fake_temporarily():  # real: packed documents are computed from them on the host
        return torch.full((cfg.data.batch_size, cfg.model.seq_len), int(engine.eod == 0), dtype=torch.long)


def _hetero_steps(cfg: Config, mesh, trace: OpTrace | None) -> tuple[dict, int]:
    """:func:`_one_step` under hetero: the build and two steps, then a checkpoint's state where the job
    saves, all inside :class:`.live.LiveTensors`; hetero's own figures from its stats."""
    live = LiveTensors()
    with live:
        engine = _composed(cfg, mesh)
        tokens = _tokens(cfg, engine)
        engine.train_step(tokens, tokens, measure_memory=True)
        memory = engine.memory
        with trace or nullcontext():
            engine.train_step(tokens, tokens)
        save = _save_bytes(engine, live) if cfg.checkpoint.enabled else 0
    stats = engine.store.hetero_stats()
    placement = {k: stats[k] for k in _PLACEMENT} if stats["master_dtype"] else None
    if save and placement and stats["dp"] == 1:
        # at dp = 1 a save writes the host master's live tensors (counted: none), and with a GPU copies the
        # device rows' to the host (here, on fake CPU tensors, live too: added)
        save += placement["optimizer_device_bytes"]
    memory.update(hetero_moved=stats["device_bytes_moved_per_step"], hetero_params=stats["params"],
                  hetero_min_budget=stats["min_feasible_budget_bytes"], host_peak=live.peak, save_bytes=save,
                  hetero_host_transient=stats["host_transient_bytes"], master_placement=placement)
    return _with_experts(memory, engine), engine.store.expected_optimizer_state_bytes()


_PLACEMENT = ("optimizer_rows_on_device", "optimizer_rows_on_host", "optimizer_device_bytes", "optimizer_host_bytes")


def _save_bytes(engine, live: LiveTensors) -> int:
    """The most a checkpoint's save adds to what the rank holds: the state it gathers (hetero's whole
    parameters and Adam moments, on every data replica), held while DCP writes it."""
    before, peak = live.live, live.restart_peak()
    state = engine.checkpoint_state()
    del state
    grown = live.peak - before
    live.peak = max(peak, live.peak)
    return grown


def moe_layer_activations(cfg: Config) -> int:
    """The bytes one MoE layer's routed path — its input, router, dispatch, experts and combine; not a shared
    expert — keeps for the backward of one micro-batch (:func:`~.moe.routed_tokens` ``[T, h]``) at the uniform
    load (:mod:`.moe`): the layer's own code on fake tensors in the parameters' dtype, under the job's
    autocast, counted by the rule a run's first step uses (:class:`~parallel4d.engine.memory.SavedActivations`).
    Part of :attr:`RankPlan.activations` (which holds every layer's at the step's peak)."""
    m = cfg.model
    moe = replace(MoeShape.of(m), output_router_logits=False, shared_width=0)
    tokens = routed_tokens(cfg)
    dtype, half = parameter_dtype(cfg), cfg.train.autocast
    autocast = torch.autocast("cpu", getattr(torch, half)) if half != "none" else nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True), _default_dtype(dtype), UniformLoad():
        layer = SparseMoE(moe, m.hidden, 0)
        x = torch.empty(tokens, m.hidden, requires_grad=True)
        with SavedActivations(layer.parameters()) as meter, autocast:
            layer(x)
    return meter.peak


EXACT_DEPTH = 4  # a deeper one-stage model is planned from two shallow dry runs (see plan)


def plan(cfg: Config, timed: bool = False) -> list[RankPlan]:
    """Every pipeline position's :class:`RankPlan`.

    Without a pipeline every counted quantity is affine in the depth: each block adds the same
    parameters, gradients, optimizer state, saved activations (all of them live at the end of the
    forward, or only the blocks' inputs under activation checkpointing) and bytes sent. So a deeper
    model is the dry runs at depths 1 and 2 extrapolated, exactly, in the time of three blocks
    (hetero's chunk packing is not affine: it is always dry-run whole). So are the ops a ``timed``
    plan traces (:func:`dry_run`).
    """
    passes = block_passes(cfg)
    if passes > MAX_BLOCK_PASSES:
        raise ConfigError(f"parallel4d plan would dry-run {passes} block forwards and backwards (model.layers="
                          f"{cfg.model.layers} × pipeline.microbatches={cfg.pipeline.microbatches}"
                          f"{' × hetero' if cfg.hetero.enabled else ''}), minutes on fake tensors; it plans at most "
                          f"{MAX_BLOCK_PASSES}: plan a shallower copy (--set model.layers=...) and scale its "
                          "per-block parameters, gradients, optimizer state and activations, or lower "
                          "pipeline.microbatches for the plan")
    if _extrapolates(cfg):
        one, two = (dry_run(cfg.model_copy(update={"model": cfg.model.model_copy(update={"layers": d})}), 0, timed)
                    for d in (1, 2))
        return [_extrapolated(one, two, cfg.model.layers - 1)]
    return [dry_run(cfg, r, timed) for r in range(cfg.parallel.pp)]


MAX_BLOCK_PASSES = 1024  # ~20-30 ms each on fake tensors (2 busy cores): under half a minute


def _extrapolates(cfg: Config) -> bool:
    """Whether :func:`plan` takes ``cfg`` from one- and two-block dry runs: one stage, not hetero, every block
    alike (a model mixing MoE and dense layers is dry-run whole)."""
    return cfg.parallel.pp == 1 and cfg.model.layers > EXACT_DEPTH and not cfg.hetero.enabled and \
        is_uniform_depth(MoeShape.of(cfg.model), cfg.model.layers)


def block_passes(cfg: Config) -> int:
    """The transformer-block forwards and backwards :func:`plan`'s dry runs make (hetero's cost about
    eight times as much: its hooks move chunks, and it runs two steps)."""
    layers = 3 if _extrapolates(cfg) else cfg.model.layers
    return layers * cfg.pipeline.microbatches * (8 if cfg.hetero.enabled else 1)


def _extrapolated(one: RankPlan, two: RankPlan, more: int) -> RankPlan:
    """``one`` (a one-block model's plan) plus ``more`` times what a second block added (``two - one``)."""
    def at(a, b):
        return None if a is None else a + (b - a) * more

    def per_key(a: dict, b: dict) -> dict:
        return {k: at(a.get(k, 0), b.get(k, 0)) for k in {**a, **b}}

    ops = None if one.ops is None else Counter({k: n for k, n in per_key(one.ops, two.ops).items() if n})
    return RankPlan(one.pp_rank, one.global_rank, at(one.parameters, two.parameters),
                    at(one.gradients, two.gradients), at(one.optimizer_state, two.optimizer_state),
                    at(one.activations, two.activations), None, None,
                    per_key(one.sent_by_axis, two.sent_by_axis), calls_by_axis=per_key(one.calls_by_axis, two.calls_by_axis),
                    ops=ops, expert_parameters=at(one.expert_parameters, two.expert_parameters))


# --- will it fit ------------------------------------------------------------------------------

_UNITS = {"b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--gpus-memory") -> int:
    """``"80GiB"``, ``"80GB"``, ``"81920MiB"``, ``"8e10B"`` → bytes; ConfigError naming ``flag`` and the
    forms. A unit is required: a bare ``80`` would be 80 bytes where 80 GiB was meant."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if m and not m.group(2):
        raise ConfigError(f"{flag} {text!r} has no unit; write e.g. {m.group(1)}GiB (or {m.group(1)}B for bytes)")
    if not m or m.group(2) not in _UNITS:
        raise ConfigError(f"{flag} {text!r}: give a size such as 80GiB, 80GB or 81920MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def knobs(cfg: Config) -> list[list[str]]:
    """Overrides that lower a rank's memory at the same world size, mildest first; the last
    combines the first three."""
    p, out = cfg.parallel, []
    if cfg.train.activation_checkpointing == "none":
        out.append(["train.activation_checkpointing=blocks"])
    out.append([f"pipeline.microbatches={2 * cfg.pipeline.microbatches}"])
    if not cfg.hetero.enabled:
        out.append(["hetero.enabled=true"])
    if len(out) > 1:
        out.append([o for k in out for o in k])
    if p.dp % 2 == 0:
        out.append([f"parallel.dp={p.dp // 2}", f"parallel.pp={2 * p.pp}"])
    if p.dp % 4 == 0:
        out.append([f"parallel.dp={p.dp // 4}", f"parallel.tp={4 * p.tp}"])
    return out


def try_knobs(path, overrides: list[str], cfg: Config) -> list[tuple[list[str], int | str]]:
    """``(knob, the largest rank's device bytes, or why the config refuses it)`` for each of :func:`knobs`."""
    out = []
    for knob in knobs(cfg):
        try:
            changed = load_config(path, [*overrides, *knob])
        except (ConfigError, ValueError) as e:
            out.append((knob, f"refused: {str(e).splitlines()[0]}"))
            continue
        if block_passes(changed) > MAX_BLOCK_PASSES:
            out.append((knob, "not planned: its dry run would take minutes"))
            continue
        out.append((knob, max(r.device_bytes for r in plan(changed))))
    return out


# --- printing ---------------------------------------------------------------------------------


def format_ranks(ranks: list[RankPlan]) -> list[str]:
    """The per-rank table and the bytes each rank sends per step along each axis."""
    hetero = ranks[0].hetero_device is not None
    cols = ["pp rank", "parameters", "gradients", "optimizer", "activations"]
    cols += ["hetero device", "hetero host", "device total", "host total"] if hetero else ["device total"]
    lines = ["memory per rank (each pp position; its dp, sp and grid peers hold the same):",
             "  " + "".join(f"{c:>14}" for c in cols)]
    for r in ranks:
        vals = [r.parameters, r.gradients, r.optimizer_state, r.activations]
        vals += [r.hetero_device, r.hetero_host, r.device_bytes, r.host_bytes] if hetero else [r.device_bytes]
        lines.append("  " + f"{r.pp_rank:>14}" + "".join(f"{'in chunks' if v is None else human(v):>14}"
                                                           for v in vals))
    for r in ranks if hetero else ():
        lines += _hetero_lines(r)
    lines.append("sent per step by each rank (forward and backward, gradient reduction included):")
    for r in ranks:
        axes = sorted(r.sent_by_axis, key=lambda a: (a not in AXES, AXES.index(a) if a in AXES else 0, a))
        lines.append(f"  pp rank {r.pp_rank}: " + (", ".join(f"{a} {human(r.sent_by_axis[a])}" for a in axes)
                                                     or "nothing"))
    return lines


def _hetero_lines(r: RankPlan) -> list[str]:
    """One rank's hetero figures: its chunks' host bytes and traffic, where the master state is (16-bit
    chunks), and its process's peak host memory (``summary.json``'s ``hetero.host_rss_bytes_per_param``)."""
    lines = [f"  pp rank {r.pp_rank} hetero: {r.host_bytes_per_param:.2f} host bytes per parameter in its chunks, "
             f"{human(r.hetero_moved)} between host and device per step"]
    m = r.master_placement
    if m is not None:
        lines.append(f"  pp rank {r.pp_rank} master state (parameters and Adam moments): {m['optimizer_rows_on_device']} "
                     f"rows on the device ({human(m['optimizer_device_bytes'])}), {m['optimizer_rows_on_host']} on the "
                     f"host ({human(m['optimizer_host_bytes'])})")
    save = f" (a checkpoint's save adds {human(r.save_bytes)})" if r.save_bytes else ""
    lines.append(f"  pp rank {r.pp_rank} process memory above its start at its peak (summary.json's host_rss): "
                 f"{r.host_rss_bytes_per_param(True):.2f} bytes per parameter ({human(r.host_rss_bytes(True))}) "
                 f"computing on the CPU, {r.host_rss_bytes_per_param(False):.2f} ({human(r.host_rss_bytes(False))}) "
                 f"of host memory with a GPU{save}")
    return lines


def format_fit(ranks: list[RankPlan], capacity: int, tried: list[tuple[list[str], int | str]]) -> list[str]:
    need = max(r.device_bytes for r in ranks)
    usable = HEADROOM * capacity
    if need <= usable:
        return [f"fits: the largest rank needs {human(need)} of {human(capacity)} "
                f"({100 * need / capacity:.0f} %; {100 * HEADROOM:.0f} % usable)"]
    lines = [f"does not fit: the largest rank needs {human(need)}, {human(usable)} usable of {human(capacity)} "
             f"({100 * HEADROOM:.0f} %); what would change it:"]
    for knob, result in tried:
        verdict = result if isinstance(result, str) else \
            f"{human(result)} — {'fits' if result <= usable else 'still too much'}"
        lines.append(f"  {' '.join(knob):<60} {verdict}")
    return lines
