"""compose(): build the model and apply the strategies in a fixed order.

Order (DESIGN.md): build the dense reference through the layer factory from the
job seed → (tensor2d / sequence swap layers) → (pipeline cuts chunks) → hand the
parameters to hetero or to plain data parallelism → build the optimizer →
:class:`Engine` with ``train_step``, ``state_dict``/``load_state_dict`` and counters.

Building the dense model first, from the same seed, is what makes every
parallel layout start from exactly the parameters of the single-process run.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from . import comm
from .config import Config, ConfigError
from .data import local_slice
from .mesh import Mesh
from .models.gpt import GPTShape, build_gpt

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}


def build_optimizer(params, opt_cfg) -> torch.optim.Optimizer:
    """AdamW / Adam from the ``optimizer`` section."""
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[opt_cfg.name]
    return cls(params, lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps,
               weight_decay=opt_cfg.weight_decay)


def lr_at(step: int, opt_cfg) -> float:
    """Linear warm-up over ``warmup_steps``, then constant."""
    if opt_cfg.warmup_steps and step < opt_cfg.warmup_steps:
        return opt_cfg.lr * (step + 1) / opt_cfg.warmup_steps
    return opt_cfg.lr


class DataParallel:
    """Plain data parallelism: average gradients over the ``dp`` group in one flat buffer."""

    def __init__(self, params: list[torch.nn.Parameter], mesh: Mesh, timeout_s: float):
        self.params = params
        self.mesh = mesh
        self.timeout_s = timeout_s

    def sync_gradients(self) -> None:
        group = self.mesh.group("dp")
        n = self.mesh.size("dp")
        if n == 1:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = comm.all_reduce(flat, group, stats=self.mesh.comm_stats, label="dp_grad", async_op=True)
        comm.wait(work, self.timeout_s, "data-parallel gradient all-reduce")
        flat /= n
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class Engine:
    """One rank's share of the job: ``train_step(step, tokens, targets)`` on the global batch."""

    def __init__(self, cfg: Config, mesh: Mesh, model: torch.nn.Module, optimizer, dp: DataParallel):
        self.cfg, self.mesh, self.model, self.optimizer, self.dp = cfg, mesh, model, optimizer, dp
        self.device = mesh.device
        self.step = 0
        self.tokens_seen = 0
        self.compute_seconds = 0.0
        dtype = cfg.train.dtype
        self.autocast = (torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
                         if dtype == "bfloat16" else nullcontext())

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor):
        """This rank's rows of the global ``[B, S]`` batch: block ``dp`` of ``dp`` blocks."""
        d, n = self.mesh.rank("dp"), self.mesh.size("dp")
        return local_slice(tokens, d, n).to(self.device), local_slice(targets, d, n).to(self.device)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch; returns the global mean loss."""
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg.optimizer)
        x, y = self.local_batch(tokens, targets)
        with self.autocast:
            loss = self.model(x, y)
        loss.backward()
        self.dp.sync_gradients()
        if self.cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.detach().to(torch.float64).reshape(1)
        comm.all_reduce(value, self.mesh.group("dp"), stats=self.mesh.comm_stats, label="loss")
        self.step += 1
        self.tokens_seen += tokens.numel()
        self.compute_seconds += time.perf_counter() - t0
        return value.item() / self.mesh.size("dp")

    # --- checkpointing -----------------------------------------------------------
    def state_dict(self) -> dict:
        """Model and optimizer state keyed by parameter name, plus the step."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(self.step),
                "tokens_seen": torch.tensor(self.tokens_seen)}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


def unsupported(cfg: Config) -> list[str]:
    """Config choices this build cannot run yet, as messages naming the field."""
    out = []
    if cfg.parallel.pp > 1:
        out.append(f"parallel.pp={cfg.parallel.pp}: pipeline parallelism is not available in this build; use parallel.pp=1")
    if cfg.parallel.sp > 1:
        out.append(f"parallel.sp={cfg.parallel.sp}: sequence parallelism is not available in this build; use parallel.sp=1")
    if cfg.parallel.tp > 1:
        out.append(f"parallel.tp={cfg.parallel.tp}: 2D tensor parallelism is not available in this build; use parallel.tp=1")
    if cfg.hetero.enabled:
        out.append("hetero.enabled=true: heterogeneous memory is not available in this build; use hetero.enabled=false")
    return out


def compose(cfg: Config, mesh: Mesh) -> Engine:
    """Build this rank's model, optimizer and gradient synchronisation for ``cfg``."""
    problems = unsupported(cfg)
    if problems:
        raise ConfigError("this configuration cannot run:\n" + "\n".join(f"  - {p}" for p in problems))
    shape = GPTShape.from_config(cfg.model)
    model = build_gpt(shape, seed=cfg.train.seed).to(device=mesh.device, dtype=DTYPES[cfg.train.dtype])
    params = [p for p in model.parameters() if p.requires_grad]
    dp = DataParallel(params, mesh, cfg.train.timeout_s)
    optimizer = build_optimizer(params, cfg.optimizer)
    return Engine(cfg, mesh, model, optimizer, dp)


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(cfg: Config) -> float:
    """≈ 6·N + 12·L·h·s training FLOPs per token (N: non-embedding parameters)."""
    m = cfg.model
    n = 12 * m.layers * m.hidden ** 2
    return 6 * n + 12 * m.layers * m.hidden * m.seq_len


__all__ = ["compose", "Engine", "build_optimizer", "lr_at", "parameter_count", "flops_per_token"]
