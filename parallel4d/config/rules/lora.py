"""Low-rank adapter rules (``model.lora``): targets the family has, and the layouts adapters do not run
in yet (every parallel axis, recomputation, packing, compile and hetero run; a deepspeed: section comes
later), and what an MoE model's routed experts' adapters need (:func:`expert_problems`).

Torch-free; ``config/checks.py`` calls :func:`problems` among the cross-field rules with the family's
peft target names (its spec's ``lora_targets``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parallel4d.config.rules.common import did_you_mean

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config


def target_problems(cfg: Config, valid: tuple[str, ...]) -> list[str]:
    """Each of ``model.lora.targets`` one of the family's peft ``target_modules`` names (``valid``)."""
    lora, arch = cfg.model.lora, cfg.model.arch
    out = []
    for name in dict.fromkeys(lora.targets):
        if name not in valid:
            out.append(f"model.lora.targets names {name!r}, not a linear layer of model.arch={arch}; "
                       f"{did_you_mean(name, valid)}use peft's target_modules names of the family: "
                       f"{', '.join(valid)}")
    if len(set(lora.targets)) < len(lora.targets):
        out.append(f"model.lora.targets={lora.targets} names a layer twice; remove the repeated name (each once)")
    return out


#: an MoE layer's routed experts' adapters: the fused parameter each adapts (peft's target_parameters), the
#: targets it needs (models/lora.py builds them from this)
EXPERT_ADAPTERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
#: the targets that adapt the routed experts, and which fused parameter each is
_EXPERT_TARGETS = {t: fused for fused, targets in EXPERT_ADAPTERS.items() for t in targets}


def expert_problems(cfg: Config) -> list[str]:
    """Routed experts' adapters (an MoE model, ``model.lora.targets`` naming an MLP projection) as peft adapts
    transformers 5's fused experts: ``gate_proj`` and ``up_proj`` together (one adapter over both), no
    dropout."""
    lora = cfg.model.lora
    named = [t for t in lora.targets if t in _EXPERT_TARGETS]
    if not cfg.model.num_experts or not named:
        return []
    out = []
    half = {"gate_proj", "up_proj"} & set(named)
    if len(half) == 1:
        [have], [lacks] = half, {"gate_proj", "up_proj"} - half
        out.append(f"model.lora.targets names {have!r} but not {lacks!r}: an MoE layer's experts hold gate_proj and "
                   f"up_proj fused (peft adapts them as one, gate_up_proj); add {lacks!r} or remove {have!r}")
    if lora.dropout:
        out.append(f"model.lora.dropout={lora.dropout} with the experts targeted ({', '.join(named)}): peft applies "
                   "no dropout on adapted expert weights; set model.lora.dropout=0 or target attention only")
    return out


def layout_problems(cfg: Config) -> list[str]:
    """What adapters do not run in yet: a deepspeed: section (its engine owns the optimizer and the gradient
    reduction: a later part of issue 49); MoE layers' experts: :func:`expert_problems`."""
    if cfg.deepspeed is None:
        return []
    return ["model.lora (low-rank adapters) runs in parallel4d's own engine (every parallel axis, hetero), not "
            "with a deepspeed: section yet; remove the deepspeed: section or model.lora"]


def problems(cfg: Config, valid: tuple[str, ...]) -> list[str]:
    """``model.lora``'s rules (none without it)."""
    if cfg.model.lora is None:
        return []
    return target_problems(cfg, valid) + expert_problems(cfg) + layout_problems(cfg)


def _linears(m, width: int) -> dict[str, list[tuple[int, int]]]:
    """Per peft target name, the ``(in, out)`` of each linear of one layer it names, the MLP's of ``width``
    (GPT-2's ``c_proj`` is two: the attention's and the MLP's; its ``c_attn`` one fused q, k, v)."""
    attn, kv = m.heads * m.head_size, m.kv_heads_or_heads * m.head_size
    h, w = m.hidden, width
    return {"q_proj": [(h, attn)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(attn, h)],
            "gate_proj": [(h, w)], "up_proj": [(h, w)], "down_proj": [(w, h)],
            "c_attn": [(h, 3 * h)], "c_proj": [(h, h), (w, h)], "c_fc": [(h, w)]}


def _is_sparse(m, layer: int) -> bool:
    """Whether layer ``layer`` (from 0) of ``m`` holds routed experts (transformers' rule, as models/moe/spec.py's)."""
    return bool(m.num_experts) and layer not in m.mlp_only_layers and (layer + 1) % m.decoder_sparse_step == 0


def adapter_parameters(m) -> tuple[int, int]:
    """Elements of the adapters ``model.lora`` adds to the model ``m`` (``(0, 0)`` without it): ``(dense,
    experts)``. Dense: ``rank·(in + out)`` per targeted linear (``lora_A`` ``[r, in]``, ``lora_B``
    ``[out, r]``), every layer — an MoE layer's attention and shared expert, a dense layer's MLP. Experts: the
    routed experts' (:func:`expert_problems`'s fused layout, what ``parallel.ep`` splits with them): ``gate_proj``
    + ``up_proj`` one adapter of rank ``2r`` over the fused ``[2I, h]``, ``down_proj`` one of rank ``r``, per expert."""
    if m.lora is None:
        return 0, 0
    r, targets = m.lora.rank, list(dict.fromkeys(m.lora.targets))
    dense = experts = 0
    for layer in range(m.layers):
        sparse = _is_sparse(m, layer)
        shapes = _linears(m, m.shared_expert_intermediate_size if sparse else m.mlp_width)
        mlp_here = not sparse or m.shared_expert_intermediate_size  # a dense layer's MLP, or the shared expert's
        dense += r * sum(i + o for t in targets if mlp_here or t not in _EXPERT_TARGETS for i, o in shapes.get(t, ()))
        if sparse:
            h, width = m.hidden, m.expert_width
            fused = 2 * r * (h + 2 * width) if {"gate_proj", "up_proj"} <= set(targets) else 0
            experts += m.num_experts * (fused + (r * (width + h) if "down_proj" in targets else 0))
    return dense, experts
