"""Where every parameter lives: unique parameters in module order, packed into rows of chunks.

A *row* is one packing of parameters into ``C`` elements; its mirrored chunks (P, G, M, V
and, under ZeRO, the shards PS, GS) share that layout. Trainable and frozen parameters
get rows of their own (frozen rows have no G, M, V). Pure planning: no chunk exists yet.
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


@dataclass(eq=False)
class Layout:
    """The packing of one model: rows of ``C`` elements, each split into ``dp`` shards of ``Sz``."""

    C: int
    dp: int
    dtype: torch.dtype  # the parameters' (the master copy's)
    rows: list[Row]
    records: list[ParamRecord]
    module_params: dict[nn.Module, list[nn.Parameter]]  # modules with direct parameters
    by_param: dict[int, ParamRecord]  # id(param) → record
    cdtype: torch.dtype = None  # the device chunks' (compute copy); None: ``dtype``

    def __post_init__(self):
        self.cdtype = self.cdtype or self.dtype

    @property
    def mixed(self) -> bool:
        """A compute copy in another dtype than the master (16-bit chunks, master on the host)."""
        return self.cdtype != self.dtype

    @property
    def Sz(self) -> int:
        return self.C // self.dp

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


def plan_layout(model: nn.Module, chunk_elems: Optional[int], dp: int,
                compute_dtype: Optional[torch.dtype] = None) -> Layout:
    """Pack ``model``'s parameters into rows; ``chunk_elems`` (``hetero.chunk_elems``) or searched;
    ``compute_dtype``: the device chunks' dtype (None: the parameters')."""
    order, names, module_params = unique_params(model)
    dtype = common_dtype(order)
    if compute_dtype is not None and (not compute_dtype.is_floating_point
                                      or compute_dtype.itemsize > dtype.itemsize):
        raise ValueError(f"hetero.compute_dtype={compute_dtype} is wider than the parameters ({dtype}); "
                         "use a narrower floating dtype or leave it unset")
    C = choose_chunk_elems([p.numel() for p in order], chunk_elems, dp)
    rows, records = pack_rows(order, names, C)
    return Layout(C, dp, dtype, rows, records, module_params, {id(r.param): r for r in records}, compute_dtype)


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


def pack_rows(order: list[nn.Parameter], names: dict[int, list[str]], C: int):
    """``(rows, records)``: trainable parameters first, then frozen ones, in order."""
    trainable = [p for p in order if p.requires_grad]
    frozen = [p for p in order if not p.requires_grad]
    rows: list[Row] = []
    records: list[ParamRecord] = []
    for group, is_tr in ((trainable, True), (frozen, False)):
        for chunk_list in pack([p.numel() for p in group], C, ALIGN):
            row = Row(len(rows), is_tr)
            for i, off in chunk_list:
                p = group[i]
                rec = ParamRecord(p, names[id(p)], row.index, len(row.records), is_tr, tuple(p.shape), off)
                row.records.append(rec)
                records.append(rec)
            rows.append(row)
    return rows, records
