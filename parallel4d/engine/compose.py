"""compose(): build the model and apply the strategies in a fixed order.

Order (docs/architecture.md): pipeline (the schedule decides which stages this rank
holds) → build those stages of the dense reference, each from ``(seed, stage)``
→ sequence (ring attention in every block, global position ids) → tensor2d
(each stage converted with ``from_dense`` as soon as it is built) → the rank's
:class:`~.model.LocalModel` (dense names, pretrained weights) → its parameter store
(:mod:`.store`: plain gradient averaging over the data replicas ``dp × sp``, or
hetero's chunked ZeRO when ``hetero.enabled``) with the optimizer → :class:`~.step.Engine`.

Every stage is initialised from ``(seed, stage)`` alone, exactly as the
single-process reference initialises it: that is what makes every layout start
from the same parameters, without any rank materialising the whole model.
This is the only module that knows several strategies exist.

Data on the rank at (pp, dp=d, sp=r, tp_row=i, tp_col=j): the global batch
``[B, S]`` → rows block ``d`` of ``dp`` → rows block ``i`` of ``q`` → sequence
shard ``r`` of ``sp`` (in ``sequence.layout``) → ``m`` micro-batches:
``[B/(dp·q·m), S/sp]`` tokens; activations ``[B/(dp·q·m), S/sp, h/q]``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

from parallel4d.checkpoint.adapters import adapter_pieces, load_adapter
from parallel4d.config.errors import ConfigError
from parallel4d.config.schema import Config
from parallel4d.distributed import comm
from parallel4d.distributed.mesh import Mesh
from parallel4d.engine.compile import compile_block
from parallel4d.engine.experts import expert_slices, place_experts
from parallel4d.engine.flops import stage_flops
from parallel4d.engine.model import (LocalModel, PositionedEmbedding, model_shape, parameter_dtype,
                                     pipeline_activation_dtype)
from parallel4d.engine.pretrained import load_pretrained
from parallel4d.engine.state import dense_layouts
from parallel4d.engine.step import Engine
from parallel4d.engine.store import parameter_store
from parallel4d.fp8.rowwise import AmaxSync, device_problem
from parallel4d.models.build import build_stage, family
from parallel4d.models.context import ForwardContext, attach
from parallel4d.models.fp8 import use_fp8
from parallel4d.models.lora import LoraShape, adapted_modules, add_adapters
from parallel4d.models.moe.balance import CarryingChunk, StepLoad
from parallel4d.models.moe.spec import MoeShape
from parallel4d.models.stages import cross_entropy, stage_names, with_auxiliary
from parallel4d.optim.fused import use_fused_norms
from parallel4d.pipeline import make_schedule, probe, simulate
from parallel4d.pipeline.executor import PipelineExecutor, TiedGradSync
from parallel4d.pipeline.partition import build_chunks, partition
from parallel4d.sequence import make_ring_attention_fn
from parallel4d.sequence.ulysses import hybrid_position_tensor, make_ulysses_attention_fn
from parallel4d.tensor2d import Head2D, VocabParallelCrossEntropy2D, loss_2d


# --- this rank's stages ------------------------------------------------------------


def _sequence(cfg: Config, mesh: Mesh):
    """(attention_fn, positions) for ``parallel.sp``: the ring, or Ulysses around it
    (``sequence.ulysses > 1``); when sp = 1 (None, None) — the model's own core —, or under
    ``sequence.kernel: blockwise`` the ring on this rank alone, positions None (0..s-1)."""
    seq = cfg.sequence
    if mesh.size("sp") == 1 and seq.kernel == "auto":
        return None, None
    if seq.ulysses > 1:  # never at sp = 1: the rules want ulysses to divide sp
        fn = make_ulysses_attention_fn(*mesh.sp_split(seq.ulysses), layout=seq.layout, stats=mesh.comm_stats,
                                       timeout_s=cfg.train.timeout_s, deadlines=mesh.deadlines)
    else:
        fn = make_ring_attention_fn(mesh.group("sp"), layout=seq.layout, stats=mesh.comm_stats,
                                    timeout_s=cfg.train.timeout_s, deadlines=mesh.deadlines)
    return fn, _shard_positions(cfg, mesh)


def _shard_positions(cfg: Config, mesh: Mesh) -> torch.Tensor | None:
    """The global positions ``[s/sp]`` of this rank's tokens; None when sp = 1 (``0..s-1``)."""
    if mesh.size("sp") == 1:
        return None
    return hybrid_position_tensor(cfg.model.seq_len, mesh.rank("sp"), mesh.size("sp"), cfg.sequence.ulysses,
                                  cfg.sequence.layout, device=mesh.device)


