"""Replay per-rank posting sequences under NCCL's rules and find a deadlock (pure Python, no torch).

Input: per rank, what its host did, in order (recorded from the real code over fake process
groups, see ``tests/nccl_fakes.py``): :class:`Post` (a ``batch_isend_irecv``, a plain
``isend``/``irecv``, or a collective) and :class:`Wait` (a host wait on a posted work).
Output: a :class:`Verdict`: clean, or each rank's blocked state and the cycle of ranks that wait on
each other.

The model (``torch.distributed`` over NCCL, ``ProcessGroupNCCL``):

* a **communicator** runs its kernels on one stream per rank, strictly in post order (a kernel
  starts when the one before it on that stream completed);
* a **collective** and a **batch** (``batch_isend_irecv``: ``ncclGroupStart/End``, one kernel) go
  on the process group's own communicator; a plain **isend/irecv** on a 2-rank communicator of its
  own for that pair (lazy mode, the default) — or, with ``eager_init`` (``init_process_group(
  device_id=...)``, which makes torch reuse the group's communicator for unbatched p2p), on the
  group's communicator too;
* a p2p op matches the peer's op of the same direction in FIFO order per (communicator, sender,
  receiver), and completes only while both kernels run at once (**rendezvous**: no eager buffering,
  the conservative choice — NCCL buffers small messages, but need not);
* a collective is the k-th on its communicator; it completes when every member runs its k-th;
  a kernel completes when every op in it has;
* a host **wait** blocks that rank's host until the work's kernel completed (conservative: NCCL's
  ``wait()`` only makes the compute stream wait, but what is posted after it depends on that
  stream, so the host blocking adds no freedom a real run has and removes none it lacks);
* **lazy init**: the first use of a communicator (all of them without ``eager_init``; only the pair
  ones never exist there) blocks the host until every member reached its own first use of it
  (``ncclCommInitRank`` is blocking);
* a recorded ``is_completed()`` query says False (the recorder's choice: the code then waits);
* with ``serial``, all of a rank's kernels, whatever their communicator, run one at a time in post
  order: NCCL does not promise that kernels of two communicators make progress at the same time
  (its guidance: issue them in the same order on every rank), so this is the strictest reading.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Post:
    """One call that enqueues a kernel. ``kind``: ``"batch"`` | ``"p2p"`` | ``"coll"``; ``group``: the
    process group's name; ``members``: its global ranks; ``ops``: ``(("send" | "recv", peer global
    rank), ...)`` (one op for ``"p2p"``), or ``(("coll", name),)``; ``work``: an id unique per rank."""

    work: int
    kind: str
    group: str
    members: tuple[int, ...]
    ops: tuple[tuple[str, object], ...]
    label: str = ""


@dataclass(frozen=True)
class Wait:
    """The host waits for work ``work``; ``what`` says why (the code's own description), ``timeout_s``
    its limit (None: none given; for a check that every wait is bounded)."""

    work: int
    what: str = ""
    timeout_s: float | None = None


@dataclass
class Verdict:
    """``ok``: every host finished and every kernel completed (and matched collectives were the same
    call); otherwise ``blocked``: rank → what it is stuck on (or the mismatch), ``cycle``: ranks that
    wait on each other in order (empty if none was found)."""

    ok: bool
    blocked: dict[int, str] = field(default_factory=dict)
    cycle: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        if self.ok:
            return "no deadlock"
        lines = [f"  rank {r}: {why}" for r, why in sorted(self.blocked.items())]
        cycle = " → ".join(f"rank {r}" for r in self.cycle + self.cycle[:1]) if self.cycle else "none found"
        return "deadlock or mismatch under NCCL's rules:\n" + "\n".join(lines) + f"\n  cycle: {cycle}"


@dataclass(eq=False)  # compared by identity
class _Kernel:
    rank: int
    comm: tuple
    stream: tuple  # (rank, communicator), or (rank, "serial")
    post: Post
    pending: set = field(default_factory=set)  # op keys not yet completed


def _comm(rank: int, post: Post, eager: bool) -> tuple[tuple, tuple[int, ...]]:
    """The communicator (key, members) a post runs on."""
    if post.kind == "p2p" and not eager:
        peer = post.ops[0][1]
        pair = (min(rank, peer), max(rank, peer))
        return ("pair", post.group) + pair, pair
    return ("group", post.group), tuple(post.members)


class _Replay:
    def __init__(self, traces: dict[int, list], eager: bool, serial: bool):
        self.traces, self.eager, self.serial = traces, eager, serial
        self.pc = {r: 0 for r in traces}
        self.streams: dict[tuple, list[_Kernel]] = defaultdict(list)  # stream → its queued kernels
        self.kernel_of: dict[tuple[int, int], _Kernel] = {}           # (rank, work) → kernel
        self.done: set[tuple[int, int]] = set()                        # (rank, work) completed
        self.arrived: dict[tuple, set[int]] = defaultdict(set)         # comm → ranks at its init
        self.ready: set[tuple] = set()                                 # initialised communicators
        self.counts: dict[tuple, int] = defaultdict(int)               # matching counters
        self.where: dict[tuple, _Kernel] = {}                          # op key → kernel holding it
        self.mismatch: dict[int, str] = {}                             # rank → collectives that differ

    # --- host ------------------------------------------------------------------------
    def host(self, r: int) -> bool:
        moved = False
        while self.pc[r] < len(self.traces[r]):
            ev = self.traces[r][self.pc[r]]
            if isinstance(ev, Wait):
                if (r, ev.work) not in self.done:
                    return moved
            else:
                comm, members = _comm(r, ev, self.eager)
                if comm not in self.ready and not (self.eager and comm[0] == "group"):
                    self.arrived[comm].add(r)
                    if not self.arrived[comm] >= set(members):
                        return moved
                    self.ready.add(comm)
                self._enqueue(r, comm, ev)
            self.pc[r] += 1
            moved = True
        return moved

    def _enqueue(self, r: int, comm: tuple, post: Post) -> None:
        k = _Kernel(r, comm, (r, "serial") if self.serial else (r, comm), post)
        for kind, peer in post.ops:
            if kind == "coll":
                key = ("coll", comm, self._next(("coll", comm, r)), r)
            else:
                src, dst = (r, peer) if kind == "send" else (peer, r)
                key = (kind, comm, src, dst, self._next((kind, comm, src, dst)))
            k.pending.add(key)
            self.where[key] = k
        self.streams[k.stream].append(k)
        self.kernel_of[(r, post.work)] = k

    def _next(self, counter) -> int:
        self.counts[counter] += 1
        return self.counts[counter] - 1

    # --- devices ---------------------------------------------------------------------
    def _running(self, k: _Kernel | None) -> bool:
        queue = self.streams[k.stream] if k is not None else []
        return bool(queue) and queue[0] is k

    def _partners(self, key: tuple, k: _Kernel) -> list[tuple]:
        """The op keys that must run at the same time as ``key``."""
        if key[0] == "coll":
            _, comm, n, _ = key
            return [("coll", comm, n, m) for m in _comm(k.rank, k.post, self.eager)[1]]
        kind, comm, src, dst, n = key
        return [key, ("recv" if kind == "send" else "send", comm, src, dst, n)]

    def devices(self) -> bool:
        moved = False
        for stream in list(self.streams.values()):
            k = stream[0] if stream else None
            if k is None:
                continue
            for key in list(k.pending):
                keys = self._partners(key, k)
                if all(self._running(self.where.get(x)) for x in keys):
                    self._check_same(key, [self.where[x] for x in keys])
                    for x in keys:
                        self.where[x].pending.discard(x)
                    moved = True
        for stream in self.streams.values():
            while stream and not stream[0].pending:
                done = stream.pop(0)
                self.done.add((done.rank, done.post.work))
                moved = True
        return moved

    def _check_same(self, key: tuple, kernels: list[_Kernel]) -> None:
        """Matched collectives must be the same call (NCCL would hang or mix up buffers otherwise)."""
        if key[0] == "coll":
            names = {k.rank: k.post.ops[0][1] for k in kernels}
            if len(set(names.values())) > 1:
                self.mismatch[kernels[0].rank] = (f"collective #{key[2]} on {_comm_name(key[1])} is "
                                                  + ", ".join(f"{n} on rank {r}" for r, n in sorted(names.items())))

    # --- verdict ---------------------------------------------------------------------
    def run(self) -> Verdict:
        while any([self.host(r) for r in self.traces]) | self.devices():
            pass
        if self.mismatch:
            return Verdict(False, dict(self.mismatch))
        finished = all(self.pc[r] == len(t) for r, t in self.traces.items())
        if finished and not any(self.streams.values()):
            return Verdict(True)
        blocked, waits_on = {}, {}
        for r in sorted(self.traces):
            why, on = self._explain(r)
            if why:
                blocked[r], waits_on[r] = why, on
        return Verdict(False, blocked, _cycle(waits_on))

    def _explain(self, r: int) -> tuple[str, set[int]]:
        """What rank ``r`` is stuck on, and the ranks that would have to move first."""
        if self.pc[r] == len(self.traces[r]):
            stuck = [k for (rank, _), s in self.streams.items() if rank == r for k in s[:1]]
            if not stuck:
                return "", set()
            k = stuck[0]
            why, on = self._kernel_blocker(k)
            return f"host finished, but kernel {_name(k.post)} never completes: {why}", on
        ev = self.traces[r][self.pc[r]]
        if isinstance(ev, Post):
            comm, members = _comm(r, ev, self.eager)
            missing = sorted(set(members) - self.arrived[comm])
            return (f"posting {_name(ev)}: first use of communicator {_comm_name(comm)} waits for rank(s) "
                    f"{missing} to reach theirs (blocking init)"), set(missing)
        k = self.kernel_of[(r, ev.work)]
        head = self.streams[k.stream][0]
        why, on = self._kernel_blocker(head)
        behind = "" if head is k else f" (queued behind {_name(head.post)} on that stream)"
        return f"waits for {_name(k.post)} [{ev.what}] on {_stream_name(k)}{behind}: {why}", on

    def _kernel_blocker(self, k: _Kernel) -> tuple[str, set[int]]:
        for key in sorted(k.pending, key=str):
            for x in self._partners(key, k):
                other = self.where.get(x)
                peer = x[-1] if x[0] == "coll" else (x[3] if x[0] == "recv" else x[2])
                if other is None:
                    return f"rank {peer} has not posted its {_op_name(x)}", {peer}
                if not self._running(other):
                    head = self.streams[other.stream][0]
                    return (f"rank {peer}'s {_op_name(x)} in {_name(other.post)} is queued behind "
                            f"{_name(head.post)} on {_stream_name(other)}"), {peer}
        return "its ops wait for each other", set()


def _name(post: Post) -> str:
    ops = ", ".join(f"{kind} {'to' if kind == 'send' else 'from'} {peer}" if kind != "coll" else str(peer)
                    for kind, peer in post.ops)
    return f"{post.kind}#{post.work}({post.label or ops}{'' if not post.label else ': ' + ops})"


def _op_name(key: tuple) -> str:
    if key[0] == "coll":
        return f"collective #{key[2]}"
    kind, _, src, dst, n = key
    return f"{kind} #{n} of {src}→{dst}"


def _stream_name(k: _Kernel) -> str:
    return "its one (serial) queue" if k.stream[1] == "serial" else f"the stream of {_comm_name(k.comm)}"


def _comm_name(comm: tuple) -> str:
    return f"pair {comm[2]}:{comm[3]} of {comm[1]}" if comm[0] == "pair" else f"group {comm[1]}"


def _cycle(waits_on: dict[int, set[int]]) -> list[int]:
    """A cycle in the wait-for graph (rank → ranks it waits on), or []."""
    state: dict[int, int] = {}  # 1: on the current path, 2: explored

    def visit(r: int, path: list[int]) -> list[int]:
        state[r] = 1
        path.append(r)
        for s in sorted(waits_on.get(r, ())):
            if state.get(s) == 1:
                return path[path.index(s):]
            if s not in state and (found := visit(s, path)):
                return found
        state[r] = 2
        path.pop()
        return []

    for r in sorted(waits_on):
        if r not in state and (found := visit(r, [])):
            return found
    return []


def replay(traces: dict[int, list], eager_init: bool = False, serial: bool = False) -> Verdict:
    """Run ``traces`` (global rank → its :class:`Post` / :class:`Wait` events in host order) under the
    model of the module docstring until nothing moves; the :class:`Verdict`."""
    return _Replay(traces, eager_init, serial).run()
