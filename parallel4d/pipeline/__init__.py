"""Pipeline parallelism: schedules as data, one executor (GPipe, 1F1B, interleaved, Hanayo waves,
and the split-backward schedules: ZB-H1, ZB-V and Hanayo with ``split_backward``).

Schedules (:mod:`.types`, built by :mod:`.schedule` and :mod:`.hanayo`) are pure data — ``Schedule.placement`` (pp rank →
chunk ids) and ``Schedule.actions`` (pp rank → ordered ``Action(kind, microbatch,
chunk)``). :func:`validate`, :func:`simulate`, :func:`plot` read them; the
:class:`~.executor.PipelineExecutor` runs any valid one over the mesh's ``pp`` axis.

How the engine uses it (one optimizer step = one ``executor.step``)::

    from parallel4d.pipeline import (check_pipeline_args, make_schedule, partition,
                                     parameter_costs, build_chunks, PipelineExecutor, TiedGradSync)

    # 1. before any process group (config validation): ValueError naming the field
    check_pipeline_args(layers=L, pp=P, microbatches=m, schedule=name, waves=W,
                        chunks_per_rank=v, batch=global_batch, batch_divisor=dp * q)

    # 2. on every rank, same arguments → the same schedule
    sched = make_schedule(name, P, m, waves=W, chunks_per_rank=v)
    stages = model.stages()                      # [embed, block_0..block_{L-1}, head]
    ranges = partition(costs, sched.num_chunks)   # contiguous, balanced: costs per stage, e.g. its
                                                  # training FLOPs (the engine's), parameter_costs(stages)
    me = mesh.rank("pp")
    chunks = build_chunks(stages, ranges, sched.placement[me])      # {chunk id: nn.Sequential}
    # only parameters of `chunks` belong to this rank (optimizer, DP all-reduce, hetero)

    executor = PipelineExecutor(sched, mesh, chunks, loss_fn,
                                activation_shape=(b_local // m, s_local, h_local),  # [b/(dp·q)/m, s/sp, h/q]
                                activation_dtype=dtype, timeout_s=cfg.train.timeout_s)
    tied = TiedGradSync(mesh, sched)   # collective over the world: build once, on every rank

    # 3. each step (zero grads first, as usual)
    # tokens, targets: this rank's shard, local_batch(mesh, ·, layout, microbatches=m): its rows of each micro-batch
    tokens_mb = list(tokens.chunk(m)); targets_mb = list(targets.chunk(m))
    res = executor.step(tokens_mb if sched.owner(0) == me else None,
                        targets_mb if sched.owner(sched.num_chunks - 1) == me else None)
    if tied.active and me in tied.owners:
        tied([embedding_weight_copy_on_this_rank])   # sums embed/head grads between the two owners
    loss = res.loss          # mean over micro-batches, identical on every pp rank (float64 [1], on the device)
    # then DP gradient reduction over mesh.group("dp"), clipping, optimizer.step()

Contract: ``loss_fn(output_of_last_chunk, targets_mb)`` returns the mean loss of
one micro-batch; the executor scales by ``1/m`` once, so grads equal those of
the mean over micro-batches (= full-batch mean for equal micro-batches).
Gradients *accumulate* into ``.grad`` (zero them between steps). Every
micro-batch must have the same shape (static buffers, no shape handshake).
Under Hanayo the embedding (chunk 0) and head (last chunk) both live on pp rank 0
and share one Parameter: ``TiedGradSync`` is inactive there. ``res.trace`` holds
per-action timestamps; ``res.peak_activations`` equals
``simulate(sched).peak_activations[me]``.
"""

from parallel4d.config.rules.pipeline import SCHEDULES, check_schedule_name, num_chunks, pipeline_arg_problems
from parallel4d.pipeline.analysis import (Message, ScheduleError, SimResult, bubble_formula, makespan_floor,
                                         message_order, message_plan, simulate, validate)
from parallel4d.pipeline.checks import check_pipeline_args
from parallel4d.pipeline.executor import PipelineExecutor, StepResult, TiedGradSync
from parallel4d.pipeline.hanayo import hanayo, list_schedule, wave_placement, wave_rank
from parallel4d.pipeline.partition import build_chunks, parameter_costs, partition, timed_costs
from parallel4d.pipeline.plot import plot
from parallel4d.pipeline.schedule import gpipe, interleaved_1f1b, linear_placement, looped_placement, make_schedule, one_f_one_b
from parallel4d.pipeline.types import Action, Schedule
from parallel4d.pipeline.zero_bubble import zb_h1, zbv

__all__ = [
    "Action", "Schedule", "ScheduleError", "SimResult", "Message", "SCHEDULES",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "hanayo", "zb_h1", "zbv", "make_schedule", "list_schedule",
    "linear_placement", "looped_placement", "wave_placement", "wave_rank",
    "validate", "simulate", "makespan_floor", "bubble_formula", "message_order", "message_plan", "plot",
    "check_pipeline_args", "check_schedule_name", "num_chunks", "pipeline_arg_problems",
    "partition", "parameter_costs", "timed_costs", "build_chunks",
    "PipelineExecutor", "StepResult", "TiedGradSync",
]
