"""``wrap(model, optimizer_config, hetero_config, mesh=None)``: hand a model's data to chunks.

Hooks (module-level, on every module with direct parameters):

* forward pre-hook: the module's parameters → COMPUTE; ``param.data`` = a view into
  the chunk's device slot.
* forward hook: → HOLD_AFTER_FWD (HOLD without grad); ``param.data`` = a NaN placeholder
  of the right shape (expanded from one element, so stray reads show NaN and writes fail);
  a hook on each output that requires grad marks the *pre-backward* moment.
* pre-backward (output-gradient hook): parameters → COMPUTE until their gradient is
  written (``register_post_accumulate_grad_hook``: the gradient is copied/added into the
  grad chunk, ``p.grad = None``, parameter → HOLD_AFTER_BWD). Frozen parameters and
  anything still held are released by an end-of-backward callback.
* a forward pre-hook that runs *inside* backward is activation-checkpoint
  recomputation: its holds last until the backward hold is released, so the views the
  recomputation saved cannot be relocated before they are used.
* saved tensors (``saved_tensors_hooks`` around ``model.forward``) that alias a chunk
  slot are saved as ``(chunk, offset, size, stride)`` and rebuilt on the chunk's slot at
  unpack time (a saved ``weight.t()`` would otherwise read whatever chunk reuses the slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.distributed as dist
from pydantic import ValidationError

from .. import comm
from ..config import HeteroConfig, OptimizerConfig
from ..rules import did_you_mean
from .chunk import Chunk, TensorInfo, TensorState, pack, round_up, search_chunk_elems
from .manager import ChunkManager
from .optim import HeteroOptimizer, adam_update, fused_adam_update
from . import zero as Z

S = TensorState
ALIGN = 64  # elements: 256 B for fp32, the alignment cuBLAS likes


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


def _validate(cfg, cls, field_name: str):
    if cfg is None:
        return cls()
    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, dict):
        try:
            return cls.model_validate(cfg)
        except ValidationError as e:
            raise ValueError("\n".join(_field_errors(e, cls, field_name))) from None
    raise ValueError(f"{field_name} must be a {cls.__name__} or a dict of its fields, got {type(cfg).__name__}")


def _field_errors(e: ValidationError, cls, field_name: str) -> list[str]:
    """One line per error, fields named as in the job file (``hetero.policy``)."""
    lines = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            hint = did_you_mean(where, cls.model_fields, prefix=f"{field_name}.")
            lines.append(f"unknown field {field_name}.{where}; {hint}valid fields: {', '.join(cls.model_fields)}")
        else:
            lines.append(f"{field_name}.{where}: {err['msg']}")
    return lines


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


class HeteroRuntime:
    """Chunks, hooks and the optimizer arithmetic behind one wrapped model."""

    def __init__(self, model: nn.Module, opt_cfg: OptimizerConfig, cfg: HeteroConfig, mesh=None):
        self.model, self.cfg = model, cfg
        self.device = resolve_device(cfg.compute_device, mesh)
        self.dp = mesh.size("dp") if mesh is not None else 1
        if self.dp > 1 and self.device.type != torch.device(mesh.device).type:
            # ZeRO's collectives take chunks on the compute device: NCCL refuses host tensors.
            raise ValueError(f"hetero.compute_device={cfg.compute_device!r} computes on {self.device} but the data "
                             f"replicas communicate on {mesh.device}; use hetero.compute_device=auto")
        self.group = mesh.group("dp") if self.dp > 1 else None
        self.dp_rank = mesh.rank("dp") if self.dp > 1 else 0
        self.mesh = mesh
        if self.dp > 1 and cfg.dynamic_budget:
            raise ValueError("hetero.dynamic_budget=true is not supported with parallel.dp>1 (every dp rank must "
                             "make the same eviction decisions); use hetero.dynamic_budget=false")

        # --- unique parameters in module order, trainable and frozen apart ---------
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        order: list[nn.Parameter] = []
        seen = set()
        self.module_params: dict[nn.Module, list[nn.Parameter]] = {}
        for _, mod in model.named_modules():
            direct = [p for p in mod._parameters.values() if p is not None]
            if direct:
                self.module_params[mod] = direct
            for p in direct:
                if id(p) not in seen:
                    seen.add(id(p))
                    order.append(p)
        if not order:
            raise ValueError("hetero: the model has no parameters")
        dtypes = {p.dtype for p in order}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(f"hetero: all parameters must share one floating dtype, got {sorted(map(str, dtypes))}; "
                             "cast the model first (e.g. model.float())")
        self.dtype = next(iter(dtypes))
        esize = torch.empty((), dtype=self.dtype).element_size()

        numels = [p.numel() for p in order]
        mult = self.dp
        if cfg.chunk_elems is None:
            C = search_chunk_elems(numels, ALIGN, mult)
        else:
            C = int(cfg.chunk_elems)
            if C % (ALIGN * mult):
                C2 = round_up(C, ALIGN * mult)
                raise ValueError(f"hetero.chunk_elems={C} must be a multiple of {ALIGN}·dp = {ALIGN * mult}; "
                                 f"use hetero.chunk_elems={C2}")
            if C < max(numels):
                raise ValueError(f"hetero.chunk_elems={C} is smaller than the largest parameter ({max(numels)} "
                                 f"elements); use hetero.chunk_elems≥{round_up(max(numels), ALIGN * mult)} "
                                 "or leave it unset to search")
        self.C = C
        self.Sz = C // self.dp
        trainable = [p for p in order if p.requires_grad]
        frozen = [p for p in order if not p.requires_grad]
        self.rows: list[Row] = []
        self.records: list[ParamRecord] = []
        for group, is_tr in ((trainable, True), (frozen, False)):
            for chunk_list in pack([p.numel() for p in group], C, ALIGN):
                row = Row(len(self.rows), is_tr)
                for i, off in chunk_list:
                    p = group[i]
                    rec = ParamRecord(p, names[id(p)], row.index, len(row.records), is_tr, tuple(p.shape), off)
                    row.records.append(rec)
                    self.records.append(rec)
                self.rows.append(row)
        self.by_param = {id(r.param): r for r in self.records}
        n_tr = sum(r.trainable for r in self.rows)

        # --- budget → slots ------------------------------------------------------------
        chunk_bytes = C * esize
        shard_slots = 4 if self.dp > 1 else 0
        shard_bytes = shard_slots * self.Sz * esize
        # chunks in the main pool: P(+G) per row (ZeRO keeps M, V in the shard pool)
        main_chunks = len(self.rows) + n_tr * (1 if self.dp > 1 else 3)
        static_min = self._static_min_slots(n_tr)
        cap = cfg.device_budget_bytes
        dynamic_capacity = None
        if cfg.dynamic_budget:
            if cap is None:
                if self.device.type != "cuda":
                    raise ValueError("hetero.dynamic_budget=true on the CPU needs hetero.device_budget_bytes "
                                     "(the device capacity for model and non-model data)")
                cap = int(0.9 * torch.cuda.get_device_properties(self.device).total_memory)
            dynamic_capacity = cap
        if cap is None:
            main_slots = main_chunks
        else:
            main_slots = min(main_chunks, (cap - shard_bytes) // chunk_bytes)
            need = static_min * chunk_bytes + shard_bytes
            if main_slots < static_min:
                raise ValueError(
                    f"hetero.device_budget_bytes={cap} is too small: this model needs at least {static_min} "
                    f"chunks of {chunk_bytes} bytes on the device at once" + (
                        f" plus {shard_slots} ZeRO shard slots of {self.Sz * esize} bytes" if shard_slots else "")
                    + f", i.e. the minimum feasible value is at least {need}; use hetero.device_budget_bytes≥{need}")
        pools = {"main": (C, main_slots)}
        if shard_slots:
            pools["shard"] = (self.Sz, shard_slots)
        self._saved_bytes = 0
        nonmodel = self._nonmodel_cuda if self.device.type == "cuda" else (lambda: self._saved_bytes)
        self.mgr = ChunkManager(self.device, self.dtype, pools, policy=cfg.policy,
                                dynamic_capacity=dynamic_capacity, nonmodel_fn=nonmodel,
                                budget_bytes=cap if cap is not None else None)

        # --- chunks (host backing) and initial contents -------------------------------------
        mk = self._make_chunk
        lo, hi = Z.window(self.dp_rank, self.Sz)  # this rank's shard of every chunk (ZeRO)
        zero_mode = self.dp > 1
        for row in self.rows:
            row.P = mk(row, "param", S.HOLD, backing=not zero_mode)
            if row.trainable:
                row.G = mk(row, "grad", S.FREE)
                pool = "shard" if zero_mode else "main"
                row.M = mk(row, "exp_avg", S.FREE, pool=pool)
                row.V = mk(row, "exp_avg_sq", S.FREE, pool=pool)
            if zero_mode:
                row.PS = mk(row, "param_shard", S.HOLD, pool="shard")
                if row.trainable:
                    row.GS = mk(row, "grad_shard", S.FREE, pool="shard")
                row.P.loader = self._gather_loader(row)
        # model data this rank holds (= P, G, M, V of every row at dp=1; under ZeRO the
        # shards plus the full-size gradient staging chunks)
        self.model_data_bytes = self.mgr.allocate_backings()
        self.reduce_scatters = {"on_completion": 0, "end_of_backward": 0}
        for rec in self.records:
            rec.placeholder = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device).expand(rec.shape)
        for row in self.rows:
            with torch.no_grad():
                full = torch.zeros(C, dtype=self.dtype)
                for rec in row.records:
                    full.narrow(0, rec.offset, rec.param.numel()).copy_(rec.param.detach().reshape(-1))
                    rec.param.data = rec.placeholder  # free the original storage row by row
                    rec.param.grad = None
                if zero_mode:
                    row.PS.backing.copy_(full[lo:hi])
                else:
                    row.P.backing.copy_(full)
        for mod in model.modules():
            for bn, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[bn] = b.to(self.device)
        self._cb_task = None
        self._hook_stack: list = []
        # where rows that are not fully resident take their Adam step: "off" (load them),
        # "fused" (torch's fused CPU AdamW on the host backings), "exact" (single-tensor math)
        self.host_optimizer = "fused" if self.device.type == "cuda" else "off"
        self.host_steps = 0
        self.steps: dict[str, int] = {}
        self._install_hooks()

    # --- construction helpers -------------------------------------------------------------
    def _make_chunk(self, row: Row, kind: str, state: TensorState, pool: str = "main", backing: bool = True) -> Chunk:
        cap = self.C if pool == "main" else self.Sz
        tensors = [TensorInfo(f"{kind}:{r.name}", r.shape, r.offset, r.param.numel(), state) for r in row.records]
        base = self.dp_rank * self.Sz if pool == "shard" else 0
        return self.mgr.add(Chunk(-1, kind, row.index, cap, tensors, pool=pool, base=base), backing=backing)

    def _static_min_slots(self, n_trainable_rows: int) -> int:
        """Lower bound on main-pool slots: the optimizer pins P, G, M, V of one row (under
        ZeRO it works in the shard pool); a module pins the chunks of its parameters, plus
        one gradient chunk while a gradient is written."""
        spans = []
        for params in self.module_params.values():
            rows = {self.by_param[id(p)].row for p in params}
            spans.append(len(rows) + (1 if any(p.requires_grad for p in params) else 0))
        opt = 4 if n_trainable_rows and self.dp == 1 else 0
        return max([opt, 1] + spans)

    def _gather_loader(self, row: Row):
        def load(dst: torch.Tensor) -> None:
            lo, hi = Z.window(self.dp_rank, self.Sz)
            local = dst.narrow(0, lo, self.Sz)
            ps = row.PS
            if ps.slot is not None:
                local.copy_(self.mgr.read(ps))
            else:
                self.mgr._copy(local, ps.backing)
                for s in (self.mgr.stats, self.mgr.iter_stats):
                    s.load_bytes += self.Sz * self.mgr.esize
                    s.loads += 1
            Z.all_gather_into(dst, local.clone(), self.group)
            got = (self.dp - 1) * self.Sz * self.mgr.esize
            for s in (self.mgr.stats, self.mgr.iter_stats):
                s.gather_bytes += got
            if self.mesh is not None:
                self.mesh.comm_stats.add("hetero.all_gather", self.Sz * self.mgr.esize, got)
        return load

    def _nonmodel_cuda(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.mgr.arena_bytes

    # --- hooks --------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        self.handles = []
        self.mod_groups: dict[nn.Module, list[tuple[Chunk, list[TensorInfo], list[ParamRecord]]]] = {}
        for mod, params in self.module_params.items():
            by_chunk: dict[int, tuple[Chunk, list, list]] = {}
            for p in params:
                rec = self.by_param[id(p)]
                row = self.rows[rec.row]
                e = by_chunk.setdefault(row.index, (row.P, [], []))
                if rec not in e[2]:
                    e[1].append(row.P.tensors[rec.k])
                    e[2].append(rec)
            self.mod_groups[mod] = list(by_chunk.values())
            self.handles.append(mod.register_forward_pre_hook(self._pre_forward))
            self.handles.append(mod.register_forward_hook(self._post_forward, always_call=True))
        for rec in self.records:
            if rec.trainable:
                self.handles.append(rec.param.register_post_accumulate_grad_hook(self._grad_ready))
        model, rt = self.model, self
        inner = model.forward

        def forward(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(rt._pack, rt._unpack):
                return inner(*args, **kwargs)

        model.forward = forward
        # the public hook registrars tag the callable, so pass plain functions
        self.handles.append(model.register_state_dict_post_hook(lambda *a: rt._state_dict_hook(*a)))
        self.handles.append(model.register_load_state_dict_pre_hook(lambda *a: rt._load_pre_hook(*a)))
        self.handles.append(model.register_load_state_dict_post_hook(lambda *a: rt._load_post_hook(*a)))

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _hold(self, chunk: Chunk, tensors: list[TensorInfo], recs: list[ParamRecord]) -> None:
        self.mgr.acquire(chunk, tensors)
        for t, rec in zip(tensors, recs):
            rec.param.data = self.mgr.view(chunk, t)

    def _unhold(self, chunk: Chunk, tensors: list[TensorInfo], recs: list[ParamRecord], to: TensorState) -> None:
        self.mgr.release(chunk, tensors, to)
        for t, rec in zip(tensors, recs):
            if t.holds == 0:
                rec.param.data = rec.placeholder

    def _push_saved_hooks(self) -> None:
        """Relocatable saved tensors also when a module is called outside ``model.forward``
        (e.g. pipeline stages): push our hooks unless some are active already (ours from
        ``model.forward``, or activation checkpointing's, which saves nothing)."""
        ctx = None
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
        self._hook_stack.append(ctx)

    def _pop_saved_hooks(self) -> None:
        ctx = self._hook_stack.pop() if self._hook_stack else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _pre_forward(self, mod, args) -> None:
        self._push_saved_hooks()
        if self._in_backward():  # activation-checkpoint recomputation
            self._queue_end_of_backward()
            self._hold_for_backward(mod)
            return
        for chunk, tensors, recs in self.mod_groups[mod]:
            self._hold(chunk, tensors, recs)

    def _post_forward(self, mod, args, out) -> None:
        self._pop_saved_hooks()
        if self._in_backward():
            return  # recomputation: the holds taken in _pre_forward are backward holds
        grad = torch.is_grad_enabled()
        if grad:
            outs = [t for t in _tensors(out) if t.requires_grad]
            for t in outs:
                t.register_hook(lambda g, mod=mod: self._pre_backward(mod))
        for chunk, tensors, recs in self.mod_groups[mod]:
            self._unhold(chunk, tensors, recs, S.HOLD_AFTER_FWD if grad else S.HOLD)

    def _pre_backward(self, mod) -> None:
        self._queue_end_of_backward()
        self._hold_for_backward(mod)

    def _hold_for_backward(self, mod) -> None:
        """Hold ``mod``'s parameters for its backward (once each: a module may run twice)."""
        for chunk, tensors, recs in self.mod_groups[mod]:
            need = [(t, r) for t, r in zip(tensors, recs) if not r.bwd_held]
            if need:
                self._hold(chunk, [t for t, _ in need], [r for _, r in need])
                for _, r in need:
                    r.bwd_held = True

    def _release_bwd(self, rec: ParamRecord) -> None:
        row = self.rows[rec.row]
        rec.bwd_held = False
        self._unhold(row.P, [row.P.tensors[rec.k]], [rec], S.HOLD_AFTER_BWD)

    def _grad_ready(self, p: nn.Parameter) -> None:
        rec = self.by_param[id(p)]
        row = self.rows[rec.row]
        g = p.grad
        if g is not None:
            t = row.G.tensors[rec.k]
            first = t.state == S.FREE
            self.mgr.acquire(row.G, [t], write=True, zero_free=False)
            dst = self.mgr.view(row.G, t)
            with torch.no_grad():
                if first:
                    dst.copy_(g)
                else:
                    dst.add_(g)
            self.mgr.release(row.G, [t], S.HOLD_AFTER_BWD)
            p.grad = None
        if rec.bwd_held:
            self._release_bwd(rec)
        if self.dp > 1 and all(t.state == S.HOLD_AFTER_BWD for t in row.G.tensors):
            self.reduce_scatters["on_completion"] += 1
            self._reduce_row(row)

    def _queue_end_of_backward(self) -> None:
        tid = torch._C._current_graph_task_id()
        if tid != self._cb_task:
            self._cb_task = tid
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._cb_task = None
        for rec in self.records:
            if rec.bwd_held:
                self._release_bwd(rec)
        if self.dp > 1:  # rows whose tensors did not all get a gradient (unused parameters)
            for row in self.rows:
                if row.trainable and any(t.state == S.HOLD_AFTER_BWD for t in row.G.tensors):
                    self.reduce_scatters["end_of_backward"] += 1
                    self._reduce_row(row)

    def _reduce_row(self, row: Row) -> None:
        """ZeRO: reduce-scatter row's gradient chunk into this rank's grad shard."""
        G, GS = row.G, row.GS
        self.mgr.pin(G)
        full = self.mgr.slot_view(G)
        got = [k for k, t in enumerate(G.tensors) if t.state == S.HOLD_AFTER_BWD]
        with torch.no_grad():
            for t in G.tensors:  # content of FREE tensors is stale: contribute zeros
                if t.state == S.FREE:
                    full.narrow(0, t.offset, t.numel).zero_()
            shard = Z.reduce_scatter_mean(full, self.group, self.dp)
            sb = self.Sz * self.mgr.esize
            for s in (self.mgr.stats, self.mgr.iter_stats):
                s.reduce_scatter_bytes += (self.dp - 1) * sb
            if self.mesh is not None:
                self.mesh.comm_stats.add("hetero.reduce_scatter", (self.dp - 1) * sb, (self.dp - 1) * sb)
            for k in got:
                G.tensors[k].set_state(S.FREE)
        self.mgr.unpin(G)
        lo, hi = Z.window(self.dp_rank, self.Sz)
        first = {k: GS.tensors[k].state == S.FREE for k in got}
        ts = [GS.tensors[k] for k in got]
        self.mgr.acquire(GS, ts, write=True, zero_free=False)
        dst = self.mgr.slot_view(GS)
        with torch.no_grad():
            for k in got:
                seg = Z.segment(GS.tensors[k], lo, hi)
                if seg is None:
                    continue
                a, b = seg[0] - lo, seg[1] - lo
                if first[k]:
                    dst[a:b].copy_(shard[a:b])
                else:
                    dst[a:b].add_(shard[a:b])
        self.mgr.release(GS, ts, S.HOLD_AFTER_BWD)

    # --- saved tensors --------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.numel():
            loc = self.mgr.locate(t)
            if loc is not None:
                _, c, off = loc
                return ("hetero-chunk", c, off, tuple(t.size()), tuple(t.stride()))
        nb = t.numel() * t.element_size()
        self._saved_bytes += nb
        return ("hetero-act", t, nb)

    def _unpack(self, obj):
        if obj[0] == "hetero-act":
            self._saved_bytes -= obj[2]
            return obj[1]
        _, c, off, size, stride = obj
        if c.slot is None:
            raise RuntimeError(f"hetero: a saved view of chunk {c.kind}[{c.index}] is needed by backward while the "
                               "chunk is not resident (a parameter used outside the module that owns it?)")
        p = self.mgr.pools[c.pool]
        return torch.as_strided(p.arena, size, stride, c.slot * p.slot_elems + off)

    # --- optimizer --------------------------------------------------------------------------
    def _opt_chunks(self, row: Row):
        if self.dp > 1:
            return row.PS, row.GS, row.M, row.V, Z.window(self.dp_rank, self.Sz)
        return row.P, row.G, row.M, row.V, (0, self.C)

    @torch.no_grad()
    def optimizer_step(self, *, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale=None) -> None:
        """Adam(W) row by row. A row whose P, G, M, V chunks are all resident is updated in
        its device slots; otherwise, when ``host_optimizer`` is on (default on CUDA), on the
        host backings (PatrickStar's hybrid placement: no chunk crosses PCIe for the step;
        ``"fused"`` uses torch's fused CPU AdamW, ``"exact"`` the single-tensor arithmetic)."""
        self._check_idle("optimizer.step()")
        hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled)
        mgr = self.mgr
        for row in self.rows:
            if not row.trainable:
                continue
            P, G, M, V, (lo, hi) = self._opt_chunks(row)
            ks = [k for k, t in enumerate(G.tensors) if t.state == S.HOLD_AFTER_BWD]
            if not ks:
                continue
            gts, mts, vts = ([c.tensors[k] for k in ks] for c in (G, M, V))
            steps = []
            for k in ks:
                name = row.records[k].name
                self.steps[name] = self.steps.get(name, 0) + 1
                steps.append(self.steps[name])
            on_host = self.host_optimizer in ("exact", "fused") and any(c.slot is None for c in (P, G, M, V))
            if on_host:
                for c in (P, G, M, V):
                    mgr.flush(c)
                mgr.sync_copies()
                for c, ts in ((P, P.tensors), (G, gts), (M, mts), (V, vts)):
                    for t in ts:
                        if t.state == S.FREE:  # fresh Adam moments start at zero
                            a, b = max(t.offset, c.base), min(t.end, c.base + c.capacity)
                            c.backing[a - c.base:b - c.base].zero_()
                        t.set_state(S.COMPUTE)
                views = [c.backing for c in (P, G, M, V)]
                self.host_steps += 1
            else:
                mgr.acquire(P, None, write=True)
                mgr.acquire(G, gts, write=grad_scale is not None)
                mgr.acquire(M, mts, write=True)
                mgr.acquire(V, vts, write=True)
                views = [mgr.slot_view(c) for c in (P, G, M, V)]
            update = fused_adam_update if on_host and self.host_optimizer == "fused" else adam_update
            with torch.no_grad():
                if len(ks) == len(G.tensors) and len(set(steps)) == 1:
                    # one flat update over the window (padding is zero in G, M, V and stays zero)
                    spans = [(0, min(hi, G.used) - lo, steps[0])]
                else:
                    spans = []
                    for k, st in zip(ks, steps):
                        seg = Z.segment(G.tensors[k], lo, hi)
                        if seg is not None:
                            spans.append((seg[0] - lo, seg[1] - lo, st))
                for a, b, st in spans:
                    if b > a:
                        p, g, m, v = (x[a:b] for x in views)
                        if grad_scale is not None:
                            g.mul_(grad_scale)
                        update(p, g, m, v, step=st, **hp)
            if on_host:
                for c, ts, to in ((P, P.tensors, S.HOLD), (G, gts, S.FREE), (M, mts, S.HOLD), (V, vts, S.HOLD)):
                    for t in ts:
                        t.set_state(to)
                for c in (P, M, V):  # device copies are stale now
                    mgr.invalidate(c)
            else:
                mgr.release(P, None, S.HOLD)
                mgr.release(G, gts, S.FREE)  # consumed
                mgr.release(M, mts, S.HOLD)
                mgr.release(V, vts, S.HOLD)
            if self.dp > 1:  # the gathered parameters are stale now
                mgr.invalidate(row.P)
        for row in self.rows:
            for t in row.P.tensors:
                if t.state in (S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD):
                    t.set_state(S.HOLD)
        mgr.end_iteration()

    def zero_grad(self) -> None:
        self._check_idle("optimizer.zero_grad()")
        for row in self.rows:
            for c in (row.G, row.GS):
                if c is None:
                    continue
                for t in c.tensors:
                    if t.state != S.FREE:
                        t.set_state(S.FREE)

    def _check_idle(self, what: str) -> None:
        busy = [r.name for r in self.records if r.bwd_held]
        for row in self.rows:
            for c in (row.P, row.G):
                if c is not None and c.pinned:
                    busy.append(f"{c.kind}[{c.index}]")
        if busy:
            raise RuntimeError(f"hetero: {what} called while chunks are in use ({', '.join(busy[:5])}); "
                               "call it after loss.backward() has returned")

    @torch.no_grad()
    def grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for row in self.rows:
            if not row.trainable:
                continue
            _, G, _, _, (lo, hi) = self._opt_chunks(row)
            content = self.mgr.read(G).to(self.device)
            for t in G.tensors:
                seg = Z.segment(t, lo, hi) if t.state == S.HOLD_AFTER_BWD else None
                if seg is not None:
                    sq += content[seg[0] - lo:seg[1] - lo].double().pow(2).sum()
        if self.dp > 1:
            with comm.named("hetero gradient-norm all-reduce", self.group):
                dist.all_reduce(sq, group=self.group)
        return float(sq.sqrt())

    # --- full tensors (state dicts, gradients) --------------------------------------------------
    def _full_row(self, chunk: Optional[Chunk], shard: Optional[Chunk]) -> torch.Tensor:
        """A row's whole ``[C]`` content on the CPU (all-gathered from the shards under ZeRO)."""
        if self.dp == 1:
            return self.mgr.read(chunk).detach().to("cpu", copy=True)
        local = self.mgr.read(shard).to(self.device)
        full = torch.empty(self.C, dtype=self.dtype, device=self.device)
        Z.all_gather_into(full, local, self.group)
        return full.cpu()

    def full_params(self) -> dict[str, torch.Tensor]:
        out = {}
        for row in self.rows:
            full = self._full_row(row.P, row.PS)
            for rec in row.records:
                out[rec.name] = full.narrow(0, rec.offset, rec.param.numel()).view(rec.shape).clone()
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        out = {}
        for row in self.rows:
            if not row.trainable:
                continue
            g = row.GS if self.dp > 1 else row.G
            full = self._full_row(row.G, row.GS)
            for rec, t in zip(row.records, g.tensors):
                if t.state != S.FREE:
                    out[rec.name] = full.narrow(0, rec.offset, rec.param.numel()).view(rec.shape).clone()
        return out

    def optimizer_state_dict(self, group: dict) -> dict:
        state = {}
        for row in self.rows:
            if not row.trainable:
                continue
            m = self._full_row(row.M, row.M)
            v = self._full_row(row.V, row.V)
            for rec, t in zip(row.records, row.M.tensors):
                # every trainable parameter has an entry (zeros, step 0 before its first
                # update) so that a fresh optimizer's state_dict is a complete DCP load template
                if t.state == S.FREE:
                    state[rec.name] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(rec.shape, dtype=self.dtype),
                                       "exp_avg_sq": torch.zeros(rec.shape, dtype=self.dtype)}
                    continue
                sl = lambda x: x.narrow(0, rec.offset, rec.param.numel()).view(rec.shape).clone()
                state[rec.name] = {"step": torch.tensor(float(self.steps.get(rec.name, 0))),
                                   "exp_avg": sl(m), "exp_avg_sq": sl(v)}
        g = {k: v for k, v in group.items() if k != "params"}
        g["betas"] = list(g["betas"])
        return {"state": state, "param_groups": [g]}

    @torch.no_grad()
    def _write(self, chunk: Chunk, k: int, value: torch.Tensor, lo: int, hi: int) -> None:
        """Write tensor ``k``'s full value (its part inside ``[lo, hi)``) into ``chunk``; → HOLD."""
        t = chunk.tensors[k]
        seg = Z.segment(t, lo, hi)
        self.mgr.acquire(chunk, [t], write=True, zero_free=False, record=False)
        if seg is not None:
            flat = value.reshape(-1).to(self.device, self.dtype)
            self.mgr.slot_view(chunk)[seg[0] - lo:seg[1] - lo].copy_(flat[seg[0] - t.offset:seg[1] - t.offset])
        self.mgr.release(chunk, [t], S.HOLD)

    def load_params(self, values: dict[str, torch.Tensor]) -> None:
        self._check_idle("load_state_dict()")
        for row in self.rows:
            tgt, (lo, hi) = (row.PS, Z.window(self.dp_rank, self.Sz)) if self.dp > 1 else (row.P, (0, self.C))
            for rec in row.records:
                v = next((values[n] for n in rec.names if n in values), None)
                if v is not None:
                    self._write(tgt, rec.k, v, lo, hi)
            if self.dp > 1:
                self.mgr.invalidate(row.P)

    def load_optimizer_state_dict(self, sd: dict) -> None:
        self._check_idle("optimizer.load_state_dict()")
        state = sd["state"]
        for row in self.rows:
            if not row.trainable:
                continue
            lo, hi = Z.window(self.dp_rank, self.Sz) if self.dp > 1 else (0, self.C)
            for rec in row.records:
                st = next((state[n] for n in rec.names if n in state), None)
                if st is None:
                    continue
                self.steps[rec.name] = int(float(st["step"]))
                self._write(row.M, rec.k, st["exp_avg"], lo, hi)
                self._write(row.V, rec.k, st["exp_avg_sq"], lo, hi)

    # --- nn.Module state-dict hooks -----------------------------------------------------------
    def _state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        full = self.full_params()
        for rec in self.records:
            for n in rec.names:
                if prefix + n in state_dict:
                    state_dict[prefix + n] = full[rec.name]

    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # let nn.Module's loader copy into full-size temporaries, then move them into chunks
        full = self.full_params()
        for rec in self.records:
            rec.param.data = full[rec.name].to(self.device)
        self._loading = {rec.name: rec.param.data for rec in self.records}

    def _load_post_hook(self, module, incompatible) -> None:
        values, self._loading = self._loading, None
        for rec in self.records:
            rec.param.data = rec.placeholder
        self.load_params(values)

    # --- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        m = self.mgr
        last = m.history[-1] if m.history else None
        return {
            "model_data_bytes": self.model_data_bytes,
            "device_budget_bytes": m.budget_bytes,
            "arena_bytes": m.arena_bytes,
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
            "pinned_host": m.pinned_host,
            "iterations": m.trace.iterations,
            "trace_divergences": m.trace.divergences,
            "reduce_scatters": dict(self.reduce_scatters),
            "host_optimizer": self.host_optimizer,
            "host_optimizer_rows": self.host_steps,
            "bytes_moved": m.stats.moved_bytes,
            "total": m.stats.as_dict(),
            "last_iteration": {k: v for k, v in last.items() if k not in ("trace", "live", "nonmodel", "start_resident")}
            if last else None,
        }


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


def wrap(model: nn.Module, optimizer_config=None, hetero_config=None, mesh=None):
    """Move ``model``'s parameters, gradients and Adam states into chunks.

    ``optimizer_config``: :class:`~parallel4d.config.OptimizerConfig` or a dict of its
    fields; ``hetero_config``: :class:`~parallel4d.config.HeteroConfig` or a dict;
    ``mesh``: a :class:`~parallel4d.mesh.Mesh` whose ``dp`` axis (if > 1) shards the
    chunks ZeRO-style. Returns ``(model, optimizer)``: the same module object (hooks
    installed, ``state_dict`` gives full values under the original keys) and a
    :class:`~parallel4d.hetero.optim.HeteroOptimizer`.
    """
    opt_cfg = _validate(optimizer_config, OptimizerConfig, "optimizer")
    cfg = _validate(hetero_config, HeteroConfig, "hetero")
    if getattr(model, "_hetero_runtime", None) is not None:
        raise ValueError("hetero.wrap: this model is already wrapped")
    rt = HeteroRuntime(model, opt_cfg, cfg, mesh)
    model._hetero_runtime = rt
    return model, HeteroOptimizer(rt, opt_cfg)
