"""``model.arch: llama`` without torch: fields, rules, Hugging Face mapping, parameters and FLOPs.

The Llama family: pre-norm blocks with RMSNorm, rotary embeddings (no position table; scaled as
``rope_scaling`` says: linear, dynamic, yarn, llama3), grouped-query attention (``kv_heads`` key/value
heads for ``heads`` query heads of ``head_dim`` each), a SwiGLU MLP ``intermediate_size`` wide, no
biases but Qwen2's on q, k, v (``qkv_bias``), Qwen3's RMSNorm of each head's q and k (``qk_norm``), an
LM head of its own by default; mixture-of-experts layers in place of the MLP where ``num_experts`` and
the layer selection say (:mod:`parallel4d.models.moe`: Qwen3-MoE, Qwen2-MoE's shared expert, Mixtral).
Hugging Face ``model_type`` llama, mistral (without a sliding window), qwen2, qwen3, qwen3_moe, qwen2_moe
and mixtral load as this family; what the model lacks (sliding windows, mixtures of experts in the dense
types, per-layer rotary, other rotary types, biases but Qwen2's, router jitter) is refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parallel4d.config.rules.common import divisors, not_divisible, or_list
from parallel4d.config.rules.moe import MOE_FIELDS, field_problems as moe_field_problems
from parallel4d.models.moe.spec import HF_MOE_TYPES, MoeShape, fields_from_hf as moe_fields_from_hf, \
    hf_config_keys, hf_layer_names, hf_model_type, hf_type_problems, layer_matrices, sparse_layers
from parallel4d.models.spec import ModelSpec, NameMap, need, refuse, stage_training_flops, training_flops

if TYPE_CHECKING:
    from parallel4d.config.schema import ModelConfig

_BLOCK = ("input_layernorm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
          "post_attention_layernorm.weight", *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))


# What each model.rope_scaling.rope_type reads besides factor: (required, optional) — one home for the
# validation, the Hugging Face mapping and models/llama/rotary.py's formulas
ROPE_FIELDS = {
    "linear": ((), ()),
    "dynamic": ((), ()),  # reads max_positions (max_position_embeddings) and the sequence's length
    "yarn": (("original_max_position_embeddings",),
             ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
}
_ROPE_PARAMETERS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
                    "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
             "n_shared_experts")


def _rope_problems(m: ModelConfig) -> list[str]:
    """Each rope_type's parameters there, no other's; llama3's two factors in order; dynamic's head size."""
    rs = m.rope_scaling
    if rs is None:
        return []
    kind, (required, optional) = rs.rope_type, ROPE_FIELDS[rs.rope_type]
    out = [f"model.rope_scaling.{f} is missing: rope_type {kind} needs it (the checkpoint's rope_parameters "
           f"hold it)" for f in required if getattr(rs, f) is None]
    out += [f"model.rope_scaling.{f}={getattr(rs, f)} is not read by rope_type {kind} (it reads factor"
            f"{''.join(', ' + x for x in required + optional)}); remove it" for f in _ROPE_PARAMETERS[1:]
            if f not in required + optional and getattr(rs, f) is not None]
    if kind == "llama3" and None not in (rs.low_freq_factor, rs.high_freq_factor) and \
            rs.high_freq_factor <= rs.low_freq_factor:
        out.append(f"model.rope_scaling.high_freq_factor={rs.high_freq_factor} must exceed low_freq_factor="
                   f"{rs.low_freq_factor} (llama3 blends the wavelengths between original/high and original/low)")
    if kind == "dynamic" and m.head_size <= 2:
        out.append(f"model.rope_scaling rope_type dynamic needs a head size above 2 (its base grows with the power "
                   f"d/(d-2)); model.head_dim is {m.head_size}")
    return out


def problems(m: ModelConfig, q: int) -> list[str]:
    """gpt2's activation set; key/value heads, head size, widths the attention and the ``q×q`` grid need;
    the rotary scaling's parameters."""
    out = []
    if m.activation != type(m).model_fields["activation"].default:
        out.append(f"model.activation={m.activation} is gpt2's (llama's MLP is SwiGLU); remove it")
    out += [f"model.{f}={getattr(m, f)} with model.arch=llama: transformers' Llama, Mistral and Qwen2 drop out only "
            "the attention probabilities; set model.attention_dropout for those and remove model." + f
            for f in ("dropout", "embedding_dropout") if getattr(m, f)]
    kv = m.kv_heads_or_heads
    if m.heads % kv:
        out.append(f"model.kv_heads={kv} must divide model.heads={m.heads} (each key/value head serves a group of "
                   f"query heads); use {or_list(d for d in divisors(m.heads) if d <= m.heads)}")
    if (m.head_dim or m.hidden % m.heads == 0) and m.head_size % 2:
        size = f"model.head_dim={m.head_dim}" if m.head_dim else f"model.hidden/model.heads = {m.head_size}"
        out.append(f"{size} is odd, and rotary embeddings rotate pairs of dimensions; use an even head size")
    by = f"q={q} (parallel.tp={q * q} is a {q}×{q} grid: each grid column holds whole key/value heads and an MLP block)"
    out += filter(None, [not_divisible("model.kv_heads", kv, q, by),
                         not_divisible("model.intermediate_size", m.mlp_width, q, by)])
    return out + _rope_problems(m) + moe_field_problems(m)


