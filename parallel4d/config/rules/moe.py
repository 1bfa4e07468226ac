"""Mixture-of-experts rules (``model.num_experts`` and the fields beside it): what the router and the
layer selection need, the MoE fields set on a dense model, ``parallel.ep`` (experts over data-replica
ranks), the 2D grid's token split (:func:`grid_problems`) and the layouts MoE layers do not run in yet
(a deepspeed: section).

Torch-free; ``models/llama/spec.py`` calls :func:`field_problems` among its rules, ``config/checks.py``
:func:`layout_problems` among the cross-field rules.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from parallel4d.config.rules.common import closest, divisors, nearest_multiples, or_list

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


def ep_problems(cfg: Config) -> list[str]:
    """``parallel.ep``: an MoE model's experts split over ``ep`` of the ``dp·sp`` data-replica ranks, so
    ``ep`` divides ``dp·sp`` and the expert count, and is at most that count. The fix: the nearest ep
    that divides both (a divisor of their gcd)."""
    p, e = cfg.parallel, cfg.model.num_experts
    if p.ep == 1:
        return []
    if not e:
        return [f"parallel.ep={p.ep} with model.num_experts=0 (no mixture-of-experts layers) has no experts to "
                "split; use parallel.ep=1, or an MoE model (model.num_experts > 0, model.arch=llama)"]
    replicas = p.dp * p.sp
    fits = or_list(closest(divisors(math.gcd(replicas, e)), p.ep))
    if replicas % p.ep:
        return [f"parallel.ep={p.ep} does not divide parallel.dp × parallel.sp = {p.dp} × {p.sp} = {replicas} "
                f"(the expert-parallel ranks are drawn from the data-replica ranks); use parallel.ep={fits}, or "
                f"dp·sp a multiple of {p.ep}"]
    if p.ep > e:
        return [f"parallel.ep={p.ep} is more than model.num_experts={e}: each expert-parallel rank holds at least "
                f"one whole expert; use parallel.ep={fits}"]
    if e % p.ep:
        return [f"parallel.ep={p.ep} does not split model.num_experts={e} experts evenly over its ranks; use "
                f"parallel.ep={fits}"]
    return []


#: what MoE layers do not compose with yet, and the fix of each
_NOT_YET = "DeepSpeed comes later"


def grid_problems(cfg: Config) -> list[str]:
    """Under 2D tp (``q = √tp > 1``) an MoE layer splits each grid row's tokens of a micro-batch, ``B/(dp·q·m)``
    rows of ``S/sp`` tokens, over the row's q ranks (models/moe/tp2d.py): their number must divide by q.
    (A batch the grid rows do not split is the data rules' to report.)"""
    p, q = cfg.parallel, cfg.parallel.q
    rows_per_grid = p.dp * q * cfg.pipeline.microbatches
    if q == 1 or cfg.data.batch_size % rows_per_grid or cfg.model.seq_len % p.sp:
        return []
    rows, tokens = cfg.data.batch_size // rows_per_grid, cfg.model.seq_len // p.sp
    if (rows * tokens) % q == 0:
        return []
    return [f"model.num_experts={cfg.model.num_experts} with parallel.tp={p.tp}: an MoE layer splits each grid row's "
            f"{rows} × {tokens} = {rows * tokens} tokens of a micro-batch (data.batch_size / (dp·q·microbatches) "
            f"rows of model.seq_len / parallel.sp) over its q={q} ranks, and {rows * tokens} is not divisible by "
            f"{q}; use model.seq_len a multiple of parallel.sp × {q} = {p.sp * q} (e.g. model.seq_len="
            f"{or_list(nearest_multiples(cfg.model.seq_len, p.sp * q))}), or data.batch_size a multiple of "
            f"{rows_per_grid * q}"]


def layout_problems(cfg: Config, family_has_moe: bool) -> list[str]:
    """MoE fields on a dense model (``num_experts: 0``, any family), MoE layers in a family that has none
    (``family_has_moe``: the family reads ``num_experts``), ``parallel.ep`` (:func:`ep_problems`), or MoE
    layers in a layout they do not run in yet: every parallel axis (dp, sp, ep, pp, tp: :func:`grid_problems`),
    with or without hetero — no DeepSpeed."""
    m = cfg.model
    if not m.num_experts:
        stray = _set_fields(m)
        return ([f"{', '.join(stray)} with model.num_experts=0 (no MoE layers) is read by nothing; set "
                 "model.num_experts to the routed experts per MoE layer (model.arch=llama), or remove them"]
                if stray else []) + ep_problems(cfg)
    if not family_has_moe:
        return [f"model.num_experts={m.num_experts} with model.arch={m.arch}: only the llama family has "
                "mixture-of-experts layers; use model.arch=llama, or model.num_experts=0"]
    out = ep_problems(cfg) + grid_problems(cfg)
    if cfg.deepspeed is not None:
        out.append(f"model.num_experts={m.num_experts} (mixture-of-experts layers) runs over every parallel axis "
                   f"and hetero for now ({_NOT_YET}), not with a deepspeed: section; remove the deepspeed: section "
                   "(parallel4d's own engine trains MoE models in every layout)")
    return out
