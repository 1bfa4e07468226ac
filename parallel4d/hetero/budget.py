"""The compute device and how many chunk slots its budget buys.

Two pools of slots: ``main`` (``C`` elements: P and G of every row, and M, V at dp = 1) and,
under ZeRO, ``shard`` (``C/dp`` elements: 4 slots for the optimizer's PS, GS, M, V of one row; under
16-bit chunks 1, for GS: the optimizer works on the host) — and one more such pool, ``shard1`` of ``C/n``
elements, for rows sharded over a smaller replica set of ``n`` ranks (expert parallelism's experts).
Slots are in the chunks' (compute) dtype.
A budget below what one module or one optimizer row pins at once is refused up front.

Under 16-bit chunks the budget also says how many rows keep their master state (``W``, ``M``, ``V`` in
the parameters' dtype: :mod:`.master`) on the device — PatrickStar's order: every compute chunk gets a
slot first, the optimizer state takes what is left. No budget: every row; a static budget: what is left
after the arena, in whole rows; a dynamic one: decided after the warm-up, from the traced non-model peak
(:func:`device_rows_after_warmup`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from parallel4d.config.rules.hetero import SHARD_SLOTS
from parallel4d.config.schema import HeteroConfig
from parallel4d.hetero.layout import Layout, shard_pool


@dataclass
class Budget:
    """``pools``: ``{name: (slot elements, slots)}``; ``cap``: the byte budget (None = all
    resident); ``dynamic_capacity``: device bytes for model and non-model data, if dynamic;
    ``master_rows``: under 16-bit chunks, the trainable rows whose master state the device holds
    (None: chosen after the warm-up, under a dynamic budget)."""

    pools: dict[str, tuple[int, int]]
    cap: Optional[int]
    dynamic_capacity: Optional[int]
    master_rows: Optional[int] = 0


def resolve_device(spec: str, mesh=None) -> torch.device:
    """``hetero.compute_device`` as a device; ``auto`` is the mesh's device (where its collectives
    run), or without a mesh CUDA's current device when there is one, else the CPU."""
    if spec == "auto":
        if mesh is not None:
            return torch.device(mesh.device)
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"hetero.compute_device={spec!r} but CUDA is not available; use 'cpu' or 'auto'")
        d = torch.device(spec)
        return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
    raise ValueError(f"hetero.compute_device={spec!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")


def replica_count(cfg: HeteroConfig, device: torch.device, mesh) -> int:
    """The mesh's ``dp`` size (1 without a mesh), after the rules data replicas impose."""
    dp = mesh.size("dp") if mesh is not None else 1
    if dp > 1 and device.type != torch.device(mesh.device).type:
        # ZeRO's collectives take chunks on the compute device: NCCL refuses host tensors.
        raise ValueError(f"hetero.compute_device={cfg.compute_device!r} computes on {device} but the data "
                         f"replicas communicate on {mesh.device}; use hetero.compute_device=auto")
    if dp > 1 and cfg.dynamic_budget:
        raise ValueError("hetero.dynamic_budget=true is not supported with parallel.dp>1 (every dp rank must "
                         "make the same eviction decisions); use hetero.dynamic_budget=false")
    return dp


def plan_budget(layout: Layout, cfg: HeteroConfig, device: torch.device) -> Budget:
    """The slots of each pool; ``ValueError`` naming the minimum when the budget is too small."""
    cap, dynamic_capacity = _capacity(cfg, device)
    shards = shard_pools(layout)
    # chunks in the main pool: P(+G) per row (ZeRO keeps M, V in the shard pool, 16-bit chunks on the host)
    main_chunks = len(layout.rows) + layout.trainable_rows * (1 if layout.dp > 1 or layout.mixed else 3)
    main_slots = main_chunks if cap is None else _main_slots(layout, cap, main_chunks, shards)
    pools = {"main": (layout.C, main_slots), **shards}
    arena = (main_slots * layout.C + _elems(shards)) * layout.cdtype.itemsize
    return Budget(pools, cap, dynamic_capacity, _master_rows(layout, cap, dynamic_capacity, arena,
                                                            main_slots == main_chunks))


