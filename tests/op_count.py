"""Which aten ops a piece of code launches, counted on CPU: a ``TorchDispatchMode`` sees each op
once at the top of the dispatcher (a foreach op is one, as it is one launch on CUDA), views apart
(they launch nothing)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """``with CountOps() as c: …`` → ``c.ops``: ``Counter`` of op names (``"aten.mul.Tensor"``)
    that are not views; ``c.kernels``: their total."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())
