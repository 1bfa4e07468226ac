"""Low-rank adapters (LoRA) as ``peft`` defines them, on the dense model's linear layers.

A targeted linear ``y = x·Wᵀ + b`` (``W`` ``[out, in]``, frozen) becomes
``y = x·Wᵀ + b + scaling · B·A·dropout(x)`` with ``A`` (``lora_A``) ``[r, in]`` drawn as
``kaiming_uniform(a=√5)`` — a fresh ``nn.Linear(in, r)``'s weight —, ``B`` (``lora_B``) ``[out, r]``
zeros (so the adapted model starts equal to its base), ``scaling = alpha / r`` (rsLoRA: ``alpha / √r``),
and the dropout on the adapter's input only (the base sees ``x`` itself): a
:class:`~parallel4d.models.dropout.Site` of kind ``lora`` (one per adapter, ``part`` 1, 2, … in its stage),
whose masks are a function of the dense element (sample, global position, input feature), never torch's
RNG, so every layout drops what one process drops. GPT-2's ``Conv1D`` layers
(``c_attn``, ``c_proj``, ``c_fc``: ``[in, out]`` in transformers, ``[out, in]`` here) get the same
``A`` ``[r, in]`` and ``B`` ``[out, r]`` as peft gives them: its ``fan_in_fan_out`` only transposes the
merged product ``B·A``, never the adapter; the fused ``c_attn`` has one adapter over all of q, k, v.

Routed experts (an MoE layer's stacked ``experts.gate_proj``, ``up_proj`` ``[E, I, h]``, ``down_proj``
``[E, h, I]``) are adapted as peft 0.21 adapts transformers 5's fused expert parameters (its ``ParamWrapper``,
which its config conversion puts on Qwen3-MoE's ``experts.gate_up_proj`` and ``experts.down_proj`` for the
targets ``gate_proj``, ``up_proj``, ``down_proj``): :class:`ExpertsLora`, one adapter per expert stacked along
``E`` — ``lora_A`` ``[E, r, in]``, ``lora_B`` ``[E, out, r]`` —, the weight each expert uses ``W_e + scaling ·
B_e·A_e``. ``gate_proj`` and ``up_proj`` are one adapter over the fused ``[2I, h]`` rows, of rank ``2r`` and
alpha ``2·alpha`` (peft's rank and alpha patterns: ``alpha / r`` unchanged, rsLoRA's ``√2·alpha / √r``), so
they are targeted together or not at all; no dropout (peft refuses ``lora_dropout`` there: the input of
``B·A`` is not separable from the weight's). The shared expert's and dense MLP layers' linears are
:class:`LoraLinear` s as in a dense model.

The targets are peft's ``target_modules`` names: the last component of a module's Hugging Face name
(``q_proj`` … ``down_proj``, ``c_attn`` / ``c_proj`` / ``c_fc``; GPT-2's ``c_proj`` is both the attention's
and the MLP's output, as in peft). Which dense module each is comes from the family's name map
(:func:`~parallel4d.models.hf.p4d_to_hf`), so the base parameters keep their dense names (``….weight``,
``….bias``) and each adapter adds ``….lora_A`` and ``….lora_B`` beside them; :func:`peft_names` maps
those to peft's (``<hf module>.lora_A.weight``, as ``get_peft_model_state_dict`` writes them, under
``base_model.model.``).

Each ``lora_A`` is drawn from a generator of its own, seeded from ``(train.seed, stage, part)``: a rank
holding some of the stages (a pipeline's) draws the adapters one process draws there.

On the 2D grid (``parallel.tp``) a targeted :class:`~parallel4d.tensor2d.layers.Linear2D` (found by its dense
name in its 2D stage) becomes a :class:`LoraLinear2D`: the same dense adapter, drawn as one process draws it,
held as this grid rank's slices, its dropout site shifted to the grid column's input features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.distributed import comm
from parallel4d.models.context import ReadsContext
from parallel4d.models.dropout import WORD, Site, hash_words
from parallel4d.config.rules.lora import EXPERT_ADAPTERS
from parallel4d.models.moe.layer import Experts
from parallel4d.models.moe.tp2d import SparseMoE2D
from parallel4d.models.registry import spec
from parallel4d.tensor2d.composite import Composite2D
from parallel4d.tensor2d.grid import all_reduce_sum, block_of, gather_columns
from parallel4d.tensor2d.layer_base import DenseLayout, box_at, new_param
from parallel4d.tensor2d.layers import Linear2D

ADAPTER_PARTS = ("lora_A", "lora_B")
EXPERT_PARTS = 1 << 16  # the routed experts' adapters' part numbers start here: above any stage's linears


@dataclass(frozen=True)
class LoraShape:
    """``model.lora`` as the modules read it: rank ``r``, ``alpha``, the adapter-input dropout, the
    peft target names, rsLoRA's scaling."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    rslora: bool = False

    @property
    def scaling(self) -> float:
        """peft's factor of the adapter's product: ``alpha / r``, rsLoRA ``alpha / √r``."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def of(cls, lora_cfg) -> "LoraShape":
        """From the config's ``model.lora`` section."""
        return cls(lora_cfg.rank, float(lora_cfg.alpha), float(lora_cfg.dropout), tuple(lora_cfg.targets),
                   lora_cfg.rslora)


