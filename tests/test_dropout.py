"""Dropout (#30.4): drawn per dense element from ``(train.seed, step, site, sample, position, feature /
head, key position)``, so every layout drops what one process drops.

* the 16-worker job (tests/conftest.py) trains gpt2 (every site at 0.1) and a grouped-query llama
  (attention dropout 0.1) under 2D tp=4 × ring sp=2 (zigzag and contiguous) × a pipeline (1F1B,
  Hanayo, activation checkpointing) or × dp=2 (micro-batches): float64 losses 1e-10 and every
  parameter after 3 steps 1e-9 against the dense model trained in this process with the same draws;
* in this process: the masks' rate and scale, their change with the step and the site, evaluation
  without dropout, p = 0 unchanged, activation checkpointing's recomputation drawing the same masks,
  and the fields to and from Hugging Face's config.json.
"""

from __future__ import annotations

import pytest
import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.data.batches import build_dataset
from parallel4d.engine.model import model_shape
from parallel4d.models.build import build_dense
from parallel4d.models.context import Draw, ForwardContext
from parallel4d.models.dropout import Site, keep_scale, site_key
from test_llama import check_pieces, dense_run, train_layouts

GPT2 = {"arch": "gpt2", "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2, "dropout": 0.1}
LLAMA = {"arch": "llama", "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "kv_heads": 2, "layers": 2,
         "intermediate_size": 48, "attention_dropout": 0.1}
TRAIN = {"steps": 3, "dtype": "float64", "grad_clip": None, "timeout_s": 60, "seed": 7}


def _job(model, parallel, pipeline=None, **sections) -> dict:
    return {"model": model, "data": {"source": "synthetic", "batch_size": 8}, "parallel": parallel,
            "pipeline": pipeline or {"microbatches": 2}, "optimizer": {"lr": 0.01, "warmup_steps": 1},
            "train": {**TRAIN, **sections.pop("train", {})}, **sections}


RECOMPUTE = {"activation_checkpointing": "blocks"}
# 16 workers each: 2D tp=4 × ring sp=2 × (dp=2 or pp=2), both ring layouts, both families, recomputed
SIXTEEN = {
    "gpt2 dp=2 × ring sp=2 zigzag × 2D tp=4, 2 micro-batches, recomputed": _job(
        GPT2, {"dp": 2, "sp": 2, "tp": 4}, sequence={"layout": "zigzag"}, train=RECOMPUTE),
    "llama Hanayo pp=2 × ring sp=2 contiguous × 2D tp=4, recomputed": _job(
        LLAMA, {"pp": 2, "sp": 2, "tp": 4}, {"schedule": "hanayo", "waves": 1, "microbatches": 2},
        sequence={"layout": "contiguous"}, train=RECOMPUTE),
}


def check_layouts(results: list[dict], jobs: dict) -> None:
    """Every rank's losses (1e-10) and parameter pieces (1e-9) against :func:`dense_run`'s."""
    for name, job in jobs.items():
        check_pieces(results, name, *dense_run(job))


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job (tests/conftest.py)."""
    return train_layouts(SIXTEEN)


def test_every_layout_draws_the_masks_one_process_draws(sixteen_workers):
    check_layouts([r["test_dropout"] for r in sixteen_workers], SIXTEEN)


# --- one process ---------------------------------------------------------------------------------


def test_masks_keep_1_minus_p_scaled_and_change_with_step_and_site():
    coords = [torch.arange(8), torch.arange(32), torch.arange(1000, 1064)]
    masks = {(step, stage, kind): keep_scale(site_key(7, step, stage, kind), 0.25, coords, torch.float64)
             for step in (0, 1) for stage in (1, 2) for kind in ("attention_output", "mlp_output")}
    for m in masks.values():
        assert set(m.unique().tolist()) == {0.0, 1 / 0.75}
        assert abs(float((m == 0).double().mean()) - 0.25) < 0.015  # 16384 draws: σ ≈ 0.0034
    ms = list(masks.values())
    for i, a in enumerate(ms):
        for b in ms[i + 1:]:  # independent masks agree on 1 - 2p(1-p) = 62.5% of the elements
            assert abs(float((a == b).double().mean()) - 0.625) < 0.02  # σ ≈ 0.0038
    # a slice of the coordinates draws the same elements as the whole (what a shard does)
    whole = masks[(0, 1, "mlp_output")]
    part = keep_scale(site_key(7, 0, 1, "mlp_output"), 0.25, [coords[0][2:4], coords[1][8:16], coords[2][32:64]],
                      torch.float64)
    assert torch.equal(part, whole[2:4, 8:16, 32:64])
    assert torch.equal(keep_scale(1, 0.0, coords, torch.float32), torch.ones(8, 32, 64))


def test_sites_need_a_draw_and_follow_its_rows_and_positions():
    x = torch.ones(4, 6, 8, dtype=torch.float64)
    site = Site(0.5, 3, "embedding", offset=8)
    site.context = ForwardContext(1, positions=torch.tensor([10, 11, 12, 13, 14, 15]))
    assert site(x) is x  # no draw: evaluation, generation
    with site.context.drawing(Draw(step=2, first_row=4)):
        got = site(x)
    want = keep_scale(site_key(1, 2, 3, "embedding"), 0.5,
                      [torch.arange(4, 8), torch.arange(10, 16), torch.arange(8, 16)], torch.float64)
    assert torch.equal(got, want) and site.context.draw is None


def _model(fields, **extra):
    cfg = make_config({"model": {**fields, **extra}, "train": {"dtype": "float64", "seed": 3}})
    return build_dense(model_shape(cfg), seed=3).double()


@pytest.mark.parametrize("fields", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_dense_model_drops_in_training_only(fields):
    tokens, targets = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(0))
    plain = _model(fields, dropout=0.0, attention_dropout=0.0)
    model = _model(fields)
    want = plain(tokens, targets)
    assert torch.equal(plain(tokens, targets, step=0), want)  # p = 0: nothing drawn, nothing changed
    assert torch.equal(model(tokens, targets), want)  # no step: no dropout (evaluation, generation)
    first, again, second = (model(tokens, targets, step=s) for s in (0, 0, 1))
    assert torch.equal(first, again) and not torch.isclose(first, want) and not torch.isclose(first, second)
    model.eval()  # eval mode: no dropout even with a step
    assert torch.equal(model(tokens, targets, step=0), want)


def test_engine_drops_in_train_step_not_in_evaluate_and_recomputes_the_same_masks(single_rank):
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    def engine(model, **train):
        cfg = make_config(_job(model, {}, train={"steps": 1, **train}))
        return compose(cfg, init_mesh(timeout_s=60))

    plain, dropped, recomputed = engine({**GPT2, "dropout": 0.0}), engine(GPT2), engine(GPT2, **RECOMPUTE)
    batch = build_dataset(make_config(_job(GPT2, {}))).batch(0)
    assert torch.equal(dropped.evaluate(*batch), plain.evaluate(*batch))
    losses = [e.compute_gradients(*batch) for e in (plain, dropped, recomputed)]
    assert not torch.equal(losses[1], losses[0])
    assert torch.equal(losses[2], losses[1])
    grads = [{n: p.grad.clone() for n, p in e.model.named_parameters()} for e in (dropped, recomputed)]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-13, atol=0, msg=name)


# --- config.json both ways -------------------------------------------------------------------------


def test_gpt2_dropouts_from_and_to_config_json():
    from parallel4d.config.hf_fields import model_fields_from_hf
    from parallel4d.models.gpt2.spec import hf_config

    hf = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 64,
          "resid_pdrop": 0.1, "embd_pdrop": 0.2, "attn_pdrop": 0.1}
    fields = model_fields_from_hf(hf)
    assert (fields["dropout"], fields["embedding_dropout"], fields["attention_dropout"]) == (0.1, 0.2, None)
    m = make_config({"model": fields}).model
    out = hf_config(m, {})
    assert (out["resid_pdrop"], out["embd_pdrop"], out["attn_pdrop"]) == (0.1, 0.2, 0.1)
    assert model_fields_from_hf({k: v for k, v in hf.items() if "pdrop" not in k})["dropout"] == 0.1  # its default


def test_llama_attention_dropout_from_and_to_config_json_and_its_refusals():
    from parallel4d.config.hf_fields import mismatches, model_fields_from_hf
    from parallel4d.models.llama.spec import hf_config

    hf = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 48, "attention_dropout": 0.1}
    fields = model_fields_from_hf(hf)
    assert fields["attention_dropout"] == 0.1
    assert hf_config(make_config({"model": fields}).model, {})["attention_dropout"] == 0.1
    assert mismatches(fields, {"attention_dropout": 0.0}) == []  # a fine-tune picks its own dropout
    for field in ("dropout", "embedding_dropout"):
        with pytest.raises(ConfigError, match=f"model.{field}=0.1 with model.arch=llama: .* set "
                                              "model.attention_dropout"):
            make_config({"model": {**LLAMA, field: 0.1}})


def test_deepspeed_refuses_dropout_by_name():
    with pytest.raises(ConfigError, match=r"model.dropout=0.1, model.attention_dropout=0.1, "
                                          r"model.embedding_dropout=0.1 with DeepSpeed"):
        make_config({"model": GPT2, "deepspeed": {"zero_optimization": {"stage": 1}}})


def test_gpt2_sites_are_transformers_own(tmp_path, monkeypatch):
    """transformers' GPT-2 in training mode with its dropouts drawing our masks (its modules swapped for
    our sites; its eager attention's probabilities multiplied by our keep) equals the dense model
    drawing them (float64): the same sites, in the same places, with the same scaling."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2 import modeling_gpt2

    from parallel4d.models import hf
    from parallel4d.models.context import attach

    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_head=4, n_layer=2, resid_pdrop=0.1, embd_pdrop=0.2,
        attn_pdrop=0.3, activation_function="gelu", bos_token_id=None, eos_token_id=None,
        attn_implementation="eager")).double()
    ref.save_pretrained(tmp_path)
    fields = hf.model_fields_from_hf(ref.config.to_dict())
    cfg = make_config({"model": {**fields, "seq_len": 16}, "train": {"dtype": "float64", "seed": 5}})
    ours = build_dense(model_shape(cfg), seed=5).double()
    ours.load_state_dict(hf.load_hf_state_dict(tmp_path, cfg.model), strict=True)

    ref.transformer.drop = Site(0.2, 0, "embedding")
    for i, block in enumerate(ref.transformer.h):
        block.attn.resid_dropout, block.mlp.dropout = Site(0.1, i + 1, "attention_output"), Site(0.1, i + 1, "mlp_output")
    attach(ref, ours.context)

    def eager(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kwargs):
        site = Site(module.attn_dropout.p, module.layer_idx + 1, "attention")
        site.context = ours.context
        weights = ((q @ k.transpose(-1, -2)) * scaling + attention_mask).softmax(-1)
        pos = torch.arange(q.shape[2])
        weights = weights * site.attention(q.shape[0], q.shape[1], q.device).keep(pos, pos, weights.dtype)
        return (weights @ v).transpose(1, 2), weights

    monkeypatch.setattr(modeling_gpt2, "eager_attention_forward", eager)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ref.train()
    with ours.context.drawing(Draw(step=4)):
        want = ref(tokens).logits
    got = ours(tokens, step=4)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    assert (got - ours(tokens)).abs().max() > 1e-3  # dropout was drawn
