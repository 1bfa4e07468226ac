"""The optimizer's work on the chunks: Adam(W) row by row, the gradient norm, zero_grad.

A row whose P, G, M, V chunks are all resident is updated in its device slots; otherwise,
when ``host_optimizer`` is on (default on CUDA), on the host backings (PatrickStar's hybrid
placement: no chunk crosses PCIe for the step; ``"fused"`` uses torch's fused CPU AdamW,
``"exact"`` the single-tensor arithmetic, ``"off"`` loads the chunks). Under ZeRO each rank
updates its shards only. Under 16-bit chunks (``Layout.mixed``) a row's master state
(:class:`~parallel4d.hetero.master.MasterState`) is updated where its placement puts it: a device
row there, from its gradient chunk, its parameter chunk rounded in place; a host row by the host
worker, from the gradient's host backing, in forward order while the training thread goes on (the
next forward's upload of the row waits for its update).
"""

from __future__ import annotations

from typing import Callable

import torch

from parallel4d.hetero.chunk import Chunk, TensorInfo, TensorState
from parallel4d.hetero.layout import Layout, Row
from parallel4d.hetero.manager import ChunkManager
from parallel4d.hetero.master import DEVICE, HOST, HostUpdates, MasterState
from parallel4d.hetero.optim import adam_update, fused_adam_update
from parallel4d.hetero.zero import ZeroShards, segment
from parallel4d.optim.norms import tensor_norms, weighted_sq_sum

S = TensorState