def _block_matrices(m: ModelConfig, layer: int = 0, active: bool = True) -> int:
    """Weights of block ``layer``'s matrices: q and o ``h·a·d`` each, k and v ``h·d·kv`` each, SwiGLU ``3·h·I``
    (``d`` the head size: ``h/a`` unless ``head_dim`` sets it); an MoE layer's instead of the SwiGLU
    (:func:`~parallel4d.models.moe.spec.layer_matrices`): those a token passes through when ``active``
    (FLOPs), else all of them (parameters)."""
    h, d, moe = m.hidden, m.head_size, MoeShape.of(m)
    attention = 2 * h * m.heads * d + 2 * h * d * m.kv_heads_or_heads
    if moe is not None and moe.is_sparse(layer):
        return attention + layer_matrices(moe, h)[1 if active else 0]
    return attention + 3 * h * m.mlp_width


def _all_blocks(m: ModelConfig, active: bool) -> int:
    return sum(_block_matrices(m, i, active) for i in range(m.layers)) if m.num_experts else \
        m.layers * _block_matrices(m)


def dense_parameters(m: ModelConfig) -> int:
    """Token table (and the LM head when untied) and every block's matrices (every expert's)."""
    return m.vocab_size * m.hidden * (1 if m.tie_embeddings else 2) + _all_blocks(m, active=False)


def flops_per_token(m: ModelConfig) -> float:
    """:func:`~parallel4d.models.spec.training_flops` of the block matrices a token passes through (an MoE
    layer's router, its k experts and shared expert) and the LM head ``V·h``; the attention's width is
    that of the query heads, ``a·d`` (grouped keys are shared, not fewer products)."""
    return training_flops(_all_blocks(m, active=True) + m.vocab_size * m.hidden, m.layers, m.seq_len,
                          m.heads * m.head_size)


def stage_flops(m: ModelConfig) -> list[float]:
    """:func:`flops_per_token` per stage (:func:`~parallel4d.models.spec.stage_training_flops`; each block
    its own when MoE layers make them differ)."""
    out = stage_training_flops(_block_matrices(m), m.vocab_size * m.hidden, m.layers, m.seq_len,
                               m.heads * m.head_size)
    if m.num_experts:
        out[1:-1] = [stage_training_flops(_block_matrices(m, i), 0, 1, m.seq_len, m.heads * m.head_size)[1]
                     for i in range(m.layers)]
    return out


def _rope_parameters(c: dict, mt: str) -> dict:
    """The rotary's settings as transformers 5 reads them: ``rope_parameters`` (its own files), else a
    legacy ``rope_scaling`` (which wins when both are there, as in transformers), with ``type`` for
    ``rope_type`` and ``rope_theta`` at the top level. A nested dict (per-layer-type rotary) is refused."""
    rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    nested = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if nested:
        refuse(mt, f"rope_parameters per layer type ({', '.join(nested)}) are not supported: the dense model has "
                   "one rotary for every layer")
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    return rope


