"""Module hooks that drive residency (on every module with direct parameters).

* forward pre-hook: the module's parameters → COMPUTE; ``param.data`` = a view into the
  chunk's device slot.
* forward hook: → HOLD_AFTER_FWD (HOLD without grad); ``param.data`` = the NaN placeholder;
  a hook on each output that requires grad marks the *pre-backward* moment.
* pre-backward (output-gradient hook): parameters → COMPUTE until their gradient is written
  (``register_post_accumulate_grad_hook``: the gradient is copied/added into the grad chunk,
  ``p.grad = None``, parameter → HOLD_AFTER_BWD). Frozen parameters (a LoRA base) have no gradient to
  say their module's backward is over: the forward pre-hook passes the module's inputs that require grad
  through an identity (:class:`AfterBackward`) whose backward — the inputs' gradients from this module
  complete — releases them, so a frozen base streams layer by layer in the backward too. Anything still
  held (a module whose inputs need no gradient) is released by an end-of-backward callback.
* a forward pre-hook that runs *inside* backward is activation-checkpoint recomputation:
  its holds last until the backward hold is released, so the views the recomputation saved
  cannot be relocated before they are used.
* under ``torch.compile`` (``train.compile: blocks``) the forward hooks run eagerly, each a graph
  break inside the compiled block: they swap ``param.data``, which a graph cannot hold.
* the root module's own pre-hook and hook enter and leave :class:`SavedTensors` around its
  ``forward`` (which itself runs unmodified); a module called on its own (a pipeline stage)
  enters them in its pre-hook unless some are active.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from parallel4d.hetero.chunk import Chunk, TensorInfo, TensorState
from parallel4d.hetero.layout import Layout, ParamRecord
from parallel4d.hetero.manager import ChunkManager
from parallel4d.hetero.saved import SavedTensors
from parallel4d.hetero.zero import ZeroShards

S = TensorState
Group = tuple[Chunk, list[TensorInfo], list[ParamRecord]]  # one chunk's part of a module's parameters


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class AfterBackward(torch.autograd.Function):
    """The identity on a module's input tensors; its backward (every input's gradient from this module
    written) calls ``release`` — the module's backward is done with its frozen parameters."""

    @staticmethod
    def forward(ctx, release, *xs):
        ctx.release = release
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.release()
        return (None, *grads)


