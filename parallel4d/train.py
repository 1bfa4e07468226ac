"""The training job one rank runs: mesh → engine → steps → checkpoints → summary.json."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint
from .config import Config
from .data import build_dataset
from .engine import compose, flops_per_token, parameter_count
from .mesh import init_mesh


class _StopFlag:
    """Set by SIGINT/SIGTERM; the ranks agree on it at step boundaries, then save and stop."""

    def __init__(self):
        self.set = False
        self._old = {}

    def __enter__(self):
        def handler(signum, frame):
            self.set = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.set else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Progress:
    """Rank 0's progress: a tqdm bar on a terminal, plain log lines elsewhere (CI, files)."""

    def __init__(self, cfg: Config, initial: int, enabled: bool):
        self.cfg, self.enabled, self.bar = cfg, enabled, None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=initial, desc="parallel4d", unit="step", file=sys.stderr)

    def update(self, step: int, loss: float, tokens_per_second: float, elapsed: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{tokens_per_second:,.0f}")
        elif self.enabled and (step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps):
            _log(f"[parallel4d] step {step}/{self.cfg.train.steps} loss {loss:.4f} "
                 f"{tokens_per_second:,.0f} tokens/s ({elapsed:.1f}s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_training(cfg: Config) -> dict:
    """Train ``cfg`` on this rank (the default process group must exist or be joinable).

    Returns the summary on rank 0 (also written to ``<train.out_dir>/summary.json``)
    and ``{"rank": r}`` elsewhere.
    """
    p = cfg.parallel
    mesh = init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=cfg.train.timeout_s)
    rank = dist.get_rank()
    lead = rank == 0
    engine = compose(cfg, mesh)
    data = build_dataset(cfg)
    out_dir = Path(cfg.train.out_dir)
    ckpt_dir = Path(cfg.checkpoint.dir or out_dir / "checkpoints")
    losses: list[float] = []
    summary_path = out_dir / "summary.json"

    if cfg.train.resume:
        found = checkpoint.latest_checkpoint(ckpt_dir)
        if found is not None:
            state = engine.state_dict()
            checkpoint.load(state, found)
            engine.load_state_dict(state)
            if summary_path.is_file():
                losses = json.loads(summary_path.read_text()).get("losses", [])[: engine.step]
            if lead:
                _log(f"[parallel4d] resumed from {found} at step {engine.step}")
        elif lead:
            _log(f"[parallel4d] train.resume: no checkpoint under {ckpt_dir}; starting from step 0")

    def save_checkpoint():
        checkpoint.save(engine.state_dict(), ckpt_dir, engine.step, keep=cfg.checkpoint.keep,
                        extra_files={"config.yaml": cfg.to_yaml()})

    if lead:
        out_dir.mkdir(parents=True, exist_ok=True)
        _log(f"[parallel4d] world {mesh.world_size} ({', '.join(f'{a}={n}' for a, n in mesh.shape.items())}), "
             f"{parameter_count(engine.model) / 1e6:.2f}M parameters per rank, {cfg.train.steps} steps")
    interrupted = False
    start = time.perf_counter()
    start_step = engine.step
    progress = _Progress(cfg, engine.step, enabled=lead)
    with _StopFlag() as stop:
        while engine.step < cfg.train.steps:
            tokens, targets = data.batch(engine.step)
            loss = engine.train_step(tokens, targets)
            losses.append(loss)
            if not torch.isfinite(torch.tensor(loss)):
                raise FloatingPointError(f"loss became {loss} at step {engine.step}; lower optimizer.lr "
                                         "or set train.grad_clip")
            elapsed = time.perf_counter() - start
            tps = (engine.step - start_step) * tokens.numel() / max(elapsed, 1e-9)
            progress.update(engine.step, loss, tps, elapsed)
            if cfg.checkpoint.enabled and cfg.checkpoint.every and engine.step % cfg.checkpoint.every == 0 \
                    and engine.step < cfg.train.steps:
                save_checkpoint()
            if stop.agreed():
                interrupted = True
                if lead:
                    _log(f"[parallel4d] interrupted at step {engine.step}: saving a checkpoint and stopping")
                break
    progress.close()
    elapsed = time.perf_counter() - start
    if cfg.checkpoint.enabled:
        save_checkpoint()
    trained = engine.step - start_step
    tokens_per_second = trained * cfg.data.batch_size * cfg.model.seq_len / max(elapsed, 1e-9)
    if not lead:
        return {"rank": rank}
    summary = {
        "losses": losses,
        "steps": engine.step,
        "interrupted": interrupted,
        "tokens_per_second": tokens_per_second,
        "model_flops_per_second": tokens_per_second * flops_per_token(cfg),
        "seconds": elapsed,
        "world_size": mesh.world_size,
        "parallel": cfg.parallel.model_dump(),
        "parameters": parameter_count(engine.model),
        "bytes_communicated": mesh.comm_stats.as_dict(),
        "device": str(mesh.device),
        "torch": torch.__version__,
        "config": cfg.model_dump(mode="json"),
    }
    if engine.hetero is not None:
        summary["hetero"] = engine.hetero.stats()
    if engine.executor is not None:
        summary["pipeline"] = {"schedule": cfg.pipeline.schedule, **engine.last_step_info}
    tmp = summary_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, summary_path)
    _log(f"[parallel4d] done: {engine.step} steps, last loss {losses[-1]:.4f}, "
         f"{tokens_per_second:,.0f} tokens/s; summary in {summary_path}")
    return summary
