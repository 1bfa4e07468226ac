"""NCCL's rules as a test (#28): what the executor, the ring and SUMMA post — recorded from the code
itself over fake NCCL groups (``nccl_fakes``), every rank in turn in this process — replayed by
``parallel4d.distributed.nccl_replay`` (per-communicator streams, rendezvous p2p, blocking lazy
communicator init) finds no deadlock in each of three readings (:data:`MODELS`): torch's default
lazy mode (a communicator per pair for unbatched p2p); eager mode (``device_id`` given: unbatched
p2p on the group's own stream); and lazy with every NCCL kernel of a rank run one at a time in post
order (NCCL does not promise two communicators progress at once). First the replayer on small
hand-written cases.

Every schedule at pp 2–8: all micro-batch counts 1–16 the generator takes for gpipe, 1f1b,
interleaved (2 and 4 chunks per rank) and zb_h1; for hanayo (W=1, 2, with and without split
backward) and zbv, whose generators search (≈0.1–2 s a schedule), m = 1 and m = pp here, and every
m with ``PARALLEL4D_REPLAY_ALL=1`` (≈3 minutes).
"""

import os
from datetime import timedelta

import pytest
import torch

from nccl_fakes import record_experts, record_hetero_zero, record_pipeline, record_ring, record_summa
from parallel4d.distributed import comm
from parallel4d.distributed.nccl_replay import Post, Wait, replay
from parallel4d.pipeline import make_schedule
from parallel4d.pipeline.executor import PipelineExecutor

# --- the replayer on cases small enough to check by hand --------------------------------------


def _p2p(work, kind, *ops, members=(0, 1)):
    return Post(work, kind, "g", members, tuple(ops))


def test_recv_first_batches_on_one_stream_deadlock():
    # Each rank batches its receive, then its send, in two kernels on the group's stream: both
    # receives run, both sends wait behind them.
    traces = {0: [_p2p(0, "batch", ("recv", 1)), _p2p(1, "batch", ("send", 1)), Wait(0)],
              1: [_p2p(0, "batch", ("recv", 0)), _p2p(1, "batch", ("send", 0)), Wait(0)]}
    v = replay(traces)
    assert not v.ok and v.cycle == [0, 1], v
    assert "queued behind batch#0" in v.blocked[0] and "cycle: rank 0 → rank 1 → rank 0" in str(v)


def test_one_batch_both_ways_and_matching_order_are_clean():
    both = {r: [_p2p(0, "batch", ("send", 1 - r), ("recv", 1 - r)), Wait(0)] for r in (0, 1)}
    assert replay(both).ok
    # Unbatched: the pair's own stream carries both directions; same order on both sides is fine,
    # both receiving first is not.
    same = {0: [_p2p(0, "p2p", ("send", 1)), _p2p(1, "p2p", ("recv", 1)), Wait(1)],
            1: [_p2p(0, "p2p", ("recv", 0)), _p2p(1, "p2p", ("send", 0)), Wait(0)]}
    assert replay(same).ok and replay(same, eager_init=True).ok
    crossed = {0: [_p2p(0, "p2p", ("recv", 1)), _p2p(1, "p2p", ("send", 1)), Wait(0)],
               1: [_p2p(0, "p2p", ("recv", 0)), _p2p(1, "p2p", ("send", 0)), Wait(0)]}
    assert not replay(crossed).ok


def test_lazy_pair_init_around_a_ring_deadlocks():
    # Unbatched ring shift: each rank's first op creates the pair communicator with its next rank,
    # which is busy creating the one with its own next: a cycle of blocking inits.
    ring = {r: [_p2p(0, "p2p", ("send", (r + 1) % 3), members=(0, 1, 2)),
                _p2p(1, "p2p", ("recv", (r - 1) % 3), members=(0, 1, 2)), Wait(0), Wait(1)] for r in range(3)}
    v = replay(ring)
    assert not v.ok and sorted(v.cycle) == [0, 1, 2], v
    assert all("first use of communicator pair" in why for why in v.blocked.values()), v
    # In eager mode there is no pair init, but the group's one stream serializes: still stuck.
    assert not replay(ring, eager_init=True).ok
    # Pairs in one order on every rank (ascending) cannot close the cycle.
    ordered = {r: sorted(ring[r][:2], key=lambda p: sorted((r, p.ops[0][1]))) for r in range(3)}
    ordered = {r: [Post(i, p.kind, p.group, p.members, p.ops) for i, p in enumerate(ordered[r])] + [Wait(0), Wait(1)]
               for r in range(3)}
    assert replay(ordered).ok