class LoraLinear(nn.Module):
    """A frozen linear (the same ``weight`` ``[out, in]`` and ``bias`` ``[out]`` Parameters as the one it
    replaces, so their names stay) plus a trainable adapter ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``;
    ``lora_dropout``: the adapter input's dropout site (``lora.dropout``; stage ``stage``, ``part``)."""

    def __init__(self, base: nn.Linear, lora: LoraShape, generator: torch.Generator | None = None,
                 stage: int = 1, part: int = 1):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.scaling = lora.scaling
        self.lora_dropout = Site(lora.dropout, stage, "lora", part=part)
        self.lora_A = nn.Parameter(initial_lora_A(lora.rank, self.in_features, base.weight, generator))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, lora.rank, dtype=base.weight.dtype,
                                               device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, s, in]`` → ``[b, s, out]``: the base's output plus the scaled adapter's (of ``x``
        with the dropout's mask: the dense elements' masks, whatever slice of the batch ``x`` is)."""
        base = F.linear(x, self.weight, self.bias)
        return base + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.lora_A.shape[0]}, scaling={self.scaling}"


class ExpertsLora(nn.Module):
    """One adapter per routed expert, stacked along ``E``: ``lora_A`` ``[E, r, in]`` (each expert's drawn as
    peft draws the ``[E·r, in]`` matrix it stores: uniform in ±1/√in), ``lora_B`` ``[E, out, r]`` zeros."""

    def __init__(self, experts: int, out_features: int, in_features: int, lora: LoraShape,
                 like: torch.Tensor, generator: torch.Generator | None = None):
        super().__init__()
        self.scaling = lora.scaling
        kw = dict(dtype=like.dtype, device=like.device)
        flat = initial_lora_A(experts * lora.rank, in_features, like, generator)  # peft's [E·r, in]: fan-in ``in``
        self.lora_A = nn.Parameter(flat.view(experts, lora.rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(experts, out_features, lora.rank, **kw))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[E, out, in]`` plus each expert's ``scaling · B_e·A_e`` (peft's ``baddbmm``); the module's
        call, so that a layout wrapping the forward of each module that owns parameters (the 2D grid's gradient
        sums, :mod:`~parallel4d.models.moe.tp2d`) sees the adapters used."""
        return torch.baddbmm(weight, self.lora_B, self.lora_A, alpha=self.scaling)

    def extra_repr(self) -> str:
        e, out, r = self.lora_B.shape
        return f"experts={e}, in={self.lora_A.shape[-1]}, out={out}, r={r}, scaling={self.scaling}"


