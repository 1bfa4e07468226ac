"""Where every parameter lives: unique parameters in module order, packed into rows of chunks.

A *row* is one packing of parameters into ``C`` elements; its mirrored chunks (P, G, M, V
and, under ZeRO, the shards PS, GS) share that layout. Trainable and frozen parameters
get rows of their own (frozen rows have no G, M, V), and so do parameters that only some of the
data replicas hold (``partial``: expert parallelism's expert slices, the same on the ranks of a smaller
replica set; ZeRO shards their rows over that set, :attr:`Row.replicas`). Pure planning: no chunk exists yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from parallel4d.config.rules.hetero import CHUNK_ALIGN as ALIGN
from parallel4d.hetero.chunk import Chunk, pack, round_up, search_chunk_elems



@dataclass(eq=False)
class ParamRecord:
    """One unique parameter: its names, chunk row and index inside the row."""

    param: nn.Parameter
    names: list[str]
    row: int
    k: int
    trainable: bool
    shape: tuple[int, ...]
    offset: int = 0
    placeholder: Optional[torch.Tensor] = None
    bwd_held: bool = False

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(eq=False)
class Row:
    """Mirrored chunks of one row: P (params) and, for trainable rows, G, M, V (+ ZeRO shards)."""

    index: int
    trainable: bool
    records: list[ParamRecord] = field(default_factory=list)
    P: Optional[Chunk] = None
    G: Optional[Chunk] = None
    M: Optional[Chunk] = None
    V: Optional[Chunk] = None
    PS: Optional[Chunk] = None  # ZeRO shards (dp > 1)
    GS: Optional[Chunk] = None
    replicas: int = 0  # the replica set ZeRO shards it over (Layout.replicas): 0 every data replica


@dataclass(eq=False)
class Layout:
    """The packing of one model: rows of ``C`` elements, each split into ``dp`` shards of ``Sz`` — or, a row
    of a smaller replica set (``row.replicas`` > 0), into ``replicas[row.replicas]`` shards
    (:meth:`shard_elems`)."""

    C: int
    dp: int
    dtype: torch.dtype  # the parameters' (the master copy's)
    rows: list[Row]
    records: list[ParamRecord]
    module_params: dict[nn.Module, list[nn.Parameter]]  # modules with direct parameters
    by_param: dict[int, ParamRecord]  # id(param) → record
    cdtype: torch.dtype = None  # the device chunks' (compute copy); None: ``dtype``
    replicas: list[int] = None  # each replica set's size: [dp] or [dp, the partial parameters' set]

    def __post_init__(self):
        self.cdtype = self.cdtype or self.dtype
        self.replicas = self.replicas or [self.dp]

    @property
    def mixed(self) -> bool:
        """A compute copy in another dtype than the master (16-bit chunks, master on the host)."""
        return self.cdtype != self.dtype

    @property
    def Sz(self) -> int:
        return self.C // self.dp

    def shard_elems(self, row: Row) -> int:
        """Elements of ``row``'s ZeRO shard: ``C`` over the size of its replica set."""
        return self.C // self.replicas[row.replicas]

    def sets_used(self) -> list[int]:
        """The replica sets some row is sharded over (0 first)."""
        return sorted({row.replicas for row in self.rows})

    @property
    def params(self) -> int:
        """Elements of the unique parameters (padding left out)."""
        return sum(r.param.numel() for r in self.records)

    @property
    def trainable_rows(self) -> int:
        return sum(r.trainable for r in self.rows)

    def row_of(self, p: nn.Parameter) -> tuple[ParamRecord, Row]:
        rec = self.by_param[id(p)]
        return rec, self.rows[rec.row]

    def check_idle(self, what: str) -> None:
        """``RuntimeError`` while a backward still holds parameters or pins chunks."""
        busy = [r.name for r in self.records if r.bwd_held]
        for row in self.rows:
            for c in (row.P, row.G):
                if c is not None and c.pinned:
                    busy.append(f"{c.kind}[{c.index}]")
        if busy:
            raise RuntimeError(f"hetero: {what} called while chunks are in use ({', '.join(busy[:5])}); "
                               "call it after loss.backward() has returned")


