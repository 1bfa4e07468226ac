"""``comm.reduce_scatter`` on NCCL (#28): one ``reduce_scatter_tensor`` over the contiguous input, no
per-chunk ``.contiguous()`` copies and no list; gloo keeps its all-reduce + slice. One process:
``torch.distributed`` is replaced by a recording fake that reports the backend asked for."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from op_count import CountOps
from parallel4d.distributed import comm

N, RANK = 4, 1


class FakeDist:
    """The functions reduce_scatter calls, recording each collective; the group sums ``N`` equal
    replicas of the input. A reduce-scatter's output is written by :meth:`complete` (as the device
    does later), so that counting the caller's kernels does not count the fake's."""

    def __init__(self, monkeypatch, backend: str, deferred: bool = False):
        self.calls, self.pending, self.deferred = [], [], deferred
        for name in ("get_backend", "get_world_size", "get_rank", "reduce_scatter_tensor", "reduce_scatter",
                     "all_reduce"):
            monkeypatch.setattr(dist, name, getattr(self, name))
        self.backend = backend

    def get_backend(self, group=None):
        return self.backend

    def get_world_size(self, group=None):
        return N

    def get_rank(self, group=None):
        return RANK

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append(("reduce_scatter_tensor", input.data_ptr(), input.is_contiguous(), tuple(output.shape)))
        self.pending.append((output, input.chunk(N)[RANK]))
        if not self.deferred:
            self.complete()

    def complete(self):
        for output, mine in self.pending:
            output.copy_(mine * N)
        self.pending = []

    def reduce_scatter(self, output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append(("reduce_scatter", len(input_list)))
        output.copy_(input_list[RANK] * N)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append(("all_reduce",))
        tensor.mul_(N)


def test_nccl_reduce_scatters_the_input_itself(monkeypatch):
    fake = FakeDist(monkeypatch, "nccl", deferred=True)
    x = torch.randn(8, 3, 5)
    with CountOps() as ops:
        out = comm.reduce_scatter(x, object(), dim=0)
    fake.complete()
    assert fake.calls == [("reduce_scatter_tensor", x.data_ptr(), True, (2, 3, 5))]
    # the output is the only new tensor: nothing copied into chunks or a list
    assert not {"aten.copy_.default", "aten.clone.default", "aten.cat.default"} & set(ops.ops), ops.ops
    assert torch.equal(out, x.chunk(N)[RANK] * N)


@pytest.mark.parametrize("dim", [1, 2])
def test_nccl_reduce_scatter_along_a_later_dim(monkeypatch, dim):
    """dim ≠ 0: the dim is moved to the front (one copy of the whole tensor), NCCL splits it."""
    fake = FakeDist(monkeypatch, "nccl")
    x = torch.randn(3, 8, 4)
    out = comm.reduce_scatter(x.transpose(0, 2).contiguous().transpose(0, 2), object(), dim=dim)
    assert [c[0] for c in fake.calls] == ["reduce_scatter_tensor"] and fake.calls[0][2]
    assert out.is_contiguous() and torch.equal(out, x.chunk(N, dim=dim)[RANK] * N)


def test_gloo_keeps_all_reduce_and_slice(monkeypatch):
    fake = FakeDist(monkeypatch, "gloo")
    x = torch.randn(8, 3)
    out = comm.reduce_scatter(x, object(), dim=0)
    assert fake.calls == [("all_reduce",)]
    assert torch.equal(out, x.chunk(N)[RANK] * N) and torch.equal(x, x)  # the input is left alone
