"""Hugging Face checkpoints ↔ the dense models (``parallel4d/models/hf.py``), against ``transformers`` itself.

Tiny random models built from ``transformers`` configs (no download), in this one process:

* import: ``save_pretrained`` → ``model_fields_from_hf`` + ``load_hf_state_dict`` → the dense model
  loads it strictly and computes transformers' logits, loss and every parameter gradient —
  in float32 with transformers as it is (eager attention), and in float64 to 1e-10 with the two
  float32 choices of the Llama family patched and its attention through SDPA (see
  :func:`float64_transformers`);
* export: a dense model → ``save_hf`` → ``AutoModelForCausalLM.from_pretrained`` (no missing or
  unexpected keys, no warning) → the same logits; sharded too;
* errors: an unsupported ``model_type``, a missing / wrong-shaped tensor, a truncated or missing
  file, what the dense model lacks (sliding windows, mixtures of experts, per-layer or unsupported
  rotary, biases), ``seq_len`` above gpt2's ``n_positions``.

Llama-family imports include each scaled rotary (linear, dynamic, yarn, llama3) and Qwen3 (q/k norms,
a head size other than hidden/heads); tests/test_pretrained.py runs every IMPORTS case again under
2D tp=4 × ring sp=2.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)
from transformers import modeling_rope_utils  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

from parallel4d.config.load import make_config
from parallel4d.models.build import build_dense, shape_from_config  # noqa: E402
from parallel4d.models import hf  # noqa: E402

V, S, B = 61, 16, 3  # vocabulary (not a power of two), sequence, batch
# eager: transformers' own attention (matmul, additive mask, softmax), not the SDPA kernel the dense model calls
_NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager")
# GQA (2 key/value heads for 4), untied head, a head dim of 8 (4 rotary frequencies)
_LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2,
              tie_word_embeddings=False, **_NO_IDS)


def _rope(theta, rope_type="default", **scaling):
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **scaling}}


# Scaled rotary, each with the checkpoint's own parameters, chosen so that the scaling changes the
# logits at the test's S = 16 positions (test_scaled_rotary_is_not_the_plain_one): with theta 1e4 and
# a head of 8, the wavelengths are 6.3, 63, 628 and 6283 positions.
SCALED = {
    "llama-linear": (64, _rope(1e4, "linear", factor=4.0)),
    # max_position_embeddings 8 < S: the base grows with the sequence's length (plain rotary up to 8 tokens)
    "llama-dynamic": (8, _rope(1e4, "dynamic", factor=2.0)),
    # the ramp runs over dimensions 0..2 (one half-way), cos and sin scaled by 0.1·ln 4 + 1
    "llama-yarn": (256, _rope(1e4, "yarn", factor=4.0, original_max_position_embeddings=64)),
    # 6.3 kept (< 64/4), 63 blended (between 16 and 64), 628 and 6283 divided by 8 (> 64)
    "llama-llama3": (128, _rope(1e4, "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64)),
}


def _scaled(case, v=V, scaled=True):
    """A tiny Llama with ``SCALED[case]``'s rotary (``scaled=False``: the same model, plain rotary)."""
    positions, rope = SCALED[case]
    return LlamaForCausalLM(LlamaConfig(**{**_LLAMA, "vocab_size": v, "max_position_embeddings": positions},
                                        **(rope if scaled else _rope(1e4))))


