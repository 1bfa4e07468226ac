"""``parallel4d plan CONFIG --largest``: the largest model of the config's family that fits on a given
memory with hetero, beside the largest that DeepSpeed's own estimator admits on the same memory.

**Growing.** ``--grow shapes`` (the default) walks the config's own model, then its family's usual
shapes with more parameters (:attr:`.ModelSpec.shapes`: GPT-2's and GPT-3's sizes, Llama's); it
takes the widest whose usual shape fits, then adds layers at that width while they fit. ``--grow
layers`` only adds layers at the config's own width. Everything else (vocabulary, sequence, batch,
layout, dtypes) is the config's. DeepSpeed's figure comes from the same walk, so the two are models
of one family, counted the same way (:func:`count`).

**Ours.** Every candidate is planned by :func:`.plan.plan`, the job's own code dry-run under fake
tensors, with hetero's chunk size searched for it (``chunk_elems`` unset) and its static device
budget (``hetero.device_budget_bytes``) at the smallest value the hetero code accepts for that
model: the model data waits on the host, so the model grows as far as the host allows. That value
is hetero's own ``min_feasible_budget_bytes`` of a dry run with every chunk resident (what its steps
pinned at once), and the candidate is planned again at it. Under 16-bit chunks the budget is then raised
by what the GPU has left at it (a budget beyond the compute chunks holds rows' float32 master state on
the device, 12 bytes per parameter the host no longer holds), and the candidate planned a third time. A candidate fits when the largest rank's
device bytes are at most :data:`.plan.HEADROOM` of ``--gpu-memory`` and the host bytes of all the
job's ranks together (one host holds them, as ``parallel4d launch`` runs them) at most
``--host-memory``. The bytes are the dry run's, never a formula: they follow what hetero keeps where,
and a rank's host bytes are what ``parallel4d plan`` predicts its process grows by with a GPU
(:meth:`.plan.RankPlan.host_rss_bytes`, the figure ``summary.json``'s ``hetero.host_rss_bytes`` measures:
hetero's host memory and the most it adds at once, a checkpoint's gathered state where the config saves).
The search: a binary search over the widths, then over the depth a guess interpolated between the
two latest dry runs (the bytes grow about linearly with the layers), so a few dry runs each.

**LoRA.** With ``model.lora`` the candidates keep it: the same adapters on each base, the base frozen, so
the dry runs hold the base in its chunks alone (hetero/populate.py: no gradient, master or moments) and
the largest is the largest *base* that a LoRA fine-tune fits (its parameters counted without the adapters).

**DeepSpeed.** ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``, the function
behind the rows ``estimate_zero3_model_states_mem_needs_all_cold`` prints, for ZeRO-3 with
parameters and optimizer offloaded to the CPU (``cpu_offload_params``, ``cpu_offload``; ``zero_init``;
``additional_buffer_factor`` 1.5, its default), the job's ranks as GPUs of one node. A model fits when
its per-CPU figure is at most ``--host-memory`` and its per-GPU figure at most ``--gpu-memory``
(it covers the model states only; the buffer factor is its own margin).
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass
from typing import Callable

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.config.schema import Config, ModelConfig
from parallel4d.models.build import build_stage, shape_from_config
from parallel4d.models.registry import spec
from parallel4d.planning.dry_run import HEADROOM, MAX_BLOCK_PASSES, RankPlan, block_passes, human, parse_bytes, plan

GROW = ("shapes", "layers")
BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor (its estimator's default)
GROWTH = 8  # the depth search's largest step before it brackets the limit: at most this many times deeper


@dataclass(frozen=True)
class Memory:
    """``gpu``: one GPU's bytes; ``host``: the host's bytes, which all the job's ranks share."""

    gpu: int
    host: int


@dataclass(frozen=True)
class Verdict:
    """One candidate model as one side sees it (bytes)."""

    cfg: Config
    params: int  # the dense model's parameters (a tied table once): :func:`count`
    device: int  # ours: the largest rank's device bytes; DeepSpeed: its per-GPU estimate
    host: int  # ours: every rank's host bytes together; DeepSpeed: its per-CPU (per-node) estimate
    load: float  # the larger of device and host over what each may use: the model fits when ≤ 1
    budget: int | None = None  # ours: the hetero.device_budget_bytes it was planned with

    @property
    def fits(self) -> bool:
        return self.load <= 1

    @property
    def layers(self) -> int:
        return self.cfg.model.layers


