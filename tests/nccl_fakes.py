"""Record what the real code posts, over fake NCCL process groups, every rank in turn in this process.

:func:`recording` swaps the ``torch.distributed`` functions that ``parallel4d.distributed.comm`` (and
the code under test) calls for recording fakes: each post becomes a
:class:`~parallel4d.distributed.nccl_replay.Post`, each ``Work.wait`` a ``Wait``; ``is_completed()``
says False (the code then waits: the conservative answer); a received tensor is zeros; the backend
is reported as ``"nccl"``. The code runs rank by rank (a wait returns at once), so the sequences are
the code's own, not a re-derivation; :func:`~parallel4d.distributed.nccl_replay.replay` then decides.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel4d.distributed import comm
from parallel4d.distributed.comm import CommStats
from parallel4d.distributed.nccl_replay import Post, Wait


class FakeGroup:
    def __init__(self, name: str, ranks):
        self.name, self.ranks = name, list(ranks)

    def __repr__(self):
        return f"FakeGroup({self.name})"


class FakeWork:
    def __init__(self, rec: "Recorder", rank: int, work: int):
        self.rec, self.rank, self.work = rec, rank, work

    def wait(self, timeout: timedelta | None = None):
        limit = None if timeout is None else timeout.total_seconds()
        self.rec.events[self.rank].append(Wait(self.work, self.rec.what, limit))
        return True

    def is_completed(self) -> bool:
        return False


class FakeP2POp:
    def __init__(self, op, tensor, peer, group=None, tag=0):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class Recorder:
    """Events per global rank; ``rank``: the rank whose code runs now."""

    def __init__(self, world: int):
        self.world = FakeGroup("world", range(world))
        self.rank = 0
        self.events: dict[int, list] = defaultdict(list)
        self._next: dict[int, int] = defaultdict(int)
        self.what = ""

    def post(self, kind: str, group, ops, label: str = "") -> FakeWork:
        group = group or self.world
        work = self._next[self.rank]
        self._next[self.rank] += 1
        self.events[self.rank].append(Post(work, kind, group.name, tuple(group.ranks), tuple(ops), label or self.what))
        return FakeWork(self, self.rank, work)

    def collective(self, name: str, group, async_op: bool):
        work = self.post("coll", group, [("coll", name)])
        if async_op:
            return work
        work.wait()  # a blocking call: the host waits (conservative on NCCL)
        return None

    # the fakes, as torch.distributed spells them
    def isend(self, tensor, dst=None, group=None, tag=0):
        return self.post("p2p", group, [("send", dst)])

    def irecv(self, tensor, src=None, group=None, tag=0):
        tensor.zero_()
        return self.post("p2p", group, [("recv", src)])

    def batch_isend_irecv(self, ops):
        for op in ops:
            if op.op == self.irecv:
                op.tensor.zero_()
        return [self.post("batch", ops[0].group, [("send" if op.op == self.isend else "recv", op.peer) for op in ops])]

    def broadcast(self, tensor, src, group=None, async_op=False):
        return self.collective("broadcast", group, async_op)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return self.collective("all_reduce", group, async_op)

    def reduce(self, tensor, dst, op=None, group=None, async_op=False):
        return self.collective("reduce", group, async_op)

    def all_gather(self, parts, tensor, group=None, async_op=False):
        for p in parts:
            p.copy_(tensor)
        return self.collective("all_gather", group, async_op)

    def all_gather_into_tensor(self, out, tensor, group=None, async_op=False):
        out.zero_()
        return self.collective("all_gather_into_tensor", group, async_op)

    def reduce_scatter_tensor(self, out, tensor, op=None, group=None, async_op=False):
        out.zero_()
        return self.collective("reduce_scatter_tensor", group, async_op)

    def all_to_all_single(self, out, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        out.zero_()  # the counts of expert parallelism arrive as zeros: every later split is empty
        return self.collective("all_to_all_single", group, async_op)

    def get_rank(self, group=None):
        return self.rank if group is None else group.ranks.index(self.rank)

    def get_world_size(self, group=None):
        return len((group or self.world).ranks)


@contextmanager
def recording(world: int):
    """A :class:`Recorder` whose fakes stand in for ``torch.distributed``'s functions inside the block."""
    rec = Recorder(world)

    class named:  # remembers what the code says it waits for (a fake never fails: nothing to translate)
        def __init__(self, what, group=None, timeout_s=None):
            rec.what = what

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fakes = {
        "isend": rec.isend, "irecv": rec.irecv, "batch_isend_irecv": rec.batch_isend_irecv, "P2POp": FakeP2POp,
        "broadcast": rec.broadcast, "all_reduce": rec.all_reduce, "reduce": rec.reduce, "all_gather": rec.all_gather,
        "all_gather_into_tensor": rec.all_gather_into_tensor, "reduce_scatter_tensor": rec.reduce_scatter_tensor,
        "all_to_all_single": rec.all_to_all_single,
        **{name: fake for name, fake in (("all_gather_single", rec.all_gather_into_tensor),  # newer torch's names
                                         ("reduce_scatter_single", rec.reduce_scatter_tensor)) if hasattr(dist, name)},
        "get_rank": rec.get_rank, "get_world_size": rec.get_world_size, "is_initialized": lambda: True,
        "get_backend": lambda group=None: "nccl", "get_global_rank": lambda group, i: group.ranks[i],
        "get_process_group_ranks": lambda group: list(group.ranks),
    }
    real_named = comm.named
    saved = {name: getattr(dist, name) for name in fakes}
    try:
        for name, fake in fakes.items():
            setattr(dist, name, fake)
        comm.named = named
        yield rec
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
        comm.named = real_named


