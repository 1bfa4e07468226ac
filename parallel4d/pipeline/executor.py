"""One executor for every :class:`~.schedule.Schedule`, over the mesh's ``pp`` axis.

Per optimizer step, each pp rank walks its own action list in order:

* ``F(i, c)``: input = micro-batch ``i`` (chunk 0), or the activation of chunk
  ``c-1`` (received, or handed over locally at a wave turn); runs chunk ``c``;
  the last chunk also applies ``loss_fn(output, targets[i])``. Stores
  ``(input, output)`` for the backward and sends the output on.
* ``B(i, c)``: backward of chunk ``c`` with the received output-gradient (or
  ``loss / m`` for the last chunk), frees what ``F(i, c)`` stored, and sends the
  input-gradient to chunk ``c-1``. Gradients accumulate in the modules' ``.grad``.
* In a schedule that splits the backward: ``B(i, c)`` computes and sends only the
  input-gradient and keeps the chunk's graph; ``W(i, c)`` later accumulates the
  weight gradients from it and frees it (:mod:`.split_grad`).

Messages. A message is the activation and, when the executor is given ``carried``
specs, that many small tensors after it (each its own shape and dtype: e.g. float64
statistics beside bfloat16 activations), the same at every boundary: chunk ``c > 0``
is called as ``chunk(x, *carried)`` and returns ``(y, *carried)`` (the last chunk's
output, whatever it is, goes to the loss); their gradients travel back the same way.
The executor knows nothing of what they hold.

Transfers: shapes/dtypes are known up front (no handshake). Every message has a
position in one global order (:func:`~.analysis.message_order`) and each rank posts
its sends and receives, over all its peers, in that order: p2p matching is
FIFO-correct per pair on gloo and NCCL without tags, no rank ever has to post a
send it has not produced before a receive it needs, and no cycle of ops waiting
on each other can form, even where a rank's transfers share one stream and each
completes only when its peer's op runs (NCCL's rules, replayed for every schedule
by ``tests/test_nccl_replay.py``). A message of several tensors is that many ops to the same peer, posted one after another
at the message's position: per pair they still match in order. Receives are posted ahead (``recv_lookahead``
actions); each op is its own ``isend``/``irecv`` (NCCL: a communicator and stream
per pair of ranks, created at construction by :meth:`PipelineExecutor._warm_up`).
Each receive must arrive within ``timeout_s`` of being posted, as NCCL's watchdog
counts, and a hang becomes a :class:`~parallel4d.comm.CommTimeout` naming the rank
and action.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel4d.distributed import comm
from parallel4d.pipeline.analysis import Message, message_order, validate
from parallel4d.pipeline.split_grad import input_gradient
from parallel4d.pipeline.types import Action, Schedule

ShapeSpec = Union[Sequence[int], Callable[[int], Sequence[int]]]
TensorSpec = Tuple[Sequence[int], torch.dtype]  # one tensor of a message: (shape, dtype)


@dataclass
class StepResult:
    """What one :meth:`PipelineExecutor.step` did on this rank.

    ``loss``: mean over micro-batches of the per-micro-batch loss (same on all
    pp ranks), float64 ``[1]`` on the device: not read back (that would wait for the step). ``peak_activations``: most chunk activations stored at once
    (equals ``simulate(schedule).peak_activations[pp_rank]``);
    ``peak_microbatches``: most distinct micro-batches among them. ``trace``:
    ``(action, start, end)`` in ``time.perf_counter`` seconds, compute only.
    ``wait_s``: seconds spent waiting for receives.
    """

    loss: torch.Tensor
    peak_activations: int
    peak_microbatches: int
    trace: list[tuple[Action, float, float]] = field(repr=False)
    wait_s: float = 0.0


class PipelineExecutor:
    """Runs ``schedule`` for this rank's chunks on the ``pp`` axis of ``mesh``.

    Args:
        schedule: a valid schedule (checked with :func:`validate`); every pp rank
            must pass the same one (compared once here).
        mesh: a :class:`~parallel4d.mesh.Mesh`; peers are ``mesh.global_rank("pp", i)``.
        chunks: ``{chunk id: module}`` for exactly ``schedule.placement[pp_rank]``.
        loss_fn: ``loss_fn(output_of_last_chunk, targets) -> scalar`` (mean over
            the micro-batch); the executor divides by ``m`` once.
        activation_shape: shape of the tensor between chunks for one
            micro-batch, e.g. ``[b/m, s, h]`` (local shard shape under TP/SP), or
            ``f(c) -> shape`` for the output of chunk ``c``.
        activation_dtype: dtype of those tensors (and of their gradients).
        carried: ``(shape, dtype)`` of each tensor every message carries after the activation (none by
            default): chunk ``c > 0`` is then called as ``chunk(x, *carried)`` and each chunk but the last
            returns ``(y, *carried)``; they and their gradients cross pp ranks with the activation.
        timeout_s: limit for any single wait (a receive: from its post).
        recv_lookahead: post the receives of this many upcoming actions early.
    """

    def __init__(self, schedule: Schedule, mesh, chunks: dict[int, nn.Module], loss_fn: Callable,
                 activation_shape: ShapeSpec, activation_dtype: torch.dtype = torch.float32, *,
                 carried: Sequence[TensorSpec] = (), timeout_s: float = 300.0, recv_lookahead: int = 2,
                 device: torch.device | None = None, forward_only: bool = False):
        validate(schedule)
        self.forward_only = forward_only
        self.loss_scale = 1.0  # the backward starts from loss · loss_scale / m (float16's dynamic scale)
        # entered around each chunk's forward (and the loss) of micro-batch i: the engine's dropout draw and packed
        # documents for it; None: nothing
        self.around_forward: Callable[[int], ContextManager] | None = None
        if mesh.size("pp") != schedule.pp:
            raise ValueError(f"schedule is for pp={schedule.pp} but the mesh has parallel.pp={mesh.size('pp')}")
        self.schedule = schedule
        self.mesh = mesh
        self.me = mesh.rank("pp")
        mine = sorted(schedule.placement[self.me])
        if sorted(chunks) != mine:
            raise ValueError(f"pp rank {self.me} must get the modules of chunks {mine} "
                             f"(schedule.placement[{self.me}]), got chunks {sorted(chunks)}")
        self.chunks = chunks
        self.loss_fn = loss_fn
        self._shape = activation_shape if callable(activation_shape) else (lambda c, s=tuple(activation_shape): s)
        self.dtype = activation_dtype
        self.carried = tuple((tuple(shape), dtype) for shape, dtype in carried)
        self.timeout_s = float(timeout_s)
        self.lookahead = max(0, int(recv_lookahead))
        self.device = device or mesh.device
        self.group = mesh.group("pp")
        self.stats = mesh.comm_stats
        self.last = schedule.num_chunks - 1
        self.owner = {c: r for r, cs in schedule.placement.items() for c in cs}
        self.split = schedule.split_backward
        # Forward only (evaluation): the schedule's forwards in its order, and only their messages
        # (a subsequence of the global message order: still deadlock-free).
        self.actions = [a for a in schedule.actions[self.me] if a.kind == "F" or not forward_only]
        # This rank's messages in the global order; per action: the position it needs / produces.
        self.order: list[Message] = [m for m in message_order(schedule) if self.me in (m.src, m.dst)
                                     and (m.kind == "act" or not forward_only)]
        self.need: dict[Action, int] = {m.consumer: k for k, m in enumerate(self.order) if m.dst == self.me}
        self.makes: dict[Action, int] = {m.producer: k for k, m in enumerate(self.order) if m.src == self.me}
        if schedule.pp > 1:
            self._check_same_schedule()
            self._warm_up()

    # --- setup ------------------------------------------------------------------
    def _check_same_schedule(self) -> None:
        # Also the first collective on the pp group (NCCL creates communicators lazily).
        mine = torch.tensor([int(self.schedule.fingerprint()[:15], 16)], dtype=torch.int64, device=self.device)
        every = comm.all_gather(mine, self.group, stats=self.stats, label="pp.check")
        if comm.has_values(every) and bool((every != mine).any()):
            raise ValueError(f"pp ranks run different schedules (fingerprints {every.tolist()}); build the "
                             f"schedule from the same config on every rank")

    def _warm_up(self) -> None:
        """One tiny message over every pair of ranks this rank exchanges messages with, pairs in one
        order on every rank (ascending). On NCCL a pair's first ``isend``/``irecv`` creates its
        communicator and blocks until the peer's first one does: done here, in an order that cannot
        close a cycle, the step's first transfers find them ready (and a failure names the pair)."""
        peers = sorted({m.src if m.dst == self.me else m.dst for m in self.order})
        ops = [("send" if self.me < p else "recv", torch.zeros(1, device=self.device), self._peer(p)) for p in peers]
        works = comm.p2p(ops, self.group, stats=self.stats, label="pp.warm_up", coalesce=False)
        comm.wait(works, self.timeout_s, what=f"pp rank {self.me}: first transfer with pp ranks {peers}",
                  deadlines=self.mesh.deadlines)

    def specs(self, boundary: int) -> tuple[TensorSpec, ...]:
        """``(shape, dtype)`` of each tensor of a message at ``boundary`` (the output of chunk ``boundary``,
        or its gradient): the activation, then the carried tensors."""
        return ((tuple(self._shape(boundary)), self.dtype),) + self.carried

    def _peer(self, pp_index: int) -> int:
        return self.mesh.global_rank("pp", pp_index)

    def _where(self, i: int, a: Action) -> str:
        return f"pp rank {self.me} (global rank {dist.get_rank()}) at action #{i} {a.describe()}"

    # --- one step ---------------------------------------------------------------
    def step(self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None) -> StepResult:
        """Run one step's forwards and backwards (forwards only: :meth:`for_evaluation`);
        gradients accumulate into the chunks.

        ``inputs[i]``: micro-batch ``i``'s input to chunk 0 (e.g. tokens
        ``[b/m, s]``), needed on the rank holding chunk 0; ``targets[i]``: the
        loss targets, needed on the rank holding the last chunk. Others may pass
        ``None``. Returns the mean loss on every pp rank.
        """
        m = self.schedule.microbatches
        if self.owner[0] == self.me and (inputs is None or len(inputs) != m):
            raise ValueError(f"pp rank {self.me} holds chunk 0 and needs {m} input micro-batches, "
                             f"got {None if inputs is None else len(inputs)}")
        if self.owner[self.last] == self.me and (targets is None or len(targets) != m):
            raise ValueError(f"pp rank {self.me} holds the last chunk and needs {m} target micro-batches, "
                             f"got {None if targets is None else len(targets)}")
        st = _StepState(self)
        st.issue(st.lookahead_ops(0))
        for i, a in enumerate(self.actions):
            x_in = st.take_input(i, a)
            t0 = time.perf_counter()
            if a.kind == "F":
                out = self._forward(st, a, x_in, inputs, targets)
            elif a.kind == "B":
                out = self._backward(st, a, x_in)
            else:
                out = st.release(a).run()
            st.trace.append((a, t0, time.perf_counter()))
            ops = st.deliver(a, out)
            ops += st.lookahead_ops(i + 1)
            st.issue(ops)
            st.reap_sends()
        st.finish_sends()
        loss = self._mean_loss(st)
        return StepResult(loss, st.peak, st.peak_mb, st.trace, st.wait_s)

    def _forward(self, st: "_StepState", a: Action, xs, inputs, targets):
        i, c = a.microbatch, a.chunk
        if c == 0:
            xs = (inputs[i].to(self.device),)
        else:
            xs = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in xs)
        with self.around_forward(i) if self.around_forward is not None else contextlib.nullcontext():
            y = self.chunks[c](*xs)
            if c == self.last:  # the loss too reads the micro-batch's context (packed documents' weight)
                y = self.loss_fn(y, targets[i].to(self.device))
        if c == self.last:
            loss = y
            st.losses.append(loss.detach())
            if not self.forward_only:
                st.store(a, xs, (loss,))
            return None
        ys = y if isinstance(y, tuple) else (y,)
        specs = self.specs(c)
        got = tuple((tuple(t.shape), t.dtype) for t in ys)
        if got != specs:
            raise ValueError(f"chunk {c} produced {got} but the executor was told {specs} for its output "
                             f"(activation_shape, activation_dtype, carried)")
        if not self.forward_only:
            st.store(a, xs, ys)
        return tuple(t.detach() for t in ys)

    def for_evaluation(self) -> "PipelineExecutor":
        """The same schedule, chunks and transfers with forwards only: ``step`` under
        ``torch.no_grad()`` returns the mean loss and leaves no gradient (collective on pp)."""
        return PipelineExecutor(self.schedule, self.mesh, self.chunks, self.loss_fn, self._shape, self.dtype,
                                carried=self.carried, timeout_s=self.timeout_s, recv_lookahead=self.lookahead, device=self.device,
                                forward_only=True)

    def _backward(self, st: "_StepState", a: Action, grads):
        xs, ys = st.release(a)
        if a.chunk == self.last:
            ys, grads = (ys[0] * (self.loss_scale / self.schedule.microbatches),), None
        if self.split:
            gxs, weights = input_gradient(ys, grads, xs)
            st.store(Action("W", a.microbatch, a.chunk), weights)
        else:
            pairs = [(y, g) for y, g in zip(ys, grads or (None,) * len(ys)) if y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs] if grads else None)
            gxs = tuple(x.grad for x in xs)
        if a.chunk == 0:
            return None
        return tuple(g if g is not None else torch.zeros_like(x) for g, x in zip(gxs, xs))

    def _mean_loss(self, st: "_StepState") -> torch.Tensor:
        src = self.owner[self.last]
        t = torch.zeros(1, dtype=torch.float64, device=self.device)
        if src == self.me:
            t += torch.stack([x.double() for x in st.losses]).sum() / self.schedule.microbatches
        if self.schedule.pp > 1:
            # The same limit as every wait. A rank that finished waits here for the slowest. A rank
            # stalled in an action waits for a receive whose limit counts from its post, which the
            # look-ahead put early: where that post came before this one, the stalled action is the
            # first to time out and the one reported.
            # the step's result: it returns once gloo's thread has let go of it too (comm.wait_released)
            comm.wait_released(
                lambda: comm.broadcast(t, self._peer(src), self.group, stats=self.stats, label="pp.loss", async_op=True),
                t, self.timeout_s, f"pp rank {self.me}: loss broadcast from pp rank {src} "
                                   f"(waiting for every pp rank to finish its step)", self.mesh.deadlines)
        return t  # float64 [1] on the device; reading it here would make every step wait for the GPU