# Each takes the vocabulary size: 61 in one process, a multiple of the grid side under 2D layouts.
IMPORTS = {
    "llama-theta1e4": lambda v=V: LlamaForCausalLM(LlamaConfig(**{**_LLAMA, "vocab_size": v}, **_rope(1e4))),
    "llama-theta5e5": lambda v=V: LlamaForCausalLM(LlamaConfig(**{**_LLAMA, "vocab_size": v}, **_rope(5e5))),
    **{case: (lambda v=V, case=case: _scaled(case, v)) for case in SCALED},
    "qwen2": lambda v=V: Qwen2ForCausalLM(Qwen2Config(**{**_LLAMA, "vocab_size": v}, **_rope(1e6))),  # + q, k, v biases
    # q and k norms per head; heads of 16 (not hidden/heads = 8): q_proj [64, 32]; GQA 4:2
    "qwen3": lambda v=V: Qwen3ForCausalLM(Qwen3Config(**{**_LLAMA, "vocab_size": v}, head_dim=16, **_rope(1e6))),
    "mistral-tied": lambda v=V: MistralForCausalLM(MistralConfig(
        **{**_LLAMA, "vocab_size": v, "tie_word_embeddings": True}, sliding_window=None, **_rope(1e4))),
    # n_positions 24 > seq_len 16: the dense model holds the whole position table (rows past 16 unread)
    "gpt2": lambda v=V: GPT2LMHeadModel(GPT2Config(vocab_size=v, n_positions=24, n_embd=32, n_head=4, n_layer=2,
                                                   activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0, initializer_range=0.2, **_NO_IDS)),
}


# --------------------------------------------------------------------------- the float64 patch

def _rmsnorm_forward(self, hidden_states):
    """transformers' ``{Llama,Mistral,Qwen2}RMSNorm.forward`` with ``.to(torch.float32)`` replaced
    by the wider of the input dtype and float32 (so float64 stays float64)."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


@torch.no_grad()
def _rotary_cos_sin(self, x, position_ids):
    """transformers' ``{Llama,Mistral,Qwen2,Qwen3}RotaryEmbedding.forward`` with its two ``.float()`` /
    ``dtype=torch.float`` casts replaced by the wider of ``x``'s dtype and float32."""
    wide = torch.promote_types(x.dtype, torch.float32)
    freqs = position_ids[..., None].to(wide) * self.inv_freq.to(device=x.device, dtype=wide)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


_dynamic_cos_sin = modeling_rope_utils.dynamic_rope_update(_rotary_cos_sin)  # transformers' own decorator, as theirs