def expert_adapters(targets) -> list[str]:
    """The fused expert parameters (:data:`EXPERT_ADAPTERS`) ``targets`` adapt; ``gate_proj`` without
    ``up_proj`` (or the reverse) adapts neither (the config refuses it, as peft does)."""
    return [fused for fused, names in EXPERT_ADAPTERS.items() if set(names) <= set(targets)]


def _rows_of(whole: ExpertsLora, experts: range) -> ExpertsLora:
    """A new :class:`ExpertsLora` of ``whole``'s scaling holding the rows ``experts`` of its ``lora_A`` /
    ``lora_B`` (copies: ``whole`` holds all ``E`` experts' adapters)."""
    kept = ExpertsLora.__new__(ExpertsLora)
    nn.Module.__init__(kept)
    kept.scaling = whole.scaling
    for part in ADAPTER_PARTS:
        setattr(kept, part, nn.Parameter(getattr(whole, part).detach()[experts.start:experts.stop].clone()))
    return kept


def expert_shape(lora: LoraShape, which: str) -> LoraShape:
    """The adapter of the experts' fused parameter ``which`` (:data:`EXPERT_ADAPTERS`): ``gate_up_proj`` one over
    two projections, of rank ``2r`` and alpha ``2·alpha`` (peft's rank and alpha patterns), ``down_proj`` ``lora``'s
    own; no dropout."""
    wide = len(EXPERT_ADAPTERS[which])
    return LoraShape(lora.rank * wide, lora.alpha * wide, 0.0, lora.targets, lora.rslora)


def add_expert_adapters(model: nn.Module, lora: LoraShape, seed: int) -> list[str]:
    """An :class:`ExpertsLora` on each MoE layer's routed experts of ``model`` (``<experts>.adapters.<fused>``),
    ``gate_up_proj`` of rank ``2r`` and alpha ``2·alpha``; each drawn for all ``E`` experts from its own
    generator (:func:`adapter_generator` of its block's stage, parts numbered from :data:`EXPERT_PARTS` so
    never a linear adapter's) and cut to the experts the module holds (expert parallelism, pipelines: the
    same draw in every layout). Returns the adapted modules' names."""
    fused = expert_adapters(lora.targets)
    done = []
    for name, experts in sorted((n, m) for n, m in model.named_modules() if isinstance(m, Experts)):
        if not fused:
            break
        adapters = {}
        stage = int(name.split(".")[1]) + 1  # blocks.i.…: stage i + 1, as adapter_sites numbers it
        for number, which in enumerate(fused):
            generator = adapter_generator(seed, stage, EXPERT_PARTS + number)
            shape = expert_shape(lora, which)
            stacked = experts if experts.each is None else experts.each[0]  # one expert's: its [out, in] the same
            weight = stacked.down_proj if which == "down_proj" else stacked.gate_proj
            out = weight.shape[-2] * len(EXPERT_ADAPTERS[which])
            whole = ExpertsLora(experts.num_experts, out, weight.shape[-1], shape, weight, generator)
            adapters[which] = whole
            done.append(f"{name}.adapters.{which}")
        held = range(experts.held.start, experts.held.stop)  # this module's experts only
        if experts.each is None:
            experts.adapters = nn.ModuleDict({w: _rows_of(a, held) for w, a in adapters.items()})
        else:  # one module per expert (hetero): each its rows, a stack of one
            for j, expert in zip(held, experts.each):
                expert.adapters = nn.ModuleDict({w: _rows_of(a, range(j, j + 1)) for w, a in adapters.items()})
    for module in model.modules():  # a 2D layer's experts: the new adapters join its gradient sums over the grid
        if isinstance(module, SparseMoE2D):
            module.adopt_parameters()
    return done


