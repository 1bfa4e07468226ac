"""Tokens to the experts they chose and back: on one rank, or over the ``ep`` ranks that share the experts.

A mixture-of-experts layer routes each of its ``T`` tokens to ``k`` of ``E`` experts (``ids [T, k]``,
with the router's ``weights [T, k]``) and returns ``Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])``.
Both dispatchers here compute exactly that; they differ in where the experts are:

* :class:`OneRank` (:func:`dispatch_local`): every expert on this rank. The ``T·k`` (token, choice) slots are sorted by
  expert (a stable sort: within an expert, token order), the experts run on contiguous row blocks,
  the rows go back to their slots and are summed with their weights.
* :class:`ExpertParallel`: the experts split over the ``n`` ranks of an ep group, rank ``r`` holding
  experts ``[r·E/n, (r+1)·E/n)``. After the same sort, the rows for rank ``r``'s experts are one
  contiguous block; one all-to-all sends each block to its rank, where the rows (arriving source by
  source, each source's sorted by expert) are regrouped expert by expert, run, put back in arrival
  order and returned by the inverse all-to-all. Dropless: every slot reaches its expert, however
  uneven the load.

The experts themselves are the caller's :class:`ExpertFn`: rows grouped by expert and the per-expert
row counts, as a device tensor (a grouped matrix product takes them as offsets without reading them;
a loop over experts reads them once).

Host reads: the all-to-all's split sizes must be host integers, so :class:`ExpertParallel` reads once
per call — this rank's rows per destination and per source, together (the counts it receives come by a
small equal-split all-to-all first). :func:`dispatch_local` reads nothing.

Agreed experts (:class:`Agreement`, a dispatcher's ``agreement``; the engine sets it under hetero): the experts
run are then decided on the host, the same on every rank of a group — an expert runs (and its weights are
touched) when it has rows on some rank of the group, at the same local position (the ranks may hold
different experts). hetero moves an expert's chunks only when it runs, and every rank of its ZeRO group must
make the same chunk accesses (its all-gathers, reduce-scatters and evictions match only then); the counts'
max over the group is read with what the dispatcher reads anyway — still one host read per call
(:func:`dispatch_local` then reads once too) — and handed to ``expert_fn`` as :class:`HostCounts`.

Autograd: the all-to-alls' gradient is the inverse all-to-all (:class:`AllToAllRows`); everything else is
indexing, differentiable as it is. An expert's gradient on its rank therefore sums the contributions
of every rank's tokens in the ep group: whoever reduces gradients over data replicas must sum expert
parameters over the ranks that hold the same experts (not over ep) with the same divisor as the
dense parameters.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from parallel4d.distributed import comm

#: the label of the token all-to-alls in :class:`~parallel4d.distributed.comm.CommStats`
A2A = "experts.all_to_all"
#: the label of the small all-to-all of the per-expert counts
COUNTS = "experts.counts"
#: the label of the counts' max over an :class:`Agreement`'s group
AGREE = "experts.agree"


class Dispatcher(Protocol):
    """Where a mixture-of-experts layer's experts are: ``dispatcher(x [T, h], ids [T, k], weights [T, k],
    expert_fn, counts) → [T, h]`` (:class:`OneRank`, :class:`ExpertParallel`); ``counts``: the caller's
    :func:`count_per_expert` of ``ids`` (the layer counts once, for the dispatch and the load-balancing
    loss alike), None to count here. ``experts``: the global indices of the experts ``expert_fn``
    applies, numbered from 0 there."""

    experts: range

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert_fn: "ExpertFn",
                 counts: torch.Tensor | None = None) -> torch.Tensor: ...


class HostCounts(NamedTuple):
    """An :class:`Agreement`'s host read for ``E_local`` experts: ``rows`` (this rank's rows per expert, the
    device ``counts`` on the host) and ``used`` (whether the expert has rows on some rank of the group: it
    runs, on zero rows here if need be)."""

    rows: list[int]
    used: list[bool]


class Agreement:
    """The ranks of ``group`` (None: this rank alone) run the same experts, by local position: the max of
    their ``[E_local]`` counts, read with the dispatcher's other host values (:class:`HostCounts`)."""

    def __init__(self, group=None, stats: comm.CommStats | None = None):
        self.group, self.stats = group, stats

    def most(self, counts: torch.Tensor) -> torch.Tensor:
        """``[E_local]``: each position's largest count over the group (on the device)."""
        most = counts.clone()
        if self.group is not None:
            comm.all_reduce(most, self.group, op=dist.ReduceOp.MAX, stats=self.stats, label=AGREE)
        return most

    @staticmethod
    def host(values: list[int], local: int) -> HostCounts:
        """The last ``2·local`` of ``values`` (this rank's counts, then the group's max) as :class:`HostCounts`."""
        rows, most = values[len(values) - 2 * local:len(values) - local], values[len(values) - local:]
        return HostCounts(rows, [m > 0 for m in most])