class _StepState:
    """Buffers, posted transfers and counters of one step on one rank."""

    def __init__(self, ex: PipelineExecutor):
        self.ex = ex
        self.ptr = 0                                  # next unposted position in ex.order
        self.outbox: dict[int, tuple] = {}            # produced, not yet posted: position → a message's tensors
        self.recv: dict[int, tuple[tuple, list, float]] = {}  # position → (buffers, works, posted at)
        self.sends: list[tuple[list, torch.Tensor]] = []
        self.local: dict[Action, tuple] = {}          # wave-turn hand-offs, keyed by consumer
        self.stash: dict[Action, object] = {}        # F → (input, output); W → its WeightGradients
        self.losses: list[torch.Tensor] = []
        self.trace: list = []
        self.peak = self.peak_mb = 0
        self.wait_s = 0.0

    # activations stored from F to B (to W when the backward is split: B hands them over)
    def store(self, a: Action, *kept) -> None:
        self.stash[a] = kept if len(kept) > 1 else kept[0]
        self.peak = max(self.peak, len(self.stash))
        self.peak_mb = max(self.peak_mb, len({k.microbatch for k in self.stash}))

    def release(self, a: Action):
        """What ``a`` consumes: F's (input, output) for B, B's weight gradients for W."""
        return self.stash.pop(Action("F" if a.kind == "B" else "W", a.microbatch, a.chunk))

    # posting
    def _post_upto(self, pos: int, ops: list) -> bool:
        """Queue this rank's messages up to ``pos`` in the global order; False at a send not produced yet."""
        while self.ptr <= pos:
            msg = self.ex.order[self.ptr]
            if msg.src == self.ex.me:
                message = self.outbox.pop(self.ptr, None)
                if message is None:
                    return False  # produced later; the global order guarantees the wait is not needed now
                ops.append(("send", message, msg.dst, self.ptr))
            else:
                bufs = tuple(torch.empty(shape, dtype=dtype, device=self.ex.device)
                             for shape, dtype in self.ex.specs(msg.boundary))
                ops.append(("recv", bufs, msg.src, self.ptr))
            self.ptr += 1
        return True

    def lookahead_ops(self, start: int) -> list:
        ops: list = []
        for a in self.ex.actions[start:start + self.ex.lookahead]:
            need = self.ex.need.get(a)
            if need is not None:
                self._post_upto(need, ops)
        return ops

    def issue(self, ops: list) -> None:
        if not ops:
            return
        now = time.monotonic()
        # a message's tensors one op each, one after another to the same peer (matched in order)
        flat = [(kind, t, self.ex._peer(peer)) for kind, message, peer, _ in ops for t in message]
        works = iter(comm.p2p(flat, self.ex.group, stats=self.ex.stats, label="pp.p2p", coalesce=False))
        for kind, message, _, pos in ops:
            mine = [next(works) for _ in message]
            if kind == "recv":
                self.recv[pos] = (message, mine, now)
            else:
                self.sends.extend(([w], t) for w, t in zip(mine, message))

    def take_input(self, i: int, a: Action):
        """The received / local message (its tensors) action ``a`` consumes (``None`` when it needs none)."""
        if a in self.local:
            return self.local.pop(a)
        need = self.ex.need.get(a)
        if need is None:
            return None
        if need not in self.recv:
            ops: list = []
            if not self._post_upto(need, ops):
                raise RuntimeError(f"{self.ex._where(i, a)}: message plan out of order (a bug)")
            self.issue(ops)
        buf, works, posted = self.recv.pop(need)
        peer = self.ex.order[need].src
        what = "activation" if a.kind == "F" else "gradient"
        src = Action("F", a.microbatch, a.chunk - 1) if a.kind == "F" else Action("B", a.microbatch, a.chunk + 1)
        t0 = time.perf_counter()
        ago = time.monotonic() - posted  # the limit counts from the post, as NCCL's watchdog does
        comm.wait(works, round(self.ex.timeout_s - ago, 3),
                  what=f"{self.ex._where(i, a)} waiting for the {what} of {src.describe()} from pp rank {peer} "
                       f"(posted {ago:.2f}s before)", deadlines=self.ex.mesh.deadlines)
        self.wait_s += time.perf_counter() - t0
        return buf

    def deliver(self, a: Action, out) -> list:
        """Hand ``a``'s output to its consumer: local (wave turn) or a send op."""
        ops: list = []
        if out is None:
            return ops
        nxt = Action("F", a.microbatch, a.chunk + 1) if a.kind == "F" else Action("B", a.microbatch, a.chunk - 1)
        if self.ex.owner[nxt.chunk] == self.ex.me:
            self.local[nxt] = out
            return ops
        pos = self.ex.makes[a]
        self.outbox[pos] = tuple(t.contiguous() for t in out)
        if not self._post_upto(pos, ops):
            raise RuntimeError(f"pp rank {self.ex.me}: message plan out of order at {a.describe()} (a bug)")
        return ops

    def reap_sends(self) -> None:
        # Drop finished sends so their tensors can be freed before the step ends.
        self.sends = [(w, t) for (w, t) in self.sends if not all(x.is_completed() for x in w)]

    def finish_sends(self) -> None:
        for w, _ in self.sends:
            comm.wait(w, self.ex.timeout_s, what=f"pp rank {self.ex.me}: sends at the end of the step",
                      deadlines=self.ex.mesh.deadlines)
        self.sends.clear()
        leftover = [k for k in self.outbox]
        if leftover or self.stash or self.local:
            raise RuntimeError(f"pp rank {self.ex.me}: step ended with unsent {leftover}, "
                               f"stored {list(self.stash)}, local {list(self.local)} (a bug)")