def shard_pools(layout: Layout) -> dict[str, tuple[int, int]]:
    """Under ZeRO, ``{pool: (C/n, slots)}`` for each replica set of ``n`` ranks some row is sharded over
    (``shard``: every data replica; ``shard1``: a smaller set); {} at dp = 1."""
    if layout.dp == 1:
        return {}
    slots = 1 if layout.mixed else SHARD_SLOTS  # mixed: GS only
    return {shard_pool(i): (layout.C // layout.replicas[i], slots) for i in layout.sets_used()}


def _elems(pools: dict[str, tuple[int, int]]) -> int:
    return sum(elems * slots for elems, slots in pools.values())


def master_row_bytes(layout: Layout) -> int:
    """A trainable row's master state on one rank at most: ``W``, ``M``, ``V`` of its ``[C/n]`` window (``n``:
    its replica set's size; the smallest set's, whose windows are the widest)."""
    return 3 * max(layout.shard_elems(row) for row in layout.rows) * layout.dtype.itemsize


def _master_rows(layout: Layout, cap: Optional[int], dynamic: Optional[int], arena: int, all_slots: bool):
    """The trainable rows whose master state fits on the device beside the arena (16-bit chunks)."""
    if not layout.mixed:
        return 0
    if dynamic is not None:
        return None
    if cap is None:
        return layout.trainable_rows
    if not all_slots:  # the compute chunks come first: a budget short of them has nothing left
        return 0
    return min(layout.trainable_rows, max(0, cap - arena) // master_row_bytes(layout))


DYNAMIC_MARGIN = 0.8  # PatrickStar's share of the margin a dynamic budget gives the optimizer state


def device_rows_after_warmup(layout: Layout, capacity: int, nonmodel_peak: int, arena: int) -> int:
    """Under a dynamic budget: the trainable rows whose master state goes to the device once the warm-up
    has traced the non-model peak, ``0.8 · (capacity − non-model peak − arena) / row`` as PatrickStar
    sizes its device optimizer chunks (the share left for the non-model data's variation)."""
    margin = capacity - nonmodel_peak - arena
    return min(layout.trainable_rows, max(0, int(DYNAMIC_MARGIN * margin) // master_row_bytes(layout)))


def _capacity(cfg: HeteroConfig, device: torch.device) -> tuple[Optional[int], Optional[int]]:
    """``(budget bytes, dynamic capacity)``: a dynamic budget without a size takes 90% of the GPU."""
    cap = cfg.device_budget_bytes
    if not cfg.dynamic_budget:
        return cap, None
    if cap is None:
        if device.type != "cuda":
            raise ValueError("hetero.dynamic_budget=true on the CPU needs hetero.device_budget_bytes "
                             "(the device capacity for model and non-model data)")
        cap = int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    return cap, cap


def _main_slots(layout: Layout, cap: int, main_chunks: int, shards: dict[str, tuple[int, int]]) -> int:
    esize = layout.cdtype.itemsize
    chunk_bytes = layout.C * esize
    shard_bytes = _elems(shards) * esize
    static_min = static_min_slots(layout)
    main_slots = min(main_chunks, (cap - shard_bytes) // chunk_bytes)
    if main_slots < static_min:
        need = static_min * chunk_bytes + shard_bytes
        shards = "".join(f" plus {slots} ZeRO shard slots of {elems * esize} bytes"
                         for elems, slots in shards.values())
        raise ValueError(
            f"hetero.device_budget_bytes={cap} is too small: this model needs at least {static_min} "
            f"chunks of {chunk_bytes} bytes on the device at once{shards}, i.e. the minimum feasible value "
            f"is at least {need}; use hetero.device_budget_bytes≥{need}")
    return main_slots


def static_min_slots(layout: Layout) -> int:
    """Lower bound on main-pool slots: the optimizer pins P, G, M, V of one row (under
    ZeRO it works in the shard pool, under 16-bit chunks on the host); a module pins the chunks of its parameters, plus
    one gradient chunk while a gradient is written."""
    spans = []
    for params in layout.module_params.values():
        rows = {layout.by_param[id(p)].row for p in params}
        spans.append(len(rows) + (1 if any(p.requires_grad for p in params) else 0))
    opt = 4 if layout.trainable_rows and layout.dp == 1 and not layout.mixed else 0
    return max([opt, 1] + spans)
