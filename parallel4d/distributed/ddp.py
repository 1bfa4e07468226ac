"""Data-parallel gradient averaging that overlaps the backward.

:class:`GradBuckets` cuts this rank's parameters, in reverse model order (the
order their gradients become ready), into buckets of about ``bucket_bytes``.
A hook on each parameter counts its gradient accumulations; once every
parameter of a bucket has received all of this step's contributions (``expected``
per step: one per micro-batch, more for a parameter shared by several pipeline
chunks), an async all-reduce (sum) of the bucket's flat buffer on the mesh's device
is posted over the data replicas ``dp·sp`` while the backward goes on.
:meth:`GradBuckets.finish` posts what is left (parameters that got fewer
contributions, or none; ``deferred`` ones, whose grads change after the backward:
the tied copies of a pipeline), waits for every bucket with the timeout and divides
by the number of replicas. A parameter split over ranks rather than replicated on every replica
(an expert under expert parallelism, ``sum_over``) is summed over the group of ranks that hold it
instead, in buckets of its own, and divided by the same number of replicas.

Each parameter's ``.grad`` is a view of its bucket's buffer (allocated once):
:meth:`GradBuckets.start` points the grads there (zeroed), the backward accumulates
into the bucket in place and the all-reduce works on it in place — no gradient is
copied in or out, and gradients take no memory beside the buckets. A parameter
that got no gradient this step holds zeros (every replica sums the same layout).
Only a ``reduce_dtype`` other than the parameters' needs the copies (a cast in and
out), and a ``.grad`` someone replaced is copied into its view once, then pointed back.

Buckets are posted strictly in bucket order, so every replica issues the same
collectives in the same order. The result is the same, element for element, as
one all-reduce of all grads concatenated: each element is summed over the same
ranks and divided by the same count; the bytes counted under ``dp_grad`` are
the same too, spread over several calls.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from parallel4d.distributed import comm

WHAT = "gradient all-reduce over the data replicas (dp·sp)"


class _Bucket:
    """Some parameters of one dtype and a flat buffer ``[Σ numel]`` as long as their elements;
    ``views``: each parameter's slice of it, shaped like the parameter, which becomes its ``.grad``
    (None when the buffer's dtype or device differs from the parameters': then grads are cast in and out)."""

    def __init__(self, index: int, params: list[nn.Parameter], device: torch.device,
                 reduce_dtype: torch.dtype | None = None, group=None, label: str = "dp_grad"):
        self.index, self.params, self.group, self.label = index, params, group, label
        dtype = reduce_dtype or params[0].dtype
        self.flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views = None
        if dtype == params[0].dtype and all(p.device == self.flat.device for p in params):
            offsets = [0]
            for p in params:
                offsets.append(offsets[-1] + p.numel())
            self.views = [self.flat[a:b].view_as(p) for p, a, b in zip(params, offsets, offsets[1:])]
        self.ready = 0
        self.work = self.grads = None

    @property
    def full(self) -> bool:
        """Every parameter has all of this step's gradient contributions."""
        return self.ready == len(self.params)

    def attach(self) -> None:
        """Point every ``.grad`` at its view before the backward: zeros where it was None (after
        ``zero_grad()``: one fill of the buffer), kept where it already is the view (accumulation goes on)."""
        if self.views is None:
            return
        if all(p.grad is None for p in self.params):
            self.flat.zero_()
            for p, v in zip(self.params, self.views):
                p.grad = v
            return
        self._adopt()

    def _adopt(self) -> None:
        """A ``.grad`` that is not its view (set by someone else) is copied into the view, which
        becomes the grad again; a missing one becomes its view, zeroed."""
        for p, v in zip(self.params, self.views):
            if p.grad is v:
                continue
            if p.grad is not None:
                v.copy_(p.grad)
            else:
                v.zero_()
            p.grad = v

    def post(self, stats) -> None:
        """Post the async sum of the buffer over the bucket's group (in place); under a cast, copy the
        present grads in first."""
        if self.views is not None:
            self._adopt()
            self.work = comm.all_reduce(self.flat, self.group, stats=stats, label=self.label, async_op=True)
            return
        self.grads = [p.grad for p in self.params if p.grad is not None]
        n = sum(g.numel() for g in self.grads)
        offset = 0
        for g in self.grads:
            self.flat[offset:offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        if n:
            self.work = comm.all_reduce(self.flat[:n], self.group, stats=stats, label=self.label, async_op=True)

    def unpack(self, replicas: int) -> None:
        """Divide the summed buffer by ``replicas`` (under a cast: and copy it back into the grads)."""
        if self.views is not None:
            self.flat /= replicas
            return
        n = sum(g.numel() for g in self.grads)
        flat = self.flat[:n]
        flat /= replicas
        offset = 0
        for g in self.grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _split(params: list[nn.Parameter], bucket_bytes: float, kind=lambda p: None) -> list[list[nn.Parameter]]:
    """Consecutive runs of one dtype and one ``kind`` (the group a parameter is summed over), each closed
    once it holds ``bucket_bytes``."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if not out or size >= bucket_bytes or p.dtype != out[-1][0].dtype or kind(p) != kind(out[-1][0]):
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel() * p.element_size()
    return out


class GradBuckets:
    """Bucketed async gradient all-reduce over ``mesh.group_over("dp", "sp")``, posted from
    gradient hooks. Per step: :meth:`start` before the backward, :meth:`finish` after it.
    ``sum_over``: ``(group, label, parameters)`` summed over ``group`` instead (counted under ``label``),
    still divided by the ``dp·sp`` replicas: an expert's gradient over the ranks holding that expert."""

    def __init__(self, params: Iterable[nn.Parameter], mesh, *, bucket_bytes: float, timeout_s: float,
                 expected: dict[int, int], deferred: Iterable[nn.Parameter] = (),
                 reduce_dtype: torch.dtype | None = None, sum_over: tuple | None = None):
        params = list({id(p): p for p in params}.values())
        skip = {id(p) for p in deferred}
        self.mesh, self.timeout_s = mesh, timeout_s
        self.group = mesh.group_over("dp", "sp")
        self.replicas = mesh.size("dp") * mesh.size("sp")
        other_group, other_label, others = sum_over if sum_over is not None else (None, None, ())
        other = {id(p) for p in others}

        def kind(p):
            return id(p) in other

        early = [p for p in reversed(params) if id(p) not in skip]
        late = [p for p in reversed(params) if id(p) in skip]
        groups = _split(early, bucket_bytes, kind) + _split(late, bucket_bytes, kind)
        self.buckets = [_Bucket(i, ps, mesh.device, reduce_dtype,
                                *((other_group, other_label) if kind(ps[0]) else (self.group, "dp_grad")))
                        for i, ps in enumerate(groups)]
        self._where = {id(p): b for b in self.buckets for p in b.params}
        self._expected = {id(p): (0 if id(p) in skip else expected.get(id(p), 1)) for p in params}
        self._counts: dict[int, int] = {}
        self._next = 0
        self._armed = False
        self.posted_in_backward = 0  # buckets posted from a hook, this step (tests, benchmarks)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in early]

    def start(self) -> None:
        """Arm the hooks for one step's backward; the grads become views of the buckets."""
        for b in self.buckets:
            b.ready, b.work, b.grads = 0, None, None
            b.attach()
        self._counts = {}
        self._next = 0
        self.posted_in_backward = 0
        self._armed = True

    def _hook(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        count = self._counts.get(id(p), 0) + 1
        self._counts[id(p)] = count
        bucket = self._where[id(p)]
        if count > self._expected[id(p)]:
            raise RuntimeError(f"a parameter of gradient bucket {bucket.index} got gradient contribution {count} "
                               f"of {self._expected[id(p)]} expected this step, after its bucket was all-reduced")
        if count == self._expected[id(p)]:
            bucket.ready += 1
            while self._next < len(self.buckets) and self.buckets[self._next].full:
                self._post_next()
                self.posted_in_backward += 1

    def _post_next(self) -> None:
        self.buckets[self._next].post(self.mesh.comm_stats)
        self._next += 1

    def finish(self) -> None:
        """Post the rest, wait for every bucket (``timeout_s`` each), average (in ``.grad``: the buckets' views)."""
        self._armed = False
        while self._next < len(self.buckets):
            self._post_next()
        n = len(self.buckets)
        for b in self.buckets:
            what = WHAT if b.group is self.group else f"{b.label} all-reduce over the ranks holding the same parameters"
            comm.wait(b.work, self.timeout_s, f"{what}, bucket {b.index + 1} of {n}", self.mesh.deadlines)
        for b in self.buckets:  # every bucket, even one summed over a group of one (no work): the same divisor
            b.unpack(self.replicas)

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []
