"""The few collective / point-to-point helpers the strategies share.

Every helper counts the payload it moves in a :class:`CommStats` (the mesh
carries one per rank) so benchmarks and tests can compare measured bytes with
analytic formulas. Counting convention: ``sent``/``received`` are the bytes of
the tensors this rank hands to / gets from the operation, independent of the
backend's internal algorithm (a ring all-reduce moves more on the wire):

* ``broadcast``: the source counts ``nbytes`` sent, every other member ``nbytes`` received.
* ``reduce``: every non-destination member counts ``nbytes`` sent, the destination
  ``nbytes·(n-1)`` received.
* ``all_reduce``: ``nbytes`` sent and received.
* ``all_gather``: the local shard sent, the other ``n-1`` shards received.
* ``reduce_scatter``: the ``n-1`` shards for others sent, ``n-1`` shards received.
* ``send`` / ``recv``: the tensor's bytes.

Every failure of a collective or transfer is re-raised naming the action, the
group's members and this rank: ``CommTimeout`` when it ran past its limit (a
peer stopped answering), ``PeerLost`` when a peer's connection closed (that
peer failed or exited). The group's own timeout (set by the ``Mesh``) bounds
blocking calls; :func:`wait` can take a tighter one.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
import math
import time
from typing import Iterable, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import is_fake


class CommTimeout(RuntimeError):
    """A collective or p2p transfer did not finish within its timeout: a peer stopped answering."""


class PeerLost(RuntimeError):
    """A peer closed its connection during a collective or p2p transfer: it failed or exited."""


_TIMED_OUT = ("timed out", "timeout")
_LOST = ("connection closed", "connection reset", "broken pipe", "socket closed", "remote worker",
         "connection refused", "end of file", "unexpected eof")


_UNKNOWN = object()  # a wait on works: their group is not known here
_LEAST_TIMEOUT_S = 1e-3


def _members(group) -> str:
    if group is _UNKNOWN:
        return ""
    try:
        return f" (group ranks {dist.get_process_group_ranks(group)})" if group is not None else " (all ranks)"
    except Exception:  # a group this rank is not in, or no process group: say nothing
        return ""


def translate(err: BaseException, what: str, group=None, timeout_s: float | None = None) -> BaseException:
    """``CommTimeout`` / ``PeerLost`` naming ``what``, its group and this rank, or ``err`` unchanged."""
    text = str(err).lower()
    me = dist.get_rank() if dist.is_initialized() else 0
    if any(k in text for k in _TIMED_OUT):
        limit = f"within {timeout_s:g}s" if timeout_s is not None else "within the group's timeout"
        return CommTimeout(f"rank {me}: {what}{_members(group)} did not finish {limit}: a peer stopped answering")
    if any(k in text for k in _LOST):
        return PeerLost(f"rank {me}: {what}{_members(group)}: a peer closed its connection (it failed or exited)")
    return err


@contextmanager
def named(what: str, group=None, timeout_s: float | None = None):
    """Re-raise a communication failure inside the block as :func:`translate` says."""
    try:
        yield
    except (CommTimeout, PeerLost):
        raise
    except RuntimeError as e:
        new = translate(e, what, group, timeout_s)
        if new is e:
            raise
        raise new from e


@dataclass
class CommStats:
    """Per-rank byte counters, keyed by an operation label and by the group's mesh axis.

    The ``Mesh`` names the groups it creates (:meth:`name_group`: ``"tp_row"``,
    ``"dp+sp"``, …); bytes moved in a group it did not name count under ``"other"``,
    in the default group under ``"world"``.
    """

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    axis_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    axis_received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    axis_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # messages: what latency costs
    group_names: dict[int, str] = field(default_factory=dict)  # id(group) → axis name

    def name_group(self, group, name: str) -> None:
        self.group_names[id(group)] = name

    def add(self, label: str, sent: int = 0, received: int = 0, group=_UNKNOWN) -> None:
        self.sent[label] += int(sent)
        self.received[label] += int(received)
        self.calls[label] += 1
        axis = "world" if group is None else self.group_names.get(id(group), "other")
        self.axis_sent[axis] += int(sent)
        self.axis_received[axis] += int(received)
        self.axis_calls[axis] += 1

    def total_sent(self) -> int:
        return sum(self.sent.values())

    def total_received(self) -> int:
        return sum(self.received.values())

    def reset(self) -> None:
        for counts in (self.sent, self.received, self.calls, self.axis_sent, self.axis_received, self.axis_calls):
            counts.clear()

    def as_dict(self) -> dict:
        return {
            "sent": dict(self.sent),
            "received": dict(self.received),
            "calls": dict(self.calls),
            "by_axis": {"sent": dict(self.axis_sent), "received": dict(self.axis_received)},
        }


def has_values(t: torch.Tensor) -> bool:
    """False for a fake tensor (``parallel4d plan``'s dry run: shapes and dtypes, no values), whose
    checks and ``.item()`` have nothing to read."""
    return not is_fake(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count(stats: CommStats | None, label: str, sent: int, received: int, group) -> None:
    if stats is not None:
        stats.add(label, sent, received, group)


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group)


def broadcast(tensor, src: int, group=None, *, stats=None, label="broadcast", async_op=False):
    """Broadcast ``tensor`` from global rank ``src`` to the group (in place)."""
    n = group_size(group)
    if n > 1:
        me = dist.get_rank()
        _count(stats, label, _nbytes(tensor) if me == src else 0, 0 if me == src else _nbytes(tensor), group)
        with named(f"{label} from rank {src}", group):
            return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    return None


def reduce(tensor, dst: int, group=None, *, stats=None, label="reduce", async_op=False):
    """Sum ``tensor`` over the group into global rank ``dst`` (in place there)."""
    n = group_size(group)
    if n > 1:
        me = dist.get_rank()
        nb = _nbytes(tensor)
        _count(stats, label, 0 if me == dst else nb, nb * (n - 1) if me == dst else 0, group)
        with named(f"{label} to rank {dst}", group):
            return dist.reduce(tensor, dst=dst, group=group, async_op=async_op)
    return None


def all_reduce(tensor, group=None, *, op=dist.ReduceOp.SUM, stats=None, label="all_reduce", async_op=False):
    """In-place all-reduce; a no-op on a group of one."""
    if group_size(group) > 1:
        _count(stats, label, _nbytes(tensor), _nbytes(tensor), group)
        with named(label, group):
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return None


def traced_all_reduce(tensor: torch.Tensor, group, op: str) -> torch.Tensor:
    """A new tensor: ``tensor`` all-reduced by ``op`` (``"sum"``, ``"max"``, ...) as a functional collective,
    which ``torch.compile`` traces into its graphs (forward or backward) — the compiled code runs it, and no
    Python runs there to count it: the caller counts it with :func:`count_all_reduce` where it runs."""
    return funcol.all_reduce(tensor, op, group)


def count_all_reduce(nbytes: int, group, *, stats=None, label: str = "all_reduce") -> None:
    """Count an all-reduce of ``nbytes`` that ran inside compiled code (:func:`traced_all_reduce`) as
    :func:`all_reduce` counts its own (none on a group of one)."""
    if group_size(group) > 1:
        _count(stats, label, nbytes, nbytes, group)


def all_gather(tensor: torch.Tensor, group=None, *, dim: int = 0, stats=None, label="all_gather") -> torch.Tensor:
    """Concatenate every member's ``tensor`` along ``dim`` (same shape on all members)."""
    n = group_size(group)
    if n == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(n)]
    with named(label, group):
        dist.all_gather(parts, tensor.contiguous(), group=group)
    _count(stats, label, _nbytes(tensor), _nbytes(tensor) * (n - 1), group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(tensor: torch.Tensor, group=None, *, dim: int = 0, stats=None, label="reduce_scatter") -> torch.Tensor:
    """Sum over the group, then keep this member's ``1/n`` slice along ``dim``.

    On NCCL one ``reduce_scatter_tensor`` over the whole tensor (``dim`` moved to the front, a copy
    only when ``dim`` ≠ 0 or ``tensor`` is not contiguous): NCCL splits it by rank itself, with no
    per-chunk copies. Implemented as all-reduce + slice where the backend lacks reduce_scatter
    (gloo); the counted bytes follow the logical reduce-scatter. Returns a contiguous tensor.
    """
    n = group_size(group)
    if n == 1:
        return tensor
    if tensor.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {tensor.shape[dim]} along dim {dim} not divisible by group size {n}")
    shard = _nbytes(tensor) // n
    _count(stats, label, shard * (n - 1), shard * (n - 1), group)
    with named(label, group):
        if dist.get_backend(group) == "nccl":
            whole = tensor.movedim(dim, 0).contiguous()
            out = whole.new_empty((whole.shape[0] // n, *whole.shape[1:]))
            dist.reduce_scatter_tensor(out, whole, group=group)
            return out.movedim(0, dim).contiguous()
        full = tensor.contiguous().clone()
        dist.all_reduce(full, group=group)
    return full.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_to_all(tensor: torch.Tensor, group=None, *, scatter_dim: int, gather_dim: int, stats=None,
               label="all_to_all") -> torch.Tensor:
    """Member ``j`` gets this member's ``j``-th slice of ``tensor`` along ``scatter_dim``; the slices
    received are concatenated along ``gather_dim`` in member order. ``[.., n·a, .., c, ..]`` →
    ``[.., a, .., n·c, ..]``. One ``all_to_all_single`` (the slices moved to the front, contiguous)."""
    n = group_size(group)
    if n == 1:
        return tensor
    if tensor.shape[scatter_dim] % n:
        raise ValueError(f"all_to_all: size {tensor.shape[scatter_dim]} along dim {scatter_dim} not divisible "
                         f"by the group's {n} members")
    parts = torch.stack(tensor.chunk(n, dim=scatter_dim)).contiguous()  # [n, ...]: slice j for member j
    out = torch.empty_like(parts)
    _count(stats, label, _nbytes(parts) * (n - 1) // n, _nbytes(parts) * (n - 1) // n, group)
    with named(label, group):
        dist.all_to_all_single(out, parts, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


def all_to_all_v(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None, *, stats=None,
                 label="all_to_all_v") -> torch.Tensor:
    """Uneven all-to-all along dim 0: ``tensor``'s first ``send_splits[0]`` rows go to member 0, the next
    ``send_splits[1]`` to member 1, …; the rows received, ``recv_splits[j]`` from member ``j``, come back
    concatenated in member order. ``[Σ send_splits, ...]`` → ``[Σ recv_splits, ...]``. The split sizes are
    host integers (what the backend needs): the caller reads them once, before. Counts the rows that
    cross to other members (not this member's own)."""
    n, me = group_size(group), group_rank(group)
    if n == 1:
        return tensor
    row = tensor.element_size() * math.prod(tensor.shape[1:])  # bytes per row
    out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
    _count(stats, label, row * (sum(send_splits) - send_splits[me]), row * (sum(recv_splits) - recv_splits[me]), group)
    with named(label, group):
        dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits, group=group)
    return out


def p2p(ops: Iterable[tuple[str, torch.Tensor, int]], group=None, *, stats=None, label="p2p",
        coalesce: bool = True) -> list:
    """Post sends/receives; returns the works to :func:`wait`.

    ``ops`` holds ``("send" | "recv", tensor, peer_global_rank)``. ``coalesce``: one
    ``batch_isend_irecv`` (NCCL: one kernel on the group's own communicator and stream, done when
    every op is; posting both directions together avoids the send-before-recv deadlock), else one
    ``isend``/``irecv`` each (NCCL: each pair of ranks has a communicator and stream of its own, so
    a pending op holds up only that pair's later ops). gloo posts one op at a time either way.
    """
    ops = list(ops)
    for kind, tensor, _ in ops:
        if kind not in ("send", "recv"):
            raise ValueError(f"p2p op kind must be 'send' or 'recv', got {kind!r}")
        _count(stats, label, _nbytes(tensor) if kind == "send" else 0, _nbytes(tensor) if kind == "recv" else 0, group)
    if not ops:
        return []
    with named(f"{label} with ranks {sorted({peer for *_, peer in ops})}", group):
        if not coalesce:
            return [dist.isend(t, peer, group) if kind == "send" else dist.irecv(t, peer, group)
                    for kind, t, peer in ops]
        return list(dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group)
                                            for kind, t, peer in ops]))


def eager(fn):
    """``fn``, a function that communicates, run eagerly even when called from code ``torch.compile``
    traces: the call is a graph break, so compiled graphs hold the computation between collectives and
    never a c10d call, its timeout or its byte count (nor a guard on its label, which differs per layer
    and would recompile each layer). Outside compiled code it is a plain call."""
    return torch.compiler.disable(fn)


class DeadlineLedger(Protocol):
    """Where a stream-ordered wait leaves its limit (:class:`parallel4d.distributed.deadlines.Deadlines`)."""

    def add(self, timeout_s: float | None, what: str) -> None: ...


def wait(works, timeout_s: float | None = None, what: str = "communication",
         deadlines: DeadlineLedger | None = None) -> None:
    """Wait for ``works`` (a work or a list), at most ``timeout_s`` each (None: the
    group's timeout); ``CommTimeout`` / ``PeerLost`` naming ``what`` on failure.

    With ``deadlines`` (the mesh's, on NCCL) the wait is stream-ordered: what the current stream
    runs next waits for the works, the host does not, and the limit goes to ``deadlines``, which
    the host checks where it reads the device back."""
    if works is None:
        return
    if not isinstance(works, (list, tuple)):
        works = [works]
    if deadlines is not None:
        with named(what, _UNKNOWN, timeout_s):
            for w in works:
                if w is not None:
                    w.wait()  # NCCL: the stream waits, not the host (gloo: bounded by the group's timeout)
        deadlines.add(timeout_s, what)
        return
    if timeout_s is not None:  # a zero timeout means "none" to torch's Work.wait: keep a spent limit positive
        timeout_s = max(float(timeout_s), _LEAST_TIMEOUT_S)
    with named(what, _UNKNOWN, timeout_s):
        for w in works:
            if w is None:
                continue
            if timeout_s is None:
                w.wait()
            else:
                w.wait(timeout=timedelta(seconds=timeout_s))


def wait_released(post, tensor: torch.Tensor, timeout_s: float | None, what: str,
                  deadlines: DeadlineLedger | None = None, limit_s: float = 5.0) -> None:
    """``post()`` (a collective over ``tensor`` with ``async_op=True``: its work, or None), then
    :func:`wait`; on host-timed (gloo) waits, return only once the communication thread has let go of
    ``tensor`` too (at most ``limit_s`` more, sleeping with the GIL released). For a step's result.

    Why: gloo's worker thread drops a finished work — and the tensors it holds — a moment after the
    wait returns. When that drop leaves only the Python object's reference, it needs the GIL; were
    the interpreter finalizing by then (a script exiting right after its last step), Python ends
    the thread and the process aborts ("terminate called without an active exception"). The work
    is held only here, so dropping it leaves the thread's references the only ones above the count
    before the post. Not on stream-ordered (NCCL) waits, where waiting for the thread would stall the host."""
    uses_before = tensor._use_count()
    work = post()
    wait(work, timeout_s, what, deadlines)
    if work is None or deadlines is not None:
        return
    del work
    end = time.monotonic() + limit_s
    while tensor._use_count() > uses_before and time.monotonic() < end:
        time.sleep(0)