def test_collectives_in_different_orders_deadlock_and_mismatches_are_named():
    a, b = ("coll", "all_reduce"), ("coll", "broadcast")
    crossed = {0: [Post(0, "coll", "A", (0, 1), (a,)), Wait(0), Post(1, "coll", "B", (0, 1), (b,)), Wait(1)],
               1: [Post(0, "coll", "B", (0, 1), (b,)), Wait(0), Post(1, "coll", "A", (0, 1), (a,)), Wait(1)]}
    v = replay(crossed, eager_init=True)
    assert not v.ok and v.cycle == [0, 1], v
    # Posted without waiting in between: each group's stream gets by on its own (existing
    # communicators), but not where one kernel at a time runs on each rank.
    both = {0: [Post(0, "coll", "A", (0, 1), (a,)), Post(1, "coll", "B", (0, 1), (b,)), Wait(0), Wait(1)],
            1: [Post(0, "coll", "B", (0, 1), (b,)), Post(1, "coll", "A", (0, 1), (a,)), Wait(0), Wait(1)]}
    assert replay(both, eager_init=True).ok
    v = replay(both, eager_init=True, serial=True)
    assert not v.ok and "its one (serial) queue" in str(v), v
    mixed = {0: [Post(0, "coll", "A", (0, 1), (a,)), Wait(0)], 1: [Post(0, "coll", "A", (0, 1), (b,)), Wait(0)]}
    v = replay(mixed)
    assert not v.ok and "all_reduce on rank 0, broadcast on rank 1" in str(v), v


# --- the pipeline executor, every schedule ---------------------------------------------------------

VARIANTS = {
    "gpipe": ("gpipe", {}), "1f1b": ("1f1b", {}), "interleaved-v2": ("interleaved", {"chunks_per_rank": 2}),
    "interleaved-v4": ("interleaved", {"chunks_per_rank": 4}), "zb_h1": ("zb_h1", {}),
    "hanayo-w1": ("hanayo", {"waves": 1}), "hanayo-w2": ("hanayo", {"waves": 2}),
    "hanayo-w1-split": ("hanayo", {"waves": 1, "split_backward": True}),
    "hanayo-w2-split": ("hanayo", {"waves": 2, "split_backward": True}), "zbv": ("zbv", {}),
}
SEARCHED = ("hanayo", "zbv")  # generators that search: a few micro-batch counts unless asked for all
EVERY_M = os.environ.get("PARALLEL4D_REPLAY_ALL") == "1"


def _schedules(name, kw):
    for pp in range(2, 9):
        for m in range(1, 17) if EVERY_M or name not in SEARCHED else sorted({1, pp}):
            try:
                yield make_schedule(name, pp, m, **kw)
            except ValueError:  # a count the generator refuses (interleaved: m ≤ pp or a multiple)
                continue


MODELS = {"lazy": {}, "eager": {"eager_init": True}, "serial": {"serial": True}}


def _stuck(traces) -> list[str]:
    """Each model's verdict where it is not clean."""
    return [f"{name}: {v}" for name, kw in MODELS.items() if not (v := replay(traces, **kw)).ok]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_executor_posting_is_deadlock_free_under_nccl(variant):
    """Training and evaluation (``for_evaluation``), each model of :data:`MODELS`. On the code before
    #28 (one ``batch_isend_irecv`` per call, look-ahead receives posted per pair) interleaved
    deadlocks at every pp ≥ 3: the wrap from rank P-1 to rank 0 closes the cycle."""
    name, kw = VARIANTS[variant]
    failed, n = [], 0
    for s in _schedules(name, kw):
        for evaluation, traces in enumerate(record_pipeline(s)):
            n += 1
            failed += [f"pp={s.pp} m={s.microbatches} {'evaluation' if evaluation else 'training'}, {why}"
                       for why in _stuck(traces)]
    assert n and not failed, f"{len(failed)} stuck in {n} recordings; the first:\n{failed[0]}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_messages_of_several_tensors_are_deadlock_free_under_nccl(variant):
    """A message carrying a float64 vector beside the activation (MoE's load statistics) is two ops to one
    peer at the message's one place in the global order: still clean in every model, training and
    evaluation (pp 2–4, m = pp)."""
    name, kw = VARIANTS[variant]
    failed, n = [], 0

    def sends(traces):
        return sum(op[0] == "send" for events in traces.values() for e in events
                   if isinstance(e, Post) and e.label.startswith("pp.p2p") for op in e.ops)

    for pp in (2, 3, 4):
        s = make_schedule(name, pp, pp, **kw)
        for evaluation, (traces, plain) in enumerate(zip(record_pipeline(s, carried=True), record_pipeline(s))):
            n += 1
            assert sends(traces) == 2 * sends(plain) > 0  # every message two tensors
            failed += [f"pp={pp} {'evaluation' if evaluation else 'training'}, {why}" for why in _stuck(traces)]
    assert n and not failed, f"{len(failed)} stuck in {n} recordings; the first:\n{failed[0]}"


