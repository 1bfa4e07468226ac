"""The training job one rank runs: mesh → engine → steps → checkpoints → summary.json.

The host never waits for the device at a step that neither logs, evaluates nor saves: the
trainer's step returns its loss as a device tensor, and the losses since the last read come back
to the host together, with the log's gradient norm, loss scale and peak memory and the ranks' stop
signal, in one copy (:func:`_read_back`) at each log step (``train.log_every``), evaluation step
and checkpoint step, and at the last. A signal is therefore acted on at the next such step
(docs/operations.md: the host syncs of a step).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel4d.checkpoint import dcp as checkpoint
from parallel4d.checkpoint.failures import CheckpointError
from parallel4d.checkpoint.resume import check_start, choose_checkpoint, describe_changes, resume_changes, saved_config
from parallel4d.checkpoint.steps import new_run_id, read_info
from parallel4d.distributed import comm
from parallel4d.distributed import elastic
from parallel4d.config.rules.training import resolve_fused
from parallel4d.config.schema import Config
from parallel4d.data.batches import build_dataset, build_validation
from parallel4d.engine.compose import compose
from parallel4d.engine.flops import flops_per_token
from parallel4d.engine.model import tf32_allowed, use_tf32
from parallel4d.engine.trainer import Trainer
from parallel4d.distributed.mesh import init_mesh
from parallel4d.integrations import deepspeed_integration
from parallel4d.training.checkpoints import check_format, job_files
from parallel4d.training.host_memory import HostPeak
from parallel4d.training.metrics import MetricsLog, gather_objects, gather_per_rank, peak_memory, read_together
from parallel4d.training.signals import silence_a_hung_up_terminal, stop_signals


class _StopFlag:
    """Set by a stop signal (SIGINT, SIGTERM, SIGHUP: :func:`.signals.stop_signals`); the ranks agree on it
    at the steps that read back (:func:`_read_back`), then save and stop."""

    def __init__(self):
        self.signum = 0  # the signal received, 0 for none
        self._old = {}

    def __enter__(self):
        def handler(signum, frame):
            self.signum = signum
            silence_a_hung_up_terminal()  # a closed terminal's SIGHUP: the save must not fail saying so

        for sig in stop_signals():
            try:
                self._old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def post(self, mesh) -> torch.Tensor:
        """The largest signal number any rank got, float32 ``[1]`` on the mesh's device: a collective over
        all ranks, not read back (:meth:`name` it once read)."""
        # NCCL groups take device tensors only; a fill, where torch.tensor([...], device=) would copy and wait
        flag = torch.full((1,), float(self.signum), device=mesh.device)
        work = comm.all_reduce(flag, None, op=dist.ReduceOp.MAX, label="stop signal", async_op=True)
        comm.wait(work, mesh.timeout_s, "stop-signal agreement at the step boundary", mesh.deadlines)
        return flag

    @staticmethod
    def name(signum: float) -> str | None:
        """The signal that stops every rank (``"SIGTERM"`` before ``"SIGINT"`` before ``"SIGHUP"``: the larger
        number, whichever rank got it), or None to go on."""
        return signal.Signals(int(signum)).name if signum else None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Progress:
    """Rank 0's progress: a tqdm bar on a terminal, plain log lines elsewhere (CI, files)."""

    def __init__(self, cfg: Config, initial: int, enabled: bool):
        self.cfg, self.enabled, self.bar = cfg, enabled, None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=initial, desc="parallel4d", unit="step", file=sys.stderr)

    def update(self, step: int, loss: float | None, tokens_per_second: float, elapsed: float) -> None:
        """After ``step``; ``loss`` where the step read it back (a log step always does)."""
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{tokens_per_second:,.0f}")
        elif self.enabled and _logged(step, self.cfg):
            _log(f"[parallel4d] step {step}/{self.cfg.train.steps} loss {loss:.4f} "
                 f"{tokens_per_second:,.0f} tokens/s ({elapsed:.1f}s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Run:
    """What a run carries across restarts: its id, loss history, training time, and checkpoints.

    The loss history, the seconds trained and the session's throughput are stored in each checkpoint
    (``run.json``), so a resumed run's summary covers the whole run whatever state summary.json is in.
    """

    def __init__(self, cfg: Config, engine: Trainer, ckpt_dir: Path, lead: bool):
        self.cfg, self.engine, self.ckpt_dir, self.lead = cfg, engine, ckpt_dir, lead
        self.run_id = new_run_id()  # only rank 0's (the writer's) is used
        self.losses: list[float] = []
        self.validation: list[dict] = []  # {"step", "loss", "perplexity"} per evaluation
        self.memory: dict | None = None  # measured at this process's first step
        self.router: dict | None = None  # MoE: the logged steps' auxiliary losses and the last expert load
        self.prior_seconds = 0.0  # trained before this process started
        self.prior_throughput: dict = {}  # the session before's figures, kept by a resume with nothing to train
        self.start_step = engine.step  # where this session started
        self.resumed_from: int | None = None
        self.changes: list[dict] = []  # a resume's changes from the checkpoint's config (rank 0's)
        self.saved_step: int | None = None  # the step whose state is on disk (saved or loaded here)
        self.saved: Path | None = None
        self.extra_files = job_files(cfg, with_pretrained=lead and cfg.checkpoint.enabled)  # read once
        # train.fp8: each rank's linears computing in FP8, gathered once (summary.json's fp8: what check reads)
        self.fp8 = gather_objects(engine.fp8_linears()) if cfg.train.fp8 != "none" else None

    def note_router(self, record: dict) -> None:
        """MoE: a logged step's auxiliary loss and expert load, for summary.json's ``moe`` (this session's)."""
        if "expert_load" not in record:
            return
        load = record["expert_load"]
        self.router = {"aux_loss": [*(self.router or {}).get("aux_loss", []), [record["step"], record["aux_loss"]]],
                       "expert_load": load, "max_load_over_mean": max(load) * len(load)}

    def resume(self, summary_path: Path) -> None:
        """Load the checkpoint :func:`choose_checkpoint` picks (every rank calls this)."""
        found = choose_checkpoint(self.ckpt_dir)
        if found is None:
            if self.lead:
                _log(f"[parallel4d] train.resume: no checkpoint under {self.ckpt_dir}; starting from step 0")
            return
        info = read_info(found)
        check_format(found, self.engine, info)
        self.engine.load_checkpoint(found)  # choose_checkpoint verified its files
        self.run_id = info.get("run_id") or self.run_id
        before = _summary_before(summary_path)  # for checkpoints saved before run.json held the history
        self.losses = list(info["losses"] if "losses" in info else before.get("losses", []))
        del self.losses[self.engine.step:]
        self.validation = [v for v in info.get("validation", []) if v["step"] <= self.engine.step]
        self.prior_seconds = float(info.get("seconds", 0.0))
        figures = info if _THROUGHPUT[0] in info else before  # run.json's, else the summary's (older checkpoints)
        self.prior_throughput = {k: figures[k] for k in _THROUGHPUT if k in figures}
        self.resumed_from = self.saved_step = self.start_step = self.engine.step
        self.saved = found
        if self.lead:
            self.changes = _changes_since(found, self.cfg)
            said = f", with changes: {describe_changes(self.changes)}" if self.changes else ""
            _log(f"[parallel4d] resumed from {found} at step {self.engine.step}{said}")

    def throughput(self, seconds: float) -> dict:
        """This session's tokens and model FLOPs per second over ``seconds``; a session that trained nothing
        (a complete run resumed) has no figures of its own and keeps those of the session before it."""
        trained = self.engine.step - self.start_step
        if trained == 0 and self.prior_throughput:
            return dict(self.prior_throughput)
        tokens_per_second = trained * self.cfg.data.batch_size * self.cfg.model.seq_len / max(seconds, 1e-9)
        return {"tokens_per_second": tokens_per_second,
                "model_flops_per_second": tokens_per_second * flops_per_token(self.cfg)}

    def save(self, seconds: float, final: bool) -> float | None:
        """Checkpoint the current step (with this session's figures, for a resume that trains nothing);
        the seconds it took, None when nothing was saved. A failing periodic save warns and training
        goes on; a failing final save raises :class:`CheckpointError`."""
        step = self.engine.step
        if step == self.saved_step:  # e.g. Ctrl-C right after a periodic save, or nothing left to train
            return None
        began = time.perf_counter()
        try:
            self.saved = checkpoint.save(
                self.engine.checkpoint_state(), self.ckpt_dir, step, keep=self.cfg.checkpoint.keep,
                extra_files=self.extra_files, run_id=self.run_id,
                info={"losses": self.losses, "validation": self.validation, "seconds": self.prior_seconds + seconds,
                      "format": self.engine.checkpoint_format, **self.throughput(seconds)})
            self.saved_step = step
            return time.perf_counter() - began
        except CheckpointError as e:
            if final:
                raise
            if self.lead:
                _log(f"[parallel4d] warning: {e}. Training goes on (the state is in memory); "
                     "the next checkpoint tries again")
            return None


def _changes_since(checkpoint: Path, cfg: Config) -> list[dict]:
    """What ``cfg`` changes from the config ``checkpoint`` was saved with (none where it has no readable one)."""
    try:
        return resume_changes(saved_config(checkpoint), cfg)
    except (CheckpointError, OSError, ValueError):
        return []


def world_line(cfg: Config, mesh, parameters: int) -> str:
    """The run's first log line: the world, the mesh's axes (and ``ep`` where experts are split over the
    data replicas: it adds no axis of its own), the parameters per rank and the steps."""
    axes = [f"{a}={n}" for a, n in mesh.shape.items()] + ([f"ep={cfg.parallel.ep}"] if cfg.parallel.ep > 1 else [])
    return (f"[parallel4d] world {mesh.world_size} ({', '.join(axes)}), {parameters / 1e6:.2f}M parameters per rank, "
            f"{cfg.train.steps} steps")


def _summary_before(path: Path) -> dict:
    """The summary.json a resumed run finds ({} if none or unreadable)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


_THROUGHPUT = ("tokens_per_second", "model_flops_per_second")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def run_training(cfg: Config) -> dict:
    """Train ``cfg`` on this rank (the default process group must exist or be joinable).

    Returns the summary on rank 0 and ``{"rank": r, "stop_signal": …}`` elsewhere. The summary is
    written to ``<train.out_dir>/summary.json`` at each checkpoint and at the end;
    after a resume it covers the whole run: ``losses`` from step 1, ``seconds``
    (training time of all sessions), while ``tokens_per_second`` is this session's (the session
    before's when this one had nothing left to train). ``finished`` once ``train.steps`` are done;
    ``stop_signal``: the signal that stopped the run before that. A run that returns has taken its
    hooks off the model and destroyed the process groups it made (the default group stays).
    """
    out_dir = Path(cfg.train.out_dir)
    ckpt_dir = cfg.checkpoint_dir
    if cfg.checkpoint.enabled:  # a run that never saves cannot spoil a directory's checkpoints
        check_start(ckpt_dir, cfg.train.resume)
    p = cfg.parallel
    mesh = init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=cfg.train.timeout_s)
    use_tf32(tf32_allowed(cfg, mesh.device))  # this process's matmul precision, before any model is built
    if elastic.under_torchelastic():  # nodes started apart: one config, one checkpoint directory
        elastic.check_nodes_agree(cfg.model_dump(mode="json"), ckpt_dir if cfg.checkpoint.enabled else None)
    rank = dist.get_rank()
    lead = rank == 0
    data, val = build_dataset(cfg), build_validation(cfg)
    host = HostPeak()  # the baseline just before the model is built (summary.json's hetero.host_rss_*)
    engine: Trainer = (compose(cfg, mesh) if cfg.deepspeed is None
                       else deepspeed_integration().DeepSpeedTrainer(cfg, mesh))
    summary_path = out_dir / "summary.json"
    run = _Run(cfg, engine, ckpt_dir, lead)
    if cfg.train.resume:
        run.resume(summary_path)
    losses = run.losses

    metrics = None
    if lead:
        out_dir.mkdir(parents=True, exist_ok=True)
        _log(world_line(cfg, mesh, engine.parameter_count()))
        metrics = MetricsLog(out_dir, run.resumed_from, tensorboard=cfg.train.tensorboard)
        if run.resumed_from is not None:  # where the curves continue, under which layout, with what changed
            metrics.event("resume", run.resumed_from, checkpoint=str(run.saved), parallel=cfg.parallel.model_dump(),
                          changes=run.changes)
    interrupted: str | None = None  # the signal that stopped the run early
    start = time.perf_counter()
    interval = _Interval(start, engine.step)

    def write_summary(elapsed: float, finished: bool) -> dict:
        summary = _summary(cfg, mesh, engine, run, elapsed, interrupted, finished, host)
        _write_json(summary_path, summary)
        return summary

    progress = _Progress(cfg, engine.step, enabled=lead)
    pending: list[torch.Tensor] = []  # the losses of the steps since the last read, on the device
    # Until the end, final save and summary included: a signal after the agreement must not kill them.
    with _StopFlag() as stop:
        while engine.step < cfg.train.steps:
            tokens, targets = data.batch(engine.step, engine.data_rows())
            evaluated = _evaluated(engine.step + 1, cfg)
            logged = evaluated or _logged(engine.step + 1, cfg)
            measure = engine.step == run.start_step  # this process's first step
            pending.append(engine.train_step(tokens, targets, measure_grad_norm=logged, measure_memory=measure))
            held = engine.held_memory() if measure else None
            if held is not None:  # what every rank held at it (memory.py), for summary.json
                run.memory = {"step": engine.step, "per_rank": gather_objects(held)}
            last = engine.step == cfg.train.steps  # nothing is left for a signal to stop
            saving = not last and _saved(engine.step, cfg)
            elapsed = time.perf_counter() - start
            tps = (engine.step - run.start_step) * tokens.numel() / max(elapsed, 1e-9)
            if not (logged or saving or last):  # nothing to read: the host runs on ahead of the device
                progress.update(engine.step, None, tps, elapsed)
                continue
            read = _read_back(engine, mesh, losses, pending, stop=None if last else stop, logged=logged)
            progress.update(engine.step, losses[-1], tps, elapsed)
            if evaluated:
                run.validation.append(_validate(cfg, engine, val, mesh))
                if lead:
                    v = run.validation[-1]
                    _log(f"[parallel4d] step {engine.step}/{cfg.train.steps} validation loss {v['loss']:.4f} "
                         f"perplexity {v['perplexity']:.2f}")
            if logged:
                record = _metrics_record(cfg, mesh, engine, losses[-1], read, interval.tokens_per_second(engine.step, tokens))
                if evaluated:
                    record.update(val_loss=run.validation[-1]["loss"], val_perplexity=run.validation[-1]["perplexity"])
                run.note_router(record)
                if metrics is not None:
                    metrics.write(record)
            if last:
                break
            if saving:
                _record_save(metrics, engine.step, run.save(elapsed, final=False), final=False)
                if lead:
                    _try_write(write_summary, elapsed, finished=False)
            interrupted = _StopFlag.name(read["signal"][0])
            if interrupted:
                if lead:
                    _log(f"[parallel4d] {interrupted} at step {engine.step}: saving a checkpoint and stopping")
                break
        progress.close()
        elapsed = time.perf_counter() - start
        if cfg.checkpoint.enabled:
            if lead:  # the loss history is on disk even if the final save fails or is killed
                _try_write(write_summary, elapsed, finished=False)
            _record_save(metrics, engine.step, run.save(elapsed, final=True), final=True)
        if lead:
            metrics.close()
            summary = write_summary(elapsed, finished=engine.step >= cfg.train.steps)
            _log(f"[parallel4d] done: {engine.step} steps, last loss {losses[-1] if losses else float('nan'):.4f}, "
                 f"{summary['tokens_per_second']:,.0f} tokens/s; summary in {summary_path}")
    # so that this process may train again without keeping this run's groups and their threads
    engine.close()
    mesh.close()
    return summary if lead else {"rank": rank, "stop_signal": interrupted}


def _record_save(metrics: MetricsLog | None, step: int, seconds: float | None, final: bool) -> None:
    """Rank 0 records a checkpoint save that took ``seconds`` (None: nothing was saved) in metrics.jsonl:
    the next record's throughput includes them (the plot marks it)."""
    if metrics is not None and seconds is not None:
        metrics.event("save", step, seconds=seconds, final=final)


def _settle(mesh, what: str) -> None:
    """Before the host reads the device: where waits are stream-ordered (NCCL), wait, bounded, until the
    device got past all it was given (``CommTimeout`` naming the first wait past its limit: a peer
    stopped), so that the read itself cannot hang (:mod:`parallel4d.distributed.deadlines`)."""
    if mesh.deadlines is not None:
        mesh.deadlines.settle(what)


def _logged(step: int, cfg: Config) -> bool:
    """Whether ``step`` gets a progress line and a metrics record (the same answer on every rank)."""
    return step % cfg.train.log_every == 0 or step == cfg.train.steps


def _saved(step: int, cfg: Config) -> bool:
    """Whether ``step`` ends with a periodic checkpoint (every ``checkpoint.every`` steps)."""
    return bool(cfg.checkpoint.enabled and cfg.checkpoint.every and step % cfg.checkpoint.every == 0)


def _read_back(engine: Trainer, mesh, losses: list[float], pending: list[torch.Tensor], stop: _StopFlag | None,
               logged: bool) -> dict:
    """What the host needs after this step, read back from the device together (one wait on a GPU):
    the ``pending`` losses (since the last read; moved to ``losses`` as floats — one that diverged
    raises, naming its step: :func:`_diverged`); where ``logged``, the gradient norm, float16's loss scale and skipped
    steps and every rank's peak memory (``peaks``, collective); with ``stop``, the signal number every
    rank agrees on (``signal``, collective). The same steps call it on every rank."""
    values: dict = {"losses": list(pending)}
    if logged:
        values.update(grad_norm=engine.last_grad_norm, peaks=gather_per_rank(peak_memory(mesh.device)[0], mesh))
        values.update(engine.router_load() or {})  # MoE: aux_loss, expert_load
        scaler = engine.loss_scaler()
        if scaler is not None:
            values.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
    if stop is not None:
        values["signal"] = stop.post(mesh)
    _settle(mesh, f"step {engine.step}: the device finishing the step before its read-back")
    read = read_together(values)
    first = engine.step - len(pending) + 1
    pending.clear()
    for k, loss in enumerate(read["losses"]):
        if _diverged(loss):
            raise FloatingPointError(f"loss became {loss} at step {first + k}; lower optimizer.lr or set "
                                     "train.grad_clip")
    losses.extend(read["losses"])
    return read


def _diverged(loss: float) -> bool:
    """A loss that is not finite, or beyond float32's range (infinite in the float32 the model
    computes in by default: a run diverged, whatever the dtype the loss is read in)."""
    return not math.isfinite(loss) or abs(loss) > _FLOAT32_MAX


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _evaluated(step: int, cfg: Config) -> bool:
    """Whether ``step`` ends with a validation (every ``train.eval_every`` steps, and the last)."""
    every = cfg.train.eval_every
    return every is not None and (step % every == 0 or step == cfg.train.steps)


def _validate(cfg: Config, engine: Trainer, val, mesh) -> dict:
    """The mean loss of the ``train.eval_batches`` validation batches, and its perplexity (read back
    once, after the last batch)."""
    rows = engine.data_rows()
    total = sum(engine.evaluate(*val.batch(k, rows)) for k in range(cfg.train.eval_batches))
    _settle(mesh, f"step {engine.step}: the device finishing the validation batches")
    loss = float(total) / cfg.train.eval_batches
    return {"step": engine.step, "loss": loss, "perplexity": math.exp(min(loss, 700.0))}


class _Interval:
    """Throughput since the previous metrics record."""

    def __init__(self, start: float, step: int):
        self.time, self.step = start, step

    def tokens_per_second(self, step: int, batch: torch.Tensor) -> float:
        now = time.perf_counter()
        tps = (step - self.step) * batch.numel() / max(now - self.time, 1e-9)
        self.time, self.step = now, step
        return tps


def _metrics_record(cfg: Config, mesh, engine: Trainer, loss: float, read: dict, tokens_per_second: float) -> dict:
    """One line of metrics.jsonl (:mod:`.metrics`) from the values a logged step read back
    (:func:`_read_back`); float16 adds the loss scale after the step and how many steps overflowed
    and were skipped."""
    record = {
        "step": engine.step, "loss": loss, "lr": engine.last_lr, "grad_norm": read["grad_norm"],
        "tokens_per_second": tokens_per_second,
        "model_flops_per_second": tokens_per_second * flops_per_token(cfg),
        "peak_memory_bytes": [int(v) for v in read["peaks"]], "peak_memory_kind": peak_memory(mesh.device)[1],
        "bytes_sent_by_axis": dict(mesh.comm_stats.axis_sent),
    }
    if "loss_scale" in read:
        record.update(loss_scale=read["loss_scale"], skipped_steps=int(read["skipped_steps"]))
    if "expert_load" in read:  # MoE: the auxiliary loss and each expert's share of the step's picks
        record.update(aux_loss=read["aux_loss"], expert_load=read["expert_load"])
    return record


def _try_write(write, *args, **kwargs) -> None:
    try:
        write(*args, **kwargs)
    except OSError as e:  # a full disk must not stop training; the final write raises
        _log(f"[parallel4d] warning: summary.json not written ({e}); training goes on")


def _summary(cfg: Config, mesh, engine: Trainer, run: _Run, elapsed: float, interrupted: str | None,
             finished: bool, host: HostPeak) -> dict:
    summary = {
        "losses": run.losses,
        "validation": run.validation,
        "steps": engine.step,
        "interrupted": interrupted is not None,
        "stop_signal": interrupted,  # SIGINT, SIGTERM or SIGHUP when a signal stopped the run early
        "finished": finished,
        "resumed_from": run.resumed_from,
        "resumed_with_changes": run.changes if run.resumed_from is not None else None,
        "checkpoint": str(run.saved) if run.saved else None,
        **run.throughput(elapsed),
        "seconds": run.prior_seconds + elapsed,
        "world_size": mesh.world_size,
        "parallel": cfg.parallel.model_dump(),
        "parameters": engine.parameter_count(),
        "bytes_communicated": mesh.comm_stats.as_dict(),
        "device": str(mesh.device),
        "fused": resolve_fused(cfg.train.fused),
        "torch": torch.__version__,
        "config": cfg.model_dump(mode="json"),
    }
    if elastic.under_torchelastic():  # which torchrun attempt wrote this (restarts so far, nodes)
        summary["elastic"] = elastic.attempt()
    read = engine.pretrained_bytes()
    if read is not None:  # rank 0's share of the Hugging Face weights
        summary["pretrained"] = {"directory": cfg.model.pretrained, "bytes_read_by_rank_0": read}
    if run.memory is not None:
        summary["memory"] = run.memory
    hetero = engine.hetero_stats()
    if hetero is not None:  # with the peak resident set this process grew by from the model's build on
        summary["hetero"] = {**hetero, **host.per_param(hetero["params"])}
    pipeline = engine.pipeline_step_info()
    if pipeline is not None:
        summary["pipeline"] = {"schedule": cfg.pipeline.schedule, **pipeline}
    if run.router is not None:  # [step, aux_loss] per logged step; the last logged step's expert load
        summary["moe"] = run.router
    if run.fp8 is not None:
        summary["fp8"] = {"recipe": cfg.train.fp8, "linears_per_rank": run.fp8}
    return summary
