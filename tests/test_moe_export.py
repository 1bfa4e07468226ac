"""``parallel4d export`` of mixture-of-experts models (issue 48's third part, the way out), against
``transformers`` itself, in this one process:

* an own MoE model → ``save_hf`` → ``AutoModelForCausalLM.from_pretrained`` loads it as
  ``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` or ``MixtralForCausalLM`` (no missing or unexpected
  key, no warning) with the model's logits, and saving that model again with transformers' own
  ``save_pretrained`` gives the very tensors written (one per expert and projection: the Qwens'
  ``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1``);
* the round trip: a directory transformers saved → a ``model.pretrained`` job (3 steps) → its
  checkpoint → ``parallel4d export`` → the directory's tensor names and shapes, its config.json key by key,
  the tokenizer's files byte for byte; the trained values as checkpointed; transformers' logits of the
  export equal the checkpoint's model;
* refusals: a model no transformers type holds, a checkpoint whose experts are not the dense tensors —
  each one line naming the fields or the tensor and the fix.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,  # noqa: E402
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from conftest import run_in_this_process  # noqa: E402
from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.models import hf  # noqa: E402
from parallel4d.models.build import shape_from_config  # noqa: E402
from test_hf import S, _dense, _tokens  # noqa: E402
from test_hf import transformers_warnings  # noqa: E402,F401  (a fixture, used by name)
from test_pretrained import _job, _with_tokenizer  # noqa: E402

# own models (test_hf's _dense: hidden 32, 4 heads): one per transformers type, each with what it alone has
OWN = {
    "qwen3_moe": {"arch": "llama", "layers": 3, "kv_heads": 2, "intermediate_size": 40, "qk_norm": True,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 12, "decoder_sparse_step": 2},
    "qwen2_moe": {"arch": "llama", "layers": 3, "kv_heads": 2, "intermediate_size": 40, "qkv_bias": True,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 12,
                  "shared_expert_intermediate_size": 20, "mlp_only_layers": [0]},
    "mixtral": {"arch": "llama", "kv_heads": 2, "intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2,
                "norm_topk_prob": True},
}
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}


def _tensors(directory) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


@pytest.mark.parametrize("kind", list(OWN))
def test_moe_export_loads_in_transformers_as_its_own_save(kind, tmp_path, transformers_warnings):
    model, cfg = _dense(OWN[kind])
    hf.save_hf(model.state_dict(), cfg, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (kind, [ARCHITECTURES[kind]])
    ref, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert type(ref).__name__ == ARCHITECTURES[kind]
    assert not any(info.values()) and transformers_warnings() == [], info
    tokens, _ = _tokens(2)
    with torch.no_grad():
        torch.testing.assert_close(ref.eval()(input_ids=tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    # transformers' own save of what it loaded: the same tensors, under the same names, in the same layout
    ref.save_pretrained(tmp_path / "theirs")
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "theirs")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    per_expert = "block_sparse_moe.experts.3.w2.weight" if kind == "mixtral" else "mlp.experts.3.down_proj.weight"
    assert any(k.endswith(per_expert) for k in ours)
    # and back: the fields of the written config.json are the model's
    back = make_config({"model": {**hf.model_fields_from_hf(config), "seq_len": S, "init_std": cfg.init_std}}).model
    assert shape_from_config(back) == shape_from_config(cfg)


# directories transformers saves (one tensor per expert), as the round trip starts from
_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, tie_word_embeddings=False, output_router_logits=True,
               router_aux_loss_coef=0.05)
SOURCES = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_COMMON, num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        norm_topk_prob=True, decoder_sparse_step=2)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **_COMMON, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, mlp_only_layers=[0])),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
        **_COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
}


def _headers(directory) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of every ``*.safetensors`` in ``directory`` (headers only)."""
    out = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return out


