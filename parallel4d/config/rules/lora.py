"""Low-rank adapter rules (``model.lora``): targets the family has, and the layouts adapters do not run
in yet (data, sequence, expert and pipeline parallelism, 2D tp, recomputation, packing and compile run;
hetero and DeepSpeed come later), and what an MoE model's routed experts' adapters need
(:func:`expert_problems`).

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


#: the targets that adapt an MoE layer's routed experts, and which fused parameter of peft's each is
_EXPERT_TARGETS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def expert_problems(cfg: Config) -> list[str]:
    """Routed experts' adapters (an MoE model, ``model.lora.targets`` naming an MLP projection) as peft adapts
    transformers 5's fused experts: ``gate_proj`` and ``up_proj`` together (one adapter over both), no
    dropout; not yet on the 2D grid (``parallel.tp``) nor under hetero (experts one module each)."""
    lora, p = cfg.model.lora, cfg.parallel
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
    beside = ([f"parallel.tp={p.tp}"] if p.tp > 1 else []) + (["hetero.enabled=true"] if cfg.hetero.enabled else [])
    if beside:
        out.append(f"model.lora.targets {', '.join(named)} adapt the routed experts, which do not run with "
                   f"{', '.join(beside)} yet; target attention only (q_proj, k_proj, v_proj, o_proj) or set "
                   "parallel.tp=1 and hetero.enabled=false")
    return out


def layout_problems(cfg: Config) -> list[str]:
    """What adapters do not run in yet: hetero, a deepspeed: section (each a later part of issue 49); MoE
    layers' experts: :func:`expert_problems`."""
    beside = [f for f, on in (("hetero.enabled=true", cfg.hetero.enabled),
                              ("a deepspeed: section", cfg.deepspeed is not None)) if on]
    out = []
    if beside:
        out.append(f"model.lora (low-rank adapters) runs with data, sequence, expert, pipeline and 2D tensor "
                   f"parallelism for now, not with {', '.join(beside)}; set hetero.enabled=false and no deepspeed: "
                   "section, or remove model.lora")
    return out


def problems(cfg: Config, valid: tuple[str, ...]) -> list[str]:
    """``model.lora``'s rules (none without it)."""
    if cfg.model.lora is None:
        return []
    return target_problems(cfg, valid) + expert_problems(cfg) + layout_problems(cfg)
