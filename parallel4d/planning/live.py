"""The most bytes a dry run's tensors held at once: what a process computing on the CPU grows by.

:class:`LiveTensors` is a dispatch mode entered around ``parallel4d plan``'s dry run of a rank (the
model's build, hetero's chunks and master state, two steps), on fake tensors: every storage an op
creates counts its bytes from its first tensor until its last tensor (any view) is gone, so the peak
covers everything the job's own code holds at once — parameters before hetero takes them, the chunk
arena and its host backings, the master state, saved activations, the gradients autograd makes
before a hook copies them into a chunk, collectives' and the update's temporaries — with no formula
of its own. Where the compute device is the CPU all of it is host memory: the figure is the run's peak
resident set above its baseline before the model was built (``summary.json``'s
``hetero.host_rss_bytes``), the allocator returning large blocks as they are freed
(:mod:`parallel4d.training.host_memory`).

Not seen: tensors made outside the mode (a thread of its own: hetero's host updates run in line in a
dry run for this), and what is no tensor (Python objects, the interpreter, communication buffers).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensors(TorchDispatchMode):
    """While entered: ``live`` and ``peak`` bytes of the storages the dispatched ops' outputs hold, each
    storage once however many tensors view it, from the op that made it until torch frees it (a
    storage's Python object lives exactly as long as the storage: its finalizer says when)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}  # id of a storage counted → its bytes

    def restart_peak(self) -> int:
        """The peak so far; from now on :attr:`peak` is the most held since this call."""
        peak, self.peak = self.peak, self.live
        return peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key = id(storage)
        if key in self._bytes:
            return
        self._bytes[key] = n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key).atexit = False

    def _release(self, key: int) -> None:
        self.live -= self._bytes.pop(key)
