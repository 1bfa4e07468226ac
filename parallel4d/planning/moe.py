"""Mixture-of-experts layers in ``parallel4d plan``: routing under an assumed uniform load, and the
experts' own figures (memory, all-to-all bytes, FLOPs).

Which experts a token reaches depends on the router's values, which the dry run's fake tensors do not
hold; the ops that follow the choice (``bincount`` of the chosen experts, the host read of the counts)
have data-dependent results. The plan therefore assumes a **uniform load**: each MoE layer's ``T·k``
(token, choice) slots of a micro-batch spread evenly over the ``E`` experts, ``T·k/E`` rows each (the
first ``T·k mod E`` experts one more). Everything else runs the job's own code:

* :class:`UniformLoad` (a dispatch mode the dry run enters inside its fake tensors) answers the count of
  fake slots per expert (:func:`~parallel4d.experts.count_per_expert`'s ``scatter_add``, or a ``bincount``)
  with those counts, as a real tensor, so the layer's own dispatcher
  (:class:`~parallel4d.experts.OneRank`), the experts' SwiGLU and the load-balancing loss's statistics
  run unchanged — no planning switch in ``models/moe`` or ``experts/``;
* :class:`UniformExpertParallel` stands in for an :class:`~parallel4d.experts.ExpertParallel` dispatcher
  (``parallel.ep`` > 1), whose split sizes come back over the ep group: it sends the uniform load's rows
  through the same all-to-alls, so their bytes are counted where a run counts them (:mod:`parallel4d.distributed.comm`).

What the assumption changes: on one rank nothing the plan counts — parameters, gradients, optimizer
state, the rows' activations and the FLOPs depend on ``T·k`` alone, not on how the rows spread. Over
ep ranks, a skewed router sends and computes more on the ranks holding popular experts than the plan
says (the mean is the plan's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from parallel4d.config.rules.common import human_bytes as human
from parallel4d.config.schema import Config
from parallel4d.distributed import comm
from parallel4d.experts import ExpertParallel, combine
from parallel4d.engine.flops import flops_per_token
from parallel4d.engine.model import parameter_dtype
from parallel4d.experts.dispatch import COUNTS, AllToAllRows
from parallel4d.models.moe.layer import Experts
from parallel4d.models.moe.spec import MoeShape, sparse_layers
from parallel4d.models.registry import spec

aten = torch.ops.aten


def expert_parallel_size(cfg: Config) -> int:
    """The ep ranks a layer's experts are split over (``parallel.ep``): the one place the plan reads it."""
    return cfg.parallel.ep


def routed_tokens(cfg: Config) -> int:
    """The tokens of one micro-batch an MoE layer routes on a rank: ``b/(dp·q)/m · s/sp`` (a grid row's), split
    over the row's q ranks under 2D tp (models/moe/tp2d.py: each grid rank routes its own ``1/q`` of them)."""
    p = cfg.parallel
    return cfg.data.batch_size // (p.dp * p.q * cfg.pipeline.microbatches) * (cfg.model.seq_len // p.sp) // p.q


def uniform_counts(slots: int, experts: int) -> list[int]:
    """The uniform load: ``slots`` rows over ``experts`` experts, ``slots // experts`` each, the first
    ``slots mod experts`` one more (they sum to ``slots``)."""
    base, extra = divmod(slots, experts)
    return [base + (e < extra) for e in range(experts)]