# --- tied parameters across pp ranks ---------------------------------------------


class TiedGradSync:
    """Sum the gradient of a parameter shared by two chunks on different pp ranks.

    Typical use: the token embedding (chunk 0) tied to the LM head (last chunk).
    Under Hanayo both chunks live on pp rank 0, where they share one
    ``nn.Parameter``: nothing to do (``active`` is False everywhere). Otherwise
    each owner holds its own copy; call this after :meth:`PipelineExecutor.step`
    on every rank (non-owners return at once) to all-reduce the copies' grads.

    The constructor is collective over the *whole world* (:meth:`Mesh.new_group` for
    every pp line of the mesh, in the same order on all ranks), so build it once,
    on every rank, before training.
    """

    def __init__(self, mesh, schedule: Schedule, chunks: Sequence[int] = (0, -1)):
        owners = sorted({schedule.owner(c % schedule.num_chunks) for c in chunks})
        self.owners = owners
        self.group = None
        self.mesh = mesh
        if len(owners) < 2:
            return
        # One small group per pp line (all other coordinates fixed), created by everyone.
        me = dist.get_rank()
        for line in mesh.lines_along("pp"):
            ranks = sorted(int(line[o]) for o in owners)
            g = mesh.new_group(ranks, axis="pp")
            if me in ranks:
                self.group = g

    @property
    def active(self) -> bool:
        return self.group is not None

    def __call__(self, params: Sequence[nn.Parameter], timeout_s: float = 300.0) -> None:
        """All-reduce (sum) the ``.grad`` of this rank's copies of the tied parameters."""
        if self.group is None:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            work = comm.all_reduce(p.grad, self.group, stats=self.mesh.comm_stats, label="pp.tied", async_op=True)
            comm.wait(work, timeout_s, what=f"pp rank {self.mesh.rank('pp')}: tied-parameter gradient all-reduce",
                      deadlines=self.mesh.deadlines)
