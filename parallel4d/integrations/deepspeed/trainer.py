"""What ``parallel4d launch`` trains for a config with a ``deepspeed:`` section.

:class:`DeepSpeedTrainer` implements the training loop's contract
(:class:`~parallel4d.engine.trainer.Trainer`, as ``engine.Engine`` does) over the engine
:func:`~.initialize.build_engine` builds, so progress, ``summary.json``, signals and the run
directory's rules are the same with and without DeepSpeed. Checkpoints are DeepSpeed's own
(``save_checkpoint`` / ``load_checkpoint``: model, optimizer and ZeRO partitions, scheduler),
written into the directory parallel4d's checkpoint module then checksums and renames into place,
plus the model's float32 parameters in parallel4d's layout-free format (:func:`checkpoint_writer`), which
``parallel4d checkpoint gather`` and ``parallel4d export`` read as they read a native checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.utils import safe_get_full_fp32_param

from parallel4d.checkpoint.dcp import write_state
from parallel4d.checkpoint.failures import CheckpointError, UnusableCheckpoint
from parallel4d.config.schema import Config
from parallel4d.distributed.mesh import Mesh
from parallel4d.engine.model import LocalModel, parameter_count
from parallel4d.engine.state import dense_state_dict
from parallel4d.engine.trainer import Trainer
from parallel4d.integrations.deepspeed.initialize import build_engine
from parallel4d.integrations.deepspeed.model import RankModel


class DeepSpeedTrainer(Trainer):
    """One rank's DeepSpeed training job, in the shape the training loop drives."""

    checkpoint_format = "deepspeed"  # run.json's "format": DeepSpeed's files, this layout only

    def __init__(self, cfg: Config, mesh: Mesh):
        self.engine, self.optimizer, self.scheduler = build_engine(cfg, mesh)
        self.model = self.engine.module
        self.executor = self.engine.executor if cfg.parallel.pp > 1 else None
        self.step = 0
        self.tokens_seen = 0
        self.last_lr: float | None = None
        self.last_grad_norm: torch.Tensor | float | None = None

    def data_rows(self) -> None:
        """None: DeepSpeed's engine is given the whole global batch and takes its share itself."""
        return None

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, measure_grad_norm: bool = False,
                   measure_memory: bool = False) -> torch.Tensor:
        """One optimizer step on the global batch; the global mean loss, float64 ``[]`` on the device,
        not read back (as :meth:`Engine.train_step <parallel4d.engine.step.Engine.train_step>`).
        ``last_lr`` and ``last_grad_norm`` are DeepSpeed's as it keeps them (its norm is None without
        ZeRO, whatever is asked); memory is not measured (:meth:`held_memory` is None)."""
        self.last_lr = float(self.optimizer.param_groups[0]["lr"])  # the scheduler set it for this step
        loss = self.engine.train_batch(tokens, targets)
        norm = self.engine.get_global_grad_norm()
        self.last_grad_norm = norm  # read back with the loss, at the log interval
        self.step += 1
        self.tokens_seen += tokens.numel()
        return loss

    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("train.eval_every is not supported with a deepspeed: section (the config "
                                  "refuses it)")

    def parameter_count(self) -> int:
        return parameter_count(self.model)

    def held_memory(self) -> None:
        """None: memory is measured by parallel4d's own engine only."""
        return None

    def loss_scaler(self) -> None:
        """None: DeepSpeed keeps its float16 loss scale to itself."""
        return None

    def pretrained_bytes(self) -> None:
        """None: not reported under DeepSpeed."""
        return None

    def router_load(self) -> None:
        """None: mixture-of-experts models are refused with a deepspeed: section (config/rules/moe.py)."""
        return None

    def fp8_linears(self) -> None:
        """None: FP8 is refused with a deepspeed: section (config/rules/fp8.py)."""
        return None

    def hetero_stats(self) -> None:
        """None: hetero and DeepSpeed never run together (the config refuses both)."""
        return None

    def pipeline_step_info(self) -> dict | None:
        """The pipeline's peak activations and wait of the last step; None at pp = 1."""
        return self.engine.last_step_info if self.executor is not None else None

    def close(self) -> None:
        self.engine.destroy()  # DeepSpeed's own hooks (its ZeRO optimizer's)

    def checkpoint_state(self):
        """``write(directory)`` for ``checkpoint.save``: :func:`checkpoint_writer`'s."""
        return checkpoint_writer(self.engine, self.step, self.tokens_seen)

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        loaded, client = self.engine.load_checkpoint(str(path.parent), tag=path.name)
        if loaded is None or "step" not in (client or {}):
            raise UnusableCheckpoint(f"checkpoint {path}: DeepSpeed found no checkpoint of this layout there "
                                     "(DeepSpeed checkpoints load into the parallel sizes that saved them); resume "
                                     "with the parallel.* sizes it was saved with")
        self.step, self.tokens_seen = int(client["step"]), int(client["tokens_seen"])


