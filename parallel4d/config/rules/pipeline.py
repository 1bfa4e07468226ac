"""The pipeline's rules: the schedule names, how many chunks a schedule cuts the model into, the
micro-batch counts and model sizes it takes, and the split backward. ``pipeline/checks.py`` raises
them for callers of the pipeline API; the config reports them for a job file."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from parallel4d.config.rules.common import did_you_mean, fixed_fields, near_multiples
from parallel4d.config.rules.data import batch_problem

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config


SCHEDULES = ("gpipe", "1f1b", "interleaved", "hanayo", "zb_h1", "zbv")
# Schedules whose backward is always split into B (input gradient) and W (weight gradient);
# hanayo splits it with pipeline.split_backward=true.
SPLIT_SCHEDULES = ("zb_h1", "zbv")


def splits_backward(schedule: str, split_backward: bool) -> bool:
    """Whether the config's schedule runs B and W apart."""
    return schedule in SPLIT_SCHEDULES or (schedule == "hanayo" and split_backward)


_ALIASES = {"one_f_one_b": "1f1b", "interleaved_1f1b": "interleaved", "wave": "hanayo", "dapple": "1f1b", "zbh1": "zb_h1", "zb_v": "zbv"}


def check_schedule_name(name: str) -> str:
    """The canonical schedule name; ``ValueError`` naming the valid ones otherwise."""
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key in SCHEDULES:
        return key
    hint = did_you_mean(str(name).lower(), SCHEDULES)
    raise ValueError(f"pipeline.schedule={name!r} is unknown; {hint}valid: {', '.join(SCHEDULES)}")


def num_chunks(schedule: str, pp: int, waves: int = 1, chunks_per_rank: int = 2) -> int:
    """How many model chunks ``schedule`` cuts the model into on ``pp`` ranks."""
    schedule = check_schedule_name(schedule)
    if schedule == "hanayo":
        return 2 * waves * pp
    if schedule == "interleaved":
        return chunks_per_rank * pp
    if schedule == "zbv":
        return 2 * pp
    return pp


def interleaved_microbatch_problem(pp: int, m: int, chunks_per_rank: int) -> Optional[str]:
    """Interleaved 1F1B takes ``m ≤ P`` or a multiple of ``P`` (see ``interleaved_1f1b``); None if fine."""
    if chunks_per_rank > 1 and m > pp and m % pp:
        return (f"pipeline.microbatches={m}: the interleaved schedule takes micro-batch counts ≤ parallel.pp={pp} "
                f"or multiples of it; use pipeline.microbatches={near_multiples(m, pp)}")
    return None


def pipeline_arg_problems(
    layers: int,
    pp: int,
    microbatches: int,
    schedule: str = "1f1b",
    waves: int = 1,
    chunks_per_rank: int = 2,
    batch: int | None = None,
    batch_divisor: int = 1,
    split_backward: bool = False,
    layers_fixed: bool = False,
) -> list[str]:
    """Every broken pipeline rule as one readable message (empty list = fine).

    ``layers``: transformer blocks (the model has ``layers + 2`` stages: embedding, blocks,
    head; every chunk needs at least one stage). ``batch``: global sequences per step, split
    over ``batch_divisor`` data replicas (dp·q) and then into ``microbatches`` micro-batches.
    ``layers_fixed``: the layers are not the job's to change (model.pretrained).
    """
    try:
        schedule = check_schedule_name(schedule)
    except ValueError as e:
        return [str(e)]
    out = _count_problems(layers, pp, microbatches, waves, chunks_per_rank)
    if out:
        return out
    out += _chunk_problems(layers, pp, schedule, waves, chunks_per_rank, layers_fixed)
    if split_backward and schedule not in ("hanayo", *SPLIT_SCHEDULES):
        out.append(f"pipeline.split_backward=true splits the backward of pipeline.schedule=hanayo; {schedule} does "
                   f"not: use pipeline.schedule=hanayo, zb_h1 (1F1B's memory) or zbv (the V placement), or "
                   f"pipeline.split_backward=false")
    if schedule == "interleaved":
        out += filter(None, [interleaved_microbatch_problem(pp, microbatches, chunks_per_rank)])
    if batch is not None:
        out += filter(None, [batch_problem(batch, microbatches, [(str(batch_divisor), batch_divisor)]
                                           if batch_divisor > 1 else [])])
    return out


def _count_problems(layers: int, pp: int, microbatches: int, waves: int, chunks_per_rank: int) -> list[str]:
    out = []
    for field, value in (("parallel.pp", pp), ("pipeline.microbatches", microbatches), ("model.layers", layers)):
        if int(value) != value or value < 1:
            out.append(f"{field}={value} must be an integer ≥ 1; use {field}=1")
    if int(waves) != waves or waves < 1:
        out.append(f"pipeline.waves={waves} must be an integer ≥ 1 (Hanayo runs 2·waves chunks per rank); "
                   f"use pipeline.waves=1")
    if int(chunks_per_rank) != chunks_per_rank or chunks_per_rank < 1:
        out.append(f"pipeline.chunks_per_rank={chunks_per_rank} must be an integer ≥ 1; use 2")
    return out


