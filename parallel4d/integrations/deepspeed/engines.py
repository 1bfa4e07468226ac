"""The engines :func:`~.initialize.initialize` returns: one ``train_batch(tokens, targets)`` for every layout.

* pp = 1 — :class:`Parallel4DEngine`, a genuine ``DeepSpeedEngine`` (DeepSpeed builds it; its
  class is then set to this subclass, which only adds methods): ``forward`` / ``backward`` /
  ``step`` work as in any DeepSpeed loop, on this rank's shards (:func:`parallel4d.local_batch`).
* pp > 1 — :class:`DeepSpeedPipeline`: DeepSpeed's own ``PipelineEngine`` runs 1F1B alone, so
  parallel4d's executor runs the schedule (1F1B, interleaved, Hanayo waves) over this rank's
  chunks, and one ``DeepSpeedEngine`` holding those chunks reduces the gradients over the data
  replicas, clips and steps (ZeRO ≤ 1). That engine runs with unmanaged gradient accumulation:
  the executor has already averaged the micro-batches (each last-chunk backward is ``loss/m``),
  so DeepSpeed neither divides by its ``gradient_accumulation_steps`` nor counts micro-steps;
  ``step()`` is the boundary where it reduces and updates.

Either way ``train_batch`` takes the *global* batch ``[B, S]`` and returns the global mean
loss, the number a single process training the dense model would print.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from parallel4d.config.schema import Config
from parallel4d.engine.batch import local_batch
from parallel4d.engine.compose import PipelineParts
from parallel4d.distributed.mesh import Mesh
from parallel4d.integrations.deepspeed.model import global_mean


class Parallel4DEngine(DeepSpeedEngine):
    """A ``DeepSpeedEngine`` over :func:`~.model.build_model`'s model, plus ``train_batch``.

    Set ``p4d_cfg`` and ``p4d_mesh`` after changing an engine's class to this one."""

    p4d_cfg: Config
    p4d_mesh: Mesh

    def train_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the global batch ``[B, S]`` (``gradient_accumulation_steps``
        micro-batches of this rank's shard through forward / backward / step); the global mean loss,
        float64 ``[]`` on the device (not read back: that would wait for the step)."""
        layout, gas = self.p4d_cfg.sequence.layout, self.gradient_accumulation_steps()
        # each micro-batch one process's (rows [i·B/m, (i+1)·B/m)), as parallel4d's engine cuts them
        x, y = (local_batch(self.p4d_mesh, t, layout, microbatches=gas) for t in (tokens, targets))
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for xm, ym in zip(x.chunk(gas), y.chunk(gas)):
            loss = self(xm, ym)
            self.backward(loss)
            self.step()
            total += loss.detach().to(torch.float64).reshape(())
        return total / gas


class DeepSpeedPipeline:
    """pp > 1: parallel4d's executor drives the schedule, ``engine`` (a ``DeepSpeedEngine`` over
    this rank's chunks, unmanaged gradient accumulation) reduces, clips and steps.

    ``engine``'s other attributes (``module``, ``optimizer``, ``save_checkpoint``,
    ``get_global_grad_norm``, ``global_steps``, …) are reachable on this object."""

    def __init__(self, engine: DeepSpeedEngine, cfg: Config, mesh: Mesh, parts: PipelineParts):
        self.engine, self.p4d_cfg, self.p4d_mesh = engine, cfg, mesh
        self.executor, self.tied_sync, self.tied_params = parts.executor, parts.tied_sync, parts.tied_params
        self.last_step_info: dict = {}

    def __getattr__(self, name: str):
        if name in ("forward", "backward", "step", "__call__"):
            raise AttributeError(f"DeepSpeedPipeline.{name}: at parallel.pp > 1 the pipeline schedule runs the "
                                 "forwards and backwards; call engine.train_batch(tokens, targets)")
        return getattr(self.__dict__["engine"], name)

    def train_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the global batch ``[B, S]``; the global mean loss, float64 ``[]`` on the device."""
        cfg, mesh = self.p4d_cfg, self.p4d_mesh
        m = cfg.pipeline.microbatches
        x = local_batch(mesh, tokens, cfg.sequence.layout, microbatches=m)  # rank's share of each micro-batch
        y = local_batch(mesh, targets, cfg.sequence.layout, microbatches=m)
        result = self.executor.step(list(x.chunk(m)), list(y.chunk(m)))  # the loss is each replica's share
        self.last_step_info = {"peak_activations": result.peak_activations, "wait_s": result.wait_s}
        if self.tied_sync is not None:
            self.tied_sync(self.tied_params, timeout_s=cfg.train.timeout_s)
        self.engine.step()
        return global_mean(result.loss.reshape(()), mesh, cfg.train.timeout_s)
