"""A Hugging Face ``config.json`` → the ``model:`` fields of a job (standard library only).

Used by ``config.py`` for ``model.pretrained`` (before any field is validated, so the rules see
the checkpoint's shape) and by ``models/hf.py``. ``llama``, ``mistral`` and ``qwen2`` become
``arch: llama``; ``gpt2`` stays ``gpt2``; anything else, or a feature the dense models lack
(sliding windows, rope scaling, other activations), is a ``ValueError`` saying which.
"""

from __future__ import annotations

import math

SUPPORTED = ("llama", "mistral", "qwen2", "gpt2")
_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _refuse(model_type: str, what: str) -> None:
    raise ValueError(f"Hugging Face model_type {model_type!r}: {what}")


def _need(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ValueError(f"Hugging Face model_type {cfg.get('model_type')!r}: config.json lacks {key!r}")
    return cfg[key]


def _rope_theta(cfg: dict, model_type: str) -> float:
    """The rotary base: transformers 5 writes ``rope_parameters: {rope_type, rope_theta}``, older
    files ``rope_theta`` and ``rope_scaling`` (``type`` or ``rope_type``) at the top level."""
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        _refuse(model_type, f"rope scaling {kind!r} is not supported (only none/default: the dense model's plain RoPE)")
    if rope and "rope_theta" not in rope:
        _refuse(model_type, f"rope_parameters {rope!r} without rope_theta (per-layer-type rotary) is not supported")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def model_fields_from_hf(config: dict) -> dict:
    """The ``model:`` fields of a job for a ``transformers`` ``config.json`` dict.

    ``seq_len`` (a training choice) and ``init_std`` are left out; :func:`hf_max_positions` gives
    the checkpoint's positions (a hard limit for gpt2's learned table). ``ValueError`` for a
    ``model_type`` other than :data:`SUPPORTED` or a feature the dense model lacks (sliding-window
    attention, rope scaling, other activations, biases Llama's attention/MLP may have).
    """
    c, mt = config, config.get("model_type")
    if mt not in SUPPORTED:
        raise ValueError(f"Hugging Face model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if mt == "gpt2":
        h = _need(c, "n_embd")
        inner = c.get("n_inner") or 4 * h
        if inner % h:
            _refuse(mt, f"n_inner={inner} is not a multiple of n_embd={h} (the dense MLP is mlp_ratio·hidden wide)")
        act = c.get("activation_function", "gelu_new")
        if act not in _GPT2_ACT:
            _refuse(mt, f"activation_function {act!r} is not supported (supported: {', '.join(_GPT2_ACT)})")
        if not c.get("scale_attn_weights", True) or c.get("scale_attn_by_inverse_layer_idx", False):
            _refuse(mt, "attention scaled other than by 1/sqrt(head_dim) is not supported")
        if c.get("add_cross_attention", False):
            _refuse(mt, "add_cross_attention is not supported")
        return {"arch": "gpt2", "vocab_size": _need(c, "vocab_size"), "hidden": h, "heads": _need(c, "n_head"),
                "layers": _need(c, "n_layer"), "mlp_ratio": inner // h, "activation": _GPT2_ACT[act],
                "tie_embeddings": c.get("tie_word_embeddings", True), "norm_eps": c.get("layer_norm_epsilon", 1e-5)}
    if mt == "mistral" and c.get("sliding_window") is not None:
        _refuse(mt, f"sliding_window={c['sliding_window']}: sliding-window attention is not supported (the dense "
                    "model attends to the whole causal prefix); only sliding_window: null loads")
    if mt == "qwen2" and c.get("use_sliding_window", False):
        _refuse(mt, "use_sliding_window: true: sliding-window attention is not supported")
    if any(t != "full_attention" for t in c.get("layer_types") or ()):
        _refuse(mt, f"layer_types {sorted(set(c['layer_types']))} are not supported (only full_attention)")
    if c.get("hidden_act", "silu") != "silu":
        _refuse(mt, f"hidden_act {c['hidden_act']!r} is not supported (the dense MLP is SwiGLU with silu)")
    if mt == "llama" and (c.get("attention_bias", False) or c.get("mlp_bias", False)):
        _refuse(mt, "attention_bias/mlp_bias is not supported (the dense model has only Qwen2's q, k, v biases)")
    h, heads = _need(c, "hidden_size"), _need(c, "num_attention_heads")
    if h % heads or c.get("head_dim") not in (None, h // heads):
        _refuse(mt, f"head_dim={c.get('head_dim')} with hidden_size={h}, num_attention_heads={heads} is not "
                    "supported (head_dim must be hidden_size/num_attention_heads)")
    return {"arch": "llama", "vocab_size": _need(c, "vocab_size"), "hidden": h, "heads": heads,
            "kv_heads": c.get("num_key_value_heads") or heads, "layers": _need(c, "num_hidden_layers"),
            "intermediate_size": _need(c, "intermediate_size"), "tie_embeddings": c.get("tie_word_embeddings", False),
            "norm_eps": c.get("rms_norm_eps", 1e-6), "rope_theta": _rope_theta(c, mt), "qkv_bias": mt == "qwen2"}


def hf_max_positions(config: dict) -> int | None:
    """``n_positions`` (gpt2: the rows of its position table, so ``seq_len`` must not exceed it) or
    ``max_position_embeddings`` (llama family: the length it was trained for, rotary has no table)."""
    return config.get("n_positions") if config.get("model_type") == "gpt2" else config.get("max_position_embeddings")


def mismatches(fields: dict, values: dict) -> list[tuple[str, object, object]]:
    """``(field, value, the checkpoint's)`` for each of :func:`model_fields_from_hf`'s ``fields``
    that ``values`` holds with another value (floats to 1e-9 relative)."""
    def same(a, b):
        return math.isclose(a, b, rel_tol=1e-9) if isinstance(b, float) and isinstance(a, (int, float)) else a == b

    return [(k, values[k], v) for k, v in fields.items() if k in values and not same(values[k], v)]


def positions_short(config: dict, arch: str, seq_len: int) -> int | None:
    """gpt2's learned position rows when ``seq_len`` needs more of them; None when they suffice."""
    limit = hf_max_positions(config)
    return limit if arch == "gpt2" and limit and seq_len > limit else None