class Residency:
    """Holds and releases parameters around each module's forward and backward, and puts
    each gradient into its grad chunk (reduce-scattering complete rows under ZeRO)."""

    def __init__(self, layout: Layout, mgr: ChunkManager, saved: SavedTensors, zero: ZeroShards):
        self.layout, self.mgr, self.saved, self.zero = layout, mgr, saved, zero
        self.mod_groups: dict[nn.Module, list[Group]] = {m: self._groups(ps) for m, ps in layout.module_params.items()}
        # per module, its frozen parameters' records (released after its backward: AfterBackward)
        self.frozen: dict[nn.Module, list[ParamRecord]] = {
            m: fs for m, ps in layout.module_params.items()
            if (fs := list({id(p): layout.by_param[id(p)] for p in ps if not layout.by_param[id(p)].trainable}.values()))}
        self._cb_task = None  # the backward whose end-of-backward callback is queued
        self.on_grad_write = None  # called with a row after each gradient written into it (the optimizer's count)

    def _groups(self, params: list[nn.Parameter]) -> list[Group]:
        """``params`` by parameter chunk (a tied parameter once)."""
        by_chunk: dict[int, Group] = {}
        for p in params:
            rec, row = self.layout.row_of(p)
            e = by_chunk.setdefault(row.index, (row.P, [], []))
            if rec not in e[2]:
                e[1].append(row.P.tensors[rec.k])
                e[2].append(rec)
        return list(by_chunk.values())

    def install(self, model: nn.Module) -> list:
        """Register every hook; returns the handles."""
        handles = []
        # a compiled block (train.compile=blocks) calls them eagerly, a graph break each: they point
        # param.data at chunk slots, which a graph cannot do
        pre, post = torch.compiler.disable(self._pre_forward), torch.compiler.disable(self._post_forward)
        for mod in self.mod_groups:
            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post, always_call=True))
        for rec in self.layout.records:
            if rec.trainable:
                handles.append(rec.param.register_post_accumulate_grad_hook(self._grad_ready))
        # inside the root's own parameter hooks (registered above), so the two nest
        handles.append(model.register_forward_pre_hook(lambda mod, args: self.saved.enter()))
        handles.append(model.register_forward_hook(lambda mod, args, out: self.saved.exit(),
                                                   prepend=True, always_call=True))
        return handles

    # --- holds --------------------------------------------------------------------------
    def _hold(self, chunk: Chunk, tensors: list[TensorInfo], recs: list[ParamRecord]) -> None:
        self.mgr.acquire(chunk, tensors)
        for t, rec in zip(tensors, recs):
            rec.param.data = self.mgr.view(chunk, t)

    def _unhold(self, chunk: Chunk, tensors: list[TensorInfo], recs: list[ParamRecord], to: TensorState) -> None:
        self.mgr.release(chunk, tensors, to)
        for t, rec in zip(tensors, recs):
            if t.holds == 0:
                rec.param.data = rec.placeholder

    # --- forward ------------------------------------------------------------------------
    def _pre_forward(self, mod, args) -> None:
        self.saved.enter(unless_active=True)
        if _in_backward():  # activation-checkpoint recomputation
            self._pre_backward(mod)
            return
        for chunk, tensors, recs in self.mod_groups[mod]:
            self._hold(chunk, tensors, recs)
        if mod in self.frozen and torch.is_grad_enabled():
            return self._after_backward(mod, args)

    def _after_backward(self, mod, args: tuple):
        """``args`` with the tensors that require grad passed through :class:`AfterBackward` (None: none do)."""
        at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not at:
            return None
        out = list(args)
        for i, x in zip(at, AfterBackward.apply(lambda: self._release_frozen(mod), *(args[i] for i in at))):
            out[i] = x
        return tuple(out)

    def _release_frozen(self, mod) -> None:
        """``mod``'s backward is over: its frozen parameters' backward holds released."""
        for rec in self.frozen[mod]:
            if rec.bwd_held:
                self._release_bwd(rec)

    def _post_forward(self, mod, args, out) -> None:
        self.saved.exit()
        if _in_backward():
            return  # recomputation: the holds taken in _pre_forward are backward holds
        grad = torch.is_grad_enabled()
        if grad:
            for t in tree_leaves(out):  # every tensor of a nested output
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, mod=mod: self._pre_backward(mod))
        for chunk, tensors, recs in self.mod_groups[mod]:
            self._unhold(chunk, tensors, recs, S.HOLD_AFTER_FWD if grad else S.HOLD)

    # --- backward -----------------------------------------------------------------------
    def _pre_backward(self, mod) -> None:
        """Hold ``mod``'s parameters for its backward (once each: a module may run twice)."""
        self._queue_end_of_backward()
        for chunk, tensors, recs in self.mod_groups[mod]:
            need = [(t, r) for t, r in zip(tensors, recs) if not r.bwd_held]
            if need:
                self._hold(chunk, [t for t, _ in need], [r for _, r in need])
                for _, r in need:
                    r.bwd_held = True

    def _release_bwd(self, rec: ParamRecord) -> None:
        row = self.layout.rows[rec.row]
        rec.bwd_held = False
        self._unhold(row.P, [row.P.tensors[rec.k]], [rec], S.HOLD_AFTER_BWD)

    def _grad_ready(self, p: nn.Parameter) -> None:
        rec, row = self.layout.row_of(p)
        wrote = p.grad is not None
        if wrote:
            self._store_grad(row.G, row.G.tensors[rec.k], p.grad)
            p.grad = None
        if rec.bwd_held:
            self._release_bwd(rec)
        if self.layout.dp > 1 and all(t.state == S.HOLD_AFTER_BWD for t in row.G.tensors):
            self.zero.reduce_row(row, "on_completion")
        if wrote and self.on_grad_write is not None:
            self.on_grad_write(row)

    @torch.no_grad()
    def _store_grad(self, G: Chunk, t: TensorInfo, g: torch.Tensor) -> None:
        """Copy ``g`` into ``t``'s place in ``G``, or add it to the gradient already there."""
        first = t.state == S.FREE
        self.mgr.acquire(G, [t], write=True, zero_free=False)
        dst = self.mgr.view(G, t)
        if first:
            dst.copy_(g)
        else:
            dst.add_(g)
        self.mgr.release(G, [t], S.HOLD_AFTER_BWD)

    def _queue_end_of_backward(self) -> None:
        tid = torch._C._current_graph_task_id()
        if tid != self._cb_task:
            self._cb_task = tid
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._cb_task = None
        for rec in self.layout.records:
            if rec.bwd_held:
                self._release_bwd(rec)
        if self.layout.dp > 1:  # rows whose tensors did not all get a gradient (unused parameters)
            for row in self.layout.rows:
                if row.trainable and any(t.state == S.HOLD_AFTER_BWD for t in row.G.tensors):
                    self.zero.reduce_row(row, "end_of_backward")
            self.zero.drain()
