"""``model.arch: gpt2`` without torch: fields, rules, Hugging Face mapping, parameters and FLOPs.

GPT-2: pre-LN blocks with LayerNorm, a learned table of ``max_positions`` positions (``seq_len`` or
more: the rows past ``seq_len`` are kept, never read, as a checkpoint's ``n_positions`` brings them), a fused ``qkv``
projection, a GELU MLP ``mlp_ratio·hidden`` wide, biases everywhere, the LM head tied to the token
table by default. Hugging Face checkpoints: ``GPT2LMHeadModel`` (``transformer.``-prefixed names),
or ``GPT2Model`` (the hub's ``gpt2``, no prefix); ``Conv1D`` weights are stored ``[in, out]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parallel4d.models.spec import ModelSpec, NameMap, need, refuse, stage_training_flops, training_flops

if TYPE_CHECKING:
    from parallel4d.config.schema import ModelConfig

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# (Hugging Face name in block i, dense name in blocks.i, transform)
_BLOCK = (("ln_1.weight", "ln1.weight", "copy"), ("ln_1.bias", "ln1.bias", "copy"),
          ("attn.c_attn.weight", "attn.qkv.weight", "t"), ("attn.c_attn.bias", "attn.qkv.bias", "copy"),
          ("attn.c_proj.weight", "attn.proj.weight", "t"), ("attn.c_proj.bias", "attn.proj.bias", "copy"),
          ("ln_2.weight", "ln2.weight", "copy"), ("ln_2.bias", "ln2.bias", "copy"),
          ("mlp.c_fc.weight", "mlp.fc1.weight", "t"), ("mlp.c_fc.bias", "mlp.fc1.bias", "copy"),
          ("mlp.c_proj.weight", "mlp.fc2.weight", "t"), ("mlp.c_proj.bias", "mlp.fc2.bias", "copy"))


def problems(m: ModelConfig, q: int) -> list[str]:
    """A ``seq_len`` past the position table, or another family's field set to a value gpt2 would
    ignore (a dumped config holds every field)."""
    out, defaults = [], type(m).model_fields
    if m.seq_len > m.positions:
        source = " (model.pretrained's n_positions)" if m.pretrained else ""
        out.append(f"model.seq_len={m.seq_len} is more than model.max_positions={m.positions}{source}, the rows of "
                   f"gpt2's learned position table; lower model.seq_len to {m.positions} or less"
                   + ("" if m.pretrained else " or raise model.max_positions"))
    if m.kv_heads not in (None, m.heads):
        out.append(f"model.kv_heads={m.kv_heads} with model.arch=gpt2: grouped-query attention is llama's; "
                   "remove model.kv_heads or set model.arch=llama")
    out += [f"model.{f}={getattr(m, f)} is a llama field and model.arch=gpt2 does not read it; remove it or "
            "set model.arch=llama" for f in ("rope_theta", "qkv_bias", "head_dim", "qk_norm", "rope_scaling")
            if getattr(m, f) != defaults[f].default]
    if m.intermediate_size not in (None, m.mlp_ratio * m.hidden):
        out.append(f"model.intermediate_size={m.intermediate_size} with model.arch=gpt2: its MLP is "
                   f"model.mlp_ratio·hidden = {m.mlp_ratio * m.hidden} wide; set model.mlp_ratio or remove "
                   "model.intermediate_size")
    return out


def _tables(m: ModelConfig) -> int:
    return m.vocab_size * m.hidden * (1 if m.tie_embeddings else 2)


def dense_parameters(m: ModelConfig) -> int:
    """Token table(s), position table (``max_positions`` rows), per block ``qkv + proj = 4h²`` and the
    MLP's ``2·h·width``."""
    h = m.hidden
    return _tables(m) + m.positions * h + m.layers * (4 * h * h + 2 * h * m.mlp_width)


def _block_matrices(m: ModelConfig) -> int:
    """Weights of one block's matrices: ``qkv + proj = 4h²`` and the MLP's ``2·h·width``."""
    return 4 * m.hidden * m.hidden + 2 * m.hidden * m.mlp_width


def flops_per_token(m: ModelConfig) -> float:
    """:func:`~parallel4d.models.spec.training_flops` of the block matrices and the LM head ``V·h``."""
    h = m.hidden
    return training_flops(m.layers * _block_matrices(m) + m.vocab_size * h, m.layers, m.seq_len, h)


def stage_flops(m: ModelConfig) -> list[float]:
    """:func:`flops_per_token` per stage (:func:`~parallel4d.models.spec.stage_training_flops`)."""
    return stage_training_flops(_block_matrices(m), m.vocab_size * m.hidden, m.layers, m.seq_len, m.hidden)


