"""Pipeline schedules as data, and the generators that build them.

A :class:`Schedule` is pure data: a placement (pp rank → the model chunks it
holds, in model order) and, per rank, the ordered list of :class:`Action` it
runs in one optimizer step. Chunk ids ``0..num_chunks-1`` follow the model
(chunk 0 holds the embedding, the last chunk the LM head + loss). The executor
(:mod:`.executor`), the validator / simulator (:mod:`.analysis`) and the plot
only read this data, so a new scheme is a new generator and nothing else.

Generators (``P`` = pp ranks, ``m`` = micro-batches):

* :func:`gpipe` — one chunk per rank, all forwards then all backwards.
* :func:`one_f_one_b` — one chunk per rank, ``P-1-r`` warm-up forwards then
  alternate forward/backward (PipeDream-Flush / DAPPLE).
* :func:`interleaved_1f1b` — ``v`` chunks per rank, chunk ``c`` on rank
  ``c mod P`` (Megatron's interleaved schedule, groups of ``P`` micro-batches).
* :func:`hanayo` — ``2·W·P`` chunks placed as ``W`` waves (chunk ``c`` on rank
  ``c mod P`` when ``c // P`` is even, on ``P-1-(c mod P)`` when odd), ordered
  by a wave-aware greedy list scheduler under a per-rank activation cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable

SCHEDULES = ("gpipe", "1f1b", "interleaved", "hanayo")


@dataclass(frozen=True, order=True)
class Action:
    """One compute step: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of
    micro-batch ``microbatch`` through model chunk ``chunk``."""

    kind: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.c{self.chunk}"

    def describe(self) -> str:
        word = "forward" if self.kind == "F" else "backward" if self.kind == "B" else self.kind
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}) [{word}]"


@dataclass(frozen=True)
class Schedule:
    """Placement + per-rank action order for one optimizer step.

    ``placement[r]``: chunk ids held by pp rank ``r``, ascending (model order).
    ``actions[r]``: the order rank ``r`` runs its actions.
    """

    name: str
    pp: int
    microbatches: int
    num_chunks: int
    placement: dict[int, list[int]]
    actions: dict[int, list[Action]]

    def owner(self, chunk: int) -> int:
        """The pp rank that holds ``chunk``."""
        return self._owners()[chunk]

    def _owners(self) -> dict[int, int]:
        # Cached on the (frozen) instance: owner() is called per action by the executor.
        cache = self.__dict__.get("_owner_cache")
        if cache is None:
            cache = {c: r for r, cs in self.placement.items() for c in cs}
            object.__setattr__(self, "_owner_cache", cache)
        return cache

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.pp

    def table(self, width: int | None = None) -> str:
        """Per-rank action lists as text, one line per rank."""
        lines = []
        for r in range(self.pp):
            chunks = ",".join(str(c) for c in self.placement[r])
            acts = " ".join(str(a) for a in self.actions[r])
            lines.append(f"rank {r} [chunks {chunks}]: {acts}")
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """A short hash of placement + orders (ranks compare it before running)."""
        import hashlib

        text = repr((self.pp, self.microbatches, self.num_chunks,
                     sorted((r, tuple(c)) for r, c in self.placement.items()),
                     sorted((r, tuple((a.kind, a.microbatch, a.chunk) for a in acts))
                            for r, acts in self.actions.items())))
        return hashlib.sha1(text.encode()).hexdigest()[:16]


# --- placements ------------------------------------------------------------------


def linear_placement(pp: int) -> dict[int, list[int]]:
    """One chunk per rank: chunk ``r`` on rank ``r``."""
    return {r: [r] for r in range(pp)}


def looped_placement(pp: int, chunks_per_rank: int) -> dict[int, list[int]]:
    """Interleaved placement: chunk ``c`` on rank ``c mod P``."""
    return {r: [k * pp + r for k in range(chunks_per_rank)] for r in range(pp)}


def wave_rank(chunk: int, pp: int) -> int:
    """Hanayo placement: rank ``c mod P`` when ``c // P`` is even, else ``P-1-(c mod P)``."""
    return chunk % pp if (chunk // pp) % 2 == 0 else pp - 1 - chunk % pp


def wave_placement(pp: int, waves: int) -> dict[int, list[int]]:
    """``2·W·P`` chunks as ``W`` waves; rank ``d`` holds ``{2kP+d, 2kP+2P-1-d}``."""
    placement: dict[int, list[int]] = {r: [] for r in range(pp)}
    for c in range(2 * waves * pp):
        placement[wave_rank(c, pp)].append(c)
    return placement


# --- simple generators ------------------------------------------------------------


def _positive(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{name}={value} must be an integer ≥ 1")
    return int(value)


def gpipe(pp: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` backwards.

    Peak stored activations: ``m`` on every rank; bubble ``(P-1)/(m+P-1)``.
    """
    pp, m = _positive("pp", pp), _positive("microbatches", microbatches)
    actions = {r: [Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]
               for r in range(pp)}
    return Schedule("gpipe", pp, m, pp, linear_placement(pp), actions)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): ``min(P-1-r, m)`` warm-up forwards, then one
    forward / one backward, then the remaining backwards.

    Peak stored activations on rank ``r``: ``min(P-r, m)``; bubble ``(P-1)/(m+P-1)``.
    """
    pp, m = _positive("pp", pp), _positive("microbatches", microbatches)
    actions = {}
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        acts = [Action("F", i, r) for i in range(warm)]
        for k in range(m - warm):
            acts += [Action("F", warm + k, r), Action("B", k, r)]
        acts += [Action("B", i, r) for i in range(m - warm, m)]
        actions[r] = acts
    return Schedule("1f1b", pp, m, pp, linear_placement(pp), actions)


def interleaved_1f1b(pp: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron): ``v`` chunks per rank on the looped placement.

    Forwards on rank ``r`` run in groups of ``P`` micro-batches: for each group,
    chunk ``r`` for the group, then chunk ``P+r``, ... (backwards likewise, chunks
    descending). ``min((v-1)·P + 2·(P-1-r), v·m)`` warm-up forwards, then one
    forward / one backward. When ``m`` is not a multiple of ``P`` the last group
    is shorter. Bubble ``(P-1)/(v·m+P-1)`` when ``P`` divides ``m``.

    Takes ``m ≤ P`` or ``m`` a multiple of ``P`` (like Megatron): with a short
    *last* group after full ones, the warm-up of rank 0 runs ahead into the short
    group's later chunks and the ranks wait on each other in a cycle (``validate``
    finds that deadlock), so other counts raise ``ValueError``.
    """
    pp, m = _positive("pp", pp), _positive("microbatches", microbatches)
    v = _positive("chunks_per_rank", chunks_per_rank)
    if v > 1 and m > pp and m % pp:
        raise ValueError(interleaved_microbatch_message(pp, m))
    actions = {}
    for r in range(pp):
        fwd, bwd = [], []
        for g0 in range(0, m, pp):
            group = range(g0, min(g0 + pp, m))
            for k in range(v):
                fwd += [Action("F", i, k * pp + r) for i in group]
            for k in reversed(range(v)):
                bwd += [Action("B", i, k * pp + r) for i in group]
        total = v * m
        warm = min((v - 1) * pp + 2 * (pp - 1 - r), total)
        acts = fwd[:warm]
        for k in range(total - warm):
            acts += [fwd[warm + k], bwd[k]]
        acts += bwd[total - warm:]
        actions[r] = acts
    return Schedule(f"interleaved(v={v})", pp, m, v * pp, looped_placement(pp, v), actions)


def interleaved_microbatch_message(pp: int, m: int) -> str:
    lo, hi = (m // pp) * pp, (m // pp + 1) * pp
    return (f"pipeline.microbatches={m}: the interleaved schedule takes micro-batch counts ≤ parallel.pp={pp} "
            f"or multiples of it; use pipeline.microbatches={lo} or {hi}")


# --- Hanayo: greedy list scheduling on the wave placement -------------------------


POLICIES = ("alternate", "backward_first", "forward_first")


def list_schedule(
    name: str,
    pp: int,
    microbatches: int,
    placement: dict[int, list[int]],
    *,
    memory_cap: int | list[int],
    policy: str = "alternate",
    group: int = 1,
    forward_order: str = "microbatch",
    backward_order: str = "group",
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    p2p_cost: float = 0.0,
) -> Schedule | None:
    """Order the actions of any placement by simulating the ranks greedily.

    Each idle rank picks one of the actions whose inputs have arrived:

    * ``policy="alternate"``: the kind (F/B) it did not run last, if one is
      ready (1F1B's steady state), else the other kind;
    * ``"backward_first"`` / ``"forward_first"``: that kind whenever ready.

    Among forwards (``forward_order``): ``"microbatch"``, the lowest
    micro-batch (then chunk); ``"diagonal"``, the lowest ``(i mod group) + c``
    within the lowest group of ``group`` micro-batches ``i // group`` — the
    action an ideal fill would reach first, so a rank mixes the chunks of
    several waves instead of finishing one micro-batch first. Among backwards
    (``backward_order``): ``"group"``, the lowest group of ``group``
    micro-batches, then the highest chunk, then the lowest micro-batch
    (``group=1``: plain oldest-first); ``"microbatch"``, oldest-first
    whatever ``group``; ``"diagonal"``, the lowest
    ``i + (S-1-c)`` (``S`` chunks), then micro-batch. A forward only starts
    while the rank stores fewer than ``memory_cap`` chunk activations (one
    int, or a list with one cap per rank). Returns
    ``None`` when the cap starves the pipeline. Costs are per chunk; the
    *order* is what the schedule keeps (deadlock-free by construction);
    ``p2p_cost`` delays an input that crosses ranks.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
    if forward_order not in ("microbatch", "diagonal"):
        raise ValueError(f"forward_order={forward_order!r} must be 'microbatch' or 'diagonal'")
    if backward_order not in ("group", "microbatch", "diagonal"):
        raise ValueError(f"backward_order={backward_order!r} must be 'group', 'microbatch' or 'diagonal'")
    m = microbatches
    caps = list(memory_cap) if isinstance(memory_cap, (list, tuple)) else [memory_cap] * pp
    num_chunks = sum(len(c) for c in placement.values())
    owner = {c: r for r, cs in placement.items() for c in cs}
    last_chunk = num_chunks - 1
    g = max(1, group)
    ready: dict[int, list[tuple[float, Action]]] = {r: [] for r in range(pp)}
    ready[owner[0]] = [(0.0, Action("F", i, 0)) for i in range(m)]
    free_at = [0.0] * pp
    stored = [0] * pp
    last_kind = ["B"] * pp
    running: list[tuple[float, int, Action]] = []
    actions: dict[int, list[Action]] = {r: [] for r in range(pp)}
    remaining = 2 * m * num_chunks
    t = 0.0

    if forward_order == "microbatch":
        def f_key(a: Action):
            return (a.microbatch, a.chunk)
    else:
        def f_key(a: Action):
            return (a.microbatch // g, a.microbatch % g + a.chunk, a.microbatch)

    if backward_order == "group":
        def b_key(a: Action):
            return (a.microbatch // g, -a.chunk, a.microbatch)
    elif backward_order == "microbatch":
        def b_key(a: Action):
            return (a.microbatch, -a.chunk)
    else:
        def b_key(a: Action):
            return (a.microbatch + last_chunk - a.chunk, a.microbatch)

    while remaining:
        for r in range(pp):
            if free_at[r] > t:
                continue
            bs = [a for (rt, a) in ready[r] if rt <= t and a.kind == "B"]
            fs = [a for (rt, a) in ready[r] if rt <= t and a.kind == "F"] if stored[r] < caps[r] else []
            if not bs and not fs:
                continue
            if policy == "alternate":
                want_b = last_kind[r] == "F"
            else:
                want_b = policy == "backward_first"
            if bs and (want_b or not fs):
                pick = min(bs, key=b_key)
            else:
                pick = min(fs, key=f_key)
            ready[r].remove(next(x for x in ready[r] if x[1] == pick))
            cost = forward_cost if pick.kind == "F" else backward_cost
            free_at[r] = t + cost
            stored[r] += 1 if pick.kind == "F" else -1
            last_kind[r] = pick.kind
            actions[r].append(pick)
            running.append((t + cost, r, pick))
        upcoming = [e for (e, _, _) in running] + [rt for r in range(pp) for (rt, _) in ready[r] if rt > t]
        if not upcoming:
            return None  # starved by the memory cap
        t = min(upcoming)
        still = []
        for (end, r, a) in running:
            if end > t:
                still.append((end, r, a))
                continue
            remaining -= 1
            if a.kind == "F":
                if a.chunk < last_chunk:
                    dst = owner[a.chunk + 1]
                    ready[dst].append((t + (p2p_cost if dst != r else 0.0), Action("F", a.microbatch, a.chunk + 1)))
                else:  # the loss is computed in the last chunk's forward; its backward may start
                    ready[r].append((t, Action("B", a.microbatch, a.chunk)))
            elif a.chunk > 0:
                dst = owner[a.chunk - 1]
                ready[dst].append((t + (p2p_cost if dst != r else 0.0), Action("B", a.microbatch, a.chunk - 1)))
        running = still
    return Schedule(name, pp, m, num_chunks, {r: list(c) for r, c in placement.items()}, actions)


def wave_slot_schedule(name: str, pp: int, microbatches: int, waves: int) -> Schedule:
    """A constructed (not greedy) order on the wave placement, in 1F1B slots.

    Slot ``σ`` holds at most one forward then one backward per rank. Micro-batch
    ``i`` enters at ``b(i) = 2·(i mod P) + S·(i div P)`` (``S = 2WP`` chunks);
    ``F(i, c)`` sits in slot ``b(i) + c`` and ``B(i, c)`` in ``b(i) + 2(S-1) - c``.
    Rank ``d`` holds chunks ``≡ d`` and ``≡ 2P-1-d (mod 2P)``, of opposite
    parity, so a group of ``P`` micro-batches spaced 2 apart fills every slot of
    a rank once, and the next group (``S`` slots later) continues it without a
    collision; a chunk's set is symmetric (``c`` held ⇔ ``S-1-c`` held), so the
    backwards tile the slots the same way. Each input is produced one slot
    earlier (or earlier in the same slot on the same rank), so the order is
    deadlock-free; a rank stores at most ``S`` activations, below interleaved's
    ``S + P - 1``. The lists keep only the order: ranks run ahead of the slots
    whenever their inputs allow.
    """
    placement = wave_placement(pp, waves)
    s = 2 * waves * pp
    actions = {}
    for r in range(pp):
        items = []
        for i in range(microbatches):
            base = 2 * (i % pp) + s * (i // pp)
            for c in placement[r]:
                items.append((base + c, 0, Action("F", i, c)))
                items.append((base + 2 * (s - 1) - c, 1, Action("B", i, c)))
        actions[r] = [a for _, _, a in sorted(items, key=lambda x: (x[0], x[1]))]
    return Schedule(name, pp, microbatches, s, placement, actions)


# hanayo's search keeps the orders within FREE_SLACK of the shortest makespan with free
# transfers, then the one with the shortest summed makespan under these hop latencies
# (per cross-rank transfer, in chunk-forward units): a real link is neither free nor known.
FREE_SLACK = 0.01
HOP_LATENCIES = (0.25, 0.5)


def peak_activations(actions: Iterable[Action]) -> int:
    """Most chunk activations one rank's list stores at once (F done, B not yet)."""
    n = best = 0
    for a in actions:
        n += 1 if a.kind == "F" else -1
        best = max(best, n)
    return best


def interleaved_peak(pp: int, chunks_per_rank: int) -> int:
    """Rank 0's peak stored chunk activations under interleaved 1F1B (m ≥ P multiple of P)."""
    return chunks_per_rank * pp + pp - 1 if chunks_per_rank > 1 else pp


def hanayo(pp: int, microbatches: int, waves: int = 1, memory_cap: int | None = None) -> Schedule:
    """Hanayo wave schedule: ``2·W·P`` chunks on the wave placement.

    The order comes from :func:`list_schedule`: a small deterministic search
    over greedy rules (oldest-micro-batch-first under the three policies, and
    a "diagonal" forward priority — groups of ``P`` or ``m`` micro-batches,
    lowest ``i + c`` first — with oldest-first or diagonal backwards) and
    activation caps (one cap ``memory_cap``, or per-rank caps rising with the
    rank around ``2W·P + r``, never above ``memory_cap``). ``memory_cap``
    defaults to interleaved 1F1B's rank-0 peak for the same chunks per rank,
    ``2W·P + P - 1``, so a Hanayo schedule never stores more activations than
    interleaved. How one order is kept is below; ``hanayo(8, 32, 3)`` takes
    about 1.2 s on one core (cached per arguments).

    Lower bounds on the wave placement (any order, free transfers): rank
    ``P-1`` starts at ``P-1``, its first backward cannot start before
    ``2WP + 2(P-1)`` (the loss is on rank 0), and after its last backward
    ``P-1`` chunk backwards remain, so the makespan is at least
    ``max(P-1 + 2Wm, 2WP + 2P - 2) + 4Wm + 2(P-1)`` chunk-forward units:
    bubble ``(P-1)/(2W·m + P-1)`` (interleaved's with ``v = 2W``) once
    ``m ≥ P + (P-1)/(2W)``, but ``2(P-1)/(3WP + 2(P-1))`` at ``m = P`` — above
    interleaved(2W)'s ``(P-1)/(2WP + P-1)``; at ``m = P`` the wave placement
    cannot match interleaved with the same chunks per rank, and W=1 cannot
    match interleaved(2) (P=4: bound .333 vs .273). Holding rank ``P-1`` busy
    also fills it to exactly ``2WP + P - 1`` activations, interleaved's peak.

    Which order is kept: those within ``FREE_SLACK`` (1 %) of the shortest
    simulated makespan with free transfers (uniform chunks, backward =
    2 × forward), then the one with the shortest summed makespan at hop
    latencies 0.25 and 0.5 (a real link is neither free nor known), then
    the lower peak memory. Simulated bubble ratio, free transfers /
    ``p2p_cost=0.5`` per hop; ``il(v)`` = interleaved 1F1B with ``v``
    chunks/rank::

        P  m   W=1        il(2)      W=2        il(4)      W=3        il(6)
        4  4   .333/.429  .273/.400  .200/.351  .158/.333  .143/.308  .111/.308
        4  8   .158/.238  .158/.250  .086/.213  .086/.200  .065/.204  .059/.182
        4  16  .086/.135  .086/.143  .059/.123  .045/.111  .040/.103  .030/.100
        8  16  .179/.267  .179/.273  .107/.262  .099/.213  .077/.230  .068/.191
        8  32  .099/.154  .099/.158  .068/.141  .052/.119  .046/.118  .035/.106

    (The latency tie-break replaced a free-transfer-only choice that gave
    P=8, m=32, W=2 .066/.203 — worse than interleaved(2) with latency — and
    P=4, m=16, W=2 .054/.165.)

    What holds (asserted in the tests): W=1 reaches the bound for ``m ≥ 2P``
    and beats interleaved(2) under hop latency (fewer hops); with free
    transfers every W ≥ 2 beats interleaved(2) and W=1, and with latency
    0.5 it beats interleaved(2) on this table too; peak activations never exceed
    interleaved's with the same chunks per rank. What does not: for W ≥ 2
    the greedy orders stay above interleaved(2W) (by up to .016 free at
    m ≥ 2P on this table, more with latency, as no rule here plans around
    latency). That gap is our generator's, not the placement's: without
    the memory cap the same rules reach the bound (P=8, m=32, W=3: .035 at
    69 stored activations vs 55), and an exact CP-SAT search (offline,
    OR-Tools, not a dependency) found for P=4, m=16, W=2 an order *on the
    bound* (makespan 201, bubble .045) with every rank at ≤ 19 = 2WP + P - 1
    activations — interleaved(4)'s bubble and peak — in 8.5 s (P=4, m=8,
    W=3: on the bound, 153 vs our 154, in 1 s); at P=8, m=32, W=2 it got
    only 409 against our 412 and the bound's 405 in 300 s, too slow to run
    at start-up, so it is not shipped. The search also tries
    the constructed slot order of :func:`wave_slot_schedule` (≤ 2WP
    activations); it wins at m = P and for W=3 at P=4, m=16 and P=8, m=32,
    but its fill runs rank ``d`` at half density until slot ``2P-1-d``, so
    it stays above interleaved(2W) too. The order also keeps a tied
    embedding/LM head on one rank.
    """
    pp, m = _positive("pp", pp), _positive("microbatches", microbatches)
    w = _positive("waves", waves)
    if memory_cap is not None:
        memory_cap = _positive("memory_cap", memory_cap)
    s = _hanayo(pp, m, w, memory_cap)
    # A fresh copy: callers may edit their schedule, the cache must not change.
    return Schedule(s.name, s.pp, s.microbatches, s.num_chunks,
                    {r: list(c) for r, c in s.placement.items()},
                    {r: list(a) for r, a in s.actions.items()})


@lru_cache(maxsize=256)
def _hanayo(pp: int, m: int, w: int, memory_cap: int | None) -> Schedule:
    from .analysis import _run

    placement = wave_placement(pp, w)
    name = f"hanayo(W={w})"
    c = 2 * w
    top = memory_cap or interleaved_peak(pp, c)
    # Candidate (caps, policy, forward order, group, backward order). Rank r's first
    # backward can start at 2WP + 2r, so a rank that never idles in the fill holds
    # about 2WP + r activations then: per-rank caps around that line, never above top.
    candidates = []
    for policy in POLICIES:  # the original greedy: oldest micro-batch first
        candidates.append((top, policy, "microbatch", 1, "group"))
    ramps = [[min(top, c * pp + r + a) for r in range(pp)] for a in sorted({1, 2, 3, pp // 2, pp - 2, pp - 1})]
    for caps in [top] + ramps:
        for group in sorted({pp, m}):
            for back in ("microbatch", "diagonal"):
                candidates.append((caps, "alternate", "diagonal", group, back))
    # The constructed slot order first (stores ≤ 2WP, so it fits any cap ≥ interleaved's).
    slot = wave_slot_schedule(name, pp, m, w)
    if max(peak_activations(a) for a in slot.actions.values()) > top:
        slot = None
    orders = []
    for cand in [None] + candidates:
        if cand is None:
            s = slot
        else:
            caps, policy, fwd, group, back = cand
            s = list_schedule(name, pp, m, placement, memory_cap=caps, policy=policy, group=group,
                              forward_order=fwd, backward_order=back)
        if s is not None:  # valid by construction; the tests validate every one
            free = _run(s, 1.0, 2.0, 0.0)
            orders.append((free.makespan, max(free.peak_activations), s))
    best = None
    if orders:
        # Near-best with free transfers (within FREE_SLACK), then the most robust to hop
        # latency (simulated only for those), then the shorter free makespan, then memory.
        limit = min(o[0] for o in orders) * (1 + FREE_SLACK) + 1e-9

        def key(o):
            lat = sum(_run(o[2], 1.0, 2.0, hop).makespan for hop in HOP_LATENCIES)
            return round(lat, 9), round(o[0], 9), o[1]

        best = min((o for o in orders if o[0] <= limit), key=key)[2]
    if best is None:
        raise ValueError(f"memory_cap={memory_cap} starves the hanayo pipeline (P={pp}, W={w}); "
                         f"use memory_cap≥{interleaved_peak(pp, c)}")
    return best


def make_schedule(name: str, pp: int, microbatches: int, *, waves: int = 1, chunks_per_rank: int = 2) -> Schedule:
    """Build a schedule by config name (``gpipe``, ``1f1b``, ``interleaved``, ``hanayo``)."""
    from .checks import check_schedule_name

    name = check_schedule_name(name)
    if name == "gpipe":
        return gpipe(pp, microbatches)
    if name == "1f1b":
        return one_f_one_b(pp, microbatches)
    if name == "interleaved":
        return interleaved_1f1b(pp, microbatches, chunks_per_rank)
    return hanayo(pp, microbatches, waves)


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "hanayo": hanayo,
}
