"""Mixture-of-experts rules (``model.num_experts`` and the fields beside it): what the router and the
layer selection need, the MoE fields set on a dense model, and the layouts MoE layers do not run in
yet (one process only, issue 48's first part: expert parallelism over ranks comes with its second).

Torch-free; ``models/llama/spec.py`` calls :func:`field_problems` among its rules, ``config/checks.py``
:func:`layout_problems` among the cross-field rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config, ModelConfig

#: the fields an MoE model reads besides num_experts (each with its default: "set" means another value)
MOE_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")


def _set_fields(m: ModelConfig) -> list[str]:
    """The MoE fields whose value is not their default, as ``model.X=value``."""
    defaults = type(m).model_fields
    return [f"model.{f}={getattr(m, f)}" for f in MOE_FIELDS
            if getattr(m, f) != defaults[f].get_default(call_default_factory=True)]


def field_problems(m: ModelConfig) -> list[str]:
    """The router's top-k against the experts, the layers ``mlp_only_layers`` names (an MoE model's; a
    dense one's MoE fields are :func:`layout_problems`')."""
    if not m.num_experts:
        return []
    out, k, e = [], m.num_experts_per_tok, m.num_experts
    if k is None:
        out.append(f"model.num_experts_per_tok is missing: with model.num_experts={e} each token is routed to its "
                   f"top-k experts; set it (1 to {e}, e.g. {min(2, e)})")
    elif k > e:
        out.append(f"model.num_experts_per_tok={k} is more than model.num_experts={e}: a token is routed to k "
                   f"different experts; use 1 to {e}")
    beyond = [i for i in m.mlp_only_layers if i >= m.layers]
    if beyond:
        out.append(f"model.mlp_only_layers={m.mlp_only_layers} names layer(s) {beyond} of a model of model.layers="
                   f"{m.layers} (numbered from 0); use layers 0 to {m.layers - 1}")
    return out


def layout_problems(cfg: Config, family_has_moe: bool) -> list[str]:
    """MoE fields on a dense model (``num_experts: 0``, any family), MoE layers in a family that has none
    (``family_has_moe``: the family reads ``num_experts``), or in a layout they do not run in yet: one
    process, no hetero, no DeepSpeed, no compiled blocks."""
    m = cfg.model
    if not m.num_experts:
        stray = _set_fields(m)
        return [f"{', '.join(stray)} with model.num_experts=0 (no MoE layers) is read by nothing; set "
                "model.num_experts to the routed experts per MoE layer (model.arch=llama), or remove them"] \
            if stray else []
    if not family_has_moe:
        return [f"model.num_experts={m.num_experts} with model.arch={m.arch}: only the llama family has "
                "mixture-of-experts layers; use model.arch=llama, or model.num_experts=0"]
    p = cfg.parallel
    wide = [f"parallel.{a}={getattr(p, a)}" for a in ("pp", "dp", "sp", "tp") if getattr(p, a) > 1]
    other = ([f"hetero.enabled=true"] if cfg.hetero.enabled else []) + \
        (["a deepspeed: section"] if cfg.deepspeed is not None else []) + \
        ([f"train.compile={cfg.train.compile}"] if cfg.train.compile != "none" else [])
    if not wide + other:
        return []
    fix = ", ".join([f"parallel.{w.split('=')[0].split('.')[1]}=1" for w in wide] +
                    ["hetero.enabled=false" for o in other if o.startswith("hetero")] +
                    ["remove the deepspeed: section" for o in other if o.startswith("a deepspeed")] +
                    ["train.compile=none" for o in other if o.startswith("train.compile")])
    return [f"model.num_experts={m.num_experts} (mixture-of-experts layers) runs in one process only for now "
            f"(expert parallelism and the other axes come later), not with {', '.join(wide + other)}; use {fix}"]
