"""Mixtures of experts without torch: the fields as the model reads them, which layers are MoE layers,
their parameters and FLOPs, and a transformers ``config.json``'s MoE keys → ``model:`` fields.

Torch-free (the config imports it through the llama spec). The rules on the fields themselves are
``config/rules/moe.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parallel4d.config.schema import ModelConfig


@dataclass(frozen=True)
class MoeShape:
    """One model's MoE layers: ``num_experts`` routed SwiGLU experts of ``expert_width``, each token to
    its ``top_k`` (renormalised when ``norm_topk_prob``), a shared expert of ``shared_width`` behind a
    sigmoid gate (0: none), in the layers :func:`sparse_layers` selects; the load-balancing loss weighs
    ``aux_loss_coef`` in the loss when ``output_router_logits`` (transformers' switch)."""

    num_experts: int
    top_k: int
    expert_width: int
    shared_width: int = 0
    norm_topk_prob: bool = False
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    @staticmethod
    def of(m: ModelConfig) -> MoeShape | None:
        """The MoE layers of a ``model:`` section; None for a dense model (``num_experts: 0``)."""
        if not m.num_experts:
            return None
        return MoeShape(m.num_experts, m.num_experts_per_tok, m.expert_width, m.shared_expert_intermediate_size,
                        m.norm_topk_prob, m.decoder_sparse_step, tuple(m.mlp_only_layers), m.router_aux_loss_coef,
                        m.output_router_logits)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) holds experts: transformers' rule — not in ``mlp_only_layers``,
        and ``layer + 1`` a multiple of ``decoder_sparse_step``."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


def sparse_layers(moe: MoeShape | None, layers: int) -> list[int]:
    """The MoE layers (from 0) of a model of ``layers`` blocks; none without ``moe``."""
    return [] if moe is None else [i for i in range(layers) if moe.is_sparse(i)]


def expert_parameters(moe: MoeShape | None, hidden: int, layers: int) -> int:
    """Every routed expert's SwiGLU over the model's MoE layers: what ``parallel.ep`` splits (``3·h·I·E`` per layer)."""
    return len(sparse_layers(moe, layers)) * moe.num_experts * 3 * hidden * moe.expert_width if moe else 0


def layer_matrices(moe: MoeShape, hidden: int) -> tuple[int, int]:
    """``(parameters, active)`` of one MoE layer's matrices: every expert's SwiGLU ``3·h·I`` (``k`` of them
    per token), the router ``h·E``, the shared expert ``3·h·I_s`` and its gate ``h`` (both per token)."""
    per_token = hidden * moe.num_experts + 3 * hidden * moe.shared_width + (hidden if moe.shared_width else 0)
    expert = 3 * hidden * moe.expert_width
    return moe.num_experts * expert + per_token, (moe.top_k or 0) * expert + per_token  # k unset: refused by the rules


# --- transformers' config.json ------------------------------------------------------------------------

#: config.json keys of an MoE model → model: fields (Mixtral's num_local_experts is num_experts)
_HF_KEYS = {"num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
            "shared_expert_intermediate_size": "shared_expert_intermediate_size", "norm_topk_prob": "norm_topk_prob",
            "decoder_sparse_step": "decoder_sparse_step", "mlp_only_layers": "mlp_only_layers",
            "router_aux_loss_coef": "router_aux_loss_coef", "output_router_logits": "output_router_logits"}

#: the MoE model_types: Mixtral renormalises the top-k (a softmax over their logits) and has no shared expert,
#: sparse step or dense layers; Qwen2-MoE and Qwen3-MoE read every key
HF_MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")


def fields_from_hf(c: dict) -> dict:
    """The MoE fields of a ``qwen3_moe``, ``qwen2_moe`` or ``mixtral`` ``config.json`` (``{}`` for any
    other model_type). ``ValueError`` for what the layers lack: Mixtral's router jitter."""
    mt = c.get("model_type")
    if mt not in HF_MOE_TYPES:
        return {}
    if c.get("router_jitter_noise"):
        raise ValueError(f"Hugging Face model_type {mt!r}: router_jitter_noise={c['router_jitter_noise']} is not "
                         "supported (the router takes no noise); only 0 loads")
    out = {f: c[k] for k, f in _HF_KEYS.items() if c.get(k) is not None}
    # the experts' key: Mixtral's num_local_experts, the Qwens' num_experts — which transformers 5 writes as
    # num_local_experts for Qwen3-MoE too (its attribute_map)
    out["num_experts"] = c.get("num_experts") or c.get("num_local_experts") or 0
    if mt == "mixtral":  # its router: softmax, top-k, renormalised; every layer an MoE layer
        out.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], shared_expert_intermediate_size=0)
        out.pop("moe_intermediate_size", None)
    if mt == "qwen2_moe" and "shared_expert_intermediate_size" not in out:
        out["shared_expert_intermediate_size"] = 5632  # transformers' Qwen2MoeConfig default
    return out


def hf_layer_names(moe: MoeShape) -> dict[str, tuple[str, str]]:
    """One MoE layer's tensors: our name under ``mlp.`` → ``(transformers' name under mlp., transform)``, in the
    layout published checkpoints and transformers 5's ``save_pretrained`` write: one tensor per expert and
    projection, ``"experts"`` — ``{e}`` in the name stands for each expert, whose tensors stacked along a first
    dimension are ours. :func:`alternatives` names the same tensor in the other layouts (fused, Mixtral's)."""
    out = {"gate.weight": ("gate.weight", "copy"),
           **{f"experts.{p}_proj": (f"experts.{{e}}.{p}_proj.weight", "experts") for p in ("gate", "up", "down")}}
    if moe.shared_width:
        out.update({f"shared_expert.{p}_proj.weight": (f"shared_expert.{p}_proj.weight", "copy")
                    for p in ("gate", "up", "down")})
        out["shared_expert_gate.weight"] = ("shared_expert_gate.weight", "copy")
    return out


_MIXTRAL = {"gate": "w1", "down": "w2", "up": "w3"}  # Mixtral's published expert names


def alternatives(hf: str, how: str) -> list[tuple[str, str]]:
    """Other names and transforms of an entry of :func:`hf_layer_names` (its full name) in the other layouts
    found in the wild, in the order a loader tries them: transformers 5's fused experts (``experts.gate_up_proj
    [E, 2I, h]``, gate rows first: ``"gate_half"`` / ``"up_half"``; ``experts.down_proj [E, h, I]``: ``"copy"``),
    then Mixtral's published ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1|w2|w3`` (gate,
    down, up). None for a tensor outside an MoE layer's router and experts."""
    if hf.endswith(".mlp.gate.weight"):
        return [(hf.replace(".mlp.gate.", ".block_sparse_moe.gate."), how)]
    if how != "experts":
        return []
    stem, _, projection = hf.partition(".{e}.")
    kind = projection.removesuffix("_proj.weight")
    fused = (f"{stem}.down_proj", "copy") if kind == "down" else (f"{stem}.gate_up_proj", f"{kind}_half")
    mixtral = (f"{stem.replace('.mlp.experts', '.block_sparse_moe.experts')}.{{e}}.{_MIXTRAL[kind]}.weight", how)
    return [fused, mixtral]