def shard_pool(replicas: int) -> str:
    """The pool of ZeRO shards of the rows of replica set ``replicas`` (their shards differ in size by set)."""
    return "shard" if replicas == 0 else f"shard{replicas}"


def plan_layout(model: nn.Module, chunk_elems: Optional[int], dp: int,
                compute_dtype: Optional[torch.dtype] = None, partial: tuple[frozenset, int] | None = None) -> Layout:
    """Pack ``model``'s parameters into rows; ``chunk_elems`` (``hetero.chunk_elems``) or searched;
    ``compute_dtype``: the device chunks' dtype (None: the parameters'); ``partial``: ``(ids of the
    parameters only a smaller replica set holds, that set's size)`` — rows of their own (set 1)."""
    order, names, module_params = unique_params(model)
    dtype = common_dtype(order)
    if compute_dtype is not None and (not compute_dtype.is_floating_point
                                      or compute_dtype.itemsize > dtype.itemsize):
        raise ValueError(f"hetero.compute_dtype={compute_dtype} is wider than the parameters ({dtype}); "
                         "use a narrower floating dtype or leave it unset")
    C = choose_chunk_elems([p.numel() for p in order], chunk_elems, dp)
    ids, size = partial if partial is not None else (frozenset(), None)
    rows, records = pack_rows(order, names, C, ids)
    return Layout(C, dp, dtype, rows, records, module_params, {id(r.param): r for r in records}, compute_dtype,
                  [dp] if size is None else [dp, size])


def unique_params(model: nn.Module):
    """``(order, names, module_params)``: each parameter once in module order, its names
    (tied ones have several), and the direct parameters of every module that has some."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    order: list[nn.Parameter] = []
    seen = set()
    module_params: dict[nn.Module, list[nn.Parameter]] = {}
    for _, mod in model.named_modules():
        direct = [p for p in mod._parameters.values() if p is not None]
        if direct:
            module_params[mod] = direct
        for p in direct:
            if id(p) not in seen:
                seen.add(id(p))
                order.append(p)
    if not order:
        raise ValueError("hetero: the model has no parameters")
    return order, names, module_params


def common_dtype(params: list[nn.Parameter]) -> torch.dtype:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"hetero: all parameters must share one floating dtype, got {sorted(map(str, dtypes))}; "
                         "cast the model first (e.g. model.float())")
    return next(iter(dtypes))


def choose_chunk_elems(numels: list[int], requested: Optional[int], dp: int) -> int:
    """``C``: searched when ``requested`` is None; a multiple of ``ALIGN·dp`` so that every
    shard is aligned, and at least the largest parameter (tensors never span chunks)."""
    step = ALIGN * dp
    if requested is None:
        return search_chunk_elems(numels, ALIGN, dp)
    C = int(requested)
    if C % step:
        raise ValueError(f"hetero.chunk_elems={C} must be a multiple of {ALIGN}·dp = {step}; "
                         f"use hetero.chunk_elems={round_up(C, step)}")
    if C < max(numels):
        raise ValueError(f"hetero.chunk_elems={C} is smaller than the largest parameter ({max(numels)} "
                         f"elements); use hetero.chunk_elems≥{round_up(max(numels), step)} "
                         "or leave it unset to search")
    return C


def pack_rows(order: list[nn.Parameter], names: dict[int, list[str]], C: int, partial: frozenset = frozenset()):
    """``(rows, records)``: trainable parameters first, then frozen ones, in order; those in ``partial``
    (ids) in rows of their own (replica set 1), after the others of their kind."""
    rows: list[Row] = []
    records: list[ParamRecord] = []
    for is_tr, replicas in ((True, 0), (True, 1), (False, 0), (False, 1)):
        group = [p for p in order if p.requires_grad == is_tr and (id(p) in partial) == bool(replicas)]
        for chunk_list in pack([p.numel() for p in group], C, ALIGN):
            row = Row(len(rows), is_tr, replicas=replicas)
            for i, off in chunk_list:
                p = group[i]
                rec = ParamRecord(p, names[id(p)], row.index, len(row.records), is_tr, tuple(p.shape), off)
                row.records.append(rec)
                records.append(rec)
            rows.append(row)
    return rows, records
