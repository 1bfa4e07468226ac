"""``parallel4d plan CONFIG --search --gpus N --gpu-memory M``: every layout of N devices that fits,
ranked by predicted tokens/s.

Candidates: every ``pp·dp·sp·tp = N`` (tp a square) with the pipeline schedules that differ in time
(1F1B; Hanayo with 1 and 2 waves; ZB-H1; ZB-V; each order built for the predicted hop), 1, 2 and 4
micro-batches per pp rank, and activation checkpointing off and on — each validated by the config's
own rules (a layout they refuse is not a candidate). The model, batch, dtype and the rest stay the
user's.

A candidate is costed from **unit dry runs** (:func:`parallel4d.planning.dry_run.dry_run`, timed): the
job's own code at depths 0 and 1 (the ends alone, then with one block), without a pipeline, on one
micro-batch of the candidate's local shape ``[b/(dp·q)/m, s/sp, h/q]``, each at 2 and 3 rows. Their
difference is one block's ops, bytes and memory; depth 0 is the embedding, the head, the loss and the
optimizer's step. Every op's work and every byte is affine in the rows, so a candidate's rows are exact;
the activations' peak is a max over the step's moments, exact unless the moment of the peak moves with
the rows (within 0.5 % in tests/test_planning.py). A ring longer than 4 is dry-run as rings of 2 and 4 at
its local shape and extrapolated (:func:`_proxies`).
Candidates sharing a local shape share their unit runs, which is what makes the search fast. A pipeline
rank then holds its chunks' blocks (the engine's own cut, :func:`~parallel4d.engine.compose.pipeline_cut`)
and, at its peak, the activations of the micro-batch chunks the schedule's simulation stores at once. The
pipeline orders are built in the same processes as the unit runs, side by side, and shared by the
candidates. Recomputation only adds work, so a candidate with it is costed only where its twin without it
does not fit and that twin's step floor (:func:`~parallel4d.planning.cost.step_floor`: a bound for any
order) is within the top's steps.
The ``top`` candidates are then dry-run whole (``plan`` as it is), as many as ``--verify-seconds``
allows, best first (one whose dry run would outlast it, at the unit runs' pace per op, is not started):
their memory is the exact plan's, and a candidate that no longer fits is dropped.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config
from parallel4d.config.schema import Config
from parallel4d.data.tokenize import pool_worker_signals
from parallel4d.engine.compose import job_schedule, pipeline_cut
from parallel4d.engine.model import pipeline_activation_dtype
from parallel4d.pipeline import simulate
from parallel4d.planning.cost import INSIDE, Prediction, half_octave, hop_cost_of, order, order_key, predict, step_floor
from parallel4d.planning.profiles import Profile
from parallel4d.planning.trace import Op
from parallel4d.planning.moe import figures as moe_figures, is_uniform_depth
from parallel4d.models.moe.spec import MoeShape
from parallel4d.planning.dry_run import HEADROOM, MAX_BLOCK_PASSES, RankPlan, block_passes, dry_run, human, plan

SCHEDULES = [("1f1b", []), ("hanayo", ["pipeline.waves=1"]), ("hanayo", ["pipeline.waves=2"]),
             ("zb_h1", []), ("zbv", [])]


@dataclass
class Ranked:
    """A candidate and what it is predicted to do; ``exact``: its memory is a whole dry run's."""

    overrides: list[str]
    cfg: Config
    device_bytes: int
    prediction: Prediction
    exact: bool = False
    order_built: bool = True  # False: hop_cost auto costed with the free-transfer order (an upper bound)
    ranks: list[RankPlan] | None = field(default=None, repr=False)  # the plans the prediction came from

    def describe(self) -> str:
        p, pl, cfg = self.cfg.parallel, self.cfg.pipeline, self.cfg
        sched = ""
        if p.pp > 1:
            sched = f" {pl.schedule}" + (f" W={pl.waves}" if pl.schedule == "hanayo" else "")
        ckpt = " recompute" if cfg.train.activation_checkpointing != "none" else ""
        return f"pp={p.pp} dp={p.dp} sp={p.sp} tp={p.tp}{sched} m={pl.microbatches}{ckpt}"


