"""``HeteroRuntime``: the chunks, hooks and optimizer arithmetic behind one wrapped model.

Built in this order: compute device and data replicas (:mod:`.budget`) → the packing of the
parameters into rows (:mod:`.layout`) → the budget's slots and the :class:`ChunkManager` →
ZeRO's shards (:mod:`.zero`) → the chunks, filled with the parameters (:mod:`.populate`) →
saved-tensor relocation (:mod:`.saved`), Adam over rows (:mod:`.step`), full state
(:mod:`.state`) → the module hooks that drive residency (:mod:`.residency`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from parallel4d.config.schema import HeteroConfig, OptimizerConfig
from parallel4d.distributed import comm
from parallel4d.hetero.budget import Budget, device_rows_after_warmup, plan_budget, replica_count, resolve_device
from parallel4d.hetero.layout import Layout, plan_layout
from parallel4d.hetero.manager import ChunkManager
from parallel4d.hetero.master import DEVICE, HOST, HostUpdates, MasterState
from parallel4d.hetero.populate import add_chunks, move_buffers, move_params_into_chunks
from parallel4d.hetero.residency import Residency
from parallel4d.hetero.saved import SavedTensors
from parallel4d.hetero.state import FullState
from parallel4d.hetero.step import RowAdam
from parallel4d.hetero.zero import ReplicaSet, ZeroShards

# per-iteration history entries that are per-moment lists or chunk sets, not counters
_TRACE_KEYS = ("trace", "live", "write", "nonmodel", "start_resident", "start_dirty",
              "end_resident", "live_at_end")


class HeteroRuntime:
    """Chunks, hooks and the optimizer arithmetic behind one wrapped model."""

    def __init__(self, model: nn.Module, opt_cfg: OptimizerConfig, cfg: HeteroConfig, mesh=None,
                 compute_dtype: torch.dtype | None = None, partial=None, zero_grad_steps=()):
        self.model, self.cfg, self.mesh = model, cfg, mesh
        self.device = resolve_device(cfg.compute_device, mesh)
        self.dp = replica_count(cfg, self.device, mesh)
        self.group = mesh.group("dp") if self.dp > 1 else None
        self.dp_rank = mesh.rank("dp") if self.dp > 1 else 0
        # parameters a smaller replica set holds (wrap's partial_replicas): rows of their own under ZeRO
        self.partial = partial_set(partial) if self.dp > 1 and partial is not None else None
        ids = frozenset(id(p) for p in partial[0]) if self.partial is not None else frozenset()
        self.layout = plan_layout(model, cfg.chunk_elems, self.dp, compute_dtype,
                                  (ids, self.partial.size) if self.partial is not None else None)
        self.rows, self.records, self.C = self.layout.rows, self.layout.records, self.layout.C
        self.budget = plan_budget(self.layout, cfg, self.device)
        self.mgr = self._manager(cfg, self.budget)
        self.zero = ZeroShards(self.mgr, self.C, self.dp, self.dp_rank, self.group, mesh, self.partial)
        # 16-bit chunks: the master parameters and Adam moments of each row on the device or the host
        # (placement: .budget; host rows updated by a worker beside the training thread)
        self.updates = HostUpdates(self.mgr.transfers.note, getattr(mesh, "timeout_s", None) or 1800.0)
        self.master = (MasterState(self.layout, self.zero.window_of, self.mgr.transfers, self.device, self.updates)
                       if self.layout.mixed else None)
        add_chunks(self.layout, self.mgr, self.zero, self.master)
        # every chunk's bytes: what the device would hold with all of them resident
        self.model_data_bytes = sum(c.capacity for c in self.mgr.chunks) * self.mgr.esize
        # the chunks' backings and the host rows' master state, row by row as the parameters' storage goes
        move_params_into_chunks(self.layout, self.mgr, self.zero, self.device, self.master,
                                frozenset(first_trainable(self.layout, self.budget.master_rows or 0)))
        widest = max(self.layout.shard_elems(row) for row in self.rows)
        self.staging_bytes = self.mgr.transfers.allocate_staging(widest) if self.master else 0
        # a dry run's fake tensors belong to its thread's fake mode: the worker could not touch them
        self.updates.inline = self.master is not None and any(is_fake(w) for w in self.master.W.values())
        self._placed = False  # the master rows re-chosen from the warm-up trace (after the first step)
        self._reserve()
        move_buffers(model, self.device)
        self.saved = SavedTensors(self.mgr)
        # host Adam for rows not resident: on CUDA it saves the PCIe round trip; on the CPU nothing
        # (16-bit chunks: the host rows' master is only there)
        host = "fused" if self.device.type == "cuda" else "exact" if self.master else "off"
        self.adam = RowAdam(self.layout, self.mgr, self.zero, host, self.master, self.updates, zero_grad_steps)
        self.full = FullState(self.layout, self.mgr, self.zero, self.master)
        self.residency = Residency(self.layout, self.mgr, self.saved, self.zero)
        self.residency.on_grad_write = self.adam.note_grad_write
        self.handles = self.residency.install(model) + self.full.install(model)

    @property
    def host_bytes(self) -> int:
        """Host bytes hetero holds: the chunks' backings (P, G, M, V of every row at dp = 1; under ZeRO the
        shards), the host rows' master state and the upload staging ring."""
        master = self.master.bytes_on(HOST) if self.master else 0
        return self.mgr.host_bytes + master + self.staging_bytes

    @property
    def host_transient_bytes(self) -> int:
        """The largest temporary hetero makes in host memory besides :attr:`host_bytes`: a row's ``[C]``
        in the parameters' dtype while the model moves into the chunks (:mod:`.populate`). An update's
        gradient piece in the master's dtype (16-bit chunks: at most :data:`.master.PIECE` elements of a
        row's ``[C/dp]`` window) is no larger."""
        return self.C * self.layout.dtype.itemsize

    def _reserve(self) -> None:
        """The device rows' master state is device memory outside the arena (a dynamic budget's business)."""
        self.mgr.reserved_bytes = self.master.bytes_on(DEVICE) if self.master else 0

    def _place_from_trace(self) -> None:
        """After the warm-up: the rows whose master state the device holds, chosen in the traced forward
        order (the first layers first: their gradients are final last and the next forward needs them
        first), as many as the budget leaves (a dynamic one: from the traced non-model peak)."""
        self._placed = True
        order = forward_order(self.layout, self.mgr.trace.ref)
        self.adam.order = order
        n = self.budget.master_rows
        if n is None:
            n = device_rows_after_warmup(self.layout, self.mgr.dynamic_capacity,
                                         max(self.mgr.trace.ref_nonmodel, default=0), self.mgr.arena_bytes)
        trainable = [i for i in order if self.layout.rows[i].trainable]
        on_device = set(trainable[:n])
        for i in sorted(trainable, key=lambda i: i in on_device):  # off the device first: room for what comes
            self.master.move(self.layout.rows[i], DEVICE if i in on_device else HOST)
        self._reserve()

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.updates.close()

    def _manager(self, cfg: HeteroConfig, budget: Budget) -> ChunkManager:
        return ChunkManager(self.device, self.layout.cdtype, budget.pools, policy=cfg.policy,
                            dynamic_capacity=budget.dynamic_capacity, nonmodel_fn=self._nonmodel_bytes,
                            budget_bytes=budget.cap)

    def _nonmodel_bytes(self) -> int:
        """Device bytes outside the chunk arena, for the dynamic budget (on the CPU: saved activations)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self.mgr.arena_bytes - self.mgr.reserved_bytes
        return self.saved.bytes

    @property
    def host_optimizer(self) -> str:
        """Where rows not fully resident take their Adam step: "fused", "exact" or "off" (load them)."""
        return self.adam.host_optimizer

    @host_optimizer.setter
    def host_optimizer(self, mode: str) -> None:
        self.adam.host_optimizer = mode

    # --- what HeteroOptimizer calls ------------------------------------------------------------
    def optimizer_step(self, hp_of: dict[str, dict], grad_scale=None) -> None:
        """``hp_of``: per trainable parameter name, its ``lr, beta1, beta2, eps, weight_decay,
        decoupled``."""
        self.adam.step(hp_of, grad_scale)
        if self.master is not None and not self._placed and self.mgr.trace.valid:
            self._place_from_trace()

    def zero_grad(self) -> None:
        self.adam.zero_grad()

    # what reads a gradient's backing on the host waits for the host updates (the state: FullState waits)
    def grad_sq_norm(self, weights: dict[str, float] | None = None) -> torch.Tensor:
        self.updates.wait_all()
        return self.adam.grad_sq_norm(weights)

    def full_params(self) -> dict[str, torch.Tensor]:
        return self.full.params()

    def full_gradients(self) -> dict[str, torch.Tensor]:
        self.updates.wait_all()
        return self.full.gradients()

    def optimizer_state_dict(self, groups: list[dict]) -> dict:
        return self.full.optimizer(self.adam.steps, groups)

    def load_params(self, values: dict[str, torch.Tensor]) -> None:
        self.full.load_params(values)

    def load_optimizer_state_dict(self, sd: dict) -> None:
        self.full.load_optimizer(sd, self.adam.steps)

    # --- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        m = self.mgr
        last = m.history[-1] if m.history else None
        return {
            "model_data_bytes": self.model_data_bytes,
            "device_budget_bytes": m.budget_bytes,
            "arena_bytes": m.arena_bytes,
            "host_bytes": self.host_bytes,
            "params": self.layout.params,
            "host_bytes_per_param": self.host_bytes / self.layout.params,
            **self._frozen(),
            "host_transient_bytes": self.host_transient_bytes,
            "device_bytes_moved_per_step": last["moved_bytes"] if last else None,
            "compute_dtype": str(self.layout.cdtype).removeprefix("torch."),
            "master_dtype": str(self.layout.dtype).removeprefix("torch.") if self.master else None,
            "peak_resident_bytes": m.peak_resident_bytes,
            "min_feasible_budget_bytes": m.min_feasible_bytes(),
            "chunk_elems": self.C,
            "chunk_bytes": self.C * m.esize,
            "chunks": len(m.chunks),
            "rows": len(self.rows),
            "dp": self.dp,
            "policy": m.policy,
            "dynamic_budget": m.dynamic_capacity is not None,
            "compute_device": str(self.device),
            "pinned_host": m.transfers.pinned_host,
            "iterations": m.trace.iterations,
            "trace_divergences": m.trace.divergences,
            "reduce_scatters": dict(self.zero.reduce_scatters),
            "host_optimizer": self.host_optimizer,
            "host_optimizer_rows": self.adam.host_rows,
            "device_optimizer_rows": self.adam.device_rows,
            **self._placement(),
            "staging_bytes": self.staging_bytes,
            "bytes_moved": m.stats.moved_bytes,
            "total": m.stats.as_dict(),
            "last_iteration": {k: v for k, v in last.items() if k not in _TRACE_KEYS}
            if last else None,
        }

    def _frozen(self) -> dict:
        """The frozen rows' part (a LoRA base): their parameters and the host bytes of their chunks' backings
        (nothing else exists for them: no master, no moments, no gradient) — under 16-bit chunks 2 bytes
        per parameter plus the rows' padding, over dp under ZeRO."""
        rows = [row for row in self.rows if not row.trainable]
        host = sum(c.capacity for row in rows for c in (row.P, row.PS) if c is not None and c.backing is not None)
        params = sum(r.param.numel() for row in rows for r in row.records)
        return {"frozen_rows": len(rows), "frozen_params": params, "frozen_host_bytes": host * self.mgr.esize,
                "frozen_host_bytes_per_param": host * self.mgr.esize / params if params else None}

    def _placement(self) -> dict:
        """Where the master state is (16-bit chunks; None otherwise: Adam's moments are chunks then)."""
        m = self.master
        return {"optimizer_rows_on_device": m.rows_on(DEVICE) if m else None,
                "optimizer_rows_on_host": m.rows_on(HOST) if m else None,
                "optimizer_device_bytes": m.bytes_on(DEVICE) if m else None,
                "optimizer_host_bytes": m.bytes_on(HOST) if m else None,
                "host_update_seconds": self.updates.seconds}


def partial_set(partial) -> ReplicaSet:
    """``(params, group)`` (:func:`~parallel4d.hetero.wrap.wrap`'s ``partial_replicas``) → the replica set of
    ``group``, a process group whose ranks are data replicas holding the same values of ``params``."""
    _, group = partial
    size = comm.group_size(group)
    return ReplicaSet(size, comm.group_rank(group), group if size > 1 else None)


def first_trainable(layout: Layout, n: int) -> list[int]:
    """The first ``n`` trainable rows in module order (the placement before the warm-up has traced)."""
    return [row.index for row in layout.rows if row.trainable][:n]


def forward_order(layout: Layout, ref: list[int]) -> list[int]:
    """Row indices by their parameter chunk's first access in the trace ``ref`` (never accessed: last)."""
    first: dict[int, int] = {}
    for i, cid in enumerate(ref):
        first.setdefault(cid, i)
    return sorted((row.index for row in layout.rows), key=lambda i: first.get(layout.rows[i].P.cid, len(ref)))