@dataclass(frozen=True)
class Largest:
    """Each side's largest model that fits and the one a layer deeper (which does not)."""

    ours: Verdict
    ours_next: Verdict
    deepspeed: Verdict
    deepspeed_next: Verdict
    grow: str
    seconds: float  # wall time of the whole search, both sides
    models: int  # models our side judged, each by dry runs
    dry_runs: int  # the plans those made (two per candidate: resident, then at the smallest budget)

    @property
    def ratio(self) -> float:
        return self.ours.params / self.deepspeed.params


# --- the request -------------------------------------------------------------------------------


def check_request(cfg: Config, largest: bool, gpu: str | None, host: str | None, grow: str | None) -> Memory | None:
    """The memory ``--largest`` searches on; ConfigError naming the flag and the fix for a request it
    cannot answer, before anything runs. None without ``--largest``."""
    if not largest:
        for flag, value in (("--host-memory", host), ("--grow", grow)):
            if value is not None:
                raise ConfigError(f"{flag} is read only with --largest; add --largest or remove {flag}")
        return None
    if gpu is None:
        raise ConfigError("--largest needs --gpu-memory SIZE (one GPU's memory, e.g. 80GiB)")
    if host is None:
        raise ConfigError("--largest needs --host-memory SIZE (the host's memory, which all the job's "
                          f"{cfg.world_size} ranks share, e.g. 125GiB)")
    if not cfg.hetero.enabled:
        raise ConfigError("--largest grows the model under hetero and this config has hetero.enabled=false; add "
                          "--set hetero.enabled=true (or plan configs/hetero.yaml)")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("--largest compares with DeepSpeed's own estimator and DeepSpeed is not installed; "
                          "pip install 'parallel4d[deepspeed]', or plan without --largest")
    return Memory(parse_bytes(gpu, "--gpu-memory"), parse_bytes(host, "--host-memory"))


# --- counting and candidates -------------------------------------------------------------------


def count(model: ModelConfig) -> tuple[int, int]:
    """``(parameters, largest layer)``: the dense model's parameters (a tied table once) and the most
    parameters one module holds itself (DeepSpeed's ``largest_layer_params``), from the family's
    embedding, one block and head built on the meta device (every block is alike)."""
    shape = shape_from_config(model)
    embed = build_stage(shape, 0, meta=True)
    block = build_stage(shape, 1, meta=True)
    head = build_stage(shape, shape.layers + 1, tied_weight=embed.tok.weight if shape.tie_embeddings else None,
                       meta=True)
    ends = {id(p): p.numel() for stage in (embed, head) for p in stage.parameters()}
    total = sum(ends.values()) + shape.layers * sum(p.numel() for p in block.parameters())
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for s in (embed, block, head) for m in s.modules()]
    return total, max(own)


def candidate(cfg: Config, fields: dict) -> Config | None:
    """``cfg`` with these ``model:`` fields, built from scratch (no ``model.pretrained``), hetero's
    chunk size searched for it (``chunk_elems`` unset) and its budget left to :func:`budget_plan`;
    None when the config's rules refuse the shape."""
    data = cfg.model_dump(mode="json")
    data["model"] = {**data["model"], **fields, "pretrained": None}
    data["hetero"] = {**data["hetero"], "chunk_elems": None, "device_budget_bytes": None, "dynamic_budget": False}
    try:
        return make_config(data)
    except ConfigError:
        return None


def widths(cfg: Config, grow: str) -> list[Config]:
    """The config's own model, then (``grow="shapes"``) each of its family's usual shapes that the
    config's rules allow, each with more parameters than the one before."""
    out = [candidate(cfg, {})]
    if out[0] is None:
        raise ConfigError("the config's own model does not validate once model.pretrained and hetero's budget are "
                          "left out; check it with parallel4d validate")
    if grow == "shapes":
        for fields in spec(cfg.model.arch).shapes:
            c = candidate(cfg, fields)
            if c is not None and count(c.model)[0] > count(out[-1].model)[0]:
                out.append(c)
    return out