def forward_context(cfg: Config, mesh: Mesh) -> ForwardContext:
    """What this rank's modules read besides their input (:mod:`parallel4d.models.context`): ``train.seed``
    and the global positions of the rank's tokens; the engine sets each micro-batch's dropout draw and
    packed documents."""
    return ForwardContext(cfg.train.seed, _shard_positions(cfg, mesh))


def build_stages(cfg: Config, mesh: Mesh, wanted=None, untie: bool = False, context: ForwardContext | None = None,
                 load: StepLoad | None = None):
    """``(stages, loss_fn)``: ``{stage index: module}`` for the stages in ``wanted``
    (default: all) in this rank's layout, and the loss function.

    Each stage is built alone from ``(seed, index)`` (as the dense reference builds
    it), converted at once (2D-parallel when ``tp > 1``, ring attention when
    ``sp > 1``), and its dense copy dropped: a rank never holds the whole model.
    ``untie``: the LM head is on another pp rank than the embedding, so it gets its
    own copy of the tied table. ``loss_fn(logits, targets)`` is the mean token loss
    over this rank's data (over the grid's batch under tp); with packed documents or a loss mask the summed
    one times the forward's ``loss_weight``. ``context``: what the stages read besides their input
    (:func:`forward_context`; None: a holder no one sets, so no dropout and no packing).
    """
    shape = model_shape(cfg)
    seed, last = cfg.train.seed, shape.layers + 1
    wanted = set(range(last + 1)) if wanted is None else set(wanted)
    dtype = parameter_dtype(cfg)
    attention_fn, positions = _sequence(cfg, mesh)
    tp = mesh.size("tp_row") > 1
    fam = family(shape.arch)  # its dense stages, their 2D twins, where a shard's positions enter
    context = context if context is not None else forward_context(cfg, mesh)

    def dense(index, tied_weight=None):
        return _placed(build_stage(shape, index, seed, tied_weight=tied_weight), mesh.device, dtype)

    stages: dict[int, nn.Module] = {}
    # The head needs the dense token table when tied: shared here, or copied (untie).
    dense_embed = dense(0) if 0 in wanted or (last in wanted and shape.tie_embeddings) else None
    if 0 in wanted:
        stages[0] = fam.embed_2d.from_dense(dense_embed, mesh) if tp else dense_embed
    for index in sorted(wanted - {0, last}):
        block = dense(index)
        if tp:
            block = fam.block_2d.from_dense(block, mesh, attention_fn, name=f"blocks.{index - 1}",
                                            overlap=cfg.tensor2d.overlap)
        elif attention_fn is not None:
            block.attn.attention_fn = attention_fn
        if fam.positions == "attention" and positions is not None:  # the shard's tokens are rotated by their global
            target = block if tp else block.attn  # positions, in a sequence of the whole length (dynamic rotary)
            target.positions, target.length = positions, cfg.model.seq_len
        if cfg.train.compile == "blocks":
            compile_block(block, eager_layers=cfg.hetero.enabled)
        if cfg.train.activation_checkpointing == "blocks":
            recompute_in_backward(block, context)
        stages[index] = block
    if last in wanted:
        tied = dense_embed.tok.weight if shape.tie_embeddings else None
        head = dense(last, tied_weight=tied)
        if tied is not None and untie:
            head.weight = nn.Parameter(tied.detach().clone())
        if tp:
            head = fam.head_2d.from_dense(head, mesh, embedding=stages.get(0) if not untie else None)
        stages[last] = head
    if not tp:  # 2D norms reduce their statistics over the grid: not a fused kernel's job
        use_fused_norms(stages.values(), cfg.train.fused, fam.rms_norms)
    if positions is not None and 0 in stages and fam.positions == "embedding":
        stages[0] = PositionedEmbedding(stages[0], positions)
    for stage in stages.values():
        attach(stage, context)
    return stages, _loss(cfg, mesh, context, load)