class LoraLinear2D(Linear2D):
    """The 2D twin of :class:`LoraLinear` (``parallel.tp = q²``): a converted linear (the same ``weight`` /
    ``bias`` Parameters, so their names stay) plus this grid rank's slices of the adapter, ``lora_A``
    ``[r, in/q]`` and ``lora_B`` ``[out/q, r]``.

    On grid rank (i, j) the input ``x`` is ``[b/q, s, in/q]`` (batch block i, input features block j) and the
    base's output ``[b/q, s, out/q]`` (batch block i, output features block j). The adapter is split so that
    no activation wider than ``r`` crosses ranks:

    * ``lora_A`` ``[r, in]``: input-feature block j, ``[r, in/q]``, held by every rank of grid column j
      (replicated over the rows, as a bias is); ``u = x · A_jᵀ`` is a partial sum, all-reduced over my grid
      row (``along_j``: the other input blocks of the same tokens) into ``[b/q, s, r]``;
    * ``lora_B`` ``[out, r]``: output-feature block j, ``[out/q, r]``, replicated over the rows the same way
      (with the base's ``out_perm`` applied first: GPT-2's fused ``c_attn`` keeps one adapter over q, k, v, its
      rows reordered as the base's are); ``u · B_jᵀ · scaling`` is exactly block (i, j) of the dense adapter's
      output, added to the base's.

    Backward: the all-reduce's backward sums ``du`` over the grid row (each column's ``B_j`` contributes to it),
    so ``dx = du · A_j`` is the dense gradient's block; each rank's ``lora_A`` / ``lora_B`` gradient covers
    its batch block only and is summed over the grid column (:func:`~parallel4d.tensor2d.grid.replicated_over_rows`),
    so the optimizer sees on every replica the dense gradient of its slice. The extra traffic per adapted
    layer: one all-reduce of ``[b/q, s, r]`` over the row forward, one backward, and the two adapter
    gradients' sums over the column.

    The dense views (``dense_state_dict``, ``dense_grads``, ``dense_layout``: checkpoints, export) name the
    adapter as the dense model does (``….lora_A`` ``[r, in]``, ``….lora_B`` ``[out, r]``, whole) beside the
    base's ``….weight`` / ``….bias``. The dropout on the adapter's input is the dense adapter's site
    (``lora_dropout``, stage ``stage``, ``part``) shifted to input feature ``j·in/q``: the local ``[b/q, s, in/q]``
    block drops the elements one process drops there (the draw's first row is the grid row's batch block).
    """

    def __init__(self, base: Linear2D, lora: LoraShape, lora_A: torch.Tensor, lora_B: torch.Tensor,
                 stage: int = 1, part: int = 1):
        """``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``: the dense adapter (every rank the same),
        sliced here with no communication."""
        super().__init__(base.in_features, base.out_features, base.mesh, name=base.name, overlap=base.overlap,
                         of=base)
        if tuple(lora_A.shape) != (lora.rank, self.in_features) or tuple(lora_B.shape) != (self.out_features,
                                                                                           lora.rank):
            raise ValueError(f"{base.name}: adapter shapes {tuple(lora_A.shape)}, {tuple(lora_B.shape)} are not "
                             f"[r, in] = [{lora.rank}, {self.in_features}] and [out, r] = "
                             f"[{self.out_features}, {lora.rank}]")
        g, kw = self.grid, dict(dtype=base.weight.dtype, device=base.weight.device)
        rows = lora_B if self.out_perm is None else lora_B[self.out_perm.to(lora_B.device)]
        self.lora, self.stage, self.part = lora, stage, part
        self.scaling = lora.scaling
        self.lora_dropout = Site(lora.dropout, stage, "lora", offset=g.j * (self.in_features // g.q), part=part)
        self.lora_A = new_param(block_of(lora_A.detach(), g.j, g.q, 1).to(**kw), ("tp_row",))
        self.lora_B = new_param(block_of(rows.detach(), g.j, g.q, 0).to(**kw), ("tp_row",))

    @comm.eager  # the base's SUMMA, then the adapter's collectives: labels stay out of traced code
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b/q, s, in/q]`` → ``[b/q, s, out/q]``: the base's output plus the scaled adapter's."""
        g = self.grid
        partial = F.linear(self.lora_dropout(x), self.replicated("lora_A"))  # [b/q, s, r]: my input block's share
        u = all_reduce_sum(partial, g.along_j, g.stats, f"{self.name}.lora_A.sum", g.comm)
        return super().forward(x) + F.linear(u, self.replicated("lora_B")) * self.scaling

    def _by_output(self, get) -> dict[str, torch.Tensor]:
        return {**super()._by_output(get), "lora_B": gather_columns(get(self.lora_B), self.grid, dim=0)}

    def _dense(self, get):
        return {**super()._dense(get), "lora_A": gather_columns(get(self.lora_A), self.grid, dim=1).contiguous()}

    def dense_layout(self) -> dict[str, DenseLayout]:
        g, runs = self.grid, self.output_runs()
        return {**super().dense_layout(),
                "lora_A": ((self.lora.rank, self.in_features), box_at(0, g.j * (self.in_features // g.q))),
                "lora_B": ((self.out_features, self.lora.rank), lambda t: [((d, 0), t[k:k + n]) for d, k, n in runs])}

    def to_dense(self) -> nn.Module:
        """The dense :class:`LoraLinear` (collective: every grid rank calls it)."""
        sd = self.dense_state_dict()
        base = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                         dtype=self.weight.dtype, device=self.weight.device)
        base.load_state_dict({k: sd[k] for k in ("weight", "bias") if k in sd})
        dense = LoraLinear(base, self.lora, torch.Generator(), self.stage, self.part)  # its draw replaced at once
        with torch.no_grad():
            dense.lora_A.copy_(sd["lora_A"])
            dense.lora_B.copy_(sd["lora_B"])
        return dense

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.lora.rank}, scaling={self.scaling}"


def initial_lora_A(rank: int, in_features: int, like: torch.Tensor,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh ``lora_A`` ``[rank, in_features]`` in ``like``'s dtype and on its device: nn.Linear's default
    weight init, peft's ``init_lora_weights=True`` (``kaiming_uniform(a=√5)``: uniform in ±1/√in), drawn on
    the host from ``generator`` (a CPU generator: the same values on any device, in any layout)."""
    a = torch.empty(rank, in_features, dtype=like.dtype)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a.to(like.device)


def adapted_modules(model_cfg) -> dict[str, str]:
    """``{dense module name: Hugging Face module name}`` of every linear ``model_cfg.lora.targets``
    names (none without ``model.lora``), from the family's name map."""
    if model_cfg.lora is None:
        return {}
    return targeted(spec(model_cfg.arch).hf_names(model_cfg), model_cfg.lora.targets)


def targeted(hf_map: dict[str, tuple[str, str]], targets) -> dict[str, str]:
    """``{dense module name: Hugging Face module name}`` of the linears whose Hugging Face name ends in
    one of ``targets`` (peft's suffix match on whole name components), from a family's name map
    ``{dense parameter: (Hugging Face parameter, transform)}``: each matrix's ``….weight`` names its module."""
    wanted = set(targets)
    out = {}
    for dense, (hf, _) in hf_map.items():
        if dense.endswith(".weight") and hf.endswith(".weight"):
            module = hf[: -len(".weight")]
            if module.rsplit(".", 1)[-1] in wanted:
                out[dense[: -len(".weight")]] = module
    return out


def add_adapters(model: nn.Module, modules: dict[str, str], lora: LoraShape, seed: int = 0) -> list[str]:
    """Replace each dense module named in ``modules`` (present in ``model``: a rank's stages may hold a
    part) by a :class:`LoraLinear` over it — over a 2D stage's :class:`~parallel4d.tensor2d.layers.Linear2D`
    (found by its dense name, :func:`by_dense_name`), a :class:`LoraLinear2D` holding this grid rank's slices of
    the same dense adapter —, its ``lora_A`` drawn from its own generator
    (:func:`adapter_generator`) and its dropout site reading the model's forward context; then the
    routed experts' adapters (:func:`add_expert_adapters`); freeze every other parameter
    (:func:`freeze_base`). ``modules``: all the model's adapted modules (what numbers each stage's
    adapters), not only this rank's. Returns the names of the adapted modules."""
    present = by_dense_name(model)
    local = {id(m): n for n, m in model.named_modules()}
    context = _context_of(model)
    done = []
    for name, (stage, part) in adapter_sites(modules).items():
        base = present.get(name)
        if base is None:
            continue
        g = adapter_generator(seed, stage, part)
        if isinstance(base, Linear2D):  # the dense adapter, drawn as one process draws it, then sliced
            adapted = LoraLinear2D(base, lora, initial_lora_A(lora.rank, base.in_features, base.weight, g),
                                   torch.zeros(base.out_features, lora.rank, dtype=base.weight.dtype), stage, part)
        elif isinstance(base, nn.Linear):
            adapted = LoraLinear(base, lora, g, stage, part)
        else:
            raise TypeError(f"LoRA target {modules[name]!r} is dense module {name!r}, a {type(base).__name__}, "
                            "not a linear layer")
        adapted.lora_dropout.context = context
        parent, _, leaf = local[id(base)].rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, adapted)
        done.append(name)
    done += add_expert_adapters(model, lora, seed)
    freeze_base(model)
    return done


