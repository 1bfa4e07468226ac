"""``model.arch: llama`` without torch: fields, rules, Hugging Face mapping, parameters and FLOPs.

The Llama family: pre-norm blocks with RMSNorm, rotary embeddings (no position table), grouped-query
attention (``kv_heads`` key/value heads for ``heads`` query heads), a SwiGLU MLP ``intermediate_size``
wide, no biases but Qwen2's on q, k, v (``qkv_bias``), an LM head of its own by default. Hugging Face
``model_type`` llama, mistral (without a sliding window) and qwen2 load as this family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parallel4d.config.rules.common import divisors, not_divisible, or_list
from parallel4d.models.spec import ModelSpec, NameMap, need, refuse, stage_training_flops, training_flops

if TYPE_CHECKING:
    from parallel4d.config.schema import ModelConfig

_BLOCK = ("input_layernorm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
          "post_attention_layernorm.weight", *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))


def problems(m: ModelConfig, q: int) -> list[str]:
    """gpt2's activation set; key/value heads, head size and widths the attention and the ``q×q`` grid need."""
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
    if m.hidden % m.heads == 0 and (m.hidden // m.heads) % 2:
        out.append(f"model.hidden/model.heads = {m.hidden // m.heads} is odd, and rotary embeddings rotate pairs of "
                   "dimensions; use an even head size")
    by = f"q={q} (parallel.tp={q * q} is a {q}×{q} grid: each grid column holds whole key/value heads and an MLP block)"
    out += filter(None, [not_divisible("model.kv_heads", kv, q, by),
                         not_divisible("model.intermediate_size", m.mlp_width, q, by)])
    return out


def _block_matrices(m: ModelConfig) -> int:
    """Weights of one block's matrices: q and o ``h²`` each, k and v ``h·d·kv`` each, SwiGLU ``3·h·I``."""
    h = m.hidden
    return 2 * h * h + 2 * h * (h // m.heads) * m.kv_heads_or_heads + 3 * h * m.mlp_width


def dense_parameters(m: ModelConfig) -> int:
    """Token table (and the LM head when untied) and every block's matrices."""
    return m.vocab_size * m.hidden * (1 if m.tie_embeddings else 2) + m.layers * _block_matrices(m)


def flops_per_token(m: ModelConfig) -> float:
    """:func:`~parallel4d.models.spec.training_flops` of the block matrices and the LM head ``V·h``;
    the attention's width is that of the query heads (grouped keys are shared, not fewer products)."""
    return training_flops(m.layers * _block_matrices(m) + m.vocab_size * m.hidden, m.layers, m.seq_len, m.hidden)


def stage_flops(m: ModelConfig) -> list[float]:
    """:func:`flops_per_token` per stage (:func:`~parallel4d.models.spec.stage_training_flops`)."""
    return stage_training_flops(_block_matrices(m), m.vocab_size * m.hidden, m.layers, m.seq_len, m.hidden)


def _rope_theta(cfg: dict, model_type: str) -> float:
    """The rotary base: transformers 5 writes ``rope_parameters: {rope_type, rope_theta}``, older
    files ``rope_theta`` and ``rope_scaling`` (``type`` or ``rope_type``) at the top level."""
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        refuse(model_type, f"rope scaling {kind!r} is not supported (only none/default: the dense model's plain RoPE)")
    if rope and "rope_theta" not in rope:
        refuse(model_type, f"rope_parameters {rope!r} without rope_theta (per-layer-type rotary) is not supported")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def fields_from_hf(c: dict) -> dict:
    """A llama, mistral or qwen2 ``config.json`` → ``model:`` fields (``ValueError`` for sliding-window
    attention, rope scaling, other activations, biases the dense model lacks, another head size)."""
    mt = c.get("model_type")
    if mt == "mistral" and c.get("sliding_window") is not None:
        refuse(mt, f"sliding_window={c['sliding_window']}: sliding-window attention is not supported (the dense "
                   "model attends to the whole causal prefix); only sliding_window: null loads")
    if mt == "qwen2" and c.get("use_sliding_window", False):
        refuse(mt, "use_sliding_window: true: sliding-window attention is not supported")
    if any(t != "full_attention" for t in c.get("layer_types") or ()):
        refuse(mt, f"layer_types {sorted(set(c['layer_types']))} are not supported (only full_attention)")
    if c.get("hidden_act", "silu") != "silu":
        refuse(mt, f"hidden_act {c['hidden_act']!r} is not supported (the dense MLP is SwiGLU with silu)")
    if mt == "llama" and (c.get("attention_bias", False) or c.get("mlp_bias", False)):
        refuse(mt, "attention_bias/mlp_bias is not supported (the dense model has only Qwen2's q, k, v biases)")
    h, heads = need(c, "hidden_size"), need(c, "num_attention_heads")
    if h % heads or c.get("head_dim") not in (None, h // heads):
        refuse(mt, f"head_dim={c.get('head_dim')} with hidden_size={h}, num_attention_heads={heads} is not "
                   "supported (head_dim must be hidden_size/num_attention_heads)")
    return {"arch": "llama", "vocab_size": need(c, "vocab_size"), "hidden": h, "heads": heads,
            "kv_heads": c.get("num_key_value_heads") or heads, "layers": need(c, "num_hidden_layers"),
            "intermediate_size": need(c, "intermediate_size"), "tie_embeddings": c.get("tie_word_embeddings", False),
            "norm_eps": c.get("rms_norm_eps", 1e-6), "rope_theta": _rope_theta(c, mt), "qkv_bias": mt == "qwen2",
            "attention_dropout": float(c.get("attention_dropout", 0.0))}


def hf_config(m: ModelConfig, common: dict) -> dict:
    """``LlamaForCausalLM``'s ``config.json``, or ``Qwen2ForCausalLM``'s with ``qkv_bias`` (Llama's own
    attention bias would include ``o_proj``). The attention dropout the model trained with."""
    qwen = m.qkv_bias
    out = {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
           "model_type": "qwen2" if qwen else "llama",
           **common, "hidden_size": m.hidden, "intermediate_size": m.mlp_width, "num_hidden_layers": m.layers,
           "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads_or_heads, "hidden_act": "silu",
           "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps, "attention_dropout": m.attention_p,
           "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}}
    if qwen:
        return {**out, "use_sliding_window": False, "sliding_window": None, "max_window_layers": m.layers}
    return {**out, "head_dim": m.hidden // m.heads, "attention_bias": False, "mlp_bias": False}


def hf_names(m: ModelConfig) -> NameMap:
    """Dense name → ``(Hugging Face name, transform)``: block names are Hugging Face's own, under
    ``model.layers.<i>``; ``qkv_bias``: Qwen2's q, k, v biases too."""
    out = {"embed.tok.weight": ("model.embed_tokens.weight", "copy")}
    names = _BLOCK + ((*(f"self_attn.{p}_proj.bias" for p in "qkv"),) if m.qkv_bias else ())
    for i in range(m.layers):
        out.update({f"blocks.{i}.{n}": (f"model.layers.{i}.{n}", "copy") for n in names})
    out["head.norm.weight"] = ("model.norm.weight", "copy")
    return out


def resolved(m: ModelConfig) -> dict:
    """The key/value heads and MLP width an unset field stands for."""
    return {"kv_heads": m.kv_heads_or_heads, "intermediate_size": m.mlp_width}


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
    name="llama", summary="RMSNorm, rotary, SwiGLU, grouped-query attention (Llama, Mistral, Qwen2)",
    torch_module="parallel4d.models.llama.family", hf_model_types=("llama", "mistral", "qwen2"),
    fields=("arch", "vocab_size", "seq_len", "hidden", "heads", "kv_heads", "layers", "intermediate_size",
            "tie_embeddings", "norm_eps", "init_std", "rope_theta", "qkv_bias", "attention_dropout", "pretrained"),
    learned_positions=False, problems=problems, dense_parameters=dense_parameters, flops_per_token=flops_per_token,
    stage_flops=stage_flops,
    fields_from_hf=fields_from_hf, hf_config=hf_config, hf_names=hf_names, hf_positions="max_position_embeddings",
    hf_ignored=(".rotary_emb.inv_freq",), defaults={"tie_embeddings": False}, resolved=resolved, shapes=SHAPES,
)
