"""Full (unsharded) tensors by parameter name, in and out of the chunks.

What ``model.state_dict()`` / ``load_state_dict`` and the optimizer's state dict see: every
value whole, on the CPU, under its parameter names, whatever the dp layout (save at dp = 2,
load at dp = 1). Collective under ZeRO: each row is all-gathered from the shards.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from parallel4d.hetero.chunk import Chunk, TensorInfo, TensorState
from parallel4d.hetero.layout import Layout, ParamRecord
from parallel4d.hetero.manager import ChunkManager
from parallel4d.hetero.master import MasterState
from parallel4d.hetero.populate import master_of
from parallel4d.hetero.zero import ZeroShards, segment

S = TensorState


def _cut(full: torch.Tensor, rec: ParamRecord, live: bool = False) -> torch.Tensor:
    """``rec``'s tensor out of a row's ``[C]`` content, with its shape: a copy of its own, or with ``live``
    a view of ``full`` (the live host master, as ``nn.Module.state_dict`` gives the live parameters)."""
    t = full.narrow(0, rec.offset, rec.param.numel()).view(rec.shape)
    return t if live else t.clone()


def _first(values: dict, rec: ParamRecord):
    """``rec``'s entry in ``values`` under any of its names (tied parameters have several)."""
    return next((values[n] for n in rec.names if n in values), None)