def fields_from_hf(c: dict) -> dict:
    """A ``gpt2`` ``config.json`` → ``model:`` fields (``ValueError`` for what the dense GPT lacks)."""
    mt = c.get("model_type")
    h = need(c, "n_embd")
    inner = c.get("n_inner") or 4 * h
    if inner % h:
        refuse(mt, f"n_inner={inner} is not a multiple of n_embd={h} (the dense MLP is mlp_ratio·hidden wide)")
    act = c.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        refuse(mt, f"activation_function {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    if not c.get("scale_attn_weights", True):
        refuse(mt, "scale_attn_weights=false: attention scaled other than by 1/sqrt(head_dim) is not supported")
    if c.get("scale_attn_by_inverse_layer_idx", False):
        refuse(mt, "scale_attn_by_inverse_layer_idx=true: attention scaled other than by 1/sqrt(head_dim) is not "
                   "supported")
    if c.get("add_cross_attention", False):
        refuse(mt, "add_cross_attention is not supported")
    if c.get("reorder_and_upcast_attn", False):
        refuse(mt, "reorder_and_upcast_attn=true (attention scores in float32 whatever the dtype) is not supported; "
                   "the dense GPT computes them in the training dtype (in float32 training the two are the same: "
                   "set it false in config.json to load the model that way)")
    if c.get("pruned_heads"):
        refuse(mt, f"pruned_heads={c['pruned_heads']}: layers with fewer heads are not supported")
    return {**_dropouts_from_hf(c), "arch": "gpt2", "vocab_size": need(c, "vocab_size"), "hidden": h, "heads": need(c, "n_head"),
            "layers": need(c, "n_layer"), "max_positions": need(c, "n_positions"), "mlp_ratio": inner // h,
            "activation": _ACTIVATIONS[act],
            "tie_embeddings": c.get("tie_word_embeddings", True), "norm_eps": c.get("layer_norm_epsilon", 1e-5)}


def _dropouts_from_hf(c: dict) -> dict:
    """``resid_pdrop`` → ``dropout``; ``attn_pdrop`` and ``embd_pdrop`` → ``attention_dropout`` and
    ``embedding_dropout``, left None (= ``dropout``) where equal to it, so a job's ``model.dropout``
    sets them all. transformers' defaults (0.1) for a key the file lacks."""
    resid = float(c.get("resid_pdrop", 0.1))
    attn, embd = float(c.get("attn_pdrop", 0.1)), float(c.get("embd_pdrop", 0.1))
    return {"dropout": resid, "attention_dropout": None if attn == resid else attn,
            "embedding_dropout": None if embd == resid else embd}


def hf_config(m: ModelConfig, common: dict) -> dict:
    """``GPT2LMHeadModel``'s ``config.json``. ``gelu_tanh`` is written ``gelu_pytorch_tanh`` (the
    ``F.gelu(approximate="tanh")`` the dense model calls; ``gelu_new``, GPT-2's name, is the same
    formula in Python ops, ~1e-7 apart in float32). The dropouts the model trained with."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common, "n_positions": m.positions,
            "n_embd": m.hidden, "n_head": m.heads, "n_layer": m.layers, "n_inner": m.mlp_ratio * m.hidden,
            "activation_function": "gelu_pytorch_tanh" if m.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": m.norm_eps, "resid_pdrop": m.dropout, "embd_pdrop": m.embedding_p, "attn_pdrop": m.attention_p,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def hf_names(m: ModelConfig) -> NameMap:
    """Dense name → ``(GPT2LMHeadModel's name, transform)``, in the dense model's order."""
    out = {"embed.tok.weight": ("transformer.wte.weight", "copy"), "embed.pos.weight": ("transformer.wpe.weight", "copy")}
    for i in range(m.layers):
        out.update({f"blocks.{i}.{d}": (f"transformer.h.{i}.{h}", t) for h, d, t in _BLOCK})
    out.update({f"head.ln_f.{p}": (f"transformer.ln_f.{p}", "copy") for p in ("weight", "bias")})
    return out


# GPT-2's four sizes, then GPT-3's wider ones (parameters at GPT-2's 50257-token vocabulary)
SHAPES = (
    {"hidden": 768, "heads": 12, "layers": 12},    # GPT-2, 124M
    {"hidden": 1024, "heads": 16, "layers": 24},   # GPT-2 medium, 355M
    {"hidden": 1280, "heads": 20, "layers": 36},   # GPT-2 large, 774M
    {"hidden": 1600, "heads": 25, "layers": 48},   # GPT-2 XL, 1.5B
    {"hidden": 2560, "heads": 32, "layers": 32},   # GPT-3 2.7B
    {"hidden": 4096, "heads": 32, "layers": 32},   # GPT-3 6.7B
    {"hidden": 5120, "heads": 40, "layers": 40},   # GPT-3 13B
    {"hidden": 12288, "heads": 96, "layers": 96},  # GPT-3 175B
)


SPEC = ModelSpec(
    name="gpt2", summary="LayerNorm, learned positions, GELU MLP", torch_module="parallel4d.models.gpt2.family",
    hf_model_types=("gpt2",),
    fields=("arch", "vocab_size", "seq_len", "max_positions", "hidden", "heads", "layers", "mlp_ratio",
            "tie_embeddings", "norm_eps", "init_std", "activation", "dropout", "attention_dropout",
            "embedding_dropout", "pretrained", "lora"),
    learned_positions=True, problems=problems, dense_parameters=dense_parameters, flops_per_token=flops_per_token,
    stage_flops=stage_flops,
    fields_from_hf=fields_from_hf, hf_config=hf_config, hf_names=hf_names, hf_positions="n_positions",
    hf_prefix="transformer.", hf_ignored=(".attn.bias", ".attn.masked_bias"), shapes=SHAPES,
    resolved=lambda m: {"max_positions": m.positions},
    lora_targets=("c_attn", "c_proj", "c_fc"),  # Conv1D layers; c_proj: the attention's and the MLP's
)