def with_layers(cfg: Config, layers: int) -> Config:
    """``cfg`` with ``layers`` blocks (the rest of its shape kept)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"layers": layers})})


# --- the two judges ----------------------------------------------------------------------------

def smallest_budget_plan(cfg: Config) -> tuple[list[RankPlan], int, int]:
    """``(the plan, its budget, plans made)`` at the smallest static ``hetero.device_budget_bytes``
    that runs ``cfg``: what its dry run's steps pinned at once with every chunk resident (hetero's own
    ``min_feasible_budget_bytes``, the largest over the pipeline's ranks), then planned at it."""
    budget = max(r.hetero_min_budget for r in _at_budget(cfg, None))
    return _at_budget(cfg, budget), budget, 2


def budget_plan(cfg: Config, gpu: int) -> tuple[list[RankPlan], int, int]:
    """``(the plan, its budget, plans made)`` at the budget that uses the GPU: the smallest (above), and under
    16-bit chunks — where a budget beyond the compute chunks keeps rows' master state on the device (12 bytes
    per parameter in float32 that the host no longer holds) — raised by what the GPU has left under
    :data:`.plan.HEADROOM` at the smallest, then planned again."""
    ranks, budget, n = smallest_budget_plan(cfg)
    if ranks[0].master_placement is None:
        return ranks, budget, n
    free = min(int(HEADROOM * gpu) - r.device_bytes for r in ranks)
    if free <= 0:
        return ranks, budget, n
    return _at_budget(cfg, budget + free), budget + free, n + 1


def _at_budget(cfg: Config, budget: int | None) -> list[RankPlan]:
    return plan(cfg.model_copy(update={"hetero": cfg.hetero.model_copy(
        update={"device_budget_bytes": budget, "dynamic_budget": False})}))


def job_host_bytes(ranks: list[RankPlan], cfg: Config) -> int:
    """Host bytes of every rank of the job at its peak with a GPU computing (:attr:`.plan.RankPlan.host_bytes`):
    each pp position's, times its dp, sp and grid peers."""
    p = cfg.parallel
    return sum(r.host_bytes for r in ranks) * p.dp * p.sp * p.tp


def ours(memory: Memory) -> tuple[Callable[[Config], Verdict], list[int]]:
    """Our judge on ``memory`` (dry runs: :func:`budget_plan`) and ``[models judged, plans made]``."""
    made = [0, 0]

    def judge(cfg: Config) -> Verdict:
        ranks, budget, n = budget_plan(cfg, memory.gpu)
        made[0] += 1
        made[1] += n
        device, host = max(r.device_bytes for r in ranks), job_host_bytes(ranks, cfg)
        load = max(device / (HEADROOM * memory.gpu), host / memory.host)
        return Verdict(cfg, count(cfg.model)[0], device, host, load, budget)

    return judge, made


def deepspeed_estimate(cfg: Config) -> tuple[int, int]:
    """``(per-CPU, per-GPU)`` bytes DeepSpeed's estimator gives ``cfg``'s model under ZeRO-3 with
    parameters and optimizer offloaded (the module docstring), the job's ranks on one node."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    total, largest_layer = count(cfg.model)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        total, largest_layer, num_gpus_per_node=cfg.world_size, num_nodes=1, cpu_offload=True,
        cpu_offload_params=True, zero_init=True, additional_buffer_factor=BUFFER_FACTOR)
    return cpu, gpu


def deepspeed(memory: Memory) -> Callable[[Config], Verdict]:
    """DeepSpeed's judge on ``memory`` (:func:`deepspeed_estimate`; no dry run)."""
    def judge(cfg: Config) -> Verdict:
        cpu, gpu = deepspeed_estimate(cfg)
        return Verdict(cfg, count(cfg.model)[0], gpu, cpu, max(gpu / memory.gpu, cpu / memory.host))

    return judge


# --- the search --------------------------------------------------------------------------------