class UniformLoad(TorchDispatchMode):
    """Entered inside the dry run's ``FakeTensorMode``: the count of fake slots per expert (the experts each
    slot chose, whose values fake tensors lack: ``count_per_expert``'s ``scatter_add`` into ``E`` int64
    zeros, or a ``bincount`` with ``minlength``) returns :func:`uniform_counts` over the ``E`` bins as a
    real int64 tensor — a real tensor, so its host read (the experts' split sizes) works. Every other op,
    and counts of real values, pass through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.bincount.default and isinstance(args[0], FakeTensor):
            bins = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            if not bins:
                raise RuntimeError("parallel4d plan: a bincount of routed slots needs its minlength (the expert count)")
            return _uniform(args[0].numel(), bins)
        if func is aten.scatter_add.default and _counts_of_fake_slots(args):  # experts.count_per_expert
            return _uniform(args[2].numel(), args[0].shape[0])
        return func(*args, **kwargs)


def _counts_of_fake_slots(args) -> bool:
    """Whether a ``scatter_add(zeros [E] int64, 0, slots, ones)`` counts fake slots per expert."""
    into, dim, index = args[0], args[1], args[2]
    return isinstance(index, FakeTensor) and into.dtype == torch.int64 and into.dim() == 1 and dim == 0


def _uniform(slots: int, experts: int) -> torch.Tensor:
    """:func:`uniform_counts` as a real int64 tensor (its host read works)."""
    with unset_fake_temporarily():
        return torch.tensor(uniform_counts(slots, experts), dtype=torch.int64)


class UniformExpertParallel:
    """A dry run's stand-in for ``real`` (an :class:`~parallel4d.experts.ExpertParallel` of ``n`` ranks):
    the same calls — the counts' small all-to-all, the rows' all-to-all out and back, this rank's experts
    on the rows it receives — with the uniform load's split sizes on the host (every rank of the group
    routes the same ``T``: each sends ``T·k/n`` rows to each rank and receives as many from each)."""

    def __init__(self, real: ExpertParallel):
        self.real, self.experts = real, real.experts

    def __call__(self, x, ids, weights, expert_fn, counts=None):  # counts: the uniform load's, not the caller's
        r = self.real
        n, local = r.size, r.local
        counts = uniform_counts(ids.numel(), r.num_experts)
        comm.all_to_all(x.new_zeros((n, local), dtype=torch.int64), r.group, scatter_dim=0, gather_dim=0,
                        stats=r.stats, label=COUNTS)  # its bytes; the values are the uniform load's
        send = [sum(counts[d * local:(d + 1) * local]) for d in range(n)]
        recv = [send[r.rank]] * n
        order = torch.argsort(ids.reshape(-1), stable=True)
        rows = AllToAllRows.apply(x[order // ids.shape[1]], send, recv, r.group, r.stats)
        with unset_fake_temporarily():
            mine = torch.tensor(counts[r.rank * local:(r.rank + 1) * local], dtype=torch.int64) * n
        out = expert_fn(rows, mine)
        return combine(AllToAllRows.apply(out, recv, send, r.group, r.stats), order, weights)


def stand_in_dispatchers(model: torch.nn.Module) -> int:
    """Every MoE layer of ``model`` whose dispatcher is an :class:`~parallel4d.experts.ExpertParallel` over
    more than one rank gets an :class:`UniformExpertParallel` in its place; how many were replaced."""
    replaced = 0
    for module in model.modules():
        real = getattr(module, "dispatcher", None)
        if isinstance(real, ExpertParallel) and real.size > 1:
            module.dispatcher = UniformExpertParallel(real)
            replaced += 1
    return replaced


def expert_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The routed experts' stacked weights among ``model``'s (router and shared expert excluded)."""
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]


# --- the experts' figures ------------------------------------------------------------------------


def all_to_all_bytes(tokens: int, top_k: int, hidden: int, ep: int, element_bytes: int, passes: int = 1,
                     returned_bytes: int | None = None) -> int:
    """Bytes one rank sends to the other ep ranks for one MoE layer and one micro-batch of ``tokens``
    tokens at the uniform load, ``passes`` forwards (2 when activation checkpointing recomputes the block
    in its backward).

    Each forward moves the rank's ``tokens·top_k`` rows of ``hidden`` elements to their experts' ranks
    (``element_bytes`` each: the blocks' stream, in the parameters' dtype) and the experts' outputs back
    (``returned_bytes`` each: autocast's dtype under autocast; default ``element_bytes``) — two all-to-alls,
    of which the ``(ep−1)/ep`` share bound for the other ranks leaves the rank (its own experts' rows stay).
    The backward, after the last forward, sends the two gradients the same way, each in its tensor's dtype.
    The small all-to-all of the counts per expert is :func:`counts_bytes`'."""
    if ep == 1:
        return 0
    returned = element_bytes if returned_bytes is None else returned_bytes
    rows_out = tokens * top_k * (ep - 1) // ep
    return (passes + 1) * rows_out * hidden * (element_bytes + returned)


def counts_bytes(num_experts: int, ep: int, passes: int = 1) -> int:
    """The counts' all-to-all per MoE layer and micro-batch: ``E`` int64 per forward, ``(ep−1)/ep`` leaving."""
    return 0 if ep == 1 else passes * 8 * num_experts * (ep - 1) // ep


