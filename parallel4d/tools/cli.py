"""Command line: ``parallel4d launch | validate | plan | check | schedule | checkpoint gather | export | tokenize | plot | generate``."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from parallel4d.checkpoint.outputs import check_output, write_text
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config
from parallel4d.config.rules.pipeline import SCHEDULES
from parallel4d.config.schema import Config
from parallel4d.launcher.preflight import check_job, under_torchrun
from parallel4d.training.signals import silence_a_hung_up_terminal, stop_signals

# Each command imports its own module (torch, and the extras it needs) when it runs, never here:
# `parallel4d validate` then needs neither.


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job YAML file (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one field, e.g. --set train.steps=50 (repeatable)")


def _job_command(command):
    """``command`` with a job's or a checkpoint's failure said in one line: exit 2 for a checkpoint it
    refuses (as for every refusal), 1 for a failed job or checkpoint I/O, 128 + the signal for a job a
    signal ended. Their classes are imported when the command runs (their modules need torch;
    ``validate`` does without)."""

    @functools.wraps(command)
    def run(args) -> int:
        from parallel4d.checkpoint.failures import CheckpointError, UnusableCheckpoint
        from parallel4d.launcher.supervise import Interrupted, WorkerError, WorkerTimeout

        try:
            return command(args)
        except UnusableCheckpoint as e:
            return _refused(str(e))
        except CheckpointError as e:
            print(f"parallel4d: {e}", file=sys.stderr)
            return 1
        except (WorkerError, WorkerTimeout) as e:
            print(f"parallel4d: the job failed: {e}", file=sys.stderr)
            return 1
        except Interrupted as e:  # a signal stopped the job before its workers could save: what was lost
            print(f"parallel4d: {e}", file=sys.stderr)
            return 128 + e.signum

    return run


def _device_type(cfg: Config) -> str:
    """The device type the job runs on, where a check depends on it: a ``deepspeed:`` section's
    rules are per device, ``train.device=cuda`` is refused without a GPU, and a dynamic hetero budget
    without one. Only then is torch asked (imported here); no other check reads it, and ``validate``
    runs without torch."""
    dynamic = cfg.hetero.enabled and cfg.hetero.dynamic_budget
    if cfg.deepspeed is None and cfg.train.device != "cuda" and not dynamic:
        return "cpu"  # read by no check
    from parallel4d.distributed.startup import device_and_backend

    return device_and_backend(cfg)[0]


def _cmd_validate(args) -> int:
    cfg = load_config(args.config, args.overrides)
    check_job(cfg, not under_torchrun(), _device_type(cfg), args.config)
    print(cfg.shown_yaml(), end="")  # model: only the fields its family reads
    p = cfg.parallel
    print(f"# world size: {cfg.world_size} = pp·dp·sp·tp = {p.pp}·{p.dp}·{p.sp}·{p.tp}"
          + (f"; experts split over ep={p.ep} of the dp·sp = {p.dp * p.sp} data-replica ranks" if p.ep > 1 else ""))
    return 0


def _cut(cfg: Config) -> str:
    """The pipeline's chunks as stage names, ``embed–blocks.1 | blocks.2–head``."""
    from parallel4d.engine.compose import pipeline_cut

    last = cfg.model.layers + 1
    name = lambda i: "embed" if i == 0 else "head" if i == last else f"blocks.{i - 1}"  # noqa: E731
    ranges = pipeline_cut(cfg, cfg.pipeline.num_chunks(cfg.parallel.pp))
    return " | ".join(name(r[0]) if len(r) == 1 else f"{name(r[0])}–{name(r[-1])}" for r in ranges)


