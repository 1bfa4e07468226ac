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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.models.context import ReadsContext
from parallel4d.models.dropout import WORD, Site, hash_words
from parallel4d.models.moe.layer import Experts
from parallel4d.models.registry import spec

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
        kw = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(lora.rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, lora.rank, **kw))
        # nn.Linear's default weight init, peft's init_lora_weights=True: uniform in ±1/√in
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)

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
        flat = torch.empty(experts * lora.rank, in_features, **kw)  # peft's lora_A weight: fan-in ``in``
        nn.init.kaiming_uniform_(flat, a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(flat.view(experts, lora.rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(experts, out_features, lora.rank, **kw))

    def delta(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[E, out, in]`` plus each expert's ``scaling · B_e·A_e`` (peft's ``baddbmm``)."""
        return torch.baddbmm(weight, self.lora_B, self.lora_A, alpha=self.scaling)

    def extra_repr(self) -> str:
        e, out, r = self.lora_B.shape
        return f"experts={e}, in={self.lora_A.shape[-1]}, out={out}, r={r}, scaling={self.scaling}"


#: the routed experts' adapters: the fused parameter each adapts (peft's target_parameters), the targets it needs
EXPERT_ADAPTERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_adapters(targets) -> list[str]:
    """The fused expert parameters (:data:`EXPERT_ADAPTERS`) ``targets`` adapt; ``gate_proj`` without
    ``up_proj`` (or the reverse) adapts neither (the config refuses it, as peft does)."""
    return [fused for fused, names in EXPERT_ADAPTERS.items() if set(names) <= set(targets)]


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
        if experts.each is not None:
            raise TypeError(f"LoRA on the experts of {name!r}: one module per expert (hetero) holds no adapters")
        adapters = {}
        stage = int(name.split(".")[1]) + 1  # blocks.i.…: stage i + 1, as adapter_sites numbers it
        for number, which in enumerate(fused):
            generator = adapter_generator(seed, stage, EXPERT_PARTS + number)
            wide = len(EXPERT_ADAPTERS[which])
            shape = LoraShape(lora.rank * wide, lora.alpha * wide, 0.0, lora.targets, lora.rslora)
            weight = experts.down_proj if which == "down_proj" else experts.gate_proj
            out = weight.shape[1] * wide
            whole = ExpertsLora(experts.num_experts, out, weight.shape[2], shape, weight, generator)
            first = experts.held.start
            for part in ("lora_A", "lora_B"):  # this module's experts only
                kept = getattr(whole, part).detach()[first:first + len(experts.held)].clone()
                setattr(whole, part, nn.Parameter(kept))
            adapters[which] = whole
            done.append(f"{name}.adapters.{which}")
        experts.adapters = nn.ModuleDict(adapters)
    return done


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
    part) by a :class:`LoraLinear` over it, its ``lora_A`` drawn from its own generator
    (:func:`adapter_generator`) and its dropout site reading the model's forward context; then the routed
    experts' adapters (:func:`add_expert_adapters`); freeze every other parameter (:func:`freeze_base`).
    ``modules``: all the model's adapted modules (what numbers each stage's adapters), not only this
    rank's. Returns the names of the adapted modules."""
    present = dict(model.named_modules())
    context = _context_of(model)
    done = []
    for name, (stage, part) in adapter_sites(modules).items():
        base = present.get(name)
        if base is None:
            continue
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRA target {modules[name]!r} is dense module {name!r}, a {type(base).__name__}, "
                            "not a linear layer")
        adapted = LoraLinear(base, lora, adapter_generator(seed, stage, part), stage, part)
        adapted.lora_dropout.context = context
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, adapted)
        done.append(name)
    done += add_expert_adapters(model, lora, seed)
    freeze_base(model)
    return done


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


def expert_peft_names(model_cfg, in_memory: bool = False) -> dict[str, str]:
    """``{our expert adapter parameter: peft's name}`` (none without expert targets): peft wraps the experts
    module (``model.layers.<l>.mlp.experts``) once per fused parameter, ``gate_up_proj`` inside
    ``down_proj`` where both are adapted (its ``base_layer``). The tensors differ in layout:
    :func:`expert_tensor_to_peft`."""
    fused = expert_adapters(model_cfg.lora.targets) if model_cfg.lora is not None else []
    tag = ".default" if in_memory else ""
    out = {}
    for dense, (hf, _) in spec(model_cfg.arch).hf_names(model_cfg).items():
        if not dense.endswith(".experts.down_proj"):
            continue
        module = "model." + hf[len("model."):].split(".experts.")[0].replace("block_sparse_moe", "mlp") + ".experts"
        ours = dense[: -len(".down_proj")]
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