@dataclass
class ExpertFigures:
    """One rank's mixture-of-experts figures for a whole step (bytes; FLOPs per token)."""

    num_experts: int
    top_k: int
    ep: int
    experts_per_rank: int
    moe_layers: int  # the MoE layers of the model (on every pp rank together)
    parameters: int  # the rank's experts' stacked weights (all its MoE layers)
    gradients: int
    optimizer_state: int
    all_to_all: int  # bytes sent to the other ep ranks per step (rows and their gradients, counts included)
    active_parameters: int  # the matrices' parameters a token passes through (MFU's, per model)
    total_parameters: int  # every matrix's, every expert's
    flops_per_token: float  # training FLOPs per token, active parameters only


def figures(cfg: Config, expert_bytes: int | None = None) -> ExpertFigures | None:
    """``cfg``'s expert figures for a rank (None for a dense model), at the uniform load. ``expert_bytes``:
    the rank's experts' weights as its dry run built them (else every MoE layer's ``E/ep`` experts in the
    parameters' dtype: whole on every rank of a 2D grid, which splits the tokens instead). Gradients as the
    weights; the optimizer state two moments and AdamW's 4-byte step per tensor
    (:func:`parallel4d.engine.memory.adam_state_bytes`' rule)."""
    moe = MoeShape.of(cfg.model)
    if moe is None:
        return None
    m, ep = cfg.model, expert_parallel_size(cfg)
    layers = len(sparse_layers(moe, m.layers))
    local = moe.num_experts // ep
    per_layer_weights = 3 * local * m.hidden * moe.expert_width * parameter_dtype(cfg).itemsize
    weights = per_layer_weights * layers if expert_bytes is None else expert_bytes
    mine = weights // per_layer_weights  # the MoE layers on this rank (its pipeline stages')
    tensors = 3 * mine
    tokens = routed_tokens(cfg)
    passes = 2 if cfg.train.activation_checkpointing != "none" else 1
    rows = all_to_all_bytes(tokens, moe.top_k, m.hidden, ep, parameter_dtype(cfg).itemsize, passes, _computed_bytes(cfg))
    per_layer = rows + counts_bytes(moe.num_experts, ep, passes)
    total, active = spec(m.arch).dense_parameters(m), _active_parameters(m, moe, layers)
    return ExpertFigures(moe.num_experts, moe.top_k, ep, local, layers, weights, weights,
                         2 * weights + 4 * tensors, per_layer * mine * cfg.pipeline.microbatches,
                         active, total, flops_per_token(cfg))


def _computed_bytes(cfg: Config) -> int:
    """The element size of what a matrix product returns: autocast's dtype, else the parameters'."""
    return getattr(torch, cfg.train.autocast).itemsize if cfg.train.autocast != "none" else parameter_dtype(cfg).itemsize


def _active_parameters(m, moe: MoeShape, layers: int) -> int:
    """The parameters a token passes through: all of them but, in each of the ``layers`` MoE layers, the
    ``E − k`` experts it does not reach (the family's parameter count: norms and biases left out)."""
    return spec(m.arch).dense_parameters(m) - layers * (moe.num_experts - moe.top_k) * 3 * m.hidden * moe.expert_width


def format_experts(f: ExpertFigures, layer_activations: int | None = None) -> list[str]:
    """``plan``'s lines for the experts; ``layer_activations``: :func:`~.dry_run.moe_layer_activations`."""
    where = "every expert on each rank" if f.ep == 1 else f"{f.experts_per_rank} per rank over ep={f.ep}"
    lines = [f"experts         {f.num_experts} per MoE layer × {f.moe_layers} layers, top-{f.top_k}, {where}; "
             f"their parameters {human(f.parameters)}, gradients {human(f.gradients)}, optimizer "
             f"{human(f.optimizer_state)}" + (f", activations {human(layer_activations)} per MoE layer and micro-batch"
                                               if layer_activations is not None else "") + " (in the table above)",
             f"                all-to-all over ep {human(f.all_to_all)} per step"
             + (" (one ep rank: none)" if f.ep == 1 else " (rows out and back, forward and backward, counts)"),
             f"                FLOPs per token {f.flops_per_token:.3g} (active parameters {f.active_parameters:,} "
             f"of {f.total_parameters:,}: MFU counts these)",
             f"                routing assumed uniform: each expert gets T·{f.top_k}/{f.num_experts} of a micro-batch's "
             "T tokens' rows (a skewed router moves more on the busy ranks)"]
    return lines


def is_uniform_depth(moe: MoeShape | None, layers: int) -> bool:
    """Whether every block of a ``layers``-block model is the same kind (all MoE layers, or none): what
    planning a deep model from one- and two-block dry runs needs."""
    kinds = {moe is not None and moe.is_sparse(i) for i in range(layers)}
    return len(kinds) <= 1