# --- the code under test, every rank in turn ---------------------------------------------------


class PipelineMesh:
    """What the executor asks of a mesh: pp only, global rank = pp index. ``deadlines``: None, each wait
    timed (as on gloo), or a mesh's stream-ordered ledger (as on NCCL); the posting order is the same."""

    def __init__(self, pp: int, me: int, group: FakeGroup, deadlines=None):
        self.pp, self.me, self.pp_group, self.deadlines = pp, me, group, deadlines
        self.comm_stats = CommStats()
        self.device = torch.device("cpu")

    def size(self, axis):
        return self.pp if axis == "pp" else 1

    def rank(self, axis):
        return self.me if axis == "pp" else 0

    def global_rank(self, axis, index):
        return index

    def group(self, axis):
        return self.pp_group


class CarryingLinear(nn.Module):
    """An ``nn.Linear(4, 4)`` chunk whose messages carry a float64 ``[3]`` vector beside the activation (a
    sum of its outputs added to it: MoE's load statistics' shape of message); the ``last`` returns ``y``."""

    def __init__(self, last: bool):
        super().__init__()
        self.linear, self.last = nn.Linear(4, 4), last

    def forward(self, x, carried=None):
        y = self.linear(x)
        if self.last:
            return y
        return y, (0 if carried is None else carried) + y.sum().double().expand(3)


def record_pipeline(schedule, steps: int = 1, timeout_s: float = 60.0, deadlines=None,
                    carried: bool = False) -> tuple[dict, dict]:
    """Per pp rank, what ``PipelineExecutor`` posts and waits for: its construction and ``steps``
    training steps; then its ``for_evaluation()`` twin's construction and ``steps`` steps under
    no_grad (``(training, evaluation)``, each global rank → events); ``deadlines``: :class:`PipelineMesh`'s. Tiny ``nn.Linear(4, 4)`` chunks
    on ``[2, 4]`` activations (``carried``: :class:`CarryingLinear`, messages of two tensors). The
    schedule's validation and message order (pure functions of it) are computed once for all ranks, not
    once per rank as in a real job."""
    from parallel4d.pipeline import executor

    pp, m = schedule.pp, schedule.microbatches
    group = FakeGroup("pp", range(pp))
    x = [torch.ones(2, 4) for _ in range(m)]
    real = {name: getattr(executor, name) for name in ("validate", "message_order", "message_plan")
            if hasattr(executor, name)}
    for name, fn in real.items():  # once for all ranks: the same schedule every time
        setattr(executor, name, lambda s, fn=fn, done={}: done[0] if done else done.setdefault(0, fn(s)))
    training: dict[int, list] = {}
    try:
        with recording(pp) as rec:
            for r in range(pp):
                rec.rank = r
                last = schedule.num_chunks - 1
                chunks = {c: CarryingLinear(c == last) if carried else nn.Linear(4, 4) for c in schedule.placement[r]}
                ex = executor.PipelineExecutor(schedule, PipelineMesh(pp, r, group, deadlines), chunks,
                                               lambda y, t: (y * t).mean(), (2, 4), torch.float32, timeout_s=timeout_s,
                                               carried=[((3,), torch.float64)] if carried else ())
                for _ in range(steps):
                    ex.step(x, x)
                training[r] = rec.events.pop(r)
                ev = ex.for_evaluation()
                with torch.no_grad():
                    for _ in range(steps):
                        ev.step(x, x)
    finally:
        for name, fn in real.items():
            setattr(executor, name, fn)
    return training, dict(rec.events)


def record_ring(n: int, causal: bool = True):
    """Per rank of an ``n``-rank sp group, what ``ring_attention`` posts and waits for, forward and
    backward (``q, k, v [1, 2, 2, 4]`` per rank)."""
    from parallel4d.sequence import ring_attention

    group = FakeGroup("sp", range(n))
    with recording(n) as rec:
        for r in range(n):
            rec.rank = r
            q, k, v = (torch.ones(1, 2, 2, 4, requires_grad=True) for _ in range(3))
            ring_attention(q, k, v, group, causal=causal, timeout_s=60.0).sum().backward()
    return dict(rec.events)


