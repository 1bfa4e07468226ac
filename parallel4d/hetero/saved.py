"""Saved tensors that survive slot reuse.

A tensor autograd saves that aliases a chunk slot (a saved ``weight.t()``) is saved as
``(chunk, offset, size, stride)`` and rebuilt on the chunk's slot at unpack time: by then the
chunk may live in another slot, and the old one may hold another chunk. Every other saved
tensor is an activation; its bytes are counted (the dynamic budget's non-model data on the CPU).
"""

from __future__ import annotations

import torch

from parallel4d.hetero.manager import ChunkManager


class SavedTensors:
    """``saved_tensors_hooks`` for a wrapped model, entered around each forward."""

    def __init__(self, mgr: ChunkManager):
        self.mgr = mgr
        self.bytes = 0  # activations saved and not yet unpacked
        self._stack: list = []
        self.outer = None  # an observer of the activations, with pack / unpack (memory.SavedActivations)

    def pack(self, t: torch.Tensor):
        if t.numel():
            loc = self.mgr.locate(t)
            if loc is not None:
                _, c, off = loc
                return ("hetero-chunk", c, off, tuple(t.size()), tuple(t.stride()))
        nb = t.numel() * t.element_size()
        self.bytes += nb
        t = t.detach()  # no grad_fn kept: see memory.SavedActivations.pack
        return ("hetero-act", t if self.outer is None else self.outer.pack(t), nb, self.outer)

    def unpack(self, obj):
        if obj[0] == "hetero-act":
            self.bytes -= obj[2]
            return obj[1] if obj[3] is None else obj[3].unpack(obj[1])
        _, c, off, size, stride = obj
        if c.slot is None:
            raise RuntimeError(f"hetero: a saved view of chunk {c.kind}[{c.index}] is needed by backward while the "
                               "chunk is not resident (a parameter used outside the module that owns it?)")
        p = self.mgr.pools[c.pool]
        return torch.as_strided(p.arena, size, stride, c.slot * p.slot_elems + off)

    def enter(self, *, unless_active: bool = False) -> None:
        """Push the hooks; with ``unless_active``, only when no saved-tensor hooks are active (ours
        from an enclosing forward, or activation checkpointing's, which saves nothing)."""
        ctx = None
        if not unless_active or not self._others_active():
            ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            ctx.__enter__()
        self._stack.append(ctx)

    def _others_active(self) -> bool:
        """Saved-tensor hooks are active that are not an observer's (a memory measurement around
        the step does not stand in for ours)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and not (self.outer is not None and top[0] == self.outer.pack)

    def exit(self) -> None:
        """Pop what the matching :meth:`enter` pushed."""
        ctx = self._stack.pop() if self._stack else None
        if ctx is not None:
            ctx.__exit__(None, None, None)