def search(shapes: list[Config], judge: Callable[[Config], Verdict], cap: int | None) -> tuple[Verdict, Verdict]:
    """``(the largest model that fits, the same a layer deeper, which does not)``: the widest of
    ``shapes`` (each larger than the one before) that fits, then layers added at its width (at most
    ``cap`` layers, when given)."""
    first = judge(shapes[0])
    if not first.fits:
        raise ConfigError(f"the config's own model ({shape_text(first.cfg.model)}) does not fit: it needs "
                          f"{human(first.device)} of device and {human(first.host)} of host memory; plan a smaller "
                          "one (--set model.layers=...)")
    shapes = [s for s in shapes if cap is None or s.model.layers <= cap]
    widest = _widest(shapes, judge, first)
    return _deepest(widest, judge, cap)


def _widest(shapes: list[Config], judge: Callable[[Config], Verdict], first: Verdict) -> Verdict:
    """Binary search: the last of ``shapes`` that fits (``first``, ``shapes[0]``'s verdict, does)."""
    lo, best, hi = 0, first, len(shapes)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        v = judge(shapes[mid])
        lo, best, hi = (mid, v, hi) if v.fits else (lo, best, mid)
    return best


def _deepest(start: Verdict, judge: Callable[[Config], Verdict], cap: int | None) -> tuple[Verdict, Verdict]:
    """From ``start`` (fits), the most layers that fit at its width and the verdict one layer deeper.
    Each guess interpolates the load between the two latest verdicts (both bytes grow about linearly
    with the layers); after two guesses on one side of the bracket, it halves it instead."""
    lo, hi, seen, sides = start, None, [start], []
    while hi is None or hi.layers - lo.layers > 1:
        layers = _guess(lo, hi, seen, sides)
        if cap is not None and layers > cap:
            if lo.layers >= cap:
                raise ConfigError(f"{shape_text(lo.cfg.model)} still fits, and deeper models are not dry-run "
                                  f"(more than {MAX_BLOCK_PASSES} block passes); grow a wider model (--grow shapes, "
                                  "or --set model.hidden=...)")
            layers = cap
        v = judge(with_layers(start.cfg, layers))
        seen.append(v)
        sides.append(v.fits)
        lo, hi = (v, hi) if v.fits else (lo, v)
    return lo, hi


def _guess(lo: Verdict, hi: Verdict | None, seen: list[Verdict], sides: list[bool]) -> int:
    """The next depth to judge, strictly between ``lo`` and ``hi``."""
    if hi is not None and len(sides) >= 2 and sides[-1] == sides[-2]:
        return (lo.layers + hi.layers) // 2
    a, b = (lo, hi) if hi is not None else (seen[-2] if len(seen) > 1 else None, lo)
    if a is None or b.load <= a.load:  # one point: the load taken as proportional to the layers
        target = b.layers / b.load if b.load > 0 else math.inf
    else:
        target = a.layers + (1 - a.load) * (b.layers - a.layers) / (b.load - a.load)
    if hi is None:
        return max(math.floor(min(target, GROWTH * lo.layers)), lo.layers + 1)
    return min(max(math.floor(target), lo.layers + 1), hi.layers - 1)


def dry_run_cap(cfg: Config) -> int:
    """The most layers a dry run of ``cfg``'s layout makes (:data:`.plan.MAX_BLOCK_PASSES`)."""
    per_layer = block_passes(with_layers(cfg, 1))
    return MAX_BLOCK_PASSES // per_layer


def largest(cfg: Config, memory: Memory, grow: str = "shapes") -> Largest:
    """Each side's largest model on ``memory`` (the module docstring)."""
    start = time.perf_counter()
    shapes = widths(cfg, grow)
    judge, made = ours(memory)
    mine = search(shapes, judge, dry_run_cap(cfg))
    theirs = search(shapes, deepspeed(memory), None)
    return Largest(*mine, *theirs, grow, time.perf_counter() - start, *made)


# --- printing ----------------------------------------------------------------------------------