def checkpoint_writer(engine, step: int, tokens_seen: int) -> Callable[[Path], None]:
    """``write(directory)`` (collective) for ``checkpoint.save`` of ``engine`` (:func:`.initialize.build_engine`'s):
    DeepSpeed's ``save_checkpoint`` into ``directory`` (what a resumed run loads, in this layout only), then the
    model's float32 parameters under the dense model's names (``model.<name>``, ``step``, ``tokens_seen``: DCP
    files, each rank its pieces) — what gather and export read, the same as from a native checkpoint. Not the
    optimizer's state: that stays in DeepSpeed's files."""
    def write(directory: Path) -> None:
        engine.save_checkpoint(str(directory.parent), tag=directory.name, save_latest=False,
                               client_state={"step": step, "tokens_seen": tokens_seen})
        local = engine.module.local if isinstance(engine.module, RankModel) else engine.module
        write_state(dense_state_dict(step, tokens_seen, (_float32_parameters(engine, local), {}), local.dense),
                    directory)
    return write


def fp16_masters(optimizer: FP16_Optimizer | FP16_UnfusedOptimizer) -> dict[int, torch.Tensor]:
    """``{id(16-bit parameter): its float32 master}`` of DeepSpeed's fp16 optimizer without ZeRO, which
    exposes no per-parameter accessor: the fused one keeps each group's masters as one flat tensor laid
    out as ``_flatten_dense_tensors`` of the group's parameters (in order), the unfused one a list."""
    masters = {}
    if isinstance(optimizer, FP16_Optimizer):
        for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
            offset = 0
            for p in params:
                masters[id(p)] = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
    else:
        for params, fp32 in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            masters.update({id(p): m for p, m in zip(params, fp32)})
    return masters


def _float32_parameters(engine, local: LocalModel) -> dict[str, torch.Tensor]:
    """``{LocalModel name: this rank's float32 parameter}`` (tied aliases included), as the engine
    trains it: the module's own tensor where it holds the float32 values (ZeRO-0/1/2 in float32), the
    fp16 optimizer's master without ZeRO, else the float32 master gathered over ZeRO's group by
    DeepSpeed (under bf16/fp16 the module holds 16-bit copies; under ZeRO-3 a partition). Collective
    over the data replicas, in module order."""
    zero3 = engine.zero_optimization_stage() == 3
    optimizer = engine.optimizer
    masters = fp16_masters(optimizer) if isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)) else None

    def master(name: str, p: torch.Tensor) -> torch.Tensor:
        if p.dtype == torch.float32 and not zero3:
            return p.detach()
        full = masters.get(id(p)) if masters is not None else safe_get_full_fp32_param(p)
        if full is None:
            raise CheckpointError(f"parameter {name} ({p.dtype}): DeepSpeed gives no float32 master of it, "
                                  "so its layout-free copy cannot be written")
        return full.detach().cpu()  # on the host: the device holds the 16-bit model only

    values: dict[int, torch.Tensor] = {}
    out = {}
    for name, p in local.named_parameters(remove_duplicate=False):
        if id(p) not in values:
            values[id(p)] = master(name, p)
        out[name] = values[id(p)]
    return out