def _rope_fields(c: dict, mt: str) -> dict:
    """``rope_theta`` and ``rope_scaling`` of a ``config.json`` (``ValueError`` for a rotary the dense model
    lacks: another rope_type, a partial rotary, a parameter its type needs missing)."""
    rope = _rope_parameters(c, mt)
    kind = rope["rope_type"]
    if kind not in ("default", *ROPE_FIELDS):
        refuse(mt, f"rope_type {kind!r} is not supported (supported: default, {', '.join(ROPE_FIELDS)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(mt, f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported (every head dimension "
                   "is rotated)")
    out = {"rope_theta": float(rope["rope_theta"])}
    if kind == "default":
        return {**out, "rope_scaling": None}
    required, optional = ROPE_FIELDS[kind]
    if kind in ("yarn", "llama3"):  # transformers: the top-level key first, else max_position_embeddings
        rope["original_max_position_embeddings"] = c.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings") or need(c, "max_position_embeddings")
    if kind == "yarn" and "factor" in rope and rope["factor"] is None:  # DeepSeek's: the two lengths' ratio
        rope["factor"] = need(c, "max_position_embeddings") / rope["original_max_position_embeddings"]
    if kind == "yarn":
        rope["truncate"] = bool(rope.get("truncate", True))  # transformers: absent = true, null = false
    missing = [k for k in ("factor", *required) if rope.get(k) is None]
    if missing:
        refuse(mt, f"rope_type {kind!r} needs {', '.join(missing)} in rope_parameters")
    scaling = {k: rope[k] for k in ("factor", *required, *optional) if rope.get(k) is not None}
    return {**out, "rope_scaling": {"rope_type": kind, **{k: v if isinstance(v, bool) or k.startswith("original")
                                                          else float(v) for k, v in scaling.items()}}}


def _refuse_unsupported(c: dict, mt: str) -> None:
    """Named refusals of what the dense model lacks: sliding windows, per-layer attention types, mixtures
    of experts, biases other than Qwen2's q, k, v ones, other activations."""
    if mt in ("mistral", "mixtral") and c.get("sliding_window") is not None:
        refuse(mt, f"sliding_window={c['sliding_window']}: sliding-window attention is not supported (the dense "
                   "model attends to the whole causal prefix); only sliding_window: null loads")
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and c.get("use_sliding_window", False):
        refuse(mt, "use_sliding_window: true: sliding-window attention is not supported")
    if any(t != "full_attention" for t in c.get("layer_types") or ()):
        refuse(mt, f"layer_types {sorted(set(c['layer_types']))} are not supported (only full_attention)")
    moe = [k for k in _MOE_KEYS if c.get(k)]
    if moe and mt not in HF_MOE_TYPES:
        refuse(mt, f"{', '.join(f'{k}={c[k]}' for k in moe)}: mixture-of-experts layers are not supported (the "
                   "dense model has one SwiGLU MLP per block)")
    if c.get("hidden_act", "silu") != "silu":
        refuse(mt, f"hidden_act {c['hidden_act']!r} is not supported (the dense MLP is SwiGLU with silu)")
    if mt in ("llama", "qwen3", "qwen3_moe") and c.get("attention_bias", False):
        refuse(mt, "attention_bias: true is not supported (it puts a bias on o_proj too; the dense model has only "
                   "Qwen2's q, k, v biases)")
    if c.get("mlp_bias", False):
        refuse(mt, "mlp_bias: true is not supported (the dense MLP has no biases)")