def step_load(cfg: Config, mesh: Mesh) -> StepLoad | None:
    """Where a step's MoE layers report their load and auxiliary loss (:class:`StepLoad`): an MoE model whose
    layers record their routing (``model.output_router_logits``); else None."""
    moe = MoeShape.of(cfg.model)
    if moe is None or not moe.output_router_logits:
        return None
    return StepLoad(moe.num_experts, cfg.pipeline.microbatches, mesh.device)


def _loss(cfg: Config, mesh: Mesh, context: ForwardContext, load: StepLoad | None = None):
    """The token loss: the mean over this rank's data (the grid's under tp), or, where the forward's state has
    a ``loss_weight`` (packed documents, a loss mask), the sum times it (:func:`~.batch.loss_weight`); plus
    the family's auxiliary loss of the forward (what its modules recorded in the context's state: MoE's load
    balancing) over the whole micro-batch, on every data replica (:func:`_auxiliary_over_replicas`)."""
    tp, vocab = mesh.size("tp_row") > 1, cfg.model.vocab_size  # the head's logits: the vocabulary padded to q
    mean = loss_2d(mesh, vocab=vocab) if tp else cross_entropy
    summed = VocabParallelCrossEntropy2D(mesh, reduction="sum", vocab=vocab) if tp else functools.partial(
        cross_entropy, reduction="sum")

    def token_loss(logits, targets):
        weight = context.state.loss_weight  # set by the engine per forward; None: this forward's own mean
        return mean(logits, targets) if weight is None else summed(logits, targets) * weight

    auxiliary = _auxiliary_over_replicas(cfg, mesh, context, load)

    def loss(logits, targets):
        return with_auxiliary(token_loss(logits, targets), auxiliary())

    return loss


def _auxiliary_over_replicas(cfg: Config, mesh: Mesh, context: ForwardContext, load: StepLoad | None = None):
    """``() → the family's auxiliary loss term of the forward now in context`` (None: none), as this data
    replica adds it to its token loss. The micro-batch's tokens are spread over the ``R = dp·sp`` data
    replicas: the load statistics are summed over them (``sum_over_ranks``: one all-reduce of ``E + 1``
    numbers, no gradient), which makes each replica's term its share of the whole micro-batch's loss (the
    shares sum to it, and each has the gradient of the whole with respect to that replica's router
    probabilities: models/moe/balance.py). The replicas' gradients are then averaged (divided by ``R``),
    so each share is counted ``R`` times: the replicas' reported mean is then the token loss's mean plus
    the whole micro-batch's auxiliary loss, and the averaged gradient the one-process one.

    Under 2D tp an MoE layer's q² grid ranks hold disjoint tokens too (models/moe/tp2d.py): the statistics
    are summed over the grid as well, and each grid rank's share keeps its gradient (the router's gradient
    is summed over the grid) while its value becomes the grid's sum of shares (one all-reduce of a
    detached number), so that every grid rank reports the same loss, as its token loss is."""
    shape, auxiliary = model_shape(cfg), family(cfg.model.arch).model_type.auxiliary_loss
    replicas = mesh.size("dp") * mesh.size("sp")
    grid = mesh.group_over("tp_row", "tp_col") if mesh.size("tp_row") > 1 and MoeShape.of(cfg.model) else None
    axes = ("dp", "sp") + (("tp_row", "tp_col") if grid is not None else ())
    group = mesh.group_over(*axes) if replicas > 1 or grid is not None else None

    def summed(totals: torch.Tensor) -> torch.Tensor:
        if group is not None:
            comm.all_reduce(totals, group, stats=mesh.comm_stats, label="moe.balance")
        if load is not None:
            load.add_totals(totals)
        return totals

    def share():
        term = auxiliary(shape, context.state, sum_over_ranks=summed)
        if term is None:
            return None
        term = term * replicas if replicas > 1 else term
        if grid is not None:
            term = term + (_summed_over(term.detach(), grid, mesh) - term.detach())
        if load is not None:
            load.add_term(term)
        return term

    return share