@_job_command
def _cmd_plan(args) -> int:
    """The resolved layout and, per rank, the bytes held and sent (a dry run: :mod:`parallel4d.planning.dry_run`)."""
    from parallel4d.tools.largest import check_request, format_largest, largest, largest_json
    from parallel4d.planning.dry_run import HEADROOM, format_fit, format_ranks, parse_bytes, plan, try_knobs

    cfg = load_config(args.config, args.overrides)
    _check_plan_outputs(args)
    memory = check_request(cfg, args.largest, args.gpus_memory, args.host_memory, args.grow)
    profile = _profile(args, cfg)
    if args.search:
        return _search(args, cfg, profile)
    p, m = cfg.parallel, cfg.model
    q = p.q
    micro = cfg.data.batch_size // (p.dp * q * cfg.pipeline.microbatches)
    seq = m.seq_len // p.sp
    capacity = parse_bytes(args.gpus_memory) if args.gpus_memory else None
    print(f"world size      {cfg.world_size}  ({p.sizes} → q={q})")
    print(f"mesh shape      (pp, dp, sp, tp_row, tp_col) = ({p.pp}, {p.dp}, {p.sp}, {q}, {q})")
    print(f"model           {m.layers} layers, hidden {m.hidden}, {m.heads} heads, vocab {m.vocab_size}, seq {m.seq_len}")
    print(f"pipeline        {cfg.pipeline.schedule}, {cfg.pipeline.num_chunks(p.pp)} chunks, "
          f"{cfg.pipeline.microbatches} micro-batches")
    if p.pp > 1:
        print(f"chunks          {_cut(cfg)}  (cut by training FLOPs per token)")
    print(f"activation/rank [b/(dp·q)/m, s/sp, h/q] = [{micro}, {seq}, {m.hidden // q}]")
    fp8 = f", FP8 {cfg.train.fp8} products in the blocks' linears" if cfg.train.fp8 != "none" else ""
    print(f"precision       parameters {cfg.train.parameters}, autocast {cfg.train.autocast}{fp8}, "
          f"activation checkpointing {cfg.train.activation_checkpointing}")
    ranks = plan(cfg, timed=profile is not None)
    print("\n".join(format_ranks(ranks)))
    if cfg.model.num_experts:
        from parallel4d.planning.dry_run import moe_layer_activations
        from parallel4d.planning.moe import figures, format_experts

        print("\n".join(format_experts(figures(cfg, max(r.expert_parameters or 0 for r in ranks)),
                                        moe_layer_activations(cfg))))
    if profile is not None:
        from parallel4d.planning.cost import format_prediction, predict

        print("\n".join(format_prediction(predict(cfg, ranks, profile), profile)))
    if cfg.deepspeed is not None:
        print("note: these are parallel4d's own engine's numbers; under the deepspeed section, DeepSpeed's ZeRO "
              "shards the optimizer state (stage ≥ 1) and gradients (stage 2) over dp")
    if capacity is not None:
        need = max(r.device_bytes for r in ranks)
        tried = try_knobs(args.config, args.overrides, cfg) if need > HEADROOM * capacity else []
        print("\n".join(format_fit(ranks, capacity, tried)))
    found = None
    if memory is not None:
        found = largest(cfg, memory, args.grow or "shapes")
        print("\n".join(format_largest(found, memory)))
    if args.json:
        per_rank = [{**asdict(r), "device_bytes": r.device_bytes, "host_bytes": r.host_bytes} for r in ranks]
        out = per_rank if found is None else {"ranks": per_rank, **largest_json(found, memory)}
        write_text(args.json, "--json", json.dumps(out, indent=1))
    return 0


def _check_plan_outputs(args) -> None:
    """``--json``, ``--write`` and ``--write-profile`` checked before the dry run or the search (never onto
    the job file or the profile it reads, nor into a checkpoint: :func:`.outputs.check_output`), ``~``
    expanded in ``args``."""
    inputs = [(Path(args.config), "the job file it plans")]
    if args.device and Path(args.device).is_file():
        inputs.append((Path(args.device), "the device profile it reads"))
    for flag in ("--json", "--write", "--write-profile"):
        name = flag[2:].replace("-", "_")
        if getattr(args, name):
            setattr(args, name, check_output(getattr(args, name), flag, inputs))