def _rotary_forward(self, x, position_ids):
    """:func:`_rotary_cos_sin` after transformers' dynamic-rotary update (what its ``forward`` is
    decorated with), run with float64 as the default dtype: its dynamic base is a tensor product of an
    integer length and a float, which the default dtype would otherwise round to float32."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _dynamic_cos_sin(self, x, position_ids)
    finally:
        torch.set_default_dtype(default)


class _Float64Torch:
    """``torch`` as transformers' rotary formulas (``modeling_rope_utils``) see it under the float64
    patch: ``torch.float`` / ``torch.float32`` are float64, all else is torch."""

    float = float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def float64_transformers(mp, model):
    """Let a float64 Llama-family ``model`` of transformers compute in float64 throughout.

    transformers computes RMSNorm in float32 even for a float64 model, and the rotary table in
    float32 (``inv_freq`` made with ``dtype=torch.float`` at construction, cos/sin from float32
    ``freqs``); that alone limits agreement to ~3e-8. Patched, via ``mp`` (pytest's monkeypatch):
    only ``forward`` of the RMSNorm and RotaryEmbedding classes of llama, mistral, qwen2 and qwen3
    (same code, the float32 casts widened to float64, see the functions above; the rotary still
    goes through transformers' dynamic-rotary update), the ``torch`` that ``modeling_rope_utils``
    sees (:class:`_Float64Torch`), and ``inv_freq`` of ``model``'s rotary modules recomputed in
    float64: by transformers' own formula of its rope_type (``ROPE_INIT_FUNCTIONS``, with that
    float64 ``torch``), the default type's by its formula written out. Everything else (attention,
    GQA, rotate_half, MLP, q/k norms, the models) is transformers' own code; the test runs the
    float64 Llama family with ``attn_implementation="sdpa"`` (transformers' SDPA integration), as
    its eager attention also takes the softmax in float32. GPT-2 stays eager.
    """
    for module, prefix in ((modeling_llama, "Llama"), (modeling_mistral, "Mistral"), (modeling_qwen2, "Qwen2"),
                           (modeling_qwen3, "Qwen3")):
        mp.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", _rmsnorm_forward)
        mp.setattr(getattr(module, f"{prefix}RotaryEmbedding"), "forward", _rotary_forward)
    mp.setattr(modeling_rope_utils, "torch", _Float64Torch())
    for m in model.modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            c = m.config
            if m.rope_type == "default":
                dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
                inv = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            else:
                inv, m.attention_scaling = modeling_rope_utils.ROPE_INIT_FUNCTIONS[m.rope_type](c, m.inv_freq.device)
            # the same table as at construction, wider (dynamic's: the one before any sequence grew it)
            torch.testing.assert_close(inv, m.original_inv_freq.double(), rtol=1e-6, atol=0)
            assert inv.dtype == torch.float64
            m.inv_freq, m.original_inv_freq, m.max_seq_len_cached = inv, inv.clone(), m.original_max_seq_len


# --------------------------------------------------------------------------- helpers

def _perturb(model, seed=0):
    """Random norm gains and biases (inits make them 1 and 0, which would hide a swapped or
    misplaced one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _tokens(seed=1):
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]  # what transformers' labels=tokens compares: token t+1 at position t
    return tokens, targets


def _imported(ref, directory):
    """``ref`` saved by transformers and loaded into a dense model (fields from its config.json)."""
    ref.save_pretrained(directory)
    fields = hf.model_fields_from_hf(json.loads((directory / "config.json").read_text()))
    cfg = make_config({"model": {**fields, "seq_len": S}}).model
    model = build_dense(shape_from_config(cfg), seed=7)
    model.load_state_dict(hf.load_hf_state_dict(directory, cfg), strict=True)
    return model, cfg


def _max(a, b):
    return (a.detach() - b.detach()).abs().max().item()


def _grad_diffs(model, ref, cfg):
    """Max |dense grad − transformers grad| over every parameter, through the name map."""
    names = hf.p4d_to_hf(cfg)
    ours = dict(model.named_parameters())  # tied: the token table once, as embed.tok.weight
    assert set(ours) == set(names)
    assert {names[n][0] for n in ours} == set(dict(ref.named_parameters())), "the map is not transformers' names"
    worst = 0.0
    for name, p in ours.items():
        hf_name, how = names[name]
        g = ref.get_parameter(hf_name).grad
        if how == "t":
            g = g.t()
        assert p.grad.shape == g.shape, name
        worst = max(worst, _max(p.grad, g))
    return worst


# --------------------------------------------------------------------------- import

@pytest.mark.parametrize("case", list(IMPORTS))
def test_import_matches_transformers(case, tmp_path, monkeypatch):
    torch.manual_seed(0)
    ref = IMPORTS[case]().eval()
    _perturb(ref)
    model, cfg = _imported(ref, tmp_path)
    tokens, targets = _tokens()

    # float32, transformers as it is (its own shifted-labels loss included)
    with torch.no_grad():
        out = ref(input_ids=tokens, labels=tokens)
        logits = model(tokens)
        loss = model(tokens, targets)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=1e-6)
    d32, d32_loss = _max(logits, out.logits), abs(loss.item() - out.loss.item())

    # float64 with transformers' two float32 choices widened (and SDPA for the Llama family, whose
    # eager attention takes its softmax in float32: softmax(..., dtype=torch.float32))
    with monkeypatch.context() as mp:
        model.double()
        ref.double()
        float64_transformers(mp, ref)
        if cfg.arch == "llama":
            ref.set_attn_implementation("sdpa")
        loss = model(tokens, targets)
        loss.backward()
        ref_logits = ref(input_ids=tokens).logits
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        ref_loss.backward()  # transformers' labels loss upcasts with .float(), i.e. to float32
        d_logits = _max(model(tokens), ref_logits)
        d_loss = abs(loss.item() - ref_loss.item())
        d_grad = _grad_diffs(model, ref, cfg)
    print(f"\n{case}: float32 logits {d32:.1e}, loss {d32_loss:.1e}; "
          f"float64 logits {d_logits:.1e}, loss {d_loss:.1e}, grads {d_grad:.1e}")
    assert ref_logits.dtype == torch.float64 and ref_logits.abs().max() > 1.0  # not a degenerate model
    assert d_logits < 1e-10 and d_loss < 1e-10 and d_grad < 1e-10