class ExpertFn(Protocol):
    """Experts applied to rows grouped by expert: ``x [N, h]`` (expert ``e``'s ``counts[e]`` rows after
    expert ``e-1``'s), ``counts [E_local]`` int64 on ``x``'s device (Σ = N) → ``[N, h_out]``; ``host``: the
    :class:`HostCounts` of an :class:`Agreement` (None without one): run exactly the ``used`` experts."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, host: HostCounts | None = None) -> torch.Tensor: ...


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: how many of ``ids`` (any shape) name each expert. A scatter-add into ``E`` zeros, not
    ``torch.bincount``, whose output size depends on the largest id: on a GPU it reads that back (a host
    sync per call)."""
    flat = ids.reshape(-1)  # (out of place: a plan's dry run answers this one op with an assumed load)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add(0, flat, torch.ones_like(flat))


def sort_by_expert(ids: torch.Tensor, num_experts: int,
                   counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [T·k], counts [E])``: the flat slots ``t·k + j`` ordered by expert (stable), and how many
    slots each expert has (``counts`` when the caller counted them already). ``ids [T, k]`` int64."""
    return torch.argsort(ids.reshape(-1), stable=True), count_per_expert(ids, num_experts) if counts is None else counts


def combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[T, h]``: the sorted slots' outputs ``rows [T·k, h]`` put back at ``order`` and summed over each
    token's ``k`` choices with ``weights [T, k]``."""
    t, k = weights.shape
    slots = rows.new_empty(rows.shape).index_copy(0, order, rows)
    return (slots.view(t, k, rows.shape[-1]) * weights.unsqueeze(-1).to(rows.dtype)).sum(1)