def _summed_over(value: torch.Tensor, group, mesh: Mesh) -> torch.Tensor:
    """``value`` (no gradient) summed over ``group`` (a copy)."""
    total = value.clone()
    comm.all_reduce(total, group, stats=mesh.comm_stats, label="moe.balance")
    return total


def _placed(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``module`` on ``device`` in ``dtype``; untouched when it already is (a plan's stand-in
    tensors cannot be converted in place)."""
    if all(t.device == device and t.dtype == dtype for t in module.parameters()):
        return module
    return module.to(device=device, dtype=dtype)


def recompute_in_backward(module: nn.Module, context: ForwardContext | None = None) -> nn.Module:
    """``module``'s forward under ``torch.utils.checkpoint`` (non-reentrant) while gradients are
    on: the block keeps only its input and runs again in the backward, collectives included (every
    rank of a tp or sp group recomputes the same block at the same point of its backward). The
    recomputation runs in the forward's state of ``context`` (another micro-batch's may be current by
    then): the same dropout draw, the same packed documents."""
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        if context is None:
            return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
        state = context.state

        def again(*a, **k):
            with context.entering(state):
                return inner(*a, **k)

        return torch.utils.checkpoint.checkpoint(again, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    return module


# --- the pipeline ------------------------------------------------------------------


class PipelineParts(NamedTuple):
    """This rank's share of a pipelined model (:func:`build_pipeline`)."""

    stages: dict[int, nn.Module]  # stage index → module, for the chunks this rank holds
    executor: PipelineExecutor
    tied_sync: TiedGradSync | None  # sums a tied table's gradient between two pp ranks; None when shared
    tied_params: list[nn.Parameter]  # this rank's copies of that table (empty when tied_sync is None)
    order: dict | None = None  # pipeline.hop_cost: the cost the order was built for (and auto's measurements)


def job_schedule(cfg: Config, p2p_cost: float | None = None):
    """The schedule ``cfg.pipeline`` names on ``parallel.pp`` ranks; ``p2p_cost``: its order built for a hop of
    that many chunk forwards (:func:`~parallel4d.pipeline.schedule.make_schedule`)."""
    pl = cfg.pipeline
    return make_schedule(pl.schedule, cfg.parallel.pp, pl.microbatches, waves=pl.waves,
                         chunks_per_rank=pl.chunks_per_rank, split_backward=pl.split_backward, p2p_cost=p2p_cost)