def test_scaled_rotary_is_not_the_plain_one():
    """Each SCALED model's logits differ from the same weights' with plain rotary at the test's
    positions (else the import test could not tell a scaling applied from one ignored); dynamic's
    equal them up to its max_position_embeddings (8 tokens)."""
    tokens, _ = _tokens()
    for case in SCALED:
        torch.manual_seed(0)
        scaled = _scaled(case).eval()
        torch.manual_seed(0)
        plain = _scaled(case, scaled=False).eval()
        with torch.no_grad():
            if case == "llama-dynamic":  # first: transformers' dynamic rotary keeps the longest length it saw
                short = tokens[:, :8]
                torch.testing.assert_close(scaled(input_ids=short).logits, plain(input_ids=short).logits)
            assert _max(scaled(input_ids=tokens).logits, plain(input_ids=tokens).logits) > 1e-2, case


def test_gpt2_hub_layout(tmp_path):
    """GPT2Model's names (the hub's gpt2: no ``transformer.`` prefix) and its causal-mask buffers
    ``attn.bias`` / ``attn.masked_bias`` load too; the buffers are skipped."""
    torch.manual_seed(0)
    ref = IMPORTS["gpt2"]()
    model, cfg = _imported(ref, tmp_path)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "model.safetensors").items()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 24, 24))
    tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = hf.load_hf_state_dict(tmp_path, cfg)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------- export

def _dense(model_fields, seed=3):
    cfg = make_config({"model": {"vocab_size": V, "seq_len": S, "hidden": 32, "heads": 4, "layers": 2, "init_std": 0.2,
                                 **model_fields}}).model
    model = build_dense(shape_from_config(cfg), seed=seed)
    _perturb(model, seed)
    return model, cfg


EXPORTS = {
    "gpt2": {"arch": "gpt2", "activation": "gelu_tanh"},
    "gpt2-untied-gelu": {"arch": "gpt2", "tie_embeddings": False, "mlp_ratio": 2},
    "llama": {"arch": "llama", "kv_heads": 2, "intermediate_size": 40, "rope_theta": 5e5},
    "llama-tied": {"arch": "llama", "tie_embeddings": True, "intermediate_size": 40},
    "qwen2": {"arch": "llama", "kv_heads": 2, "qkv_bias": True, "intermediate_size": 40},
}


@pytest.fixture
def transformers_warnings(caplog):
    """transformers' log records of level WARNING and above (its logger does not propagate by default)."""
    transformers.utils.logging.enable_propagation()
    caplog.set_level(logging.WARNING, logger="transformers")
    yield lambda: [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]
    transformers.utils.logging.disable_propagation()


@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_loads_in_transformers(case, tmp_path, transformers_warnings):
    model, cfg = _dense(EXPORTS[case])
    hf.save_hf(model.state_dict(), cfg, tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["config.json", "model.safetensors"]
    ref, info = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", output_loading_info=True)
    assert type(ref).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    assert not any(info.values()), info
    assert transformers_warnings() == []
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) == (not cfg.tie_embeddings)
    tokens, _ = _tokens(2)
    with torch.no_grad():
        torch.testing.assert_close(ref.eval()(input_ids=tokens).logits, model(tokens), rtol=1e-6, atol=1e-6)
    # and back: the fields of the written config.json are the model's
    fields = hf.model_fields_from_hf(json.loads((tmp_path / "config.json").read_text()))
    back = make_config({"model": {**fields, "seq_len": S, "init_std": cfg.init_std}}).model  # (no init_std there)
    assert shape_from_config(back) == shape_from_config(cfg)


