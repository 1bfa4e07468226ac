"""The trainer contract: what the training loop (:mod:`parallel4d.training.loop`) drives.

Two classes implement it, and say so by subclassing :class:`Trainer`: parallel4d's own
:class:`~parallel4d.engine.step.Engine` and the DeepSpeed integration's
:class:`~parallel4d.integrations.deepspeed.trainer.DeepSpeedTrainer`. Every method is
abstract, so a class that forgets one cannot be instantiated; a capability one trainer lacks
is a method that answers None (e.g. :meth:`Trainer.held_memory`), never an attribute the
loop has to probe for.

No method the loop calls per step waits for the device: the loss and the gradient norm stay
tensors on it, and the loop reads them back together once per log interval
(:mod:`parallel4d.training.loop`; docs/operations.md lists the host syncs of a step).
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import torch

from parallel4d.optim.loss_scale import LossScale


@runtime_checkable
class Trainer(Protocol):
    """One rank's training job, as the loop sees it. Every method that communicates is a
    collective: call it on every rank."""

    step: int  # optimizer steps taken (restored by load_checkpoint)
    checkpoint_format: str  # run.json's "format": whose files checkpoint_state writes
    last_lr: float | None  # the learning rate of the last step
    last_grad_norm: torch.Tensor | float | None  # the gradient's norm at the last step (``[]``), when measured

    # --- training -------------------------------------------------------------------
    @abstractmethod
    def data_rows(self) -> Sequence[int] | None:
        """The rows of each global ``[B, S]`` batch this rank reads (ascending), or None for all of them."""

    @abstractmethod
    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, measure_grad_norm: bool = False,
                   measure_memory: bool = False) -> torch.Tensor:
        """One optimizer step on the global ``[B, S]`` batch (rows outside :meth:`data_rows` may be
        zeros); the global mean loss, float64 ``[]`` on the device, not read back (reading it waits
        for the step). ``measure_grad_norm``: fill ``last_grad_norm``; ``measure_memory``: what the
        step holds, for :meth:`held_memory`, where the trainer can."""

    @abstractmethod
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The global mean loss of a ``[B, S]`` batch, forwards only: float64 ``[]`` on the device,
        not read back."""

    # --- what the loop reports --------------------------------------------------------
    @abstractmethod
    def parameter_count(self) -> int:
        """Distinct parameters on this rank (a tied weight once)."""

    @abstractmethod
    def held_memory(self) -> dict | None:
        """What this rank held at the last step that measured memory (``summary.json``'s
        ``memory``, :mod:`parallel4d.engine.memory`'s rules); None if none did or the trainer
        cannot measure."""

    @abstractmethod
    def loss_scaler(self) -> LossScale | None:
        """float16's loss scale (its scale and skipped steps go to metrics.jsonl); None without one."""

    @abstractmethod
    def router_load(self) -> dict | None:
        """Mixture of experts: the last step's ``aux_loss`` (``[]``) and ``expert_load`` (``[E]``, each expert's
        share of the picks) on the device, not read back (metrics.jsonl); None without MoE layers."""

    @abstractmethod
    def pretrained_bytes(self) -> int | None:
        """Bytes this rank read of ``model.pretrained``'s Hugging Face weights; None when not loaded here."""

    @abstractmethod
    def fp8_linears(self) -> int | None:
        """``train.fp8``: how many of this rank's linears compute in FP8 (``summary.json``'s ``fp8``, what
        ``parallel4d check`` reads to say FP8 ran); None when the trainer runs no FP8."""

    @abstractmethod
    def hetero_stats(self) -> dict | None:
        """hetero's statistics (``summary.json``'s ``hetero``); None without hetero."""

    @abstractmethod
    def pipeline_step_info(self) -> dict | None:
        """The pipeline's ``peak_activations`` and ``wait_s`` at the last step; None without a pipeline."""

    @abstractmethod
    def close(self) -> None:
        """Take off the model what the trainer hung on it (gradient hooks), so the run's objects, and
        the process groups they reach, can be freed; the trainer is not used after."""

    # --- checkpoints ----------------------------------------------------------------
    @abstractmethod
    def checkpoint_state(self):
        """What ``checkpoint.save`` writes: a state dict for DCP, or ``write(directory)``."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None:
        """Restore from checkpoint ``path`` (its files already verified)."""