def record_experts(world: int, ep: int, layers: int = 2):
    """Per rank of ``world`` ranks in ep groups of ``ep`` consecutive ones, what ``layers`` expert-parallel
    dispatches post and wait for, forward then backward, with each layer's load statistics summed over the
    world between them (the load-balancing loss's all-reduce): 4 experts, 3 tokens, top-2."""
    from parallel4d.experts import ExpertParallel

    groups = [FakeGroup(f"ep[{s}]", range(s, s + ep)) for s in range(0, world, ep)]
    with recording(world) as rec:
        for r in range(world):
            rec.rank = r
            x = torch.ones(3, 4, requires_grad=True)
            ids, weights = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.ones(3, 2)
            par, h = ExpertParallel(4, groups[r // ep]), x
            for _ in range(layers):
                h = par(h, ids, weights, lambda rows, counts: rows * 2.0)
                dist.all_reduce(torch.zeros(5), group=None)
            h.sum().backward()
    return dict(rec.events)


class GridMesh:
    """What ``tensor2d.Grid`` asks of a mesh: a q×q grid, global rank ``i·q + j``."""

    collectives = comm

    def __init__(self, q: int, rank: int):
        self.q, self.i, self.j = q, rank // q, rank % q
        self.comm_stats, self.deadlines = CommStats(), None
        self.rows = [FakeGroup(f"tp_col[i={i}]", [i * q + t for t in range(q)]) for i in range(q)]
        self.cols = [FakeGroup(f"tp_row[j={j}]", [t * q + j for t in range(q)]) for j in range(q)]

    def rank(self, axis):
        return self.i if axis == "tp_row" else self.j

    def group(self, axis):  # tp_col varies along my row; tp_row along my column
        return self.rows[self.i] if axis == "tp_col" else self.cols[self.j]

    def global_rank(self, axis, index):
        return self.i * self.q + index if axis == "tp_col" else index * self.q + self.j


def record_summa(q: int, overlap: bool = True):
    """Per rank of a q×q grid, what ``summa_ab``, ``summa_abt`` and ``summa_atb`` post and wait for,
    each forward and backward, one after another (``[2, 2]`` blocks)."""
    from parallel4d.tensor2d.summa import summa_ab, summa_abt, summa_atb

    with recording(q * q) as rec:
        for r in range(q * q):
            rec.rank = r
            mesh = GridMesh(q, r)
            for op in (summa_ab, summa_abt, summa_atb):
                a, b = (torch.ones(2, 2, requires_grad=True) for _ in range(2))
                op(a, b, mesh, overlap=overlap).sum().backward()
    return dict(rec.events)


class ReplicaMesh:
    """What hetero's ZeRO asks of a mesh: a dp group of ``dp`` ranks, global rank = dp index."""

    def __init__(self, dp: int, rank: int, timeout_s: float, deadlines=None):
        self.dp, self._rank, self.timeout_s, self.deadlines = dp, rank, timeout_s, deadlines
        self.comm_stats, self.device = CommStats(), "cpu"
        self._group = FakeGroup("dp", range(dp))

    def size(self, axis):
        return self.dp

    def rank(self, axis):
        return self._rank

    def group(self, axis):
        return self._group


def record_hetero_zero(dp: int, steps: int = 3, timeout_s: float = 60.0):
    """Per rank of a ``dp``-rank ZeRO group, what hetero posts and waits for: one step with every chunk
    resident (which measures the smallest budget), then ``steps`` steps of a small GPT in bf16 chunks at
    that budget, prefetching on (as on CUDA): prefetched all-gathers and the ones evictions force again,
    reduce-scatters in flight and those an eviction forces, the norm's all-reduce."""
    from parallel4d.hetero import wrap
    from parallel4d.models.gpt2.model import GPTShape, build_gpt

    shape = GPTShape(vocab_size=64, seq_len=8, hidden=32, heads=4, layers=3, tie_embeddings=True)
    x = torch.randint(0, shape.vocab_size, (2, shape.seq_len), generator=torch.Generator().manual_seed(0))

    def train(budget, n):
        model, opt = wrap(build_gpt(shape, seed=0), None, dict(compute_device="cpu", chunk_elems=4096,
                                                              device_budget_bytes=budget),
                          mesh=mesh, compute_dtype=torch.bfloat16)
        model._hetero_runtime.mgr.prefetch_depth = 2
        for _ in range(n):
            for _ in range(2):  # micro-batches
                (model(x, x) / 2).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        opt.remove_hooks()
        return opt.stats()

    with recording(dp) as rec:
        for r in range(dp):
            rec.rank = r
            mesh = ReplicaMesh(dp, r, timeout_s)
            st = train(train(None, 1)["min_feasible_budget_bytes"], steps)
            assert st["total"]["evictions"] > 0 and st["reduce_scatters"]["on_eviction"] > 0, st
    return dict(rec.events)