def dispatch_local(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                   expert_fn: ExpertFn, counts: torch.Tensor | None = None,
                   agreement: Agreement | None = None) -> torch.Tensor:
    """``[T, h]`` from ``x [T, h]`` with every expert on this rank (no host read; with an ``agreement``, one:
    the counts and their max over its group); ``counts``: as :class:`Dispatcher`'s."""
    order, counts = sort_by_expert(ids, num_experts, counts)
    if agreement is None:
        rows = expert_fn(x[order // ids.shape[1]], counts)
    else:
        host = Agreement.host(torch.cat([counts, agreement.most(counts)]).tolist(), num_experts)  # the one read
        rows = expert_fn(x[order // ids.shape[1]], counts, host)
    return combine(rows, order, weights)


class OneRank:
    """Every one of ``num_experts`` experts on this rank (:func:`dispatch_local`); ``agreement``: see
    :class:`Agreement` (None: off)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.experts = range(num_experts)
        self.agreement: Agreement | None = None

    def __call__(self, x, ids, weights, expert_fn: ExpertFn, counts=None) -> torch.Tensor:
        if self.agreement is None:
            return dispatch_local(x, ids, weights, self.num_experts, expert_fn, counts)
        return _agreed_local(x, ids, weights, self.num_experts, expert_fn, counts, self.agreement)


#: with an agreement, a collective and a host read: eager under train.compile: blocks (a graph break)
_agreed_local = comm.eager(dispatch_local)


class AllToAllRows(torch.autograd.Function):
    """:func:`comm.all_to_all_v` whose gradient is the inverse all-to-all (the splits swapped):
    ``AllToAllRows.apply(x, send, recv, group, stats)``."""

    @staticmethod
    def forward(ctx, x, send, recv, group, stats):
        ctx.cfg = (send, recv, group, stats)
        return comm.all_to_all_v(x, send, recv, group, stats=stats, label=A2A)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, stats = ctx.cfg
        return comm.all_to_all_v(grad.contiguous(), recv, send, group, stats=stats, label=A2A), None, None, None, None


class ExpertParallel:
    """The ``num_experts`` experts split evenly over ``group``'s ranks; :meth:`__call__` dispatches.

    ``group``: the ep process group (its size divides ``num_experts``; the config's rules refuse other
    layouts before anything runs); ``stats``: the mesh's :class:`~parallel4d.distributed.comm.CommStats`."""

    def __init__(self, num_experts: int, group, stats: comm.CommStats | None = None):
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts do not split over {self.size} expert-parallel ranks: "
                             "choose parallel.ep dividing the expert count")
        self.num_experts, self.group, self.stats = num_experts, group, stats
        self.local = num_experts // self.size
        self.agreement: Agreement | None = None  # see Agreement

    @property
    def experts(self) -> range:
        """The experts this rank holds."""
        return range(self.rank * self.local, (self.rank + 1) * self.local)

    @comm.eager  # under train.compile: blocks a graph break: its collectives and host read stay eager
    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert_fn: ExpertFn,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, h]`` from ``x [T, h]``, ``ids [T, k]`` (global expert indices), ``weights [T, k]``;
        ``expert_fn`` applies this rank's experts (:attr:`experts`, numbered from 0); ``counts``: as
        :class:`Dispatcher`'s."""
        if self.size == 1:
            return dispatch_local(x, ids, weights, self.num_experts, expert_fn, counts, self.agreement)
        n, local = self.size, self.local
        order, counts = sort_by_expert(ids, self.num_experts, counts)
        arriving = self._exchange_counts(counts)  # [n, local]: from source s, rows for local expert e
        mine = arriving.sum(0)  # [local]: rows for each of this rank's experts
        agreed = [] if self.agreement is None else [mine, self.agreement.most(mine)]
        splits = torch.cat([counts.view(n, local).sum(1), arriving.sum(1), *agreed]).tolist()  # the one host read
        send, recv = splits[:n], splits[n:2 * n]
        rows = AllToAllRows.apply(x[order // ids.shape[1]], send, recv, self.group, self.stats)
        regroup = self._regroup(arriving, sum(recv))
        if self.agreement is None:
            out = expert_fn(rows[regroup], mine)
        else:
            out = expert_fn(rows[regroup], mine, Agreement.host(splits, local))
        back = out[torch.argsort(regroup)]  # arrival order again (the inverse permutation)
        return combine(AllToAllRows.apply(back, recv, send, self.group, self.stats), order, weights)

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``[n, local]``: how many rows each source sends for each of this rank's experts (an equal-split
        all-to-all of the ``[E]`` counts, on the device)."""
        return comm.all_to_all(counts.view(self.size, self.local), self.group, scatter_dim=0, gather_dim=0,
                               stats=self.stats, label=COUNTS)

    def _regroup(self, arriving: torch.Tensor, total: int) -> torch.Tensor:
        """``[N]``: the arrival-ordered rows (source-major, each source's by expert) reordered expert-major
        (stable: within an expert, by source)."""
        expert_of_block = torch.arange(self.local, device=arriving.device).repeat(self.size)
        expert_of_row = torch.repeat_interleave(expert_of_block, arriving.reshape(-1), output_size=total)
        return torch.argsort(expert_of_row, stable=True)