def fields_from_hf(c: dict) -> dict:
    """A llama, mistral, qwen2 or qwen3 ``config.json`` → ``model:`` fields (``ValueError`` for what the
    dense model lacks: :func:`_refuse_unsupported`, a rotary other than plain / linear / dynamic / yarn /
    llama3); qwen3_moe, qwen2_moe and mixtral with their MoE fields
    (:func:`~parallel4d.models.moe.spec.fields_from_hf`)."""
    mt = c.get("model_type")
    _refuse_unsupported(c, mt)
    h, heads = need(c, "hidden_size"), need(c, "num_attention_heads")
    # transformers: Qwen3's head_dim defaults to 128, the others' to hidden_size/num_attention_heads
    head_dim = c.get("head_dim") or (128 if mt == "qwen3" else None)
    qwen2 = mt == "qwen2" or (mt == "qwen2_moe" and c.get("qkv_bias", True))  # Qwen2-MoE: q, k, v biases by default
    if head_dim is None and h % heads:
        refuse(mt, f"hidden_size={h} is not divisible by num_attention_heads={heads} and no head_dim is given")
    return {"arch": "llama", "vocab_size": need(c, "vocab_size"), "hidden": h, "heads": heads,
            "kv_heads": c.get("num_key_value_heads") or heads, "layers": need(c, "num_hidden_layers"),
            "intermediate_size": need(c, "intermediate_size"), "tie_embeddings": c.get("tie_word_embeddings", False),
            "norm_eps": c.get("rms_norm_eps", 1e-6), "qkv_bias": qwen2, "qk_norm": mt in ("qwen3", "qwen3_moe"),
            "head_dim": None if head_dim in (None, h // heads) and h % heads == 0 else head_dim,
            "max_positions": c.get("max_position_embeddings"), **_rope_fields(c, mt),
            "attention_dropout": float(c.get("attention_dropout", 0.0)), **moe_fields_from_hf(c)}


def _hf_type(m: ModelConfig) -> str:
    """The transformers family of a model: qwen3 (q/k norms), qwen2 (q, k, v biases) or llama; an MoE model's
    :func:`~parallel4d.models.moe.spec.hf_model_type` (qwen3_moe, qwen2_moe or mixtral): the nearest type, which
    :func:`_type_problems` says when it cannot hold the model (:func:`hf_config` refuses it then)."""
    moe = MoeShape.of(m)
    if moe is not None:
        return hf_model_type(moe, m.qk_norm)
    return "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"


def _type_problems(m: ModelConfig) -> list[str]:
    """Why no transformers model type holds ``m`` (none: :func:`_hf_type`'s does)."""
    moe = MoeShape.of(m)
    if moe is not None:
        return hf_type_problems(moe, m.qk_norm, m.qkv_bias)
    return ["model.qk_norm with model.qkv_bias: Qwen3's attention_bias also puts a bias on o_proj"] \
        if m.qk_norm and m.qkv_bias else []


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}


def hf_config(m: ModelConfig, common: dict) -> dict:
    """``LlamaForCausalLM``'s ``config.json``, ``Qwen2ForCausalLM``'s with ``qkv_bias`` (Llama's own
    attention bias would include ``o_proj``) or ``Qwen3ForCausalLM``'s with ``qk_norm``; with experts
    ``Qwen3MoeForCausalLM``'s, ``Qwen2MoeForCausalLM``'s or ``MixtralForCausalLM``'s (:func:`_hf_type`);
    the rotary as transformers 5 writes it (``rope_parameters``); the attention dropout the model trained
    with. ``ValueError`` naming the fields for a model no transformers type holds."""
    problems = _type_problems(m)
    if problems:
        raise ValueError(f"{'; '.join(problems)}: no transformers model type holds this model, so it cannot be "
                         "written as a Hugging Face directory (the checkpoint keeps it; `parallel4d generate` "
                         "reads it)")
    kind, moe = _hf_type(m), MoeShape.of(m)
    scaling = m.rope_scaling.model_dump(exclude_none=True) if m.rope_scaling else {"rope_type": "default"}
    out = {"architectures": [_ARCHITECTURES[kind]], "model_type": kind,
           **common, "hidden_size": m.hidden,
           "intermediate_size": m.expert_width if kind == "mixtral" else m.mlp_width,  # Mixtral's: its experts'
           "num_hidden_layers": m.layers, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads_or_heads,
           "hidden_act": "silu", "max_position_embeddings": m.positions, "rms_norm_eps": m.norm_eps,
           "attention_dropout": m.attention_p, "rope_parameters": {**scaling, "rope_theta": m.rope_theta}}
    windows = {"use_sliding_window": False, "sliding_window": None}
    if kind == "qwen2":
        return {**out, **windows, "max_window_layers": m.layers}
    out["head_dim"] = m.head_size
    if kind in ("qwen3_moe", "qwen2_moe", "mixtral"):
        attention = {"qwen3_moe": {"attention_bias": False, **windows},
                     "qwen2_moe": {"qkv_bias": m.qkv_bias, **windows, "max_window_layers": m.layers},
                     "mixtral": {"sliding_window": None}}[kind]
        return {**out, **attention, **hf_config_keys(moe, kind)}
    windows = {**windows, "max_window_layers": m.layers} if kind == "qwen3" else {"mlp_bias": False}
    return {**out, "attention_bias": False, **windows}


