"""Mixtures of experts without torch: the fields as the model reads them, which layers are MoE layers,
their parameters and FLOPs, a transformers ``config.json``'s MoE keys ↔ ``model:`` fields, and the
transformers model type (Qwen3-MoE, Qwen2-MoE, Mixtral) and tensor names of a model, both ways.

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


#: config.json keys each MoE model_type writes (its experts' count: the Qwens' num_experts, which transformers 4
#: and 5 both read, Mixtral's num_local_experts); Mixtral's other MoE fields are fixed (:func:`fields_from_hf`)
_HF_WRITES = {"qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                            "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"),
              "mixtral": ("num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")}
_HF_WRITES["qwen2_moe"] = (*_HF_WRITES["qwen3_moe"], "shared_expert_intermediate_size")


def hf_model_type(moe: MoeShape, qk_norm: bool) -> str:
    """The transformers ``model_type`` whose names and ``config.json`` an MoE model's are: ``qwen3_moe`` with q/k
    norms, ``qwen2_moe`` with a shared expert, else ``mixtral`` — the types :func:`fields_from_hf` reads, each
    loaded back as itself. :func:`hf_type_problems` says what that type cannot hold."""
    return "qwen3_moe" if qk_norm else "qwen2_moe" if moe.shared_width else "mixtral"


def hf_type_problems(moe: MoeShape, qk_norm: bool, qkv_bias: bool) -> list[str]:
    """What the :func:`hf_model_type` of a model lacks, as ``model.*`` fields with why: Qwen3-MoE has no shared
    expert nor q, k, v biases; Mixtral no biases, and it renormalises the top-k in every layer."""
    kind = hf_model_type(moe, qk_norm)
    if kind == "qwen3_moe":
        return ([f"model.qk_norm with model.shared_expert_intermediate_size={moe.shared_width}: Qwen3-MoE (q/k norms) "
                 "has no shared expert, Qwen2-MoE (a shared expert) no q/k norms"] if moe.shared_width else []) + \
            (["model.qk_norm with model.qkv_bias: Qwen3-MoE (q/k norms) has no q, k, v biases"] if qkv_bias else [])
    if kind == "qwen2_moe":
        return []
    lacks = (["model.qkv_bias"] if qkv_bias else []) + ([] if moe.norm_topk_prob else ["model.norm_topk_prob=false"]) \
        + ([f"model.decoder_sparse_step={moe.sparse_step}"] if moe.sparse_step != 1 else []) \
        + ([f"model.mlp_only_layers={list(moe.mlp_only_layers)}"] if moe.mlp_only_layers else [])
    return [f"{', '.join(lacks)} without q/k norms or a shared expert: Mixtral (neither) has no biases and "
            "renormalises the top-k (norm_topk_prob) in every layer; Qwen3-MoE needs model.qk_norm, Qwen2-MoE "
            "model.shared_expert_intermediate_size > 0"] if lacks else []


def hf_config_keys(moe: MoeShape, model_type: str) -> dict:
    """The MoE keys of a ``model_type`` (:func:`hf_model_type`) ``config.json``: :func:`fields_from_hf` reversed
    (Mixtral's expert width is its intermediate_size, the family's to write)."""
    fields = {"num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_width,
              "shared_expert_intermediate_size": moe.shared_width, "norm_topk_prob": moe.norm_topk_prob,
              "decoder_sparse_step": moe.sparse_step, "mlp_only_layers": list(moe.mlp_only_layers),
              "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": moe.output_router_logits}
    experts = {"num_local_experts": moe.num_experts, "router_jitter_noise": 0.0} if model_type == "mixtral" \
        else {"num_experts": moe.num_experts}
    return {**experts, **{k: fields[k] for k in _HF_WRITES[model_type]}}


_MIXTRAL = {"gate": "w1", "down": "w2", "up": "w3"}  # Mixtral's published expert names
_PROJECTIONS = {**{v: k for k, v in _MIXTRAL.items()}, **{f"{k}_proj": k for k in _MIXTRAL}}  # stored → gate|up|down


def hf_layer_names(moe: MoeShape, model_type: str) -> dict[str, tuple[str, str]]:
    """One MoE layer's tensors: our name under ``mlp.`` → ``(transformers' name under the layer, transform)``, in
    the layout published checkpoints and transformers 5's ``save_pretrained`` write for ``model_type``
    (:func:`hf_model_type`): one tensor per expert and projection, ``"experts"`` — ``{e}`` in the name stands
    for each expert, whose tensors stacked along a first dimension are ours; the Qwens' under ``mlp.``
    (``experts.{e}.gate_proj``), Mixtral's under ``block_sparse_moe.`` (``experts.{e}.w1``: gate, ``w2``: down,
    ``w3``: up). :func:`alternatives` names the same tensor in the other layouts (fused, the other names)."""
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    out = {"gate.weight": (f"{block}.gate.weight", "copy"),
           **{f"experts.{p}_proj": (f"{block}.experts.{{e}}.{_stored_projection(p, model_type)}.weight", "experts")
              for p in ("gate", "up", "down")}}
    if moe.shared_width:
        out.update({f"shared_expert.{p}_proj.weight": (f"mlp.shared_expert.{p}_proj.weight", "copy")
                    for p in ("gate", "up", "down")})
        out["shared_expert_gate.weight"] = ("mlp.shared_expert_gate.weight", "copy")
    return out


def _stored_projection(projection: str, model_type: str) -> str:
    """A projection's (gate, up, down) name among one expert's tensors of ``model_type``."""
    return _MIXTRAL[projection] if model_type == "mixtral" else f"{projection}_proj"


def _layouts(layer: str, projection: str) -> list[tuple[str, str]]:
    """Every stored form of a layer's ``projection`` (gate, up, down): one tensor per expert under the Qwens'
    names, transformers 5's fused experts (``experts.gate_up_proj [E, 2I, h]``, gate rows first: ``"gate_half"`` /
    ``"up_half"``; ``experts.down_proj [E, h, I]``: ``"copy"``), one per expert under Mixtral's names."""
    fused = (f"{layer}.mlp.experts.down_proj", "copy") if projection == "down" else \
        (f"{layer}.mlp.experts.gate_up_proj", f"{projection}_half")
    return [(f"{layer}.mlp.experts.{{e}}.{projection}_proj.weight", "experts"), fused,
            (f"{layer}.block_sparse_moe.experts.{{e}}.{_MIXTRAL[projection]}.weight", "experts")]


def alternatives(hf: str, how: str) -> list[tuple[str, str]]:
    """Other names and transforms of an entry of :func:`hf_layer_names` (its full name) in the other layouts
    found in the wild, in the order a loader tries them (:func:`_layouts`; the router under ``mlp.gate`` or
    ``block_sparse_moe.gate``). None for a tensor outside an MoE layer's router and experts."""
    for block in (".mlp.", ".block_sparse_moe."):
        layer, found, rest = hf.partition(block)
        if found:
            break
    else:
        return []
    if rest == "gate.weight":
        forms = [(f"{layer}.mlp.gate.weight", how), (f"{layer}.block_sparse_moe.gate.weight", how)]
    elif how == "experts" and rest.startswith("experts.{e}."):
        forms = _layouts(layer, _PROJECTIONS[rest.split(".")[2]])
    else:
        return []
    return [f for f in forms if f[0] != hf]