def test_export_sharded(tmp_path, transformers_warnings):
    model, cfg = _dense(EXPORTS["qwen2"])
    hf.save_hf(model.state_dict(), cfg, tmp_path, max_shard_bytes=8192)
    index = json.loads((tmp_path / hf.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    ref, info = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", output_loading_info=True)
    assert not any(info.values()) and transformers_warnings() == []
    tokens, _ = _tokens(3)
    with torch.no_grad():
        torch.testing.assert_close(ref.eval()(input_ids=tokens).logits, model(tokens), rtol=1e-6, atol=1e-6)
    loaded = hf.load_hf_state_dict(tmp_path, cfg)  # and our own reader of shards
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    with hf.HFCheckpoint(tmp_path) as ckpt:  # a slice read without the rest of the tensor
        name = "model.embed_tokens.weight"
        torch.testing.assert_close(ckpt.read_tensor(name, (slice(5, 9),)), model.embed.tok.weight[5:9].detach())


# --------------------------------------------------------------------------- errors

@pytest.fixture
def saved(tmp_path):
    """A small dense llama saved by save_hf: ``(directory, model config)``."""
    model, cfg = _dense(EXPORTS["llama"])
    hf.save_hf(model.state_dict(), cfg, tmp_path)
    return tmp_path, cfg


def test_unsupported_model_type():
    with pytest.raises(ValueError, match=r"'bert' is not supported; supported: gpt2, llama, mistral, qwen2"):
        hf.model_fields_from_hf({"model_type": "bert", "hidden_size": 32})


def test_refused_features():
    base = {"vocab_size": V, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 40}
    with pytest.raises(ValueError, match=r"'mistral': sliding_window=4096: sliding-window attention is not supported"):
        hf.model_fields_from_hf({**base, "model_type": "mistral", "sliding_window": 4096})
    assert hf.model_fields_from_hf({**base, "model_type": "mistral", "sliding_window": None})["arch"] == "llama"
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf.model_fields_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True})
    assert hf.model_fields_from_hf({**base, "model_type": "llama", "rope_theta": 2e4})["rope_theta"] == 2e4
    # what the dense model lacks, by name, before anything is built (#30.7)
    refused = {
        "'longrope' is not supported": {"model_type": "llama", "rope_parameters": {
            "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
        "'su' is not supported": {"model_type": "llama", "rope_scaling": {"type": "su", "factor": 2.0}},
        "partial_rotary_factor=0.5": {"model_type": "llama", "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        r"per layer type \(full_attention, sliding_attention\)": {"model_type": "qwen3", "rope_parameters": {
            "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
        r"'llama3' needs low_freq_factor, high_freq_factor": {"model_type": "llama", "max_position_embeddings": 64,
                                                             "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
        "num_local_experts=8: mixture-of-experts": {"model_type": "mistral", "sliding_window": None,
                                                     "num_local_experts": 8},
        "num_experts=4, num_experts_per_tok=2: mixture-of-experts": {"model_type": "qwen3", "num_experts": 4,
                                                                     "num_experts_per_tok": 2},
        "n_routed_experts=64": {"model_type": "llama", "n_routed_experts": 64},
        "'qwen3': use_sliding_window: true": {"model_type": "qwen3", "use_sliding_window": True},
        r"layer_types \['full_attention', 'sliding_attention'\]": {
            "model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]},
        "'qwen3': attention_bias: true": {"model_type": "qwen3", "attention_bias": True},
        "'llama': attention_bias: true": {"model_type": "llama", "attention_bias": True},
        "'llama': mlp_bias: true": {"model_type": "llama", "mlp_bias": True},
        "hidden_act 'gelu'": {"model_type": "qwen3", "hidden_act": "gelu"},
        "no head_dim is given": {"model_type": "llama", "num_attention_heads": 5},
    }
    for words, fields in refused.items():
        with pytest.raises(ValueError, match=words):
            hf.model_fields_from_hf({**base, **fields})
    gpt2 = {"model_type": "gpt2", "vocab_size": V, "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 24}
    with pytest.raises(ValueError, match="activation_function 'relu'"):
        hf.model_fields_from_hf({**gpt2, "activation_function": "relu"})
    assert hf.model_fields_from_hf({**gpt2, "activation_function": "gelu_pytorch_tanh"})["activation"] == "gelu_tanh"


def test_rotary_and_head_fields_from_config_json():
    """transformers 5's ``rope_parameters``, a transformers-4 ``rope_scaling`` (``type``, the theta at the
    top level), the defaults transformers fills in (yarn's and llama3's original length, Qwen3's head of
    128), and the fields back in ``config.json`` (``hf_config``) as transformers writes them."""
    base = {"vocab_size": V, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 40, "max_position_embeddings": 128}
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
              "original_max_position_embeddings": 64}
    got = hf.model_fields_from_hf({**base, "model_type": "llama", "rope_parameters": llama3})
    assert got["rope_theta"] == 5e5 and got["max_positions"] == 128 and got["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}
    legacy = hf.model_fields_from_hf({**base, "model_type": "qwen2", "rope_theta": 1e6,
                                      "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert legacy["rope_theta"] == 1e6 and legacy["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "truncate": True}
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert hf.model_fields_from_hf({**base, "model_type": "llama", "rope_parameters": dynamic})["rope_scaling"] == \
        dynamic
    qwen3 = hf.model_fields_from_hf({**base, "model_type": "qwen3"})
    assert (qwen3["head_dim"], qwen3["qk_norm"], qwen3["qkv_bias"]) == (128, True, False)
    assert hf.model_fields_from_hf({**base, "model_type": "llama", "head_dim": 8})["head_dim"] is None  # = 32/4
    for fields in ({**got, "seq_len": 16}, {**qwen3, "seq_len": 16, "rope_scaling": got["rope_scaling"]}):
        cfg = make_config({"model": fields}).model
        written = hf.hf_config(cfg, torch.float32)
        assert written["rope_parameters"] == {**cfg.rope_scaling.model_dump(exclude_none=True),
                                              "rope_theta": cfg.rope_theta}
        assert written["max_position_embeddings"] == 128 and written["head_dim"] == cfg.head_size
        back = make_config({"model": {**hf.model_fields_from_hf(written), "seq_len": 16}}).model
        assert back == cfg, (back, cfg)


# GPT2Config's keys that do not change what GPT2LMHeadModel computes from tokens, and why
GPT2_INERT = {"_name_or_path", "architectures", "model_type", "dtype", "transformers_version",  # bookkeeping
              "initializer_range",  # the initialisation (a loaded model has its weights)
              "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",  # generation
              "output_attentions", "output_hidden_states", "return_dict",  # what forward returns besides logits
              "id2label", "label2id", "problem_type", "summary_activation", "summary_first_dropout",
              "summary_proj_to_labels", "summary_type", "summary_use_proj",  # other heads (classifier, double heads)
              "chunk_size_feed_forward", "is_encoder_decoder"}  # GPT-2's MLP never chunks; a decoder alone


def _other(value, key):
    """A value of config key ``key`` other than ``value``."""
    if isinstance(value, bool):
        return not value
    if key == "activation_function":
        return "relu"
    return {None: 64, 0.0: 0.25}.get(value, value * 2 if isinstance(value, (int, float)) else value)


def test_no_gpt2_config_key_is_silently_dropped():
    """Each key of transformers' GPT2Config, changed alone, either changes the model: fields or is
    refused by name (ValueError), unless it is one that changes nothing the model computes (GPT2_INERT)."""
    base = GPT2Config(vocab_size=V, n_positions=24, n_embd=32, n_head=4, n_layer=2).to_dict()
    assert GPT2_INERT <= set(base), GPT2_INERT - set(base)
    fields = hf.model_fields_from_hf(base)
    dropped = []
    for key in sorted(set(base) - GPT2_INERT):
        changed = {**base, key: _other(base[key], key)}
        assert changed[key] != base[key], key
        try:
            if hf.model_fields_from_hf(changed) == fields:
                dropped.append(key)
        except ValueError as e:
            assert key in str(e), (key, e)  # named
    assert dropped == [], f"GPT2Config keys read by nothing: {dropped}"
    with pytest.raises(ValueError, match="reorder_and_upcast_attn=true .* set it false"):
        hf.model_fields_from_hf({**base, "reorder_and_upcast_attn": True})
    with pytest.raises(ValueError, match=r"pruned_heads=\{'0': \[1\]\}"):
        hf.model_fields_from_hf({**base, "pruned_heads": {"0": [1]}})


def test_missing_and_wrong_shaped_tensor(saved):
    directory, cfg = saved
    path = directory / "model.safetensors"
    file = re.escape(str(path))
    tensors = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{name}' .* missing from {file}"):
        hf.load_hf_state_dict(directory, cfg)
    save_file({**tensors, name: tensors[name][:-1]}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{file}: tensor '{name}' has shape \[39, 32\], model expects \[40, 32\]"):
        hf.load_hf_state_dict(directory, cfg)
    save_file({**tensors, "model.layers.2.mlp.up_proj.weight": tensors[name].clone()}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{file}: unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        hf.load_hf_state_dict(directory, cfg)


def test_truncated_and_missing_file(saved):
    directory, cfg = saved
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(OSError, match=rf"{re.escape(str(path))}: not a readable safetensors file"):
        hf.load_hf_state_dict(directory, cfg)
    path.unlink()
    with pytest.raises(OSError, match=rf"{re.escape(str(directory))}: no \*.safetensors file"):
        hf.load_hf_state_dict(directory, cfg)
    model, _ = _dense(EXPORTS["llama"])
    hf.save_hf(model.state_dict(), cfg, directory, max_shard_bytes=8192)
    shard = directory / json.loads((directory / hf.INDEX).read_text())["weight_map"]["model.norm.weight"]
    shard.unlink()
    with pytest.raises(OSError, match=rf"{re.escape(str(shard))}: no such safetensors file"):
        hf.load_hf_state_dict(directory, cfg)


def test_config_json_must_match(saved):
    directory, cfg = saved
    with pytest.raises(ValueError, match=r"config.json does not describe model: model.rope_theta=10000.0 "
                                         r"\(the checkpoint's 500000.0\)"):
        hf.load_hf_state_dict(directory, cfg.model_copy(update={"rope_theta": 1e4}))
    model, gcfg = _dense(EXPORTS["gpt2"])
    hf.save_hf(model.state_dict(), gcfg, directory)
    with pytest.raises(ValueError, match=rf"{re.escape(str(directory))}.* model.max_positions=32 \(the checkpoint's 16\)"):
        hf.load_hf_state_dict(directory, gcfg.model_copy(update={"seq_len": 32}))
    with pytest.raises(ValueError, match=r"'embed.pos.weight' is \[17, 32\], expected \[16, 32\]"):
        hf.save_hf({**model.state_dict(), "embed.pos.weight": torch.zeros(17, 32)}, gcfg, directory)


def test_core_does_not_import_safetensors():
    code = ("import sys, parallel4d, parallel4d.models, parallel4d.engine, parallel4d.checkpoint; "
            "assert 'safetensors' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