@pytest.mark.parametrize("kind,dtype", [("qwen3_moe", "float64"), ("qwen2_moe", "float32"), ("mixtral", "float32")])
def test_moe_round_trip_transformers_parallel4d_export_transformers(kind, dtype, tmp_path, capsys):
    """transformers' save → parallel4d (3 AdamW steps in one process, the auxiliary loss counted) →
    ``parallel4d export`` → the original's tensor names and shapes (its experts one tensor each), its
    config.json key by key (only dtype changed, by the float64 training), the tokenizer's files byte for
    byte; every tensor the checkpoint's (the experts stacked); from_pretrained loads it with no missing key,
    to the original's config, and its logits are the checkpoint's model's (1e-5)."""
    from parallel4d.checkpoint.gather import gather
    from parallel4d.tools.cli import main
    from parallel4d.tools.generate import load_model

    torch.manual_seed(0)
    SOURCES[kind]().save_pretrained(tmp_path / "saved")
    source, out, run = tmp_path / "source", tmp_path / "hf", tmp_path / "run"
    _with_tokenizer(tmp_path / "saved", source)
    job = {**_job(str(source), {}, steps=3), "train": {"steps": 3, "dtype": dtype, "out_dir": str(run)}}
    run_in_this_process(job, [])
    capsys.readouterr()
    assert main(["export", str(run / "checkpoints"), str(out)]) == 0
    assert capsys.readouterr().out == f"exported step 3 of {run / 'checkpoints'} to {out}\n"
    names = {p.name for p in source.iterdir()} - {"training_args.bin"}
    assert {p.name for p in out.iterdir()} == names
    for name in names - {"config.json", "model.safetensors"}:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name

    original, exported = (json.loads((d / "config.json").read_text()) for d in (source, out))
    changed = {k for k in {*original, *exported} if original.get(k) != exported.get(k)}
    assert changed == (set() if dtype == "float32" else {"dtype"}), changed
    assert _headers(out) == _headers(source)

    cfg = make_config(job).model
    saved = torch.load(gather(run / "checkpoints", tmp_path / "dense.pt", progress=False))["model"]
    written = _tensors(out)
    for dense, (name, how) in hf.p4d_to_hf(cfg).items():
        got = torch.stack([written[name.format(e=e)] for e in range(cfg.num_experts)]) if how == "experts" \
            else written[name]
        assert got.dtype == getattr(torch, dtype) and torch.equal(got, saved[dense]), name
    assert any((written[n] != v).any() for n, v in _tensors(source).items())  # trained: not the original's

    back, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(back).__name__ == ARCHITECTURES[kind] and not any(info.values()), info
    theirs = AutoModelForCausalLM.from_pretrained(source)
    assert back.config.to_dict() == {**theirs.config.to_dict(), "_name_or_path": str(out), "dtype": dtype}
    ours, _ = load_model(run)
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(back.float().eval()(input_ids=tokens).logits, ours.float()(tokens),
                                   rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("fields, words", [
    ({"qk_norm": True, "shared_expert_intermediate_size": 20},
     ["model.qk_norm with model.shared_expert_intermediate_size=20", "no transformers model type"]),
    ({"qk_norm": True, "qkv_bias": True}, ["model.qk_norm with model.qkv_bias"]),
    ({"decoder_sparse_step": 2}, ["model.norm_topk_prob=false, model.decoder_sparse_step=2 without q/k norms or a "
                                  "shared expert", "Qwen3-MoE needs model.qk_norm"]),
    ({"norm_topk_prob": True, "qkv_bias": True}, ["model.qkv_bias without q/k norms or a shared expert"]),
])
def test_moe_models_no_transformers_type_holds_are_refused_naming_the_fields(fields, words):
    cfg = make_config({"model": {"arch": "llama", "layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                 **fields}}).model
    with pytest.raises(ValueError) as e:
        hf.hf_config(cfg, torch.float32)
    assert all(w in str(e.value) for w in words), str(e.value)


def _checkpoint(root, model: dict, rename=None):
    """A one-step parallel4d checkpoint of ``model`` (its ``model:`` section) under ``root``, the dense
    state dict's tensors renamed by ``rename`` (name → {new name: tensor}). Returns its step directory."""
    from parallel4d.checkpoint import dcp as checkpoint
    from parallel4d.models.build import build_dense

    cfg = make_config({"model": model})
    state = {"step": torch.tensor(1), "tokens_seen": torch.tensor(0)}
    for name, t in build_dense(shape_from_config(cfg.model), seed=0).state_dict().items():
        state.update({f"model.{k}": v for k, v in (rename(name, t) if rename else {name: t}).items()})
    return checkpoint.save(state, root, 1, keep=1, extra_files={"config.yaml": cfg.to_yaml()})


MOE = {"arch": "llama", "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2,
       "intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2}


def _per_expert(name, t):
    """Experts saved one tensor each (a layout no parallel4d run writes)."""
    if ".experts." not in name:
        return {name: t}
    return {name.replace(".experts.", f".experts.{e}."): t[e].clone() for e in range(t.shape[0])}


@pytest.mark.parametrize("model, rename, words", [
    (MOE, None, ["model.norm_topk_prob=false without q/k norms or a shared expert", "no transformers model type"]),
    ({**MOE, "norm_topk_prob": True}, _per_expert,
     ["tensor 'blocks.0.mlp.experts.gate_proj' is missing", "experts stacked [num_experts, ...]"]),
])
def test_export_refuses_what_it_cannot_write_in_one_line(model, rename, words, tmp_path, capsys):
    """What export cannot write (a model no transformers type holds; experts not saved as the dense tensors):
    exit 2, one line naming the fields or the tensor and the fix, nothing written."""
    from parallel4d.tools.cli import main

    step = _checkpoint(tmp_path / "ckpt", model, rename)
    capsys.readouterr()
    assert main(["export", str(step), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    assert not (tmp_path / "hf").exists()
