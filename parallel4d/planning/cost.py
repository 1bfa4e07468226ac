"""The time model: a job's step time on a device profile, from its own dry run.

Per pipeline position, :func:`parallel4d.planning.dry_run.plan` (``timed``) gives every op of one step
(:mod:`.trace`) and the bytes and messages sent along each mesh axis. Then:

* **compute**: each op at the profile's cost (:meth:`.profiles.Profile.op_seconds`), summed by phase;
  hetero's optimizer step at the host's rates;
* **communication**: per axis, ``messages·latency + bytes / bandwidth`` on the link that axis's groups
  use (a group inside ``ranks_per_node`` consecutive ranks: the node's, else the network's). The
  tensor and sequence axes' traffic happens inside the forward and backward (added to them, in
  their proportion; nothing assumed overlapped); the pipeline's is each hop's latency; the data
  replicas' gradient reduction follows the last backward;
* **the pipeline**: :func:`parallel4d.pipeline.simulate` of the job's own order with each rank's
  chunk forward and backward and that hop (``hop_cost: auto`` builds the order for them, as a run
  does); without a pipeline, the micro-batches one after another;
* **hetero**: the chunk traffic a steady step moves, over the host link; the optimizer step's share of the
  rows whose state is on the host (16-bit chunks: the master placement the dry run reports; otherwise
  every row) at the host's rates, less what its worker hides behind the next forward (and the backward,
  when nothing scales the gradients after it and there is one data replica).

``step = pipeline + data-parallel reduction + optimizer step + hetero traffic``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from parallel4d.config.schema import Config
from parallel4d.distributed.mesh import AXES, mesh_shape
from parallel4d.engine.compose import job_schedule
from parallel4d.engine.flops import flops_per_token
from parallel4d.pipeline import makespan_floor, simulate
from parallel4d.planning.profiles import Profile
from parallel4d.planning.trace import PHASES, Op
from parallel4d.planning.dry_run import RankPlan

INSIDE = ("tp_row", "tp_col", "sp", "tp")  # axes whose traffic is part of a chunk's forward and backward
WEIGHT_SHARE = 0.5  # a split backward's W: the weight gradients' half of the backward's products


@dataclass
class RankTime:
    """One pipeline position's seconds per step: compute by phase, communication by axis."""

    pp_rank: int
    compute_s: dict[str, float]  # forward / backward / step
    comm_s: dict[str, float]  # by mesh axis
    hetero_s: float = 0.0  # host link
    host_step_s: float = 0.0  # the optimizer step's host rows (hetero), before what the worker hides

    def inside_s(self) -> float:
        return sum(t for a, t in self.comm_s.items() if a in INSIDE)

    def after_s(self) -> float:
        """The data replicas' reduction and anything outside the tensor, sequence and pipeline axes."""
        return sum(t for a, t in self.comm_s.items() if a not in INSIDE and a != "pp")


@dataclass
class Prediction:
    """A job's predicted step on a profile: the step, its parts, throughput and MFU."""

    step_s: float
    parts: dict[str, float]  # pipeline (compute, its idle, inside traffic), data_parallel, optimizer, hetero
    tokens_per_s: float
    mfu: float | None
    bubble: float
    hop_s: float | None
    ranks: list[RankTime] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bubble": self.bubble,
                "hop_s": self.hop_s, "parts": self.parts,
                "ranks": [{"pp_rank": r.pp_rank, "compute_s": r.compute_s, "comm_s": r.comm_s, "hetero_s": r.hetero_s,
                           "host_step_s": r.host_step_s}
                          for r in self.ranks]}


def _axis_sizes(cfg: Config) -> dict[str, int]:
    p = cfg.parallel
    return dict(zip(AXES, mesh_shape(p.pp, p.dp, p.sp, p.tp)))