def hf_names(m: ModelConfig) -> NameMap:
    """Dense name → ``(Hugging Face name, transform)``: block names are Hugging Face's own, under
    ``model.layers.<i>``; ``qkv_bias``: Qwen2's q, k, v biases too; ``qk_norm``: Qwen3's q and k norms; an MoE
    layer's router and experts as its model type stores them (:func:`~parallel4d.models.moe.spec.hf_layer_names`)."""
    out = {"embed.tok.weight": ("model.embed_tokens.weight", "copy")}
    names = _BLOCK + ((*(f"self_attn.{p}_proj.bias" for p in "qkv"),) if m.qkv_bias else ()) + \
        (("self_attn.q_norm.weight", "self_attn.k_norm.weight") if m.qk_norm else ())
    moe = MoeShape.of(m)
    sparse = set(sparse_layers(moe, m.layers))
    for i in range(m.layers):
        out.update({f"blocks.{i}.{n}": (f"model.layers.{i}.{n}", "copy") for n in names
                    if not (i in sparse and n.startswith("mlp."))})
        if i in sparse:  # one tensor per expert ("experts"), or fused: models/hf.py
            out.update({f"blocks.{i}.mlp.{n}": (f"model.layers.{i}.{hf}", how)
                        for n, (hf, how) in hf_layer_names(moe, _hf_type(m)).items()})
    out["head.norm.weight"] = ("model.norm.weight", "copy")
    return out


def resolved(m: ModelConfig) -> dict:
    """The key/value heads, MLP width, head size and positions an unset field stands for."""
    return {"kv_heads": m.kv_heads_or_heads, "intermediate_size": m.mlp_width, "head_dim": m.head_size,
            "max_positions": m.positions, **({"moe_intermediate_size": m.expert_width} if m.num_experts else {})}


# Meta's Llama sizes, smallest first (the names at their own 32k-128k vocabularies)
SHAPES = (
    {"hidden": 2048, "heads": 32, "kv_heads": 8, "layers": 16, "intermediate_size": 8192},     # Llama-3.2 1B
    {"hidden": 3072, "heads": 24, "kv_heads": 8, "layers": 28, "intermediate_size": 8192},     # Llama-3.2 3B
    {"hidden": 4096, "heads": 32, "kv_heads": 32, "layers": 32, "intermediate_size": 11008},   # Llama-2 7B
    {"hidden": 5120, "heads": 40, "kv_heads": 40, "layers": 40, "intermediate_size": 13824},   # Llama-2 13B
    {"hidden": 6656, "heads": 52, "kv_heads": 52, "layers": 60, "intermediate_size": 17920},   # Llama 33B
    {"hidden": 8192, "heads": 64, "kv_heads": 8, "layers": 80, "intermediate_size": 28672},    # Llama-2 70B
    {"hidden": 16384, "heads": 128, "kv_heads": 8, "layers": 126, "intermediate_size": 53248},  # Llama-3.1 405B
)


SPEC = ModelSpec(
    name="llama", summary="RMSNorm, rotary (scaled or not), SwiGLU or mixtures of experts, grouped-query attention "
                          "(Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral)",
    torch_module="parallel4d.models.llama.family",
    hf_model_types=("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"),
    fields=("arch", "vocab_size", "seq_len", "hidden", "heads", "kv_heads", "layers", "intermediate_size",
            "tie_embeddings", "norm_eps", "init_std", "rope_theta", "qkv_bias", "max_positions", "head_dim",
            "qk_norm", "rope_scaling", "attention_dropout", "num_experts", *MOE_FIELDS, "pretrained",
            "lora"),
    learned_positions=False, problems=problems, dense_parameters=dense_parameters, flops_per_token=flops_per_token,
    stage_flops=stage_flops,
    fields_from_hf=fields_from_hf, hf_config=hf_config, hf_names=hf_names, hf_positions="max_position_embeddings",
    hf_ignored=(".rotary_emb.inv_freq",), defaults={"tie_embeddings": False}, resolved=resolved, shapes=SHAPES,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)