def test_two_steps_in_a_row_are_deadlock_free():
    for name, pp, m, kw in (("interleaved", 4, 8, {"chunks_per_rank": 2}), ("zbv", 3, 6, {}), ("1f1b", 5, 3, {})):
        for traces in record_pipeline(make_schedule(name, pp, m, **kw), steps=2):
            assert not _stuck(traces), (name, _stuck(traces))


def test_every_wait_of_a_step_is_bounded_by_timeout_s():
    """The loss broadcast waited twice the limit before #28; the receives count from their post."""
    for name, kw in (("1f1b", {}), ("hanayo", {"waves": 1})):
        training, evaluation = record_pipeline(make_schedule(name, 3, 4, **kw), steps=2, timeout_s=7.0)
        for r, events in [*training.items(), *evaluation.items()]:
            waits = [e for e in events if isinstance(e, Wait) and e.what != "pp.check"]  # pp.check: the group's limit
            assert waits and all(e.timeout_s is not None and 0 < e.timeout_s <= 7.0 for e in waits), \
                (name, r, [(e.what, e.timeout_s) for e in waits if not e.timeout_s or e.timeout_s > 7.0])
            assert any("loss broadcast" in e.what for e in waits)


def test_every_stream_ordered_wait_of_a_step_leaves_a_deadline_within_timeout_s():
    """As on NCCL (the mesh's deadlines): no wait is timed (the host never polls a work), and each hands
    the deadlines a limit within timeout_s, counted from the post for a receive."""
    from parallel4d.distributed.deadlines import Deadlines

    class Ledger(Deadlines):
        def add(self, timeout_s, what):
            self.limits.append((what, timeout_s))

    ledger = Ledger(7.0)
    ledger.limits = []
    training, _ = record_pipeline(make_schedule("1f1b", 3, 4), steps=2, timeout_s=7.0, deadlines=ledger)
    waits = [e for events in training.values() for e in events if isinstance(e, Wait) and e.what != "pp.check"]
    assert waits and all(e.timeout_s is None for e in waits), [e for e in waits if e.timeout_s is not None][:3]
    assert len(ledger.limits) >= len(waits) // 2 and all(0 < t <= 7.0 for _, t in ledger.limits), ledger.limits
    assert any("loss broadcast" in what for what, _ in ledger.limits)


def test_warm_up_pairs_in_a_rotating_order_would_deadlock(monkeypatch):
    """The replay models lazy communicator creation: the warm-up in ascending pair order is clean,
    each rank starting with its next ring neighbour (interleaved's wrap) is a cycle of inits."""
    s = make_schedule("interleaved", 3, 3)
    assert replay(record_pipeline(s)[0]).ok

    def rotating(self):
        peers = sorted({m.src if m.dst == self.me else m.dst for m in self.order},
                       key=lambda p: (p - self.me) % self.schedule.pp)
        ops = [("send" if self.me < p else "recv", torch.zeros(1), p) for p in peers]
        comm.wait(comm.p2p(ops, self.group, coalesce=False), self.timeout_s, "warm-up")

    monkeypatch.setattr(PipelineExecutor, "_warm_up", rotating)
    v = replay(record_pipeline(s)[0])
    assert not v.ok and sorted(v.cycle) == [0, 1, 2] and "first use of communicator pair" in str(v), v


# --- ring attention and SUMMA ------------------------------------------------------------------------


@pytest.mark.parametrize("sp", range(2, 9))
def test_ring_attention_posting_is_deadlock_free_under_nccl(sp):
    stuck = _stuck(record_ring(sp))
    assert not stuck, stuck[0]


@pytest.mark.parametrize("q", [2, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_summa_posting_is_deadlock_free_under_nccl(q, overlap):
    stuck = _stuck(record_summa(q, overlap))
    assert not stuck, stuck[0]


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (8, 4)])
def test_expert_parallel_all_to_alls_are_deadlock_free_under_nccl(world, ep):
    """#48.4: each MoE layer's three all-to-alls over its ep group (the counts, the rows out, the rows back)
    and the backward's two, between the load statistics' all-reduces over every rank, in the same order
    on every rank."""
    traces = record_experts(world, ep)
    assert not _stuck(traces), _stuck(traces)[0]
    posted = [e.ops[0][1] for e in traces[0] if isinstance(e, Post)]
    assert posted == ["all_to_all_single"] * 3 + ["all_reduce"] + ["all_to_all_single"] * 3 + ["all_reduce"] + \
        ["all_to_all_single"] * 4