def axis_span(cfg: Config, axis: str) -> int:
    """How many consecutive global ranks one group of ``axis`` spans (mesh order pp, dp, sp, tp_row,
    tp_col: the last varies fastest); ``"dp+sp"``-style joined axes span their outermost's."""
    sizes = _axis_sizes(cfg)
    parts = axis.split("+")
    if any(a not in sizes for a in parts):
        return cfg.world_size  # the default group, or one the mesh did not name: assume the widest
    outer = min(AXES.index(a) for a in parts)
    span = 1
    for a in AXES[outer:]:
        span *= sizes[a]
    return span


def axis_size(cfg: Config, axis: str) -> int:
    sizes = _axis_sizes(cfg)
    return math.prod(sizes.get(a, cfg.world_size) for a in axis.split("+"))


def wire_bytes(cfg: Config, axis: str, counted: float) -> float:
    """What a rank puts on the wire for ``counted`` bytes (:mod:`parallel4d.distributed.comm` counts each
    collective's tensor once): the data replicas' all-reduce, a ring's ``2(n−1)/n`` of it."""
    if not axis.startswith("dp"):
        return counted
    n = axis_size(cfg, axis)
    return counted * 2 * (n - 1) / n


def compute_seconds(ops: Counter[Op], profile: Profile, host_share: float = 0.0) -> tuple[dict[str, float], float]:
    """``(seconds per phase, the step's host seconds)``: ``host_share`` of the step phase's work runs on the
    host (hetero's host rows), the rest on the device (its ``step`` entry)."""
    out = dict.fromkeys(PHASES, 0.0)
    host = 0.0
    for op, n in ops.items():
        if op.phase == "step" and host_share:
            host += n * host_share * profile.op_seconds(op, on_host=True)
            out["step"] += n * (1 - host_share) * profile.op_seconds(op)
        else:
            out[op.phase] += n * profile.op_seconds(op)
    return out, host


def host_step_share(cfg: Config, plan: RankPlan) -> float:
    """The share of the optimizer step hetero runs on the host: its host rows' (16-bit chunks), else all."""
    if not cfg.hetero.enabled:
        return 0.0
    m = plan.master_placement
    if not m:
        return 1.0
    rows = m["optimizer_rows_on_device"] + m["optimizer_rows_on_host"]
    return m["optimizer_rows_on_host"] / rows if rows else 0.0


def hidden_host_step(cfg: Config, t: RankTime) -> float:
    """The seconds of a rank's host step its worker overlaps: the next forward, and the backward too when the
    rows are handed over in it (no clipping, no float16 loss scale, one data replica)."""
    window = t.compute_s["forward"]
    if cfg.train.grad_clip is None and cfg.train.autocast != "float16" and cfg.parallel.dp * cfg.parallel.sp == 1:
        window += t.compute_s["backward"]
    return min(t.host_step_s, window)


def rank_time(cfg: Config, plan: RankPlan, profile: Profile) -> RankTime:
    comm = {}
    for axis, nbytes in plan.sent_by_axis.items():
        within = axis_span(cfg, axis) <= profile.ranks_per_node
        comm[axis] = profile.link(within).seconds(wire_bytes(cfg, axis, nbytes), plan.calls_by_axis.get(axis, 1))
    hetero = (plan.hetero_moved or 0) / profile.host_link_bytes_per_s
    compute, host = compute_seconds(plan.ops, profile, host_step_share(cfg, plan))
    return RankTime(plan.pp_rank, compute, comm, hetero, host)


def hop_seconds(cfg: Config, plan: RankPlan, profile: Profile) -> float:
    """One activation's trip between pp neighbours: its bytes (what the pp axis sent per message)."""
    messages = plan.calls_by_axis.get("pp", 0)
    per = plan.sent_by_axis.get("pp", 0) / messages if messages else 0
    return profile.link(axis_span(cfg, "pp") <= profile.ranks_per_node).seconds(per, 1)