def _profile(args, cfg: Config):
    """The device profile ``--device`` names or ``--calibrate`` measures (ConfigError for flags that do not
    go together, before anything runs); None without either."""
    from parallel4d.planning import profiles

    if args.search and (args.gpus is None or args.gpus_memory is None):
        raise ConfigError("--search needs --gpus N (the devices to lay out) and --gpu-memory SIZE (each one's, e.g. 80GiB)")
    if not args.search:
        for flag, value in (("--gpus", args.gpus), ("--write", args.write)):
            if value is not None:
                raise ConfigError(f"{flag} is read only with --search; add --search or remove {flag}")
    if args.search and (cfg.hetero.enabled or cfg.deepspeed is not None):
        raise ConfigError("--search lays out parallel4d's own engine without hetero: set hetero.enabled=false and "
                          "remove the deepspeed section for the search (plan a hetero job without --search)")
    if args.device and args.calibrate:
        raise ConfigError("--device and --calibrate both name the device; keep one")
    if args.write_profile and not args.calibrate:
        raise ConfigError("--write-profile saves what --calibrate measures; add --calibrate")
    if args.device:
        return profiles.load(args.device)
    if args.calibrate:
        from parallel4d.planning.calibrate import calibrate_for

        found = calibrate_for(cfg)
        if args.write_profile:
            profiles.save(found, args.write_profile)
        return found
    if args.search:
        raise ConfigError("--search ranks by predicted time: add --device h100 (or h200, or a profile file) or --calibrate")
    return None


def _search(args, cfg: Config, profile) -> int:
    from parallel4d.planning.search import format_search, search
    from parallel4d.planning.dry_run import parse_bytes

    capacity = parse_bytes(args.gpus_memory, "--gpu-memory")
    ranked = search(args.config, args.overrides, args.gpus, capacity, profile, args.verify_seconds, top=args.top)
    print("\n".join(format_search(ranked, capacity, args.top)))
    if not ranked:
        return 1
    if args.write:
        write_text(args.write, "--write", f"# parallel4d plan --search --gpus {args.gpus} --gpu-memory "
                   f"{args.gpus_memory}: {ranked[0].describe()}\n" + ranked[0].cfg.shown_yaml())
        print(f"wrote {args.write}")
    return 0


@_job_command
def _cmd_launch(args) -> int:
    """0 when the run finished; 128 + the signal when one stopped it early (a rank under torchrun that got
    SIGTERM, or stopped with the rank that got it), so that neither torchrun nor a scheduler takes a
    saved-and-stopped run for a finished one."""
    from parallel4d.launcher.launch import launch

    summary = launch(args.config, args.overrides)
    if "losses" in summary:  # rank 0 reports (the other ranks under torchrun return only their rank)
        losses = summary["losses"]
        print(json.dumps({"steps": summary.get("steps"), "first_loss": losses[0] if losses else None,
                          "last_loss": losses[-1] if losses else None,
                          "tokens_per_second": summary.get("tokens_per_second")}))
    stopped_by = summary.get("stop_signal")
    if stopped_by is None:
        return 0
    if "losses" in summary:
        print(f"parallel4d: stopped by {stopped_by} at step {summary.get('steps')}, {_what_was_saved(summary)}",
              file=sys.stderr)
    return 128 + signal.Signals[stopped_by].value


def _what_was_saved(summary: dict) -> str:
    """The checkpoint a stopped run's summary names, said only once its files verify."""
    from parallel4d.checkpoint.checksums import verify

    saved = summary.get("checkpoint")
    if saved is None:
        return "with nothing saved (checkpoint.enabled is false)"
    problem = verify(saved)
    if problem is not None:
        return f"but its checkpoint {saved} does not verify: {problem}"
    return f"after saving checkpoint {saved} (verified; continue with --set train.resume=true)"


@_job_command
def _cmd_gather(args) -> int:
    from parallel4d.checkpoint.gather import gather, resolve_checkpoint
    from parallel4d.checkpoint.steps import describe_checkpoint

    ckpt = resolve_checkpoint(args.checkpoint)
    print(f"gathered {describe_checkpoint(ckpt)} into {gather(ckpt, args.out)}")
    return 0