def shape_text(m: ModelConfig) -> str:
    """``gpt2 70×2560 (32 heads, mlp 10240)``: layers × width, heads (key/value heads when fewer), MLP width."""
    kv = f", {m.kv_heads_or_heads} kv" if m.kv_heads_or_heads != m.heads else ""
    return f"{m.arch} {m.layers}×{m.hidden} ({m.heads} heads{kv}, mlp {m.mlp_width})"


def _ranks(cfg: Config, what: str = "rank") -> str:
    return f"{cfg.world_size} {what}{'s' if cfg.world_size > 1 else ''}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def format_largest(result: Largest, memory: Memory) -> list[str]:
    """The two largest models, their bytes and the ratio, what one layer more needs, and how."""
    o, d, cfg = result.ours, result.deepspeed, result.ours.cfg
    how = ("the family's usual shapes, then layers at the widest that fits" if result.grow == "shapes"
           else "layers at the config's width")
    lines = [f"largest model on {human(memory.gpu)} per GPU ({100 * HEADROOM:.0f} % usable by ours) and "
             f"{human(memory.host)} of host memory for the job's {_ranks(cfg)}; grown through {how}:",
             f"  {'':<26}{'parameters':>12}  {'model':<44}{'device/GPU':>12}{'host':>12}"]
    for name, v in (("parallel4d hetero", o), ("DeepSpeed ZeRO-3 offload", d)):
        lines.append(f"  {name:<26}{_params(v.params):>12}  {shape_text(v.cfg.model):<44}{human(v.device):>12}"
                     f"{human(v.host):>12}")
    on, dn = result.ours_next, result.deepspeed_next
    lora = cfg.model.lora
    if lora is not None:  # the base frozen: its chunks only (16-bit under autocast), the adapters trained
        lines.append(f"  ours: a LoRA fine-tune of that base (model.lora: rank {lora.rank} on "
                     f"{', '.join(lora.targets)}; the base frozen, held in its chunks alone: no gradient, master "
                     "or moments); DeepSpeed's estimator trains every parameter")
    lines += [f"  ratio {result.ratio:.2f}× DeepSpeed's",
              f"  one layer more does not fit: ours at {on.layers} layers needs {human(on.device)} device, "
              f"{human(on.host)} host; DeepSpeed's at {dn.layers}, {human(dn.device)} per GPU, "
              f"{human(dn.host)} per CPU",
              f"  ours: hetero.device_budget_bytes={o.budget} ({human(o.budget)}), the smallest the hetero code "
              "accepts for that model, under 16-bit chunks raised by what the GPU has left (the master state of "
              "that many rows on the device) (static; each candidate its own)",
              f"  DeepSpeed: estimate_zero3_model_states_mem_needs, offload_param=cpu offload_optimizer=cpu "
              f"zero_init=1, additional_buffer_factor {BUFFER_FACTOR}, {_ranks(cfg, 'GPU')} on one node",
              f"  searched in {result.seconds:.0f} s ({result.models} models of ours judged in {result.dry_runs} "
              "dry runs, two each)"]
    return lines


def _side(v: Verdict, deeper: Verdict) -> dict:
    m = v.cfg.model
    return {"params": v.params, "arch": m.arch, "layers": m.layers, "hidden": m.hidden, "heads": m.heads,
            "kv_heads": m.kv_heads_or_heads, "mlp_width": m.mlp_width, "device_bytes": v.device,
            "host_bytes": v.host, "hetero_device_budget_bytes": v.budget,
            "one_layer_more": {"params": deeper.params, "layers": deeper.layers, "device_bytes": deeper.device,
                               "host_bytes": deeper.host, "hetero_device_budget_bytes": deeper.budget}}


def largest_json(result: Largest, memory: Memory) -> dict:
    """What ``--json`` adds under ``--largest``."""
    return {"largest_params": result.ours.params, "deepspeed_largest_params": result.deepspeed.params,
            "ratio": result.ratio, "largest": _side(result.ours, result.ours_next),
            "deepspeed_largest": _side(result.deepspeed, result.deepspeed_next), "gpu_memory": memory.gpu,
            "host_memory": memory.host, "headroom": HEADROOM, "grow": result.grow, "seconds": result.seconds,
            "lora": result.ours.cfg.model.lora is not None,
            "models": result.models, "dry_runs": result.dry_runs}