def _chunk_costs(cfg: Config, t: RankTime, chunks: int) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one chunk and one micro-batch on that rank, its share of the
    tensor and sequence traffic included."""
    fwd, bwd = t.compute_s["forward"], t.compute_s["backward"]
    inside = t.inside_s()
    share = fwd / (fwd + bwd) if fwd + bwd else 0.5
    per = cfg.pipeline.microbatches * chunks
    return (fwd + inside * share) / per, (bwd + inside * (1 - share)) / per


def half_octave(ratio: float) -> float:
    """``ratio`` on the grid ``2^(k/2)`` (0 below 1/64): the search builds an order per grid point, not per
    candidate (building one takes seconds at P ≥ 8), and the orders built for neighbouring ratios differ little."""
    if ratio < 1 / 64:
        return 0.0
    return round(2 ** (round(2 * math.log2(ratio)) / 2), 4)


def order_key(cfg: Config, p2p_cost: float | None = None) -> tuple:
    """What tells ``cfg``'s schedule (its order built for a hop of ``p2p_cost`` chunk forwards) from another's."""
    pl = cfg.pipeline
    return pl.schedule, cfg.parallel.pp, pl.microbatches, pl.waves, pl.chunks_per_rank, pl.split_backward, p2p_cost


def order(cfg: Config, orders: dict | None, p2p_cost: float | None = None):
    """``cfg``'s schedule, from ``orders`` (by :func:`order_key`; built into it when missing) when given: a
    search costs hundreds of candidates on a few dozen orders, each seconds to build at 16 ranks. Read it,
    never edit it."""
    key = order_key(cfg, p2p_cost)
    if orders is None:
        return job_schedule(cfg, p2p_cost)
    if key not in orders:
        orders[key] = job_schedule(cfg, p2p_cost)
    return orders[key]


def _hop_cost(cfg: Config, times: list[RankTime], hop: float, round_hop) -> float | None:
    """What the order is built for: ``pipeline.hop_cost``, or for ``auto`` (as a run builds it) the hop over a
    chunk's mean forward, rounded by ``round_hop`` (the run's 3 decimals by default)."""
    cost = cfg.pipeline.hop_cost
    if cost != "auto":
        return cost
    chunks = cfg.pipeline.num_chunks(cfg.parallel.pp) // cfg.parallel.pp  # every schedule: as many on each rank
    forwards = [_chunk_costs(cfg, t, chunks)[0] for t in times]
    ratio = hop / max(sum(forwards) / len(forwards), 1e-12)
    return round_hop(ratio) if round_hop else round(ratio, 3)


def _action_cost(cfg: Config, schedule, times: list[RankTime]):
    """``action → seconds`` on ``schedule``'s placement: its rank's chunk forward, backward, or a split
    backward's B and W (:data:`WEIGHT_SHARE`)."""
    costs = [_chunk_costs(cfg, t, len(schedule.placement[t.pp_rank])) for t in times]
    owner, split = schedule.owners(), schedule.split_backward

    def action_cost(a) -> float:
        f, b = costs[owner[a.chunk]]
        if a.kind == "F":
            return f
        if not split:
            return b
        return b * WEIGHT_SHARE if a.kind == "W" else b * (1 - WEIGHT_SHARE)

    return action_cost


def _pipeline(cfg: Config, plans: list[RankPlan], times: list[RankTime], profile: Profile, round_hop=None,
              build_order: bool = True, orders: dict | None = None):
    """(seconds of the forward and backward of all micro-batches, bubble, hop seconds); ``round_hop``: as
    :func:`_hop_cost`'s; ``build_order=False``: ``hop_cost: auto`` simulated with the order for free transfers
    instead (an upper bound: the search behind a built order also tries the free-transfer orders and keeps the
    fastest at the hop); ``orders``: as :func:`order`'s."""
    if cfg.parallel.pp == 1:
        t = times[0]
        return t.compute_s["forward"] + t.compute_s["backward"] + t.inside_s(), 0.0, None
    hop = hop_seconds(cfg, plans[0], profile)
    base = order(cfg, orders)
    cost = None if cfg.pipeline.hop_cost == "auto" and not build_order else _hop_cost(cfg, times, hop, round_hop)
    schedule = base if cost is None else order(cfg, orders, cost)
    sim = simulate(schedule, 1.0, 2.0, hop, action_cost=_action_cost(cfg, base, times))
    return sim.makespan, sim.bubble_ratio, hop


