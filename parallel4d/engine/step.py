"""The :class:`Engine`: one rank's training step on the global batch (forward and backward
through its stages or the pipeline, gradient norm, loss scaling, clipping, the optimizer
step), forwards-only evaluation, what a step holds in memory, and checkpoints under the dense
model's names."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import torch
import torch.distributed as dist

from parallel4d.checkpoint import dcp as checkpoint
from parallel4d.checkpoint.lora_base import check_base
from parallel4d.config.rules.data import eod_token, has_loss_mask
from parallel4d.config.schema import Config
from parallel4d.distributed import comm
from parallel4d.distributed.mesh import Mesh
from parallel4d.engine.batch import local_batch, local_rows, loss_weight, microbatch_rows, packed_step
from parallel4d.engine.memory import SavedActivations, tensor_bytes
from parallel4d.engine.model import TORCH_DTYPES, model_shape, parameter_count
from parallel4d.engine.state import checkpoint_keys, dense_state_dict, local_state, saved_layouts
from parallel4d.engine.store import ParameterStore
from parallel4d.engine.trainer import Trainer
from parallel4d.models.fp8 import fp8_linears
from parallel4d.models.context import Draw, ForwardContext, Packed, State
from parallel4d.models.lora import adapter_names
from parallel4d.models.moe.balance import StepLoad
from parallel4d.optim.loss_scale import LossScale
from parallel4d.optim.optimizer import lr_at


class Engine(Trainer):
    """One rank's share of the job: ``train_step(tokens, targets)`` on the global batch (the
    :class:`~parallel4d.engine.trainer.Trainer` contract), over its :class:`~.store.ParameterStore`."""

    def __init__(self, cfg: Config, mesh: Mesh, store: ParameterStore, loss_fn, stages, *, executor=None,
                 tied_sync=None, dense=None, context: ForwardContext | None = None, pipeline_order: dict | None = None,
                 load: StepLoad | None = None):
        self.cfg, self.mesh, self.store = cfg, mesh, store
        # what the stages read besides their input: each forward's dropout draw (training only) and packed documents
        self.context = context if context is not None else ForwardContext(cfg.train.seed)
        self.eod = eod_token(cfg) if cfg.data.packing == "documents" else None  # None: no packing
        # the ranks hold different numbers of valid targets (packed documents, chat data's loss mask): each sums
        # its token losses, weighed by the whole batch's count (batch.loss_weight), so every rank reads every row
        self.masked = has_loss_mask(cfg)
        self.weighed = self.eod is not None or self.masked
        self.pipeline_order = pipeline_order  # pipeline.hop_cost: what the pipeline's order was built for
        self.model, self.optimizer = store.model, store.optimizer  # the LocalModel; what steps it
        self.dense = dense  # {LocalModel name: (dense name, shape, pieces)}: see dense_layouts()
        self._stages = list(stages)  # this rank's stages in model order (unused under pp)
        self.loss_fn, self.executor, self.tied_sync = loss_fn, executor, tied_sync
        self.tied_params = store.tied_params  # this rank's copies of a table tied across two pp ranks
        self.params = store.params
        self.device = mesh.device
        self.step = 0
        self.tokens_seen = 0
        self.last_step_info: dict = {}
        self.last_lr: float | None = None  # the learning rate of the last step
        self.last_grad_norm: torch.Tensor | None = None  # see train_step
        self._eval_executor = None  # forwards-only twin of the executor, built at the first evaluate()
        half = cfg.train.autocast
        # hetero's parameters are already in the autocast dtype, and a cached cast would keep a copy
        # of each outside the chunk budget for the whole forward: no cast cache under hetero
        self.autocast = (torch.autocast(device_type=self.device.type, dtype=TORCH_DTYPES[half],
                                        cache_enabled=not cfg.hetero.enabled)
                         if half != "none" else nullcontext())
        # float16: the loss is scaled for the backward; every rank agrees on skipping a step that overflowed
        self.loss_scale = LossScale(cfg.train.loss_scale_init, cfg.train.loss_scale_window, self.device) \
            if half == "float16" else None
        self.last_step_skipped: torch.Tensor | None = None  # float16: bool [], whether the last step was skipped
        self.memory: dict | None = None  # what the last step asked to measure held (memory.py's rules)
        self.pretrained_bytes_read: int | None = None  # compose() sets it when model.pretrained is loaded
        self.load = load  # MoE: the step's expert load and auxiliary loss (what the loss function adds to it)
        self.last_aux_loss: torch.Tensor | None = None  # MoE: the last step's auxiliary loss, float64 [], see train_step

    # --- data ---------------------------------------------------------------------
    def data_rows(self) -> Sequence[int]:
        """The rows of each global batch this rank reads (the data need not read the others:
        :func:`~.batch.local_rows`); with packed documents or a loss mask every row (the loss is normalised by
        the whole batch's valid targets, counted on the host: :func:`~.batch.loss_weight`)."""
        if self.weighed:
            return range(self.cfg.data.batch_size)
        return local_rows(self.mesh, self.cfg.data.batch_size, self.cfg.pipeline.microbatches)

    def local_batch(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global ``[B, S]`` tensor, its rows of each micro-batch in turn
        (:func:`~.batch.local_batch`): ``[B/(dp·q), S/sp]``, whose ``chunk(m)`` are its micro-batches."""
        seq = self.cfg.sequence
        return local_batch(self.mesh, x, seq.layout, seq.ulysses, self.cfg.pipeline.microbatches)

    # --- one step -----------------------------------------------------------------
    def _draw(self, rows: list[range], microbatch: int) -> Draw:
        """Micro-batch ``microbatch``'s dropout draw: this step and the global index of its first sample
        (``rows``: this rank's rows of each micro-batch, :func:`~.batch.microbatch_rows`), as one process
        draws it."""
        return Draw(self.step, rows[microbatch].start)

    def _packing(self, tokens: torch.Tensor, targets: torch.Tensor
                 ) -> tuple[torch.Tensor, list[Packed | None], float | None]:
        """The step's targets, each micro-batch's packed documents (:func:`~.batch.packed_step`; without
        packing the targets as given and None for each) and what each forward's summed token loss weighs
        (:func:`~.batch.loss_weight`; None: each forward takes its own tokens' mean)."""
        mb = self.cfg.pipeline.microbatches
        if self.eod is not None:
            seq = self.cfg.sequence
            targets, packs = packed_step(self.mesh, tokens, targets, self.eod, mb, seq.layout, seq.ulysses,
                                         self.masked)
        else:
            packs = [None] * mb
        return targets, packs, loss_weight(self.mesh, targets, mb) if self.weighed else None

    def _forward_backward(self, x, y, rows: list[range], packs: list[Packed | None], weight: float | None
                          ) -> torch.Tensor:
        mb = self.cfg.pipeline.microbatches

        def state(i: int) -> State:  # micro-batch i's
            return State(self._draw(rows, i), packs[i], weight)

        if self.executor is not None:
            self.executor.loss_scale = self._scale()
            self.executor.around_forward = lambda i: self.context.entering(state(i))
            with self.autocast:
                result = self.executor.step(list(x.chunk(mb)), list(y.chunk(mb)))
            self.last_step_info = {"peak_activations": result.peak_activations, "wait_s": result.wait_s}
            if self.load is not None:
                self._router_load_over_pp()
            if self.tied_sync is not None:
                self.tied_sync(self.tied_params, timeout_s=self.cfg.train.timeout_s)
            return result.loss.reshape(1)
        if mb == 1:
            return self._micro_step(x, y, 1, state(0))
        # pp = 1: gradient accumulation over m equal micro-batches, so only one micro-batch's
        # activations are alive at a time; each mean loss weighs 1/m, the sum is the big batch's.
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for i, (xm, ym) in enumerate(zip(x.chunk(mb), y.chunk(mb))):
            total += self._micro_step(xm, ym, mb, state(i))
        return total / mb

    def _router_load_over_pp(self) -> None:
        """The step's MoE figures (:class:`StepLoad`) on every pp rank: only the rank of the last chunk computed
        the losses and added to them (the others hold zeros), so a sum over pp gives each rank the whole
        micro-batches' figures (``E + 1`` numbers)."""
        work = comm.all_reduce(self.load.reported, self.mesh.group("pp"), stats=self.mesh.comm_stats,
                               label="moe.balance", async_op=True)
        comm.wait(work, self.cfg.train.timeout_s, "the MoE load figures' sum over the pp ranks", self.mesh.deadlines)

    def _scale(self) -> torch.Tensor | float:
        """What the loss is multiplied by for the backward: float16's scale (float64 ``[]`` on the
        device, never read here), else 1."""
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    def _micro_step(self, x, y, mb: int, state: State) -> torch.Tensor:
        """Forward and backward of the local ``[b, s]`` tokens through this rank's stages (in ``state``:
        dropout's draw, packed documents), the gradient scaled by ``1/mb``; returns the (unscaled) mean
        loss as float64 ``[1]``."""
        h = x
        with self.autocast, self.context.entering(state):
            for stage in self._stages:
                h = stage(h)
            loss = self.loss_fn(h, y)
        scaled = self.loss_scale is not None or mb > 1  # decided on the host: the scale is never read
        (loss * (self._scale() / mb) if scaled else loss).backward()
        return loss.detach().to(torch.float64).reshape(1)

    def compute_gradients(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the global ``[B, S]`` batch: afterwards each parameter's
        ``.grad`` holds this rank's share of the gradient of the global mean loss (reduced
        over the data replicas dp·sp; under hetero its ZeRO reduces at the step). Returns the
        mean loss of this data replica's tokens, float64 ``[1]``, equal on its tp and pp ranks."""
        targets, packs, weight = self._packing(tokens, targets)
        x, y = self.local_batch(tokens), self.local_batch(targets)
        self.store.start_gradient_reduction()
        rows = microbatch_rows(self.mesh, tokens.shape[0], self.cfg.pipeline.microbatches)
        loss = self._forward_backward(x, y, rows, packs, weight)
        self.store.finish_gradient_reduction()
        return loss

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The global mean loss of a ``[B, S]`` batch, forwards only (no gradient is computed or
        touched), in ``pipeline.microbatches`` micro-batches as a training step cuts it: equal in
        every layout to the dense model's loss on the batch. Float64 ``[]`` on the device, not read
        back (as :meth:`train_step`'s). Collective over the whole mesh."""
        targets, packs, weight = self._packing(tokens, targets)
        x, y = self.local_batch(tokens), self.local_batch(targets)
        mb = self.cfg.pipeline.microbatches
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        with self.autocast:
            if self.executor is not None:
                if self._eval_executor is None:
                    self._eval_executor = self.executor.for_evaluation()
                self._eval_executor.around_forward = lambda i: self.context.entering(State(packed=packs[i],
                                                                                            loss_weight=weight))
                total += self._eval_executor.step(list(x.chunk(mb)), list(y.chunk(mb))).loss
            else:
                for xm, ym, packed in zip(x.chunk(mb), y.chunk(mb), packs):
                    h = xm
                    with self.context.entering(State(packed=packed, loss_weight=weight)):
                        for stage in self._stages:
                            h = stage(h)
                        total += self.loss_fn(h, ym).double() / mb
        return self.mean_over_replicas(total, "val_loss")

    def _overflow(self, norm: torch.Tensor) -> torch.Tensor:
        """Whether any rank's gradients hold an inf or NaN, agreed by every rank of the mesh (the
        norm already sums over every axis; the explicit MAX over the world makes the rule plain):
        float32 ``[]`` on the device, 1.0 or 0.0 (the form torch's fused Adam reads), never read here."""
        flag = (~torch.isfinite(norm)).to(torch.float32).reshape(1)
        work = comm.all_reduce(flag, None, op=dist.ReduceOp.MAX, stats=self.mesh.comm_stats, label="overflow",
                               async_op=True)
        comm.wait(work, self.cfg.train.timeout_s, "float16 overflow agreement over every rank", self.mesh.deadlines)
        return flag.reshape(())

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient after :meth:`compute_gradients`, float64 ``[]``,
        equal on every rank: each dense element once, in every layout, hetero's chunks included."""
        return self.store.grad_norm()

    def measure_gradients(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`compute_gradients`, measuring what this rank holds (:mod:`.memory`) into
        :attr:`memory`: ``parameters``, ``gradients``, peak ``activations`` and ``sent_by_axis``
        (bytes this rank sent per mesh axis in the forward and backward, the data replicas'
        gradient reduction included; the step's few scalars — loss, norm — are not), ``calls_by_axis``
        (the collectives and messages behind them); under hetero
        also its ``hetero_device`` (the chunk arena) and ``hetero_host`` bytes."""
        stats = self.mesh.comm_stats
        before, calls_before = dict(stats.axis_sent), dict(stats.axis_calls)
        meter = SavedActivations(self.store.model_storages())
        with self.store.measuring(meter), meter:
            loss = self.compute_gradients(tokens, targets)
        self.memory = {"parameters": tensor_bytes(self.model.parameters()),  # hetero: their shapes' bytes
                       "gradients": self.store.gradient_bytes(), "activations": meter.peak}
        self.memory.update(self.store.held_bytes())
        self.memory["sent_by_axis"] = {a: n - before.get(a, 0) for a, n in stats.axis_sent.items()
                                       if n != before.get(a, 0)}
        self.memory["calls_by_axis"] = {a: n - calls_before.get(a, 0) for a, n in stats.axis_calls.items()
                                        if n != calls_before.get(a, 0)}
        return loss

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, measure_grad_norm: bool = False,
                   measure_memory: bool = False) -> torch.Tensor:
        """One optimizer step on the global batch; returns the global mean loss, float64 ``[]`` on
        the mesh's device. The step never waits for the device: the loss, like ``last_grad_norm``
        and the loss scale, is not read back here (``float(loss)`` waits for the step to finish:
        read it when it is needed, as the training loop does once per log interval). The
        gradient's norm (before clipping, float64 ``[]``) is in ``last_grad_norm`` when
        ``train.grad_clip`` is set or ``measure_grad_norm`` asks for it (a collective: ask on every
        rank), else None. Clipping multiplies the gradients by ``min(1, clip / (norm + 1e-6))`` on
        the device. ``measure_memory``: fill :attr:`memory` (:meth:`measure_gradients`, then the
        optimizer state)."""
        lr = lr_at(self.step, self.cfg.optimizer, self.cfg.train.steps)
        if self.load is not None:
            self.load.start_step()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.last_lr = lr
        loss = (self.measure_gradients if measure_memory else self.compute_gradients)(tokens, targets)
        clip, scaler = self.cfg.train.grad_clip, self.loss_scale
        norm = self.grad_norm() if clip or measure_grad_norm or scaler else None
        coef = None  # what the gradients are multiplied by before the update (float64 []): unscaling, clipping
        if scaler is not None:
            norm, coef = norm / scaler.scale, 1.0 / scaler.scale
        if clip:
            c = (clip / (norm + 1e-6)).clamp(max=1.0)
            coef = c if coef is None else coef * c
        self.last_grad_norm = norm
        overflow = self._overflow(norm) if scaler is not None else None
        self.last_step_skipped = None if overflow is None else overflow.bool()
        self.store.optimizer_step(coef, overflow)
        if measure_memory:
            self.memory["optimizer_state"] = self.store.optimizer_state_bytes()
        self.optimizer.zero_grad()
        if scaler is not None:
            scaler.update(overflow)
        self.step += 1
        self.tokens_seen += tokens.numel()
        if self.load is None:
            return self.mean_over_replicas(loss, "loss")
        # the auxiliary term's replica mean (the whole batch's) in the loss's own all-reduce
        both = self.mean_over_replicas(torch.cat([loss.reshape(1), self.load.aux.reshape(1)]), "loss")
        self.last_aux_loss = both[1]
        return both[0]

    def router_load(self) -> dict | None:
        """MoE: the last step's ``aux_loss`` (float64 ``[]``, what ``router_aux_loss_coef`` weighs, the whole
        batch's) and ``expert_load`` (``[E]``, each expert's share of the picks summed over layers and
        micro-batches), on the device, not read back; None without MoE layers that record their routing."""
        if self.load is None or self.last_aux_loss is None:
            return None
        return {"aux_loss": self.last_aux_loss, "expert_load": self.load.expert_load()}

    def mean_over_replicas(self, loss: torch.Tensor, label: str) -> torch.Tensor:
        """The mean of the data replicas' (dp·sp) mean losses, ``[]``: ``loss`` ([1] or ``[]``; ``[2]``: two
        values averaged alike, returned ``[2]``) summed in place over them (no collective with one replica)
        and divided in place.

        The step's last collective, so it returns only once the communication thread has let go of
        the tensor (``comm.wait_released``): a script may exit right after its last step."""
        total = loss.reshape(()) if loss.numel() == 1 else loss
        group = self.mesh.group_over("dp", "sp")
        comm.wait_released(lambda: comm.all_reduce(total, group, stats=self.mesh.comm_stats, label=label, async_op=True),
                           total, self.cfg.train.timeout_s, f"{label} all-reduce over the data replicas (dp·sp)",
                           self.mesh.deadlines)
        return total.div_(self.mesh.size("dp") * self.mesh.size("sp"))

    # --- what the training loop reports ---------------------------------------------
    def parameter_count(self) -> int:
        return parameter_count(self.model)

    def held_memory(self) -> dict | None:
        return self.memory

    def loss_scaler(self) -> LossScale | None:
        return self.loss_scale

    def pretrained_bytes(self) -> int | None:
        return self.pretrained_bytes_read

    def fp8_linears(self) -> int | None:
        return fp8_linears(self.model) if self.cfg.train.fp8 != "none" else None

    def hetero_stats(self) -> dict | None:
        return self.store.hetero_stats()

    def pipeline_step_info(self) -> dict | None:
        if self.executor is None:
            return None
        return {**self.last_step_info, **({"order": self.pipeline_order} if self.pipeline_order else {})}

    def close(self) -> None:
        self.store.close()

    # --- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        """Model and optimizer state for DCP under the dense model's names and shapes, plus ``step``
        and ``tokens_seen`` (:func:`~.state.dense_state_dict`): loadable under any layout. Doubles
        as the load template of :meth:`load_state_dict`."""
        return dense_state_dict(self.step, self.tokens_seen, self.store.local_state(self.dense), self.dense)

    checkpoint_format = "parallel4d"  # run.json's "format": DCP files under the dense model's names

    def checkpoint_state(self) -> dict:
        """What ``checkpoint.save`` writes: :meth:`state_dict`, with ``model.lora`` the adapters' part only
        (the frozen base is named in ``lora_base.json``, not copied: ``checkpoint/lora_base.py``)."""
        saved = saved_layouts(self.dense, self.cfg.model.lora is not None)
        return dense_state_dict(self.step, self.tokens_seen, self.store.local_state(saved), saved)

    def load_checkpoint(self, path) -> None:
        """Restore from checkpoint ``path`` (its files already verified), whatever layout saved it."""
        if self.cfg.model.lora is not None:  # the adapters only: on the base they were trained on
            check_base(path, self.cfg.model, self.cfg.train.seed)
        state = self.checkpoint_state()
        checkpoint.load(state, path, verify_files=False,
                        known=checkpoint_keys(model_shape(self.cfg), adapter_names(self.cfg.model)))
        self.load_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        """Restore from a :meth:`state_dict` (or :meth:`checkpoint_state`) template that ``checkpoint.load``
        filled; parameters it lacks (a LoRA job's frozen base) are left as they are."""
        held = {n: v for n, v in self.dense.items() if f"model.{v[0]}" in state}  # a LoRA checkpoint: adapters
        self.store.load_local_state(local_state(state, held))
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
