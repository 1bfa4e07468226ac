"""Low-rank adapters (LoRA) as ``peft`` defines them, on the dense model's linear layers.

A targeted linear ``y = x·Wᵀ + b`` (``W`` ``[out, in]``, frozen) becomes
``y = x·Wᵀ + b + scaling · B·A·dropout(x)`` with ``A`` (``lora_A``) ``[r, in]`` drawn as
``kaiming_uniform(a=√5)`` — a fresh ``nn.Linear(in, r)``'s weight —, ``B`` (``lora_B``) ``[out, r]``
zeros (so the adapted model starts equal to its base), ``scaling = alpha / r`` (rsLoRA: ``alpha / √r``),
and the dropout on the adapter's input only (the base sees ``x`` itself). GPT-2's ``Conv1D`` layers
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.models.lora_tp2d import LoraLinear2D
from parallel4d.models.registry import spec
from parallel4d.tensor2d.composite import Composite2D
from parallel4d.tensor2d.layers import Linear2D

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
    replaces, so their names stay) plus a trainable adapter ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``."""

    def __init__(self, base: nn.Linear, lora: LoraShape, generator: torch.Generator | None = None):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.scaling, self.dropout = lora.scaling, lora.dropout
        self.lora_A = nn.Parameter(initial_lora_A(lora.rank, self.in_features, base.weight, generator))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, lora.rank, dtype=base.weight.dtype,
                                               device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` → ``[..., out]``: the base's output plus the scaled adapter's."""
        base = F.linear(x, self.weight, self.bias)
        a = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return base + F.linear(F.linear(a, self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.lora_A.shape[0]}, scaling={self.scaling}"


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
    (found by its dense name), a :class:`~parallel4d.models.lora_tp2d.LoraLinear2D` holding this grid rank's
    slices of the same dense adapter —, in sorted dense-name order, every ``lora_A`` drawn from one
    generator seeded ``seed``; freeze every other parameter (:func:`freeze_base`). Returns the names
    of the adapted modules."""
    g = torch.Generator().manual_seed(seed)
    present = by_dense_name(model)
    local = {id(m): n for n, m in model.named_modules()}
    done = []
    for name in sorted(modules):
        base = present.get(name)
        if base is None:
            continue
        if isinstance(base, Linear2D):  # the dense adapter, drawn as one process draws it, then sliced
            adapter = LoraLinear2D(base, lora, initial_lora_A(lora.rank, base.in_features, base.weight, g),
                                   torch.zeros(base.out_features, lora.rank, dtype=base.weight.dtype))
        elif isinstance(base, nn.Linear):
            adapter = LoraLinear(base, lora, g)
        else:
            raise TypeError(f"LoRA target {modules[name]!r} is dense module {name!r}, a {type(base).__name__}, "
                            "not a linear layer")
        parent, _, leaf = local[id(base)].rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, adapter)
        done.append(name)
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