class FullState:
    """Reads and writes whole tensors; installs the ``nn.Module`` state-dict hooks."""

    def __init__(self, layout: Layout, mgr: ChunkManager, zero: ZeroShards, master: Optional[MasterState] = None):
        self.layout, self.mgr, self.zero, self.master = layout, mgr, zero, master
        self._loading: Optional[dict] = None

    def _live(self, row) -> bool:
        """Whether the state dicts lend ``row``'s live master rather than a copy: dp = 1 (nothing to gather)
        and the state on the host (a checkpoint's save then needs no second copy of it)."""
        return (master_of(row, self.master) is not None and self.layout.dp == 1
                and self.master.W[row.index].device.type == "cpu")

    def _settle(self) -> None:
        """The host rows' updates done: what follows reads or writes their master state."""
        if self.master is not None:
            self.master.updates.wait_all()

    # --- out ------------------------------------------------------------------------------
    def params(self) -> dict[str, torch.Tensor]:
        """The parameters (the master copy under 16-bit chunks; a frozen one's chunk value, in the chunks'
        dtype, widened to the parameters')."""
        self._settle()
        out = {}
        for row in self.layout.rows:
            live = self._live(row)
            full = (self.zero.full_row(row, row.P, row.PS) if master_of(row, self.master) is None
                    else self.zero.full_window(row, self.master.W[row.index], copy=not live))
            for rec in row.records:
                out[rec.name] = _cut(full, rec, live).to(self.layout.dtype)
        return out

    def gradients(self) -> dict[str, torch.Tensor]:
        """The gradients written since the last step (a parameter without one is left out)."""
        out = {}
        for row in self.layout.rows:
            if not row.trainable:
                continue
            g = row.GS if self.layout.dp > 1 else row.G
            full = self.zero.full_row(row, row.G, row.GS)
            for rec, t in zip(row.records, g.tensors):
                if t.state != S.FREE:
                    out[rec.name] = _cut(full, rec)
        return out

    def optimizer(self, steps: dict[str, int], groups: list[dict]) -> dict:
        """``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [hyperparameters
        of each group]}``."""
        self._settle()
        state = {}
        for row in self.layout.rows:
            if row.trainable:
                state.update(self._adam_state(row, steps))
        out = []
        for group in groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["betas"] = list(g["betas"])
            out.append(g)
        return {"state": state, "param_groups": out}

    def _adam_state(self, row, steps: dict[str, int]) -> dict:
        # every trainable parameter has an entry (zeros, step 0 before its first update) so
        # that a fresh optimizer's state_dict is a complete DCP load template
        live = self._live(row)
        if self.master is None:
            m, v = self.zero.full_row(row, row.M, row.M), self.zero.full_row(row, row.V, row.V)
            fresh = [t.state == S.FREE for t in row.M.tensors]
        else:
            m, v = (self.zero.full_window(row, x[row.index], copy=not live) for x in (self.master.M, self.master.V))
            fresh = [steps.get(rec.name, 0) == 0 for rec in row.records]
        out = {}
        for rec, is_fresh in zip(row.records, fresh):
            if is_fresh:
                out[rec.name] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(rec.shape, dtype=self.layout.dtype),
                                 "exp_avg_sq": torch.zeros(rec.shape, dtype=self.layout.dtype)}
            else:
                out[rec.name] = {"step": torch.tensor(float(steps.get(rec.name, 0))),
                                 "exp_avg": _cut(m, rec, live), "exp_avg_sq": _cut(v, rec, live)}
        return out

    # --- in -------------------------------------------------------------------------------
    @torch.no_grad()
    def _write(self, row, chunk: Chunk, k: int, value: torch.Tensor) -> None:
        """Write tensor ``k``'s full value (its part inside this rank's window of ``row``) into ``chunk``;
        → HOLD."""
        lo, hi = self.zero.window_of(row)
        t = chunk.tensors[k]
        seg = segment(t, lo, hi)
        self.mgr.acquire(chunk, [t], write=True, zero_free=False, record=False)
        if seg is not None:
            flat = value.reshape(-1).to(self.mgr.device, self.mgr.dtype)
            self.mgr.slot_view(chunk)[seg[0] - lo:seg[1] - lo].copy_(flat[seg[0] - t.offset:seg[1] - t.offset])
        self.mgr.release(chunk, [t], S.HOLD)

    @torch.no_grad()
    def _write_master(self, row, window: torch.Tensor, t: TensorInfo, value: torch.Tensor) -> None:
        """Write ``t``'s full value (its part inside this rank's window of ``row``) into a master ``window``."""
        lo, hi = self.zero.window_of(row)
        seg = segment(t, lo, hi)
        if seg is not None:
            flat = value.reshape(-1).to(window.dtype)
            window[seg[0] - lo:seg[1] - lo].copy_(flat[seg[0] - t.offset:seg[1] - t.offset])

    def load_params(self, values: dict[str, torch.Tensor]) -> None:
        self._settle()
        self.layout.check_idle("load_state_dict()")
        for row in self.layout.rows:
            target, master = row.PS if self.layout.dp > 1 else row.P, master_of(row, self.master)
            for rec in row.records:
                v = _first(values, rec)
                if v is not None and master is not None:
                    self._write_master(row, master.W[row.index], row.P.tensors[rec.k], v)
                elif v is not None:
                    self._write(row, target, rec.k, v)
            if self.layout.dp > 1 or master is not None:  # the device's copy is stale now
                self.mgr.invalidate(row.P)

    def load_optimizer(self, sd: dict, steps: dict[str, int]) -> None:
        """Adam moments into M, V; each parameter's step count into ``steps``."""
        self._settle()
        self.layout.check_idle("optimizer.load_state_dict()")
        for row in self.layout.rows:
            if not row.trainable:
                continue
            for rec in row.records:
                st = _first(sd["state"], rec)
                if st is None:
                    continue
                steps[rec.name] = int(float(st["step"]))
                if self.master is None:
                    self._write(row, row.M, rec.k, st["exp_avg"])
                    self._write(row, row.V, rec.k, st["exp_avg_sq"])
                else:
                    for window, key in ((self.master.M, "exp_avg"), (self.master.V, "exp_avg_sq")):
                        self._write_master(row, window[row.index], row.P.tensors[rec.k], st[key])

    # --- nn.Module state-dict hooks -------------------------------------------------------------
    def install(self, model: nn.Module) -> list:
        """``model.state_dict()`` gives full values under every alias; ``load_state_dict`` writes
        into the chunks (nn.Module's loader copies into full-size temporaries first)."""
        # the public hook registrars tag the callable, so pass plain functions
        return [model.register_state_dict_post_hook(lambda *a: self._state_dict_hook(*a)),
                model.register_load_state_dict_pre_hook(lambda *a: self._load_pre_hook(*a)),
                model.register_load_state_dict_post_hook(lambda *a: self._load_post_hook(*a))]

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        full = self.params()
        for rec in self.layout.records:
            for n in rec.names:
                if prefix + n in state_dict:
                    state_dict[prefix + n] = full[rec.name]

    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        full = self.params()
        for rec in self.layout.records:
            rec.param.data = full[rec.name].to(self.mgr.device)
        # only what the dict holds is written back (a LoRA checkpoint leaves the frozen base's chunks alone)
        self._loading = {rec.name: rec.param.data for rec in self.layout.records
                         if any(prefix + n in state_dict for n in rec.names)}

    def _load_post_hook(self, module, incompatible) -> None:
        values, self._loading = self._loading, None
        for rec in self.layout.records:
            rec.param.data = rec.placeholder
        self.load_params(values)