def hop_cost_of(cfg: Config, plans: list[RankPlan], profile: Profile, round_hop=None) -> float | None:
    """The hop (in chunk forwards) the order :func:`predict` simulates a pipelined ``cfg`` with is built for."""
    times = [rank_time(cfg, p, profile) for p in plans]
    return _hop_cost(cfg, times, hop_seconds(cfg, plans[0], profile), round_hop)


def _after_pipeline(cfg: Config, times: list[RankTime]) -> dict[str, float]:
    """The step's parts after the pipeline: the replicas' reduction, the optimizer step (hetero's host rows:
    what their worker does not hide), hetero's traffic."""
    return {"data_parallel": max(t.after_s() for t in times),
            "optimizer": max(t.compute_s["step"] + t.host_step_s - hidden_host_step(cfg, t) for t in times),
            "hetero": max(t.hetero_s for t in times)}


def predict(cfg: Config, plans: list[RankPlan], profile: Profile, round_hop=None, build_order: bool = True,
            orders: dict | None = None) -> Prediction:
    """The step of ``cfg`` on ``profile`` from its timed plan (``plan(cfg, timed=True)``); ``round_hop``,
    ``build_order`` and ``orders``: as :func:`_pipeline`'s."""
    times = [rank_time(cfg, p, profile) for p in plans]
    pipeline_s, bubble, hop = _pipeline(cfg, plans, times, profile, round_hop, build_order, orders)
    parts = {"pipeline": pipeline_s, **_after_pipeline(cfg, times)}
    step = sum(parts.values())
    tokens = cfg.data.batch_size * cfg.model.seq_len
    dtype = cfg.train.autocast if cfg.train.autocast != "none" else cfg.train.parameters
    peak = profile.rates["matmul"].peak
    peak = peak.get(dtype) if isinstance(peak, dict) else peak
    mfu = tokens / step * flops_per_token(cfg) / (cfg.world_size * peak) if peak else None
    return Prediction(step, parts, tokens / step, mfu, bubble, hop, times)


def step_floor(cfg: Config, plans: list[RankPlan], profile: Profile, orders: dict | None = None) -> float:
    """A lower bound on :func:`predict`'s step for ``cfg`` whatever order its schedule's placement runs
    (:func:`~parallel4d.pipeline.makespan_floor`), cheap beside it (no order built or simulated). Every part of
    the step only grows with each op's work, so it also bounds the same job with recomputation."""
    times = [rank_time(cfg, p, profile) for p in plans]
    if cfg.parallel.pp == 1:
        pipeline_s = _pipeline(cfg, plans, times, profile)[0]
    else:
        base = order(cfg, orders)
        pipeline_s = makespan_floor(base, _action_cost(cfg, base, times), hop_seconds(cfg, plans[0], profile))
    return pipeline_s + sum(_after_pipeline(cfg, times).values())


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def format_prediction(pred: Prediction, profile: Profile) -> list[str]:
    """The predicted step on ``profile`` and its parts."""
    parts = ", ".join(f"{k.replace('_', ' ')} {_ms(v)}" for k, v in pred.parts.items() if v)
    lines = [f"predicted step on {profile.name}: {_ms(pred.step_s)} ({parts}); {pred.tokens_per_s:,.0f} tokens/s"
             + (f", MFU {100 * pred.mfu:.1f} %" if pred.mfu is not None else "")]
    if pred.hop_s is not None:
        lines.append(f"  pipeline: bubble {100 * pred.bubble:.1f} % of the ranks' time, hop {_ms(pred.hop_s)}")
    for r in pred.ranks:
        comm = ", ".join(f"{a} {_ms(t)}" for a, t in r.comm_s.items())
        lines.append(f"  pp rank {r.pp_rank}: forward {_ms(r.compute_s['forward'])}, backward "
                     f"{_ms(r.compute_s['backward'])}, optimizer step {_ms(r.compute_s['step'])}"
                     + (f"; communication {comm}" if comm else ""))
    return lines