@_job_command
def _cmd_export(args) -> int:
    from parallel4d.checkpoint.export import export
    from parallel4d.checkpoint.gather import resolve_checkpoint
    from parallel4d.checkpoint.steps import describe_checkpoint

    ckpt = resolve_checkpoint(args.checkpoint)  # once: the step said is the step exported
    out = export(ckpt, args.out_dir, max_shard_bytes=int(args.max_shard_gb * 2**30), adapter=args.adapter,
                 base=args.base)
    what = "the LoRA adapter of " if args.adapter else ""
    print(f"exported {what}{describe_checkpoint(ckpt)} to {out}")
    return 0


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP while a command runs outside a job's supervision (a tool; a launch before its
    workers start or after they end): unwound like Ctrl-C, so temporary files go and directories the
    launch made are removed, and said in one line by :func:`main`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _stop_signals_unwind():
    """SIGTERM and SIGHUP (unless ``nohup`` ignores it) raise :class:`_Stopped` here, as SIGINT raises
    KeyboardInterrupt; the launcher's supervisor takes them over while it runs workers."""
    def handler(signum, frame):
        silence_a_hung_up_terminal()  # a closed terminal's SIGHUP: the one line must not fail
        raise _Stopped(signum)

    old = {sig: signal.signal(sig, handler) for sig in stop_signals() if sig != signal.SIGINT}
    try:
        yield
    finally:
        for sig, action in old.items():
            signal.signal(sig, action)


def _signal_number(stop: KeyboardInterrupt) -> int:
    return stop.signum if isinstance(stop, _Stopped) else signal.SIGINT