@pytest.mark.parametrize("dp", [2, 4])
def test_hetero_zero_posting_is_deadlock_free_and_bounded_under_nccl(dp):
    """#29.3: hetero's ZeRO with prefetched (asynchronous) all-gathers, reduce-scatters in flight and the
    ones an eviction forces, over 3 steps at the smallest budget: every rank posts the same collectives
    in the same order, and every wait has the mesh's limit."""
    traces = record_hetero_zero(dp, timeout_s=7.0)
    assert not _stuck(traces), _stuck(traces)[0]
    kinds = {e.ops[0][1] for e in traces[0] if isinstance(e, Post)}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"} <= kinds
    waits = [e for e in traces[0] if isinstance(e, Wait)]
    assert waits and all(e.timeout_s is not None and 0 < e.timeout_s <= 7.0 for e in waits), \
        [(e.what, e.timeout_s) for e in waits if not e.timeout_s or e.timeout_s > 7.0][:3]


# --- comm.wait ----------------------------------------------------------------------------------------


def test_a_spent_limit_still_bounds_the_wait():
    """torch reads ``Work.wait(timeout=timedelta(0))`` as no limit at all: a receive whose limit, counted
    from its post, is used up must still get a positive one."""
    seen = []

    class Work:
        def wait(self, timeout=timedelta(0)):
            seen.append(timeout)

    comm.wait(Work(), 0.0)
    comm.wait(Work(), -2.5)
    assert all(t > timedelta(0) for t in seen), seen


class _Device:
    """A fake stream: markers are numbered as made; the device is past the first ``done`` of them."""

    def __init__(self):
        self.made, self.done = 0, 0

    def marker(self):
        index, device = self.made, self
        self.made += 1

        class Marker:
            @staticmethod
            def query():
                return index < device.done

        return Marker()


def test_a_stream_ordered_wait_leaves_the_host_free_and_its_limit_to_the_deadlines():
    """With the mesh's deadlines (NCCL) ``comm.wait`` never hands torch a limit (a timed ``Work.wait``
    polls the host until the GPU got there): each work gets an untimed wait (the stream's), and the
    limit (the group's default where none is given) goes to the deadlines with the action's name."""
    from parallel4d.distributed.deadlines import Deadlines

    seen, now = [], [100.0]

    class Work:
        def wait(self, timeout=None):
            seen.append(timeout)
            return True

    device = _Device()
    ledger = Deadlines(30.0, marker=device.marker, clock=lambda: now[0])
    comm.wait([Work(), Work()], 2.0, "ring_attention forward: K/V block of step 1", deadlines=ledger)
    comm.wait(Work(), None, "summa_ab step 0", deadlines=ledger)
    assert seen == [None, None, None]
    assert [(d, w) for _, d, w in ledger.entries] == [(102.0, "ring_attention forward: K/V block of step 1"),
                                                      (130.0, "summa_ab step 0")]
    device.done = device.made  # the device caught up: the next wait forgets what it is past
    comm.wait(Work(), 1.0, "pp.loss", deadlines=ledger)
    assert [w for _, _, w in ledger.entries] == ["pp.loss"]


def test_settling_names_the_first_wait_past_its_limit_within_that_limit():
    """A peer stopped: the stream never gets past the second wait. The host's read step settles: it
    returns as soon as the device catches up, else raises ``CommTimeout`` naming the stuck wait once
    its limit is spent (counted from the wait, not from the read step)."""
    import threading
    import time

    from parallel4d.distributed.comm import CommTimeout
    from parallel4d.distributed.deadlines import Deadlines

    device = _Device()
    ledger = Deadlines(5.0, marker=device.marker)
    ledger.add(0.3, "gradient all-reduce, bucket 1 of 2")
    device.done = 1
    start = time.monotonic()
    ledger.add(0.3, "pp rank 1 waiting for the activation of F(2, 0) from pp rank 0")
    ledger.add(0.3, "loss all-reduce")
    with pytest.raises(CommTimeout, match=r"rank 0: pp rank 1 waiting for the activation of F\(2, 0\) from pp rank "
                                          r"0 did not finish within its limit"):
        ledger.settle("step 3: the read-back")
    assert 0.3 <= time.monotonic() - start < 0.6
    assert ledger.entries == []

    ledger.add(0.5, "ring step 1")
    threading.Timer(0.1, lambda: setattr(device, "done", 10**9)).start()  # the peer answers late, in time
    start = time.monotonic()
    ledger.settle("step 6: the read-back")
    assert time.monotonic() - start < 0.4 and ledger.entries == []