def build_pipeline(cfg: Config, mesh: Mesh, loss_scale: float = 1.0,
                   activation_dtype: torch.dtype | None = None, context: ForwardContext | None = None,
                   load: StepLoad | None = None) -> PipelineParts:
    """Cut the model into the chunks of ``pipeline.schedule`` and build only this rank's.

    ``loss_scale`` multiplies each micro-batch's mean loss (the DeepSpeed plugin's 1/sp);
    ``activation_dtype``: what activations and their gradients travel between pp ranks in (default
    :func:`~.model.pipeline_activation_dtype`: the autocast dtype under autocast, else the parameters');
    chunks cast at their boundaries where it differs from the parameters' dtype. ``context``, ``load``: as
    :func:`build_stages`'. With MoE layers that record their routing, each message carries the forward's
    load statistics beside the activation (:func:`_carrying_routing`)."""
    pl, p, m = cfg.pipeline, cfg.parallel, cfg.model
    fixed = pl.hop_cost if isinstance(pl.hop_cost, float) else None
    schedule = job_schedule(cfg, fixed)
    shape = model_shape(cfg)
    ranges = pipeline_cut(cfg, schedule.num_chunks)
    mine = schedule.placement[mesh.rank("pp")]
    untie = schedule.owner(0) != schedule.owner(schedule.num_chunks - 1)
    context = context if context is not None else forward_context(cfg, mesh)
    stages, loss_fn = build_stages(cfg, mesh, {i for c in mine for i in ranges[c]}, untie=untie, context=context,
                                   load=load)
    if loss_scale != 1.0:
        loss_fn = functools.partial(_scaled_loss, loss_fn, loss_scale)
    wire = activation_dtype or pipeline_activation_dtype(cfg)
    chunks = build_chunks(stages, ranges, mine, activation_dtype=wire if wire != parameter_dtype(cfg) else None)
    chunks, carried = _carrying_routing(cfg, chunks, schedule.num_chunks, context)
    q, sp = mesh.size("tp_row"), mesh.size("sp")
    act_shape = [cfg.data.batch_size // (p.dp * q * pl.microbatches), m.seq_len // sp, m.hidden // q]
    order = None if fixed is None else _order_info(schedule, hop_cost=fixed)
    if pl.hop_cost == "auto":
        schedule, order = _ordered_for_the_link(cfg, mesh, schedule, chunks, act_shape, wire)
    executor = PipelineExecutor(schedule, mesh, chunks, loss_fn, act_shape, wire, carried=carried,
                                timeout_s=cfg.train.timeout_s, device=mesh.device)
    tied_sync, tied_params = None, []
    if m.tie_embeddings and untie:
        tied_sync = TiedGradSync(mesh, schedule)
        if 0 in stages:
            tied_params.append(_tied_table(stages[0]))
        if shape.layers + 1 in stages:
            tied_params.append(_tied_table(stages[shape.layers + 1], head=True))
    return PipelineParts(stages, executor, tied_sync, tied_params, order)


def _carrying_routing(cfg: Config, chunks: dict[int, nn.Module], num_chunks: int, context: ForwardContext):
    """``(chunks, carried)``: with MoE layers that record their routing (``model.output_router_logits``), each
    chunk a :class:`~parallel4d.models.moe.balance.CarryingChunk` and its messages carrying the statistics
    of the layers before it (float64, ``2E + 1``), so that the last chunk's load-balancing loss covers every
    layer of the forward (models/moe/balance.py); else the chunks as they are and nothing carried."""
    moe = MoeShape.of(cfg.model)
    if moe is None or not moe.output_router_logits:
        return chunks, ()
    carrying = {c: CarryingChunk(chunk, context, moe.num_experts, last=c == num_chunks - 1) for c, chunk in chunks.items()}
    return carrying, (CarryingChunk.spec(moe.num_experts),)


def _ordered_for_the_link(cfg: Config, mesh: Mesh, schedule, chunks, act_shape, wire) -> tuple:
    """``pipeline.hop_cost: auto``: the hop and a chunk's forward measured on this job's links and chunks
    (:mod:`parallel4d.pipeline.probe`, agreed by every rank), and the schedule's order built again for
    their ratio (the placement, hence the chunks built, unchanged). Returns ``(schedule, order info)``:
    the figures, and the simulated bubble at that hop of the order built for it and of the one it
    replaces (uniform chunks, backward 2 forwards)."""
    hop = probe.hop_seconds(mesh, act_shape, wire, cfg.train.timeout_s)
    forward = probe.forward_seconds(chunks, 0, schedule.num_chunks - 1, act_shape, wire, mesh.device)
    hop, forward = probe.agreed([hop, forward], mesh.device)
    cost = round(hop / max(forward, 1e-9), 3)
    tuned = job_schedule(cfg, cost)
    if tuned.placement != schedule.placement:  # the searched orders keep their placement: a bug otherwise
        raise RuntimeError(f"pipeline.hop_cost=auto: the order built for {cost} moved the chunks")
    bubbles = [simulate(s, 1.0, 2.0, cost).bubble_ratio for s in (tuned, schedule)]
    return tuned, _order_info(tuned, hop_cost=cost, hop_s=hop, chunk_forward_s=forward, measured=True,
                              bubble_at_hop=round(bubbles[0], 4),
                              bubble_at_hop_of_the_default_order=round(bubbles[1], 4))


def _order_info(schedule, **figures) -> dict:
    """What summary.json's ``pipeline.order`` says of an order built for a hop: ``figures`` and each pp
    rank's actions (``"F3.1"``: micro-batch 3's forward of chunk 1; B, W likewise)."""
    actions = {str(r): " ".join(f"{a.kind}{a.microbatch}.{a.chunk}" for a in acts)
               for r, acts in sorted(schedule.actions.items())}
    return {**figures, "actions": actions}


def pipeline_cut(cfg: Config, num_chunks: int) -> list[range]:
    """The stages ``[embedding, blocks…, LM head]`` of each of ``num_chunks`` chunks: contiguous, balanced
    by compute, the training FLOPs per token of each stage (:func:`~.flops.stage_flops`: the embedding's
    lookup ≈ 0, a block's products and attention, the head's ``6·h·V``), from the config alone, so
    every rank computes the same cut. Where the cut falls changes no result, only the balance."""
    return partition(stage_flops(cfg), num_chunks)


def _scaled_loss(loss_fn, scale: float, output, targets):
    return loss_fn(output, targets) * scale


def _tied_table(stage: nn.Module, head: bool = False) -> nn.Parameter:
    """The token table of an embedding stage, or the LM-head weight of a head stage."""
    if isinstance(stage, PositionedEmbedding):
        stage = stage.embed
    if head:
        return stage.lm_head.weight if isinstance(stage, Head2D) else stage.weight
    return stage.tok.weight


# --- the whole rank ----------------------------------------------------------------


def compose(cfg: Config, mesh: Mesh) -> Engine:
    """Build this rank's model, optimizer and gradient synchronisation for ``cfg``."""
    for axis, size in (("pp", cfg.parallel.pp), ("dp", cfg.parallel.dp), ("sp", cfg.parallel.sp),
                       ("tp_row", cfg.parallel.q)):
        if mesh.size(axis) != size:
            raise ConfigError(f"the mesh has {axis}={mesh.size(axis)} but the config asks for {size}; "
                              "build the mesh from cfg.parallel")
    if cfg.train.fp8 != "none" and (problem := device_problem(mesh.device)) is not None:
        raise ConfigError(problem)
    executor = tied_sync = order = None
    tied_params: list = []
    context = forward_context(cfg, mesh)
    load = step_load(cfg, mesh)  # the MoE layers' load and auxiliary loss for metrics.jsonl (None: no MoE)
    if cfg.parallel.pp > 1:
        stages, executor, tied_sync, tied_params, order = build_pipeline(cfg, mesh, context=context, load=load)
        loss_fn = executor.loss_fn
    else:
        stages, loss_fn = build_stages(cfg, mesh, context=context, load=load)
    experts = place_experts(cfg, mesh, stages)  # parallel.ep: this rank's experts only, before layouts and optimizer
    model = local_model(cfg, stages, mesh)
    if experts is not None and cfg.model.lora is not None:  # the experts' adapters travel with their experts
        experts = experts._replace(params=expert_slices(stages))
    dense, local = model.dense, model.stages()
    store = parameter_store(cfg, mesh, model, executor, tied_params, tied_sync, experts)  # hetero's chunks or plain
    engine = Engine(cfg, mesh, store, loss_fn, list(local.values()), executor=executor, tied_sync=tied_sync,
                    dense=dense, context=context, pipeline_order=order, load=load)
    engine.pretrained_bytes_read = model.pretrained_bytes_read
    return engine


def local_model(cfg: Config, stages: dict[int, nn.Module], mesh: Mesh | None = None) -> LocalModel:
    """This rank's ``stages`` (stage index → module) under their dense names, with ``.dense``
    (:func:`~.state.dense_layouts`) and, when ``model.pretrained`` is set, the parameters filled from that
    checkpoint (only this rank's slices read; ``.pretrained_bytes_read``, else None); with ``model.lora``
    the adapters added (:func:`~parallel4d.models.lora.add_adapters`, seeded ``train.seed``, or read from
    ``model.lora.adapter``: :func:`~parallel4d.checkpoint.adapters.load_adapter`), the rest frozen:
    the store and the optimizer hold only what requires a gradient; with ``train.fp8: rowwise`` the blocks'
    linears computing in FP8 (:func:`~parallel4d.models.fp8.use_fp8`), their weight gradients' token amaxes
    reduced over ``mesh``'s data replicas (:func:`fp8_token_sync`; no mesh: none)."""
    names = stage_names(model_shape(cfg))
    model = LocalModel({names[i]: stages[i] for i in sorted(stages)})
    model.dense = dense_layouts(model.stages(), tied=cfg.model.tie_embeddings)
    model.pretrained_bytes_read = load_pretrained(model, model.dense, cfg.model) if cfg.model.pretrained else None
    if cfg.model.lora is not None:  # on the loaded base: the base frozen, the adapters beside it
        add_adapters(model, adapted_modules(cfg.model), LoraShape.of(cfg.model.lora), seed=cfg.train.seed)
        model.dense = dense_layouts(model.stages(), tied=cfg.model.tie_embeddings)
        if cfg.model.lora.adapter:  # peft's adapter to start from: this rank's slices of it
            load_adapter(adapter_pieces(model, model.dense), cfg.model)
    if cfg.train.fp8 == "rowwise":  # the blocks' linears compute in FP8 over the same parameters
        use_fp8(model, fp8_token_sync(mesh) if mesh is not None else None)
    return model


def fp8_token_sync(mesh: Mesh) -> AmaxSync:
    """The FP8 linears' reduction of ``dW = dYᵀ·X``'s amaxes over the tokens (fp8/linear.py): the data replicas
    (``dp·sp``) hold the other tokens of each micro-batch (rows over dp, sequence shards over sp; Ulysses too:
    its linears see ``[b, s/sp, h]``), so each linear's backward MAX-reduces its ``[1, out + in]`` float64
    amaxes over them — one all-reduce, counted as ``fp8.amax`` — and every rank scales as one process would.
    None with one replica: no collective. Pipelines need nothing more (a micro-batch is whole on its stage)."""
    if mesh.size("dp") * mesh.size("sp") == 1:
        return None
    return ReplicaAmaxSync(mesh.group_over("dp", "sp"), mesh.comm_stats)


class ReplicaAmaxSync:
    """:func:`fp8_token_sync`'s reduction: ``largest`` (float64 amaxes) → their MAX over ``group``, labelled
    ``fp8.amax`` in ``stats``. Eager, a counted in-place all-reduce; traced by ``torch.compile`` (a compiled
    block's backward, ``train.compile: blocks``), a functional all-reduce inside the graph — no graph break,
    the quantization around it fused — counted by :meth:`count_traced`, which the compiled block calls once
    per backward of each FP8 linear that traced it (engine/compile.py)."""

    label = "fp8.amax"

    def __init__(self, group, stats):
        self.group, self.stats = group, stats

    def __call__(self, largest: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return comm.traced_all_reduce(largest, self.group, "max")
        comm.all_reduce(largest, self.group, op=dist.ReduceOp.MAX, stats=self.stats, label=self.label)
        return largest

    def count_traced(self, nbytes: int) -> None:
        """Count one traced reduction of ``nbytes`` (compiled code cannot count its own)."""
        comm.count_all_reduce(nbytes, self.group, stats=self.stats, label=self.label)