def _stopped_by(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


@_job_command
def _cmd_tokenize(args) -> int:
    """130 on Ctrl-C (143 on SIGTERM, 129 on SIGHUP), saying that ``-o`` and its sidecar were left as they were."""
    from parallel4d.data.tokenize import tokenize

    try:
        meta = tokenize(args.tokenizer, args.inputs, args.out, eos_token=args.eos_token, workers=args.workers)
    except KeyboardInterrupt as e:
        signum = _signal_number(e)
        print(f"parallel4d: tokenize {_stopped_by(signum)}; nothing was half written ({args.out} and its sidecar "
              "are as they were, or both complete)", file=sys.stderr)
        return 128 + signum
    print(json.dumps(meta))
    return 0


@_job_command
def _cmd_generate(args) -> int:
    from parallel4d.tools.generate import describe_source, generate, model_source

    source = model_source(args.source)  # once: the checkpoint said is the one sampled (stderr: stdout is the text)
    print(f"parallel4d: generating from {describe_source(source)}", file=sys.stderr)
    try:
        text = generate(source, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                        base=args.base)
    except ValueError as e:
        print(f"parallel4d: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


@_job_command
def _cmd_plot(args) -> int:
    from parallel4d.tools.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


@_job_command
def _cmd_check(args) -> int:
    from parallel4d.tools.check import format_report, nothing_to_compare, run_check, shrunk

    if args.keep is not None:  # before the runs: a place to write, outside the job file and any checkpoint
        args.keep = check_output(args.keep, "--keep", [(Path(args.config), "the job file it checks")], "directory")
    alone = None if args.resume_at is not None else nothing_to_compare(args.config, args.overrides)
    if alone:  # a resume is compared with the run that went on: something even for one process
        print(alone)
        return 0
    plan = shrunk(args.config, args.overrides, steps=args.steps, max_workers=args.max_workers)
    keep = args.keep is not None
    out = Path(args.keep) if keep else Path(tempfile.mkdtemp(prefix="parallel4d-check-"))
    try:
        outcome = run_check(args.config, args.overrides, plan, out, resume_at=args.resume_at)
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    print("\n".join(format_report(args.config, plan, outcome)))
    return 0 if outcome.equal else 1


@_job_command
def _cmd_schedule(args) -> int:
    from parallel4d.tools.schedule import run_schedule_command

    return run_schedule_command(args)


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="hanayo", help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--microbatches", "-m", type=int, default=8)
    p.add_argument("--waves", type=int, default=1, help="Hanayo waves W (2·W·pp chunks)")
    p.add_argument("--chunks-per-rank", type=int, default=2, help="chunks per rank for interleaved")
    p.add_argument("--split-backward", action="store_true",
                   help="hanayo: split each backward into B (input gradient) and W (weight gradient)")
    p.add_argument("--forward-cost", type=float, default=1.0, help="one chunk's forward time")
    p.add_argument("--backward-cost", type=float, default=2.0, help="one chunk's backward time")
    p.add_argument("--weight-cost", type=float, default=None,
                   help="a split schedule's W time, part of --backward-cost (default half of it)")
    p.add_argument("--p2p-cost", type=float, default=0.0, help="latency of one cross-rank transfer")
    p.add_argument("--plot", metavar="PNG", help="also write a timeline PNG")


def _refused(message: str) -> int:
    """A refusal: one line of stderr (under torchrun once per node, where every rank refuses the same
    config) and exit 2. Under torchrun it also goes to the error file the agent reports, so that its
    failure summary shows the refusal rather than "To enable traceback see ..."."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"parallel4d: {message}", file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and under_torchrun():
        try:
            Path(error_file).write_text(json.dumps({"message": {"message": f"ConfigError: {message}", "extraInfo": {
                "py_callstack": f"parallel4d: {message}", "timestamp": str(int(time.time()))}}}))
        except OSError:
            pass
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parallel4d", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="train a job (spawns local workers, or joins torchrun)")
    _add_config_args(p)
    p.set_defaults(func=_cmd_launch)
    p = sub.add_parser("validate", help="print the resolved config, or its errors (exit 2)")
    _add_config_args(p)
    p.set_defaults(func=_cmd_validate)
    p = sub.add_parser("plan", help="before anything runs: the mesh, and per rank the bytes of parameters, "
                                    "gradients, optimizer state, activations (hetero's device and host) and "
                                    "the bytes sent per step along each axis")
    _add_config_args(p)
    p.add_argument("--gpus-memory", "--gpu-memory", dest="gpus_memory", default=None, metavar="SIZE",
                   help="each device's memory, e.g. 80GiB: say whether the job fits, and which knob makes it fit")
    p.add_argument("--largest", action="store_true",
                   help="also grow the model to the largest that fits with hetero on --gpu-memory and --host-memory, "
                        "beside the largest DeepSpeed's ZeRO-3 offload estimator admits on the same memory")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="with --largest: the host's memory, shared by all the job's ranks, e.g. 125GiB")
    p.add_argument("--grow", choices=("shapes", "layers"), default=None,
                   help="with --largest: through the family's usual shapes, then layers (shapes, the default), "
                        "or layers only at the config's width")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the per-rank numbers as JSON (with --largest: an object, the ranks under "
                        "\"ranks\" beside largest_params, deepspeed_largest_params and the rest)")
    p.add_argument("--device", default=None, metavar="NAME|FILE",
                   help="also predict the step's time on this device profile (h100, h200, or a profile YAML)")
    p.add_argument("--calibrate", action="store_true",
                   help="also predict the step's time on this machine, measured first (about half a minute)")
    p.add_argument("--write-profile", default=None, metavar="FILE",
                   help="with --calibrate: save the measured profile, for --device FILE later")
    p.add_argument("--search", action="store_true",
                   help="rank every layout of --gpus devices that fits --gpu-memory by predicted tokens/s")
    p.add_argument("--gpus", type=int, default=None, metavar="N", help="with --search: the devices to lay out")
    p.add_argument("--top", type=int, default=8, metavar="K", help="with --search: how many to print (8)")
    p.add_argument("--write", default=None, metavar="FILE", help="with --search: write the best as a job file")
    p.add_argument("--verify-seconds", type=float, default=30.0, metavar="S",
                   help="with --search: time for whole dry runs of the best candidates, best first (30)")
    p.set_defaults(func=_cmd_plan)
    p = sub.add_parser("checkpoint", help="work with checkpoints of any layout")
    ckpt = p.add_subparsers(dest="action", required=True)
    p = ckpt.add_parser("gather", help="write a checkpoint as one dense state dict (torch.load-able)")
    p.add_argument("checkpoint", help="a checkpoint directory (step_*), or a checkpoint root: its newest")
    p.add_argument("out", help="output file, e.g. model.pt")
    p.set_defaults(func=_cmd_gather)
    p = sub.add_parser("export", help="write a checkpoint (any layout) as a Hugging Face model directory (a LoRA "
                                      "job's: the merged model, or with --adapter peft's adapter directory)")
    p.add_argument("checkpoint", help="a checkpoint directory (step_*), or a checkpoint root: its newest")
    p.add_argument("out_dir", help="output directory: config.json and *.safetensors")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size (default 5)")
    p.add_argument("--adapter", action="store_true", help="a LoRA job: the adapter alone in peft's format "
                   "(adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained) instead of "
                   "the merged model")
    p.add_argument("--base", default=None, metavar="DIR", help="a LoRA job: its base model's directory, where it is "
                   "no longer where the checkpoint names it (checked by fingerprint)")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("tokenize", help="text files (or chat .jsonl, saved datasets) → a token file for "
                                        "data.source=tokens (Hugging Face tokenizers)")
    p.add_argument("inputs", nargs="+", help="text files, tokenized in this order, each ending with the "
                                             "end-of-document token; or .jsonl chat/instruction files (messages, or "
                                             "prompt/completion, one conversation a line) or directories of "
                                             "Hugging Face datasets' save_to_disk (one conversation a row), "
                                             "rendered with the tokenizer's chat template, with a loss mask on "
                                             "the answers")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a model directory holding one")
    p.add_argument("-o", "--out", required=True, help="the token file, e.g. data/train.bin (its .json sidecar beside)")
    p.add_argument("--eos-token", default=None, help="the end-of-document token (default: the tokenizer's usual one)")
    p.add_argument("--workers", type=int, default=1, help="processes tokenizing files in parallel (default 1)")
    p.set_defaults(func=_cmd_tokenize)
    p = sub.add_parser("plot", help="draw a run's loss, validation loss, learning rate and throughput into a PNG")
    p.add_argument("run_dir", help="the run's train.out_dir (summary.json, metrics.jsonl)")
    p.add_argument("-o", "--out", default=None, help="the PNG (default RUN_DIR/curves.png)")
    p.set_defaults(func=_cmd_plot)
    p = sub.add_parser("generate", help="sample text from a run's newest checkpoint (any layout) or a Hugging Face "
                                        "directory, in one process")
    p.add_argument("source", help="a run directory (train.out_dir), a checkpoint, or a Hugging Face model directory")
    p.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base", default=None, metavar="DIR", help="a LoRA job's checkpoint: its base model's directory, "
                   "where it is no longer where the checkpoint names it (checked by fingerprint)")
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("check", help="the job's layout and features on a shrunk model, a few float64 steps on "
                                     "CPU against one process: exit 0 when losses and every parameter are equal")
    _add_config_args(p)
    p.add_argument("--steps", type=int, default=3, help="training steps of both runs (default 3)")
    p.add_argument("--max-workers", type=int, default=None, metavar="N",
                   help="local workers at most (default train.max_local_workers); above, the largest "
                        "sub-layout with every parallel axis > 1 that fits")
    p.add_argument("--resume-at", type=int, default=None, metavar="K",
                   help="stop the job after step K and resume it to the end (its checkpoint, as after an interruption)")
    p.add_argument("--keep", metavar="DIR", help="keep both runs (summaries, checkpoints) in DIR")
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("schedule", help="print a pipeline schedule and its simulated bubble / memory")
    _add_schedule_args(p)
    p.set_defaults(func=_cmd_schedule)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _stop_signals_unwind():
            return args.func(args)
    except ConfigError as e:
        return _refused(str(e))
    except KeyboardInterrupt as e:  # a signal outside the job (before its workers started, or after they ended)
        signum = _signal_number(e)
        print(f"parallel4d: {_stopped_by(signum)}", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