def by_dense_name(model: nn.Module) -> dict[str, nn.Module]:
    """``{dense module name: module}`` of ``model``'s modules: their own names, and a 2D stage's parts
    (:meth:`~parallel4d.tensor2d.composite.Composite2D.dense_parts`) under the dense module's names, the
    stage's name in ``model`` being the dense stage's (``blocks.0`` of :class:`~parallel4d.engine.model.LocalModel`)."""
    out = dict(model.named_modules())
    for name, module in list(out.items()):
        if isinstance(module, Composite2D):
            out.update({f"{name}.{part}" if name else part: layer for part, layer in module.dense_parts().items()})
    return out


def adapter_sites(modules) -> dict[str, tuple[int, int]]:
    """``{dense module name: (stage, part)}``: the stage of ``blocks.i.…`` is ``i + 1`` (stages.stage_names'
    order), and a stage's adapters are numbered 1, 2, … in sorted dense-name order."""
    out, count = {}, {}
    for name in sorted(modules):
        head, index, *_ = name.split(".") + [""]
        if head != "blocks" or not index.isdigit():
            raise ValueError(f"LoRA adapts the blocks' linears only, not dense module {name!r}")
        stage = int(index) + 1
        count[stage] = count.get(stage, 0) + 1
        out[name] = stage, count[stage]
    return out