def layouts(n: int) -> list[tuple[int, int, int, int]]:
    """Every ``(pp, dp, sp, tp)`` with ``pp·dp·sp·tp = n`` and tp a square."""
    out = []
    for q in range(1, math.isqrt(n) + 1):
        if n % (q * q):
            continue
        rest = n // (q * q)
        for pp in (d for d in range(1, rest + 1) if rest % d == 0):
            for dp in (d for d in range(1, rest // pp + 1) if (rest // pp) % d == 0):
                out.append((pp, dp, rest // pp // dp, q * q))
    return out


def candidates(path, overrides: list[str], gpus: int) -> list[tuple[list[str], Config]]:
    """Every candidate the config's rules accept (the module docstring's list)."""
    out = []
    for pp, dp, sp, tp in layouts(gpus):
        for ckpt in ("none", "blocks"):
            layout = [f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.sp={sp}", f"parallel.tp={tp}",
                      f"train.activation_checkpointing={ckpt}"]
            scheds = SCHEDULES if pp > 1 else [("1f1b", [])]
            for name, extra in scheds:
                hop = ["pipeline.hop_cost=auto"] if pp > 1 and name in ("hanayo", "zb_h1", "zbv") else \
                    ["pipeline.hop_cost=null"]
                for per in (1, 2, 4):
                    m = per * pp if pp > 1 else per
                    knobs = [*layout, f"pipeline.schedule={name}", *extra, f"pipeline.microbatches={m}", *hop]
                    try:
                        cfg = load_config(path, [*overrides, *knobs])
                    except (ConfigError, ValueError):
                        continue
                    if cfg.model.layers + 2 >= cfg.pipeline.num_chunks(pp):  # a stage or more per chunk
                        out.append((knobs, cfg))
    return out


# --- unit dry runs ----------------------------------------------------------------------------------

def rows_per_microbatch(cfg: Config) -> int:
    p = cfg.parallel
    return cfg.data.batch_size // (p.dp * p.q * cfg.pipeline.microbatches)


def _unit_key(cfg: Config) -> tuple:
    return cfg.parallel.sp, cfg.parallel.tp, cfg.train.activation_checkpointing, cfg.model.seq_len


RING_PROXIES = (2, 4)  # a longer ring's unit runs: these rings at its local shape, extrapolated


def _proxies(cfg: Config) -> list[Config]:
    """The configs whose unit runs stand for ``cfg``'s: ``cfg`` itself or, for a ring longer than
    :data:`RING_PROXIES` (without Ulysses), the proxy rings at its local shape ``[.., s/sp, ..]`` (the
    sequence shortened with the ring). Each step of a ring repeats the same calls and messages on blocks of
    that shape, and what depends on the whole sequence (position tables) grows with it, so everything a
    unit counts is affine in the ring's length there: a ring of 64 is taken from rings of 2 and 4, whose
    dry runs make a sixteenth of its ops (tests/test_planning.py holds it to the ring's own dry run)."""
    p, longest = cfg.parallel, RING_PROXIES[-1]
    if p.sp <= longest or cfg.sequence.ulysses > 1:
        return [cfg]
    local = cfg.model.seq_len // p.sp
    return [cfg.model_copy(update={"parallel": p.model_copy(update={"sp": k}),
                                   "model": cfg.model.model_copy(update={"seq_len": local * k})})
            for k in RING_PROXIES]


def _unit_cfg(cfg: Config, layers: int, rows: int) -> Config:
    """The candidate's local shape without a pipeline or data replicas: one micro-batch of ``rows`` rows
    per grid row, ``layers`` blocks."""
    p = cfg.parallel
    return cfg.model_copy(update={
        "parallel": p.model_copy(update={"pp": 1, "dp": 1}),
        "pipeline": cfg.pipeline.model_copy(update={"schedule": "1f1b", "microbatches": 1, "hop_cost": None,
                                                    "waves": 1, "split_backward": False}),
        "data": cfg.data.model_copy(update={"batch_size": rows * p.q}),
        "model": cfg.model.model_copy(update={"layers": layers})})


@dataclass
class Unit:
    """One micro-batch's block and ends (embedding + head) at a local shape: each a RankPlan's worth."""

    block: RankPlan
    ends: RankPlan


@dataclass
class UnitRuns:
    """A local shape's four unit dry runs, by ``(depth, rows)``, and their pace: seconds per op traced."""

    runs: dict[tuple[int, int], RankPlan]
    seconds_per_op: float


def _line(a: RankPlan, b: RankPlan, t: float, ops: Counter, calls: list[Op] | None = None) -> RankPlan:
    """``a + (b − a)·t`` field by field (dicts key by key), with the op counts given."""
    def f(x, y):
        return x + (y - x) * t

    def d(x, y):
        return {k: f(x.get(k, 0), y.get(k, 0)) for k in {**x, **y}}

    experts = None if a.expert_parameters is None else f(a.expert_parameters, b.expert_parameters)
    return RankPlan(a.pp_rank, a.global_rank, f(a.parameters, b.parameters), f(a.gradients, b.gradients),
                    f(a.optimizer_state, b.optimizer_state), f(a.activations, b.activations),
                    sent_by_axis=d(a.sent_by_axis, b.sent_by_axis), calls_by_axis=d(a.calls_by_axis, b.calls_by_axis),
                    ops=ops, calls=calls, expert_parameters=experts)


def _affine(a: RankPlan, b: RankPlan, t: float) -> RankPlan:
    """:func:`_line` with op calls paired in order (the same code runs the same ops, with other sizes: each
    call's work on the line); the op counts follow from the calls."""
    if len(a.calls) != len(b.calls) or any(x.kind != y.kind or x.phase != y.phase for x, y in zip(a.calls, b.calls)):
        raise RuntimeError("parallel4d plan --search: the unit dry runs made different ops; plan the candidates "
                           "one by one (without --search)")
    calls = [Op(x.kind, x.phase, x.dtype, x.work + (y.work - x.work) * t) for x, y in zip(a.calls, b.calls)]
    return _line(a, b, t, Counter(calls), calls)


def _extended(a: RankPlan, b: RankPlan, t: float) -> RankPlan:
    """:func:`_line` with each distinct op's count on the line (a longer ring repeats the same ops more
    often; an op whose work follows the whole sequence moves its count to its longer twin: the work
    summed is still on the line)."""
    return _line(a, b, t, Counter({op: a.ops.get(op, 0) + (b.ops.get(op, 0) - a.ops.get(op, 0)) * t
                                   for op in {**a.ops, **b.ops}}))


def _minus(a: RankPlan, b: RankPlan) -> RankPlan:
    """``a − b`` field by field (dicts and op counts key by key)."""
    def d(x, y):
        return {k: x.get(k, 0) - y.get(k, 0) for k in {**x, **y}}

    return RankPlan(a.pp_rank, a.global_rank, a.parameters - b.parameters, a.gradients - b.gradients,
                    a.optimizer_state - b.optimizer_state, a.activations - b.activations,
                    sent_by_axis=d(a.sent_by_axis, b.sent_by_axis), calls_by_axis=d(a.calls_by_axis, b.calls_by_axis),
                    ops=Counter({k: n for k, n in d(a.ops, b.ops).items() if n}),
                    expert_parameters=None if a.expert_parameters is None else
                    a.expert_parameters - (b.expert_parameters or 0))


UNIT_ROWS = (2, 3)  # not 1: a dimension of one takes other paths in some ops (views, broadcasts)
#: the longest :func:`prepare` waits for its next forked worker's result before doing the rest itself (a unit or
#: an order takes seconds; a forked child can deadlock on a lock another thread held at the fork)
TASK_TIMEOUT_S = 120.0
UNIT_DEPTHS = (0, 1)  # the ends alone (embedding, head, loss, optimizer), then with one block: its difference


def _unit_runs(cfg: Config) -> UnitRuns:
    """The four dry runs of ``cfg``'s local shape: :data:`UNIT_DEPTHS` at :data:`UNIT_ROWS` rows."""
    runs, seconds = {}, {}
    for d in UNIT_DEPTHS:
        for r in UNIT_ROWS:
            began = time.perf_counter()
            runs[d, r] = dry_run(_unit_cfg(cfg, d, r), 0, timed=True)
            seconds[d, r] = time.perf_counter() - began
    # the block's ops' own pace (each run also builds its model: a fixed cost a whole dry run pays once per rank)
    (d0, d1), rows = UNIT_DEPTHS, UNIT_ROWS[-1]
    more = len(runs[d1, rows].calls) - len(runs[d0, rows].calls)
    return UnitRuns(runs, max(0.0, seconds[d1, rows] - seconds[d0, rows]) / max(1, more))


def _one_task(task: tuple) -> tuple:
    """``(cache key, value)`` of a unit shape's runs (``("unit", cfg)``) or of an order (``("order", (cfg,
    p2p_cost))``)."""
    torch.set_num_threads(1)  # a dry run computes nothing: its cost is Python's, one core per worker
    kind, what = task
    if kind == "unit":
        return _task_key(task), _unit_runs(what)
    return _task_key(task), job_schedule(*what)


def prepare(cfgs: list[Config], cache: dict, workers: int, orders: list[tuple[Config, float | None]] = ()) -> None:
    """Into ``cache``: the unit runs of every local shape among ``cfgs`` (their :func:`_proxies`') and the
    ``(cfg, p2p_cost)`` orders (by :func:`~parallel4d.planning.cost.order_key`) it lacks, ``workers`` processes at once
    (forked: a dry run and an order's search are pure Python work), the costliest first (an order of 16
    ranks takes seconds, as does a unit of a ring or a grid of 4)."""
    shapes = {_unit_key(x): x for c in cfgs for x in _proxies(c) if _unit_key(x) not in cache}
    missing = {order_key(*o): o for o in orders if order_key(*o) not in cache}
    todo = [("order", missing[k]) for k in sorted(missing, key=lambda k: -k[1] * k[2])]  # pp·m: the costliest
    todo += [("unit", c) for c in sorted(shapes.values(), key=lambda c: -c.parallel.sp * c.parallel.tp)]
    if workers <= 1 or len(todo) <= 1:
        cache.update(_one_task(t) for t in todo)
        return
    with multiprocessing.get_context("fork").Pool(min(workers, len(todo)), initializer=pool_worker_signals) as pool:
        results = pool.imap_unordered(_one_task, todo, chunksize=1)
        try:
            for _ in todo:
                key, value = results.next(timeout=TASK_TIMEOUT_S)
                cache[key] = value
        except multiprocessing.TimeoutError:  # a forked worker stuck (a lock a thread held at the fork): go on here
            print(f"[parallel4d] plan --search: a worker gave nothing for {TASK_TIMEOUT_S:.0f} s; the rest runs in "
                  "this process", flush=True)
    left = [t for t in todo if _task_key(t) not in cache]  # (the pool is terminated on leaving the block)
    cache.update(_one_task(t) for t in left)


def _task_key(task: tuple):
    """The cache key :func:`_one_task` gives ``task``'s value."""
    kind, what = task
    return _unit_key(what) if kind == "unit" else order_key(*what)


def unit(cfg: Config, cache: dict) -> Unit:
    """The candidate's :class:`Unit` from its local shape's four unit runs (:func:`prepare`), shared by
    every candidate with that shape; each candidate's rows by the affine rule (the module docstring); a long
    ring's from its :func:`_proxies`."""
    key, rows = _unit_key(cfg), rows_per_microbatch(cfg)
    if (key, rows) in cache:  # candidates of one local shape differ mostly in pp and the schedule
        return cache[key, rows]
    proxies = _proxies(cfg)
    if len(proxies) > 1:
        (a, b), (low, high) = [unit(x, cache) for x in proxies], RING_PROXIES
        t = (cfg.parallel.sp - low) / (high - low)
        cache[key, rows] = Unit(_extended(a.block, b.block, t), _extended(a.ends, b.ends, t))
        return cache[key, rows]
    if key not in cache:
        cache[key] = _unit_runs(cfg)
    runs, (low, high) = cache[key].runs, UNIT_ROWS
    ends, one = (_affine(runs[(d, low)], runs[(d, high)], (rows - low) / (high - low)) for d in UNIT_DEPTHS)
    cache[key, rows] = Unit(_minus(one, ends), ends)
    return cache[key, rows]


def _combine(parts: list[tuple[RankPlan, float]], phase_scale: dict[str, float], inside_scale: float,
             pp_rank: int) -> RankPlan:
    """Σ weight·part; op counts of the forward and backward and the tensor/sequence traffic times the
    micro-batches, the step's ops and the other axes' traffic once."""
    ops: Counter = Counter()
    sent: Counter = Counter()
    calls: Counter = Counter()
    fields = dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations", "expert_parameters"), 0.0)
    for part, w in parts:
        for f in fields:
            fields[f] += w * (getattr(part, f) or 0)
        for op, n in part.ops.items():
            ops[op] += w * n * phase_scale.get(op.phase, 1.0)
        for a, n in part.sent_by_axis.items():
            sent[a] += w * n * (inside_scale if a in INSIDE else 1.0)
        for a, n in part.calls_by_axis.items():
            calls[a] += w * n * (inside_scale if a in INSIDE else 1.0)
    return RankPlan(pp_rank, 0, int(fields["parameters"]), int(fields["gradients"]), int(fields["optimizer_state"]),
                    int(fields["activations"]), sent_by_axis=dict(sent), calls_by_axis=dict(calls), ops=ops,
                    expert_parameters=int(fields["expert_parameters"]) or None)


def _replicas(cfg: Config, r: RankPlan) -> RankPlan:
    """The data replicas' gradient reduction (over dp·sp) the unit (dp = 1) may lack: the rank's whole
    gradient, in ``train.dp_bucket_mb`` buckets."""
    n = cfg.parallel.dp * cfg.parallel.sp
    sent = {a: b for a, b in r.sent_by_axis.items() if a != "dp+sp"}
    calls = {a: b for a, b in r.calls_by_axis.items() if a != "dp+sp"}
    if n > 1:
        sent["dp+sp"] = r.gradients
        calls["dp+sp"] = max(1, math.ceil(r.gradients / (cfg.train.dp_bucket_mb * 2**20)))
    return replace(r, sent_by_axis=sent, calls_by_axis=calls)


def assembled(cfg: Config, u: Unit, cache: dict | None = None) -> list[RankPlan]:
    """Each pp rank's plan from the unit (the module docstring); ``cache``: the search's (orders, peaks)."""
    return [_replicas(cfg, r) for r in _assembled(cfg, u, cache)]


def _boundaries_out(schedule, rank: int) -> int:
    """Per micro-batch, the tensors ``rank`` sends to another pp rank: an activation where its chunk's next
    chunk is elsewhere, a gradient where its previous one is (a same-rank neighbour passes it in memory)."""
    owner, last = schedule.owner, schedule.num_chunks - 1
    return sum((c < last and owner(c + 1) != rank) + (c > 0 and owner(c - 1) != rank)
               for c in schedule.placement[rank])


def _peaks(cfg: Config, cache: dict | None) -> list[int]:
    """Each pp rank's peak of stored chunk activations under ``cfg``'s order for free transfers."""
    key = ("peaks", *order_key(cfg))
    if cache is None or key not in cache:
        peaks = simulate(order(cfg, cache)).peak_activations
        if cache is None:
            return peaks
        cache[key] = peaks
    return cache[key]


def _assembled(cfg: Config, u: Unit, cache: dict | None) -> list[RankPlan]:
    p, m = cfg.parallel, cfg.pipeline.microbatches
    fb = {"forward": m, "backward": m}
    if p.pp == 1:
        return [_combine([(u.ends, 1), (u.block, cfg.model.layers)], fb, m, 0)]
    schedule, peaks = order(cfg, cache), _peaks(cfg, cache)
    ranges = pipeline_cut(cfg, schedule.num_chunks)
    wire = pipeline_activation_dtype(cfg).itemsize  # what the engine sends between pp ranks in
    last = cfg.model.layers + 1
    out = []
    for r in range(p.pp):
        stages = [i for c in schedule.placement[r] for i in ranges[c]]
        blocks = sum(1 for i in stages if 0 < i < last)
        ends = (0 in stages) * 0.5 + (last in stages) * 0.5
        plan_r = _combine([(u.ends, ends), (u.block, blocks)], fb, m, r)
        per_chunk = (plan_r.activations / max(len(schedule.placement[r]), 1))
        act_bytes = rows_per_microbatch(cfg) * (cfg.model.seq_len // p.sp) * (cfg.model.hidden // p.q) * wire
        sends = m * _boundaries_out(schedule, r)
        out.append(replace(plan_r, activations=int(per_chunk * peaks[r]),
                           sent_by_axis={**plan_r.sent_by_axis, "pp": act_bytes * sends},
                           calls_by_axis={**plan_r.calls_by_axis, "pp": sends}))
    return out


# --- the search ------------------------------------------------------------------------------------

def search(path, overrides: list[str], gpus: int, capacity: int, profile: Profile,
           verify_seconds: float = 30.0, say=print, workers: int | None = None, top: int = 8) -> list[Ranked]:
    """Every candidate that fits ``capacity`` bytes per device (:data:`HEADROOM` of it), fastest first;
    ``workers``: processes for the unit runs (default: this machine's cores)."""
    t0 = time.perf_counter()
    cands = candidates(path, overrides, gpus)
    if not cands:
        raise ConfigError(f"--gpus {gpus}: no layout of {gpus} devices passes this config's rules (tp must be a "
                          "square whose root divides the heads, sp must divide seq_len, the batch must split "
                          "over dp·tp_row and the micro-batches); try another --gpus or change the model or batch")
    _check_blocks_alike(cands[0][1])
    workers = workers or os.cpu_count() or 1
    cache: dict = {}  # unit runs, Units, orders, peaks
    plain = [c for c in cands if c[1].train.activation_checkpointing == "none"]
    prepare([cfg for _, cfg in plain], cache, workers, [(cfg, None) for _, cfg in cands if cfg.parallel.pp > 1])
    ranked, floors = _costed(plain, cache, capacity, profile)
    recompute, beaten = _worth_recomputing(cands, ranked, floors, top)
    prepare([cfg for _, cfg in recompute], cache, workers)
    ranked += _costed(recompute, cache, capacity, profile)[0]
    ranked = _ordered_for_the_hop(ranked, top, profile, cache, workers)
    runs = [v for v in cache.values() if isinstance(v, UnitRuns)]
    skipped = f"; {beaten} with recomputation not costed: slower than the {top} best even without it" if beaten else ""
    say(f"{len(cands)} candidates, {len(runs)} local shapes dry-run ({4 * len(runs)} unit runs, {workers} "
        f"processes), {len(ranked)} fit{skipped} ({time.perf_counter() - t0:.1f} s)")
    pace = sorted(r.seconds_per_op for r in runs)[len(runs) // 2]  # a whole dry run's per op: the units' median
    out, longer = _verified(ranked[:top], capacity, profile, time.perf_counter() + verify_seconds, pace)
    out += ranked[top:]
    unverified = f" (the first left out would take ~{longer:.0f} s, more than --verify-seconds allows)" if longer \
        else ""
    say(f"the best {sum(r.exact for r in out)} dry-run whole{unverified} ({time.perf_counter() - t0:.1f} s in all)")
    return sorted(out, key=lambda x: -x.prediction.tokens_per_s)


def _check_blocks_alike(cfg: Config) -> None:
    """The unit runs' one block stands for every block: refused for a model mixing MoE and dense layers."""
    m = cfg.model
    if not is_uniform_depth(MoeShape.of(m), m.layers):
        raise ConfigError(f"--search costs every block as its first one, but this model mixes MoE and dense layers "
                          f"(model.decoder_sparse_step={m.decoder_sparse_step}, model.mlp_only_layers="
                          f"{list(m.mlp_only_layers)}): plan its layouts one by one without --search, or search with "
                          "--set model.decoder_sparse_step=1 --set model.mlp_only_layers=[] for an estimate")


def _twin(knobs: list[str]) -> tuple:
    return tuple(k for k in knobs if not k.startswith("train.activation_checkpointing"))


def _costed(cands: list[tuple[list[str], Config]], cache: dict, capacity: int,
            profile: Profile) -> tuple[list[Ranked], dict[tuple, float]]:
    """The candidates that fit, each predicted with its schedule's order for free transfers (building the
    order for the hop takes seconds per pipeline shape at P ≥ 8: :func:`_ordered_for_the_hop` does it for
    the few that can win); and the ones that do not fit, by :func:`_twin`, with their step's floor
    (:func:`~parallel4d.planning.cost.step_floor`)."""
    ranked, floors = [], {}
    for knobs, cfg in cands:
        ranks = assembled(cfg, unit(cfg, cache), cache)
        need = max(r.device_bytes for r in ranks)
        if need <= HEADROOM * capacity:
            built = cfg.pipeline.hop_cost != "auto"
            ranked.append(Ranked(knobs, cfg, need, predict(cfg, ranks, profile, build_order=False, orders=cache),
                                 order_built=built, ranks=ranks))
        else:
            floors[_twin(knobs)] = step_floor(cfg, ranks, profile, cache)
    return ranked, floors


def _worth_recomputing(cands: list[tuple[list[str], Config]], ranked: list[Ranked], floors: dict[tuple, float],
                       top: int) -> tuple[list[tuple[list[str], Config]], int]:
    """The candidates with recomputation to cost, and how many others there were: recomputation only adds
    work, so one is costed only where its twin without it does not fit, and only if that twin's step floor
    is within the ``top`` best steps costed (each an upper bound: a built order only shortens them), else it
    cannot reach the top."""
    steps = sorted(r.prediction.step_s for r in ranked)
    bar = steps[top - 1] if len(steps) >= top else math.inf
    fitted = {_twin(r.overrides) for r in ranked}
    unfit = [c for c in cands if c[1].train.activation_checkpointing != "none" and _twin(c[0]) not in fitted]
    kept = [c for c in unfit if floors.get(_twin(c[0]), 0.0) <= bar]
    return kept, len(unfit) - len(kept)


def _ordered_for_the_hop(ranked: list[Ranked], top: int, profile: Profile, cache: dict, workers: int) -> list[Ranked]:
    """The ``top`` fastest and the fastest of each schedule, predicted again with the order built for their
    hop (on :func:`half_octave`'s grid; the orders built side by side first): a built order is never slower
    at its hop, so only these can climb."""
    ranked = sorted(ranked, key=lambda x: -x.prediction.tokens_per_s)
    best_of = {}
    for i, r in enumerate(ranked):
        best_of.setdefault((r.cfg.pipeline.schedule, r.cfg.pipeline.waves), i)
    chosen = [i for i in sorted(set(range(min(top, len(ranked)))) | set(best_of.values())) if not ranked[i].order_built]
    prepare([], cache, workers, [(ranked[i].cfg, hop_cost_of(ranked[i].cfg, ranked[i].ranks, profile, half_octave))
                                 for i in chosen if ranked[i].cfg.parallel.pp > 1])
    for i in chosen:
        r = ranked[i]
        ranked[i] = replace(r, prediction=predict(r.cfg, r.ranks, profile, round_hop=half_octave, orders=cache),
                            order_built=True)
    return sorted(ranked, key=lambda x: -x.prediction.tokens_per_s)


def _verified(ranked: list[Ranked], capacity: int, profile: Profile, deadline: float,
              seconds_per_op: float) -> tuple[list[Ranked], float]:
    """The best first, each dry-run whole while time remains: exact memory (dropped if it does not fit) and
    the prediction from its own trace. One whose dry run would not end in the time left (its ranks' ops at
    ``seconds_per_op``) is not started; also that estimate for the best of them, if none before it was verified."""
    out, longer = [], 0.0
    for r in ranked:
        left = deadline - time.perf_counter()
        ops = sum(sum(x.ops.values()) for x in r.ranks or [])  # a step's; plan's dry runs make block_passes
        estimate = seconds_per_op * ops * block_passes(r.cfg) / (r.cfg.model.layers * r.cfg.pipeline.microbatches)
        if estimate > left and not longer and not any(x.exact for x in out):
            longer = estimate  # the best one not verified
        fits_time = left > 0 and estimate <= left and block_passes(r.cfg) <= MAX_BLOCK_PASSES
        ranks = _whole_plan(r.cfg, left) if fits_time else None
        if ranks is not None:
            need = max(x.device_bytes for x in ranks)
            if need > HEADROOM * capacity:
                continue
            r = Ranked(r.overrides, r.cfg, need, predict(r.cfg, ranks, profile), exact=True, ranks=ranks)
        out.append(r)
    return out, longer


def _whole_plan(cfg: Config, seconds: float) -> list[RankPlan] | None:
    """``plan(cfg, timed=True)`` in a forked process, or None when it takes more than ``seconds`` (a 7B
    model's pipeline ranks take minutes: the budget is the user's)."""
    with multiprocessing.get_context("fork").Pool(1, initializer=pool_worker_signals) as pool:
        pending = pool.apply_async(plan, (cfg,), {"timed": True})
        try:
            return pending.get(timeout=seconds)
        except multiprocessing.TimeoutError:
            return None


def _expert_columns(r: Ranked) -> str:
    """An MoE candidate's experts per device (weights, gradients, optimizer state) and all-to-all per step."""
    f = moe_figures(r.cfg, max((x.expert_parameters or 0) for x in r.ranks) if r.ranks else None)
    return f"{human(f.parameters + f.gradients + f.optimizer_state):>12}{human(f.all_to_all):>12}"


def format_search(ranked: list[Ranked], capacity: int, top: int) -> list[str]:
    if not ranked:
        return [f"no candidate fits {HEADROOM:.0%} of {human(capacity)} per device: add devices (--gpus), "
                "or plan the model smaller (--set model.layers=...), or with hetero (plain plan)"]
    moe = bool(ranked[0].cfg.model.num_experts)
    lines = [f"{'':>3} {'layout':<52}{'memory/device':>15}{'step':>10}{'tokens/s':>12}{'MFU':>7}{'bubble':>8}"
             + (f"{'experts':>12}{'all-to-all':>12}" if moe else "")]
    for i, r in enumerate(ranked[:top], 1):
        pred = r.prediction
        mem = f"{human(r.device_bytes)}{'' if r.exact else '~'}"
        step = f"{pred.step_s:.3f}s{'' if r.order_built else '+'}"
        mfu = f"{100 * pred.mfu:.1f}%" if pred.mfu is not None else "–"
        lines.append(f"{i:>3} {r.describe():<52}{mem:>15}{step:>11}{pred.tokens_per_s:>12,.0f}"
                     f"{mfu:>7}{100 * pred.bubble:>7.1f}%" + (_expert_columns(r) if moe else ""))
    if moe:
        lines.append("experts: the largest rank's expert weights, gradients and optimizer state (in memory/device) and "
                     "the bytes it sends to its ep ranks per step, routing assumed uniform; MFU counts the active "
                     "parameters (the k experts a token reaches)")
    lines.append("memory: a whole dry run's (exact as `parallel4d plan`), or ~ assembled from unit dry runs "
                 "(not verified in --verify-seconds); step + : with the schedule's order for free transfers, "
                 "an upper bound (its order for the hop built only for the top and each schedule's best)")
    return lines