def _chunk_problems(layers: int, pp: int, schedule: str, waves: int, chunks_per_rank: int,
                    layers_fixed: bool = False) -> list[str]:
    """Every chunk needs one of the ``layers + 2`` stages. ``layers_fixed``: model.pretrained sets the
    layers, so only the pipeline's fields are suggested."""
    chunks = num_chunks(schedule, pp, waves, chunks_per_rank)
    stages = layers + 2
    if pp == 1 or stages >= chunks:
        return []
    fixes = [] if layers_fixed else [f"model.layers≥{chunks - 2}"]
    if schedule in ("hanayo", "zbv"):
        w_max = stages // (2 * pp)
        # Fewer waves first; if even one wave is too many chunks, fewer ranks as well.
        if schedule == "zbv":
            fixes.append(f"parallel.pp≤{max(1, stages // 2)}")
        else:
            fixes.append(f"pipeline.waves≤{w_max}" if w_max >= 1
                         else f"pipeline.waves=1 with parallel.pp≤{max(1, stages // 2)}")
    elif schedule == "interleaved":
        v_max = stages // pp
        if v_max >= 1:
            fixes.append(f"pipeline.chunks_per_rank≤{v_max}")
        elif layers_fixed:  # fewer ranks then: chunks_per_rank·pp chunks
            fixes.append(f"parallel.pp≤{max(1, stages // chunks_per_rank)}")
    else:
        fixes.append(f"parallel.pp≤{stages}")
    fixed = ", and model.pretrained's config.json sets model.layers" if layers_fixed else ""
    return [f"{schedule} with parallel.pp={pp} cuts the model into {chunks} chunks but it has only "
            f"model.layers+2 = {stages} stages (embedding, {layers} layers, head){fixed}; use {' or '.join(fixes)}"]


def layout_problems(cfg: Config) -> list[str]:
    """The job's pipeline (``parallel.pp > 1``): :func:`pipeline_arg_problems` on its fields."""
    p, m, pl = cfg.parallel, cfg.model, cfg.pipeline
    if p.pp <= 1:
        return []
    return pipeline_arg_problems(m.layers, p.pp, pl.microbatches, pl.schedule, pl.waves, pl.chunks_per_rank,
                                 split_backward=pl.split_backward, layers_fixed="model.layers" in fixed_fields(m))


ORDERED_FOR_THE_LINK = ("hanayo", "zb_h1", "zbv")  # the searched orders pipeline.hop_cost reaches


def hop_cost_problems(cfg: Config) -> list[str]:
    """``pipeline.hop_cost`` orders a searched schedule (read only with ``parallel.pp > 1``, as the
    pipeline's other fields)."""
    p, pl = cfg.parallel, cfg.pipeline
    if pl.hop_cost is None or p.pp <= 1:
        return []
    if pl.schedule not in ORDERED_FOR_THE_LINK:
        return [f"pipeline.hop_cost={pl.hop_cost} orders {', '.join(ORDERED_FOR_THE_LINK)}; "
                f"pipeline.schedule={pl.schedule} has one fixed order; remove pipeline.hop_cost or use one of them"]
    return []


def recompute_problems(cfg: Config) -> list[str]:
    """Activation checkpointing under a split backward: every block recomputed again for W."""
    p, pl = cfg.parallel, cfg.pipeline
    if p.pp > 1 and splits_backward(pl.schedule, pl.split_backward) and cfg.train.activation_checkpointing != "none":
        return [f"train.activation_checkpointing={cfg.train.activation_checkpointing} with a split backward "
                f"(pipeline.schedule={pl.schedule}{', split_backward=true' if pl.schedule == 'hanayo' else ''}) "
                "would recompute each block once in B and again for every weight matrix in W; use "
                "train.activation_checkpointing=none, or a schedule that does not split the backward"]
    return []


def compile_problems(cfg: Config) -> list[str]:
    """Compiled blocks under a split backward: a compiled block's backward is one graph computing its
    input and weight gradients together (AOTAutograd), which B and W cannot run apart."""
    p, pl = cfg.parallel, cfg.pipeline
    if p.pp > 1 and splits_backward(pl.schedule, pl.split_backward) and cfg.train.compile != "none":
        return [f"train.compile={cfg.train.compile} with a split backward (pipeline.schedule={pl.schedule}"
                f"{', split_backward=true' if pl.schedule == 'hanayo' else ''}): a compiled block's backward is one "
                "graph that computes its input and weight gradients together, so B cannot leave the weight "
                "gradients to W; use train.compile=none, or a schedule that does not split the backward "
                "(1f1b, gpipe, interleaved, hanayo with split_backward=false)"]
    return []