def adapter_generator(seed: int, stage: int, part: int) -> torch.Generator:
    """The generator of one adapter's ``lora_A``: seeded from ``(seed, stage, part)`` alone, so any rank
    holding the adapter draws the same (four words: never a dropout site's key, which has six or seven)."""
    return torch.Generator().manual_seed(hash_words((seed & WORD, seed >> 32, stage, part)))


def _context_of(model: nn.Module):
    """The forward context the model's modules read (every one of a model reads the same; None: none set)."""
    return next((m.context for m in model.modules() if isinstance(m, ReadsContext) and m.context is not None),
                None)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``….lora_A`` / ``….lora_B``)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARTS


def freeze_base(model: nn.Module) -> None:
    """Every parameter but the adapters' frozen: no gradient is kept for it, and an optimizer over the
    parameters that require one (``optim.optimizer.param_groups``) holds no state for it."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))


def peft_names(modules: dict[str, str], in_memory: bool = False) -> dict[str, str]:
    """``{our adapter parameter: peft's name}``: ``<hf module>.lora_A.weight`` under ``base_model.model.``
    as peft's adapter file stores it, or (``in_memory``) with the ``.default`` adapter name as
    ``get_peft_model(...).named_parameters()`` calls it."""
    tag = ".default" if in_memory else ""
    return {f"{dense}.{part}": f"base_model.model.{hf}.{part}{tag}.weight"
            for dense, hf in modules.items() for part in ADAPTER_PARTS}


def adapted_experts(model_cfg) -> dict[str, tuple[str, list[str]]]:
    """``{dense name of an MoE layer's experts module: (its transformers 5 module name, the fused parameters
    adapted)}`` (none without expert targets): ``blocks.<l>.mlp.experts`` → ``model.layers.<l>.mlp.experts``
    (Mixtral's ``block_sparse_moe`` is ``mlp`` there too), ``["gate_up_proj", "down_proj"]`` or a part."""
    fused = expert_adapters(model_cfg.lora.targets) if model_cfg.lora is not None else []
    if not fused:
        return {}
    out = {}
    for dense, (hf, _) in spec(model_cfg.arch).hf_names(model_cfg).items():
        if dense.endswith(".experts.down_proj"):
            module = "model." + hf[len("model."):].split(".experts.")[0].replace("block_sparse_moe", "mlp")
            out[dense[: -len(".down_proj")]] = f"{module}.experts", list(fused)
    return out


def expert_peft_names(model_cfg, in_memory: bool = False) -> dict[str, str]:
    """``{our expert adapter parameter: peft's name}`` (none without expert targets): peft wraps the experts
    module (``model.layers.<l>.mlp.experts``) once per fused parameter, ``gate_up_proj`` inside
    ``down_proj`` where both are adapted (its ``base_layer``). The tensors differ in layout:
    :func:`expert_tensor_to_peft`."""
    tag = ".default" if in_memory else ""
    out = {}
    for ours, (module, fused) in adapted_experts(model_cfg).items():
        for which in fused:
            inner = ".base_layer" if which == "gate_up_proj" and len(fused) == 2 else ""
            out.update({f"{ours}.adapters.{which}.{part}": f"base_model.model.{module}{inner}.{part}{tag}.weight"
                        for part in ADAPTER_PARTS})
    return out


def expert_tensor_to_peft(part: str, tensor: torch.Tensor) -> torch.Tensor:
    """An :class:`ExpertsLora` tensor in peft's layout: ``lora_A`` ``[E, r, in]`` → ``[E·r, in]`` (expert-major
    rows), ``lora_B`` ``[E, out, r]`` → ``[out, r·E]`` (column ``j·E + e`` is expert ``e``'s ``j``-th)."""
    if part == "lora_A":
        return tensor.reshape(-1, tensor.shape[-1])
    return tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)


def expert_tensor_from_peft(part: str, tensor: torch.Tensor, experts: int) -> torch.Tensor:
    """peft's layout of an :class:`ExpertsLora` tensor back to ours (:func:`expert_tensor_to_peft`'s inverse):
    ``lora_A`` ``[E·r, in]`` → ``[E, r, in]``, ``lora_B`` ``[out, r·E]`` → ``[E, out, r]``."""
    if part == "lora_A":
        return tensor.reshape(experts, -1, tensor.shape[-1])
    return tensor.reshape(tensor.shape[0], -1, experts).permute(2, 0, 1)


def adapter_names(model_cfg) -> list[str]:
    """Every adapter parameter's dense name of ``model.lora`` on ``model_cfg``: each adapted linear's
    ``….lora_A`` / ``….lora_B``, then each MoE layer's experts' ``….experts.adapters.<fused>.lora_A`` /
    ``lora_B``."""
    linears = [f"{m}.{part}" for m in adapted_modules(model_cfg) for part in ADAPTER_PARTS]
    return linears + list(expert_peft_names(model_cfg))
