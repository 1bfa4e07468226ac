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
from parallel4d.models.registry import spec

ADAPTER_PARTS = ("lora_A", "lora_B")


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
    (:func:`adapter_generator`) and its dropout site reading the model's forward context; freeze every
    other parameter (:func:`freeze_base`). ``modules``: all the model's adapted modules (what numbers
    each stage's adapters), not only this rank's. Returns the names of the adapted modules."""
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