class RowAdam:
    """Adam(W) over the rows' chunks; ``steps``: per parameter name, as torch's ``state["step"]``."""

    def __init__(self, layout: Layout, mgr: ChunkManager, zero: ZeroShards, host_optimizer: str,
                 master: MasterState | None = None, updates: HostUpdates | None = None, zero_grad_steps=()):
        self.layout, self.mgr, self.zero, self.master, self.updates = layout, mgr, zero, master, updates
        # per row: the tensors stepped with a zero gradient when none arrived (wrap's zero_grad_steps)
        self.zero_grad_rows: dict[int, list[int]] = {}
        for p in zero_grad_steps:
            rec, row = layout.row_of(p)
            if rec.trainable:
                self.zero_grad_rows.setdefault(row.index, []).append(rec.k)
        self._host_optimizer = host_optimizer
        self.host_rows = 0  # row updates done on the host so far
        self.device_rows = 0  # master row updates done on the device so far (16-bit chunks)
        self.order: list[int] = [row.index for row in layout.rows]  # forward order (the warm-up trace's)
        # updates in the backward (update_in_backward): the hyperparameters now, or None (off); each row's
        # gradient writes in a step, counted at the warm-up; this step's so far; the rows handed over
        self.in_backward: Callable[[], dict[str, dict]] | None = None
        self._writes_per_step: dict[int, int] | None = None
        self._writes: dict[int, int] = {}
        self._early: set[int] = set()
        self.steps: dict[str, int] = {}
        self._host_scale: torch.Tensor | None = None  # this step's grad_scale on the host (see step)

    @torch.no_grad()
    def step(self, hp_of: dict[str, dict], grad_scale=None) -> None:
        """One update of every parameter that has a gradient (``hp_of[name]``: its lr, beta1,
        beta2, eps, weight_decay, decoupled); the gradient is scaled by ``grad_scale`` first (clipping)."""
        self.layout.check_idle("optimizer.step()")
        self._zero_unwritten()
        self._host_scale = None  # grad_scale read back once, at the first row updated on the host
        if self._early and grad_scale is not None:
            raise RuntimeError("hetero: the gradients were scaled (clipping, loss scaling) after rows were updated "
                               "in the backward; call update_in_backward(False) when the step scales its gradients")
        if self._writes_per_step is None:
            self._writes_per_step = dict(self._writes)  # the warm-up's count: later steps write the same
        self._writes = {}
        if self.master is not None:
            self._step_masters(hp_of, grad_scale)
        else:
            for row in self.layout.rows:
                if row.trainable:
                    self._step_row(row, hp_of, grad_scale)
        for row in self.layout.rows:
            for t in row.P.tensors:
                if t.state in (S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD):
                    t.set_state(S.HOLD)
        self.mgr.end_iteration()

    def _zero_unwritten(self) -> None:
        """The tensors of :attr:`zero_grad_rows` without a gradient this step get a zero one where their
        gradient chunk is — its slot if resident, else its host backing: no chunk moves for them."""
        for index, ks in self.zero_grad_rows.items():
            G = self.zero.opt_chunks(self.layout.rows[index])[1]
            unwritten = [G.tensors[k] for k in ks if G.tensors[k].state == S.FREE]
            if not unwritten:
                continue
            if G.slot is not None:  # zero-filled as FREE tensors are on acquire
                self.mgr.acquire(G, unwritten, write=True, record=False)
                self.mgr.release(G, unwritten, S.HOLD_AFTER_BWD)
                continue
            self.mgr.before_host_write(G)
            for t in unwritten:
                a, b = max(t.offset, G.base), min(t.end, G.base + G.capacity)
                if a < b:
                    G.backing[a - G.base:b - G.base].zero_()
                t.set_state(S.COMPUTE)
                t.set_state(S.HOLD_AFTER_BWD)

    @property
    def host_optimizer(self) -> str:
        """"fused" | "exact" | "off" (load the chunks: not with a master on the host)."""
        return self._host_optimizer

    @host_optimizer.setter
    def host_optimizer(self, mode: str) -> None:
        if mode not in ("fused", "exact", "off") or (mode == "off" and self.master is not None):
            raise ValueError(f"host_optimizer={mode!r}: use 'fused' or 'exact'"
                             + ("" if self.master is not None else " or 'off'"))
        self._host_optimizer = mode

    def _host_grad_scale(self, grad_scale):
        """``grad_scale`` as the host arithmetic takes it: a device number read back once a step."""
        if not isinstance(grad_scale, torch.Tensor):
            return grad_scale
        if self._host_scale is None:
            self._host_scale = grad_scale.cpu()
        return self._host_scale

    def _step_row(self, row: Row, hp_of: dict[str, dict], grad_scale) -> None:
        P, G, M, V, (lo, hi) = self.zero.opt_chunks(row)
        ks = [k for k, t in enumerate(G.tensors) if t.state == S.HOLD_AFTER_BWD]
        if not ks:
            return
        steps = [(self._count_step(row.records[k].name), hp_of[row.records[k].name]) for k in ks]
        parts = [(P, P.tensors)] + [(c, [c.tensors[k] for k in ks]) for c in (G, M, V)]
        on_host = self.host_optimizer in ("exact", "fused") and any(c.slot is None for c in (P, G, M, V))
        views = self._host_views(parts) if on_host else self._device_views(parts, grad_scale is not None)
        update = fused_adam_update if on_host and self.host_optimizer == "fused" else adam_update
        if on_host:  # a wait, as the host update's for its chunks
            grad_scale = self._host_grad_scale(grad_scale)
        for a, b, (st, hp) in self._spans(G, ks, steps, lo, hi):
            if b > a:
                p, g, m, v = (x[a:b] for x in views)
                if grad_scale is not None:
                    g.mul_(grad_scale)
                update(p, g, m, v, step=st, **hp)
        if on_host:
            self._finish_host(parts)
        else:
            self._finish_device(parts)
        if self.layout.dp > 1:  # the gathered parameters are stale now
            self.mgr.invalidate(row.P)

    def _step_masters(self, hp_of: dict[str, dict], grad_scale) -> None:
        """16-bit chunks: the host rows handed to the worker in forward order (their gradients written
        back first; the worker waits for those copies and for ``grad_scale``, the training thread
        does not), then the device rows updated here."""
        rows = [self.layout.rows[i] for i in self.order if self.layout.rows[i].trainable]
        host = [row for row in rows if self.master.place[row.index] == HOST]
        for row in host:
            self.mgr.flush(self.zero.opt_chunks(row)[1])
        written = self.mgr.transfers.written_back()
        scale = self._scale_on_host(grad_scale) if host else None
        for row in host:
            if row.index in self._early:  # handed over in the backward: its gradient is consumed now
                self._early.discard(row.index)
                G = self.zero.opt_chunks(row)[1]
                self._consume(row, [t for t in G.tensors if t.state == S.HOLD_AFTER_BWD])
            else:
                self._submit_host_row(row, hp_of, scale, written)
        for row in rows:
            if self.master.place[row.index] == DEVICE:
                self._step_device_row(row, hp_of, grad_scale)

    def _final_grads(self, row: Row, hp_of: dict[str, dict]):
        """``(G, its tensors with a gradient, the spans to update)`` of ``row`` (``G``: ``GS`` under ZeRO)."""
        _, G, _, _, (lo, hi) = self.zero.opt_chunks(row)
        ks = [k for k, t in enumerate(G.tensors) if t.state == S.HOLD_AFTER_BWD]
        steps = [(self._count_step(row.records[k].name), hp_of[row.records[k].name]) for k in ks]
        return G, [G.tensors[k] for k in ks], self._spans(G, ks, steps, lo, hi)

    def note_grad_write(self, row: Row) -> None:
        """A gradient was written into ``row`` (the backward's hook). With ``in_backward`` on, a host row whose
        writes reach the warm-up's count has its final gradient: handed to the worker now, while the backward
        goes on (16-bit chunks, dp = 1, the trace replayed: every step writes as the warm-up did)."""
        if row.index in self._early:
            raise RuntimeError(f"hetero: a gradient arrived for row {row.index} after its update in the backward "
                               "(this step ran more micro-batches than the first); every step must run the same "
                               "micro-batches under update_in_backward, or call update_in_backward(False)")
        n = self._writes[row.index] = self._writes.get(row.index, 0) + 1
        if (self.in_backward is None or self.master is None or self.layout.dp > 1 or self._writes_per_step is None
                or row.index in self.zero_grad_rows  # its write count varies with the experts chosen
                or not self.mgr.trace.valid or self.master.place[row.index] != HOST
                or n != self._writes_per_step.get(row.index)):
            return
        self.mgr.flush(row.G)
        G, _, spans = self._final_grads(row, self.in_backward())
        self._early.add(row.index)  # consumed at the step (the gradient norm may still read it)
        self._hand_over(row, G, spans, lambda: None, self.mgr.transfers.written_back())

    def _submit_host_row(self, row: Row, hp_of: dict[str, dict], scale: Callable, written) -> None:
        """The row's master window stepped by the worker from its gradient's host backing; the gradient is
        consumed now (its backing is written again only after the update: the chunk's guard) and the
        device's parameter copy is stale (the next upload waits for the update)."""
        G, gts, spans = self._final_grads(row, hp_of)
        if gts:
            self._consume(row, gts)
            self._hand_over(row, G, spans, scale, written)

    def _hand_over(self, row: Row, G: Chunk, spans: list[tuple], scale: Callable, written) -> None:
        """The worker updates ``row``'s master from ``G``'s host backing once ``written`` (the event of the
        gradient's write-back, None off CUDA) is reached, scaled by ``scale()``."""
        grad, fused = G.backing, self.host_optimizer == "fused"

        def work():
            if written is not None:
                written.synchronize()
            self.master.update(row, grad, spans, scale(), fused)

        self.updates.submit(row.index, work)
        self.host_rows += 1

    def _consume(self, row: Row, gts: list[TensorInfo]) -> None:
        """The gradient tensors ``gts`` used up, the row's parameter chunk stale (its update is the worker's)."""
        for t in gts:
            t.set_state(S.FREE)
        self.mgr.invalidate(row.P)

    def _step_device_row(self, row: Row, hp_of: dict[str, dict], grad_scale) -> None:
        """The row's master window stepped on the device from its gradient chunk (loaded if it was
        evicted), its parameter chunk rounded from it in place when resident (dp = 1), else refilled at
        its next use."""
        G, gts, spans = self._final_grads(row, hp_of)
        if not gts:
            return
        self.mgr.acquire(G, gts, record=False)  # the warm-up trace is the same in every placement
        fused = self.mgr.cuda or self.host_optimizer == "fused"  # on a CPU device: the host's arithmetic
        self.master.update(row, self.mgr.slot_view(G), spans, grad_scale, fused)
        self.mgr.release(G, gts, S.FREE)
        if self.layout.dp == 1 and row.P.slot is not None:
            self.master.upload(row, self.mgr.read(row.P))
        else:
            self.mgr.invalidate(row.P)
        self.device_rows += 1

    def _scale_on_host(self, grad_scale) -> Callable:
        """What returns ``grad_scale`` on the host for the worker: a device number copied back without
        the training thread waiting (the worker waits for the copy's event)."""
        if not isinstance(grad_scale, torch.Tensor):
            return lambda: grad_scale
        if grad_scale.device.type != "cuda":
            value = grad_scale.detach().clone()
            return lambda: value
        host = torch.empty(grad_scale.shape, dtype=grad_scale.dtype, pin_memory=True)
        host.copy_(grad_scale, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def get():
            done.synchronize()
            return host
        return get

    def _count_step(self, name: str) -> int:
        self.steps[name] = self.steps.get(name, 0) + 1
        return self.steps[name]

    @staticmethod
    def _spans(G: Chunk, ks: list[int], steps: list[tuple[int, dict]], lo: int, hi: int) -> list[tuple]:
        """``(start, end, (step, hyperparameters))`` ranges of the window to update."""
        if len(ks) == len(G.tensors) and all(s == steps[0] for s in steps):
            # one flat update over the window (padding is zero in G, M, V and stays zero)
            return [(0, min(hi, G.used) - lo, steps[0])]
        spans = []
        for k, st in zip(ks, steps):
            seg = segment(G.tensors[k], lo, hi)
            if seg is not None:
                spans.append((seg[0] - lo, seg[1] - lo, st))
        return spans

    def _host_views(self, parts: list[tuple[Chunk, list[TensorInfo]]]) -> list[torch.Tensor]:
        """The host backings, current (device copies written back) and their tensors → COMPUTE."""
        for c, _ in parts:
            self.mgr.flush(c)
        self.mgr.transfers.sync()
        for c, ts in parts:
            for t in ts:
                if t.state == S.FREE:  # fresh Adam moments start at zero
                    a, b = max(t.offset, c.base), min(t.end, c.base + c.capacity)
                    c.backing[a - c.base:b - c.base].zero_()
                t.set_state(S.COMPUTE)
        self.host_rows += 1
        return [c.backing for c, _ in parts]

    def _finish_host(self, parts: list[tuple[Chunk, list[TensorInfo]]]) -> None:
        for (c, ts), to in zip(parts, (S.HOLD, S.FREE, S.HOLD, S.HOLD)):
            for t in ts:
                t.set_state(to)
        for c, _ in parts[:1] + parts[2:]:  # P, M, V: their device copies are stale now
            self.mgr.invalidate(c)

    def _device_views(self, parts: list[tuple[Chunk, list[TensorInfo]]], scaled: bool) -> list[torch.Tensor]:
        (P, _), (G, gts), (M, mts), (V, vts) = parts
        self.mgr.acquire(P, None, write=True)
        self.mgr.acquire(G, gts, write=scaled)
        self.mgr.acquire(M, mts, write=True)
        self.mgr.acquire(V, vts, write=True)
        return [self.mgr.slot_view(c) for c, _ in parts]

    def _finish_device(self, parts: list[tuple[Chunk, list[TensorInfo]]]) -> None:
        (P, _), (G, gts), (M, mts), (V, vts) = parts
        self.mgr.release(P, None, S.HOLD)
        self.mgr.release(G, gts, S.FREE)  # consumed
        self.mgr.release(M, mts, S.HOLD)
        self.mgr.release(V, vts, S.HOLD)

    def zero_grad(self) -> None:
        self.layout.check_idle("optimizer.zero_grad()")
        for row in self.layout.rows:
            for c in (row.G, row.GS):
                if c is None:
                    continue
                for t in c.tensors:
                    if t.state != S.FREE:
                        t.set_state(S.FREE)

    @torch.no_grad()
    def grad_sq_norm(self, weights: dict[str, float] | None = None) -> torch.Tensor:
        """Σ weight · ‖g‖² over the gradients written since the last step, summed over the data
        replicas (ZeRO's group); float64 ``[]``. ``weights``: by parameter name (default 1), e.g. 1/q
        for a tensor another rank also holds, so a caller summing over more axes counts it once."""
        weights = weights or {}
        # each gradient's norm where it is: the device's slots there, the host's backings on the host (the
        # copy streams drained once); one foreach norm per row's chunk, one sum per side
        parts = {"device": ([], []), "host": ([], [])}
        rows = [row for row in self.layout.rows if row.trainable]
        if any(self.zero.opt_chunks(row)[1].slot is None for row in rows):
            self.mgr.transfers.sync()
        for row in rows:
            _, G, _, _, (lo, hi) = self.zero.opt_chunks(row)
            content, (norms, ws) = ((self.mgr.read(G), parts["device"]) if G.slot is not None
                                    else (G.backing, parts["host"]))
            segs = [(t, segment(t, lo, hi)) for t in G.tensors if t.state == S.HOLD_AFTER_BWD]
            segs = [(t, s) for t, s in segs if s is not None]
            norms += tensor_norms([content[a - lo:b - lo] for _, (a, b) in segs])
            ws += [weights.get(t.name.split(":", 1)[1], 1.0) for t, _ in segs]
        sq = weighted_sq_sum(*parts["device"], self.mgr.device)
        if parts["host"][0]:  # one number crosses, not the gradients
            sq = sq + weighted_sq_sum(*parts["host"], "cpu").to(self.mgr.device, non_blocking=True)
        self.zero.all_reduce(sq, "hetero gradient-norm all-reduce")
        return sq
