"""What one rank holds, in bytes: the counting rules that ``parallel4d plan`` (a dry run) and a
training run (its first step, ``summary.json``'s ``memory``) share, so the two can be compared.

* **parameters**: the rank's distinct parameter tensors (a tied table once);
* **gradients**: the ``.grad`` tensors after a step's backward (hetero keeps them in its chunks);
* **optimizer state**: every tensor in the optimizer's ``state`` after a step;
* **activations**: the most bytes autograd holds for the backward at once during a step
  (:class:`SavedActivations`) — over every micro-batch in the schedule's order, so a pipeline's
  in-flight micro-batches are included; each storage once; parameters are not activations.
"""

from __future__ import annotations

from typing import Iterable

import torch


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself: views share it


class _Held:
    """One saved tensor; releasing it (autograd frees its graph) releases its storage's count."""

    __slots__ = ("meter", "tensor", "key")

    def __init__(self, meter: "SavedActivations", tensor: torch.Tensor, key: int):
        self.meter, self.tensor, self.key = meter, tensor, key

    def __del__(self):
        self.meter._release(self.key)


class SavedActivations:
    """Within ``with``: ``live`` and ``peak`` bytes of the tensors autograd saves for the backward.

    A storage counts once however many ops save it (or views of it), from its first save until
    the last op that saved it is freed (after its backward, or when the graph is dropped). The
    storages of ``exclude`` (the parameters) are not counted. Works on fake tensors too (a plan's
    dry run: sizes without values). Tensors a custom autograd function keeps as plain attributes
    of ``ctx`` are invisible to it: ours save through ``save_for_backward``.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {_key(t) for t in exclude}
        self._counts: dict[int, list[int]] = {}  # storage → [saves alive, bytes]
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        key = _key(t)
        if key in self._excluded:
            return t
        entry = self._counts.get(key)
        if entry is None:
            entry = self._counts[key] = [0, t.untyped_storage().nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        # Detached: a saved output holding its own grad_fn would be a cycle through autograd's C++
        # graph that no collector sees, and a retained graph (split backward) would never be freed.
        return _Held(self, t.detach(), key)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        entry = self._counts.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._counts[key]

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensors among ``tensors`` (numel × element size)."""
    seen = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in seen.values())


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in a ``torch.optim.Optimizer``'s state."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


def adam_state_bytes(optimizer) -> int:
    """What :func:`optimizer_state_bytes` reads after the first step of this Adam / AdamW, computed
    before it: two moments per trainable parameter in its dtype, plus torch's 4-byte step count
    per parameter (apex's FusedAdam keeps the step per group)."""
    per_param = 4 if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) else 0
    params = {id(p): p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}.values()
    return sum(2 * p.numel() * p.element_size() + per_param for p in params)
