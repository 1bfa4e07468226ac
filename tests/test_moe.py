"""Mixture-of-experts layers of the llama family (``parallel4d/models/moe/``, issue 48's first part),
against transformers' Qwen3-MoE, Mixtral and Qwen2-MoE in float64, one process.

Each case builds a tiny random transformers model, maps its weights into the dense model through the
family's name map (transformers 5's fused experts split by ``models/moe/layer.from_transformers``) and
its config through ``model_fields_from_hf``, then compares logits, the loss (cross entropy plus
``router_aux_loss_coef`` × the load-balancing loss, transformers' ``output_router_logits``), the
auxiliary loss alone, every gradient (1e-10) and the parameters after 20 AdamW steps (1e-9).

transformers computes its RMSNorm, rotary, router softmax, eager attention softmax, loss and
load-balancing statistics in float32 even for a float64 model. :func:`float64_transformers` makes
every one of those float64 without touching its code: the modeling modules see a ``torch`` whose
``float`` / ``float32`` are float64, and ``Tensor.float()`` keeps float64 (while patched).

Also: the engine trains an MoE job at every parallel size 1 (micro-batches and recomputation: each
micro-batch's own auxiliary loss, recorded once) as the dense model does; the config's rules.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,  # noqa: E402
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from parallel4d.config.errors import ConfigError  # noqa: E402
from parallel4d.config.hf_fields import model_fields_from_hf  # noqa: E402
from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.models.build import build_dense, shape_from_config  # noqa: E402
from parallel4d.models.hf import p4d_to_hf  # noqa: E402
from parallel4d.models.moe.balance import load_balancing_loss  # noqa: E402
from parallel4d.models.moe.layer import from_transformers  # noqa: E402
from parallel4d.models.moe.spec import alternatives  # noqa: E402

V, S, B = 61, 16, 3
_COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, pad_token_id=None, output_router_logits=True,
               router_aux_loss_coef=0.5,  # a coefficient that makes the auxiliary loss count in every gradient
               attn_implementation="eager", experts_implementation="eager")  # their loops, not grouped kernels

CASES = {
    "qwen3_moe top-2 of 4": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_COMMON, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        norm_topk_prob=False)),
    "qwen3_moe norm_topk_prob, decoder_sparse_step=2": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_COMMON, num_hidden_layers=3, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=12,
        norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral top-2 of 4": lambda: MixtralForCausalLM(MixtralConfig(
        **_COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe shared expert, mlp_only_layers=[0]": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **_COMMON, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, norm_topk_prob=False, mlp_only_layers=[0])),
}


class _Float64Torch:
    """``torch`` as a transformers modeling module sees it under :func:`float64_transformers`:
    ``torch.float`` and ``torch.float32`` are float64, all else is torch."""

    float = float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _widened_float(self):
    return self.to(torch.promote_types(self.dtype, torch.float32))


def float64_transformers(mp):
    """While ``mp`` (pytest's monkeypatch) holds: the MoE modeling modules' float32 casts are float64, and
    ``Tensor.float()`` widens without narrowing (transformers' loss and rotary call it). Build the model
    inside, so that its rotary table is computed in float64 too."""
    for module in (modeling_qwen3_moe, modeling_qwen2_moe, modeling_mixtral):
        mp.setattr(module, "torch", _Float64Torch())
    mp.setattr(torch.Tensor, "float", _widened_float)


def _perturb(model, seed=0):
    """Random norm gains and biases (inits make them 1 and 0, which would hide a swapped one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _batch(seed):
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]  # what transformers' labels=tokens compares: token t+1 at position t
    return tokens, targets


def _ours_from(ref):
    """The dense model of ``ref``'s config.json fields, its weights ``ref``'s through the name map."""
    cfg = make_config({"model": {**model_fields_from_hf(ref.config.to_dict()), "seq_len": S}}).model
    model = build_dense(shape_from_config(cfg), seed=7).double()
    theirs = dict(ref.state_dict())
    names = p4d_to_hf(cfg)
    theirs_names = set(theirs)  # in memory: fused experts (Mixtral's router under mlp.gate too)
    names = {p4d: next((a for a in [(hf, how), *alternatives(hf, how)] if a[0] in theirs_names), (hf, how))
             for p4d, (hf, how) in names.items()}
    model.load_state_dict({p4d: from_transformers(theirs[hf], how).clone() for p4d, (hf, how) in names.items()},
                          strict=True)
    used = {hf for hf, _ in names.values()}
    assert used == {n for n, _ in ref.named_parameters()}, "the name map is not transformers' parameters"
    return model, names


def _worst(model, ref, names, what):
    """Max |ours − theirs| over every parameter (``what``: "grad" or "data") through the name map."""
    theirs = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        hf, how = names[name]
        t = from_transformers(getattr(theirs[hf], what), how)
        assert getattr(p, what).shape == t.shape, name
        worst = max(worst, (getattr(p, what) - t).abs().max().item())
    return worst


def _aux(model, tokens):
    """Our load-balancing loss of one forward (every MoE layer's statistics, combined once)."""
    _, state = model.run(tokens)
    return load_balancing_loss([state.routing[i] for i in sorted(state.routing)], model.shape.moe.num_experts)


@pytest.mark.parametrize("case", list(CASES))
def test_moe_equals_transformers_in_float64(case, monkeypatch):
    with monkeypatch.context() as mp:
        float64_transformers(mp)
        torch.manual_seed(0)
        ref = CASES[case]().double().train()
        _perturb(ref)
        model, names = _ours_from(ref)
        tokens, targets = _batch(1)

        out = ref(input_ids=tokens, labels=tokens)
        loss = model(tokens, targets)
        d_logits = (model(tokens) - out.logits).abs().max().item()
        d_loss, d_aux = abs(loss.item() - out.loss.item()), abs(_aux(model, tokens).item() - out.aux_loss.item())
        out.loss.backward()
        loss.backward()
        d_grad = _worst(model, ref, names, "grad")
        assert out.logits.dtype == torch.float64 and out.logits.abs().max() > 1.0  # not a degenerate model
        assert out.aux_loss.item() > 1.0  # E·Σ f·P is 1 at perfect balance, k·(something) here
        assert d_logits < 1e-10 and d_loss < 1e-10 and d_aux < 1e-10 and d_grad < 1e-10, \
            (d_logits, d_loss, d_aux, d_grad)

        # 20 AdamW steps of both on fresh batches: every parameter after
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (ref, model)]
        for step in range(20):
            tokens, targets = _batch(100 + step)
            for opt in opts:
                opt.zero_grad()
            ref(input_ids=tokens, labels=tokens).loss.backward()
            model(tokens, targets).backward()
            for opt in opts:
                opt.step()
        d_params = _worst(model, ref, names, "data")
        print(f"\n{case}: logits {d_logits:.1e}, loss {d_loss:.1e}, aux {d_aux:.1e}, grads {d_grad:.1e}, "
              f"parameters after 20 AdamW steps {d_params:.1e}")
        assert d_params < 1e-9


def test_pretrained_qwen3_moe_directory_loads_and_computes_transformers_loss(tmp_path, single_rank, monkeypatch):
    """``model.pretrained`` pointing at a Qwen3-MoE directory transformers saved (one tensor per expert, as
    its save_pretrained writes them): the job's fields come from its config.json (num_local_experts, the
    Qwens' keys), the engine (one process) reads the experts' slices and evaluates a batch to transformers'
    loss — cross entropy plus the auxiliary loss — in float64 (1e-10)."""
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    with monkeypatch.context() as mp:
        float64_transformers(mp)
        torch.manual_seed(0)
        ref = CASES["qwen3_moe norm_topk_prob, decoder_sparse_step=2"]()
        _perturb(ref)
        ref.save_pretrained(tmp_path / "qwen3_moe")
        cfg = make_config({"model": {"pretrained": str(tmp_path / "qwen3_moe"), "seq_len": S},
                           "data": {"batch_size": B}, "train": {"dtype": "float64"}})
        assert (cfg.model.num_experts, cfg.model.num_experts_per_tok, cfg.model.decoder_sparse_step,
                cfg.model.qk_norm, cfg.model.output_router_logits) == (5, 3, 2, True, True)
        engine = compose(cfg, init_mesh())
        tokens, targets = _batch(1)
        ours = float(engine.evaluate(tokens, targets))
        engine.close()
        theirs = ref.double()(input_ids=tokens, labels=tokens).loss.item()
    print(f"\npretrained qwen3_moe: loss {ours:.6f}, |ours - transformers| {abs(ours - theirs):.1e}")
    assert abs(ours - theirs) < 1e-10


@pytest.mark.parametrize("case", list(CASES))
def test_every_expert_layout_loads_the_same_tensors(case, tmp_path):
    """A directory transformers saved (one tensor per expert: the Qwens' experts.{e}.gate_proj, Mixtral's
    block_sparse_moe.experts.{e}.w1|w2|w3) and one holding transformers 5's fused gate_up_proj load to the
    weights of the model itself, whole (load_hf_state_dict) and as a rank's box of experts (load_pieces:
    experts 1..2 of a projection, the up half of the fused tensor)."""
    from safetensors.torch import save_file

    from parallel4d.models import hf

    torch.manual_seed(0)
    ref = CASES[case]()
    model, _ = _ours_from(ref)  # the in-memory (fused) tensors through the name map
    want = model.state_dict()
    ref.save_pretrained(tmp_path / "saved")
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    cfg = make_config({"model": {**model_fields_from_hf(ref.config.to_dict()), "seq_len": S}}).model
    sparse = next(i for i, block in enumerate(model.blocks) if type(block.mlp).__name__ == "SparseMoE")
    for layout in ("saved", "fused"):
        got = hf.load_hf_state_dict(tmp_path / layout, cfg)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k].float()) for k in want), layout
        name = f"blocks.{sparse}.mlp.experts.up_proj"
        box = torch.empty(2, *want[name].shape[1:])
        hf.load_pieces({name: [((1, 0, 0), box)]}, tmp_path / layout, cfg)
        assert torch.equal(box, want[name][1:3].float()), layout


def test_moe_layer_selection_matches_transformers():
    """Which layers hold experts (decoder_sparse_step, mlp_only_layers) is transformers' choice."""
    cases = {(1, ()): 4, (2, ()): 2, (1, (0, 3)): 2, (3, (2,)): 0}  # (step, mlp_only) → MoE layers of 4
    for (step, only), n in cases.items():
        ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**_COMMON, "initializer_range": 0.02}, num_hidden_layers=4,
                                                 num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4,
                                                 decoder_sparse_step=step, mlp_only_layers=list(only)))
        model, _ = _ours_from(ref)
        theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ref.model.layers]
        ours = [type(block.mlp).__name__ == "SparseMoE" for block in model.blocks]
        assert ours == theirs and sum(ours) == n, (step, only)


BASE = {"model": {"arch": "llama", "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "kv_heads": 2,
                  "layers": 3, "intermediate_size": 40, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "mlp_only_layers": [1],
                  "output_router_logits": True, "router_aux_loss_coef": 0.1},
        "data": {"source": "synthetic", "batch_size": 8},
        "pipeline": {"microbatches": 2},
        "optimizer": {"lr": 0.01, "warmup_steps": 2, "weight_decay": 0.1, "schedule": "cosine", "min_lr": 0.002},
        "train": {"steps": 4, "dtype": "float64", "grad_clip": 0.5, "activation_checkpointing": "blocks"}}


def test_moe_job_trains_through_the_engine_as_the_dense_model(single_rank):
    """compose() at every parallel size 1, two micro-batches, blocks recomputed: the losses (1e-10) and every
    parameter after 4 steps (1e-9) equal the dense model's, each micro-batch with its own auxiliary loss
    (a forward's, as transformers computes it) and the recomputation recording nothing twice."""
    from test_llama import dense_run

    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    cfg = make_config(BASE)
    engine, data = compose(cfg, init_mesh()), build_dataset(cfg)
    losses = [float(engine.train_step(*data.batch(step))) for step in range(cfg.train.steps)]
    params = {k[len("model."):]: v.pieces[0][1].detach().clone() for k, v in engine.state_dict().items()
              if k.startswith("model.")}
    engine.close()

    def by_microbatch(model, x, y, step):  # the engine's gradient accumulation: each half's loss weighs 1/2
        return sum(model(xm, ym, step=step) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2

    want_losses, want = dense_run(BASE, by_microbatch)
    assert want_losses[-1] < want_losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-10, atol=0)
    assert set(params) == set(want)
    for name, p in want.items():
        torch.testing.assert_close(params[name], p, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_compiled_blocks_train_an_moe_model_as_eager_ones(single_rank, monkeypatch):
    """``train.compile: blocks`` (AOTAutograd without inductor's code generation, as test_compile's workers)
    over BASE (two micro-batches, recomputed blocks, the auxiliary loss): the losses and every parameter after
    4 steps equal the eager engine's (float64: 1e-12); the loop over experts' host read is a graph break."""
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine import compile as compile_module
    from parallel4d.engine.compose import compose

    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    runs = {}
    for mode in ("none", "blocks"):
        cfg = make_config({**BASE, "train": {**BASE["train"], "compile": mode}})
        engine, data = compose(cfg, init_mesh()), build_dataset(cfg)
        losses = [float(engine.train_step(*data.batch(step))) for step in range(cfg.train.steps)]
        runs[mode] = losses, {k: v.pieces[0][1].detach().clone() for k, v in engine.state_dict().items()
                              if k.startswith("model.")}
        engine.close()
    torch.testing.assert_close(torch.tensor(runs["blocks"][0]), torch.tensor(runs["none"][0]), rtol=1e-12, atol=0)
    for name, p in runs["none"][1].items():
        torch.testing.assert_close(runs["blocks"][1][name], p, rtol=1e-12, atol=1e-14, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("fields, words", [
    ({"num_experts_per_tok": 2}, ["model.num_experts_per_tok=2 with model.num_experts=0", "set model.num_experts"]),
    ({"num_experts": 4}, ["model.num_experts_per_tok is missing", "1 to 4"]),
    ({"num_experts": 4, "num_experts_per_tok": 5}, ["model.num_experts_per_tok=5 is more than", "use 1 to 4"]),
    ({"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0, 2]},
     ["model.mlp_only_layers=[0, 2]", "layer(s) [2]", "use layers 0 to 1"]),
])
def test_moe_fields_that_cannot_run_are_refused(fields, words):
    """The router's top-k, mlp_only_layers past the model, MoE fields on a dense model: named, with the fix."""
    with pytest.raises(ConfigError) as e:
        make_config({"model": {"arch": "llama", "layers": 2, **fields}})
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("sections, words", [
    ({"parallel": {"tp": 4}, "model": {"seq_len": 15}, "data": {"batch_size": 2}},
     ["parallel.tp=4", "1 × 15 = 15 tokens", "not divisible by 2", "model.seq_len=14 or 16",
      "data.batch_size a multiple of 4"]),
    ({"model": {"arch": "gpt2"}}, ["model.arch=gpt2: only the llama family", "model.num_experts=0"]),
])
def test_moe_layouts_not_supported_yet_are_refused(sections, words):
    """A family without MoE layers is refused naming the field, and a 2D grid whose
    rows' tokens its MoE layers cannot split over the row's q ranks names the fields that fix it."""
    job = {"model": {"arch": "llama", "num_experts": 4, "num_experts_per_tok": 2, **sections.get("model", {})},
           **{k: v for k, v in sections.items() if k != "model"}}
    with pytest.raises(ConfigError) as e:
        make_config(job)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("parallel, model, words", [
    ({"dp": 2, "sp": 2, "ep": 3}, {}, ["parallel.ep=3 does not divide parallel.dp × parallel.sp = 2 × 2 = 4",
                                      "use parallel.ep=2 or 4"]),
    ({"dp": 4, "sp": 2, "ep": 8}, {}, ["parallel.ep=8 is more than model.num_experts=4", "use parallel.ep=4"]),
    ({"dp": 6, "ep": 3}, {}, ["parallel.ep=3 does not split model.num_experts=4 experts evenly",
                              "use parallel.ep=2"]),
    ({"dp": 2, "ep": 2}, {"num_experts": 0, "num_experts_per_tok": None},
     ["parallel.ep=2 with model.num_experts=0", "use parallel.ep=1"]),
])
def test_expert_parallel_sizes_that_cannot_split_the_experts_are_refused(parallel, model, words):
    """parallel.ep: drawn from dp·sp, dividing the experts, an MoE model's; each refusal names the nearest ep
    that works."""
    job = {"model": {"arch": "llama", "num_experts": 4, "num_experts_per_tok": 2, **model},
           "parallel": parallel, "data": {"batch_size": 24}}
    with pytest.raises(ConfigError) as e:
        make_config(job)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("parallel", [{"dp": 2, "sp": 2}, {"dp": 2, "sp": 2, "ep": 4}, {"dp": 4, "ep": 2}])
def test_moe_runs_over_data_and_sequence_ranks_with_experts_split_or_replicated(parallel):
    """dp and sp (and ep drawn from them) are accepted for MoE models; ep adds no ranks."""
    cfg = make_config({"model": {"arch": "llama", "num_experts": 4, "num_experts_per_tok": 2},
                       "parallel": parallel, "data": {"batch_size": 8}})
    assert cfg.world_size == parallel["dp"] * parallel.get("sp", 1)


@pytest.mark.parametrize("fields", [
    {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "decoder_sparse_step": 2},
    {"num_experts": 3, "num_experts_per_tok": 1, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 40,
     "mlp_only_layers": [0]},
])
def test_moe_flops_per_token_count_the_active_experts(fields, monkeypatch):
    """The spec's FLOPs per token (MFU's numerator) count the router, the k experts a token reaches and the
    shared expert: FlopCounterMode's count of one forward and backward, to 2 % (as tests/test_flops.py).
    The experts loop here: FlopCounterMode counts nothing for ``torch._grouped_mm`` (the same products)."""
    from test_flops import counted_per_token

    from parallel4d.models.moe import routing

    monkeypatch.setattr(routing, "grouped_usable", lambda *a: False)

    from parallel4d.config.schema import ModelConfig
    from parallel4d.models.registry import spec

    m = ModelConfig(arch="llama", vocab_size=256, seq_len=32, hidden=64, heads=4, kv_heads=2, layers=2,
                    intermediate_size=96, **fields)
    counted, ours = counted_per_token(m), spec("llama").flops_per_token(m)
    assert abs(ours / counted - 1) <= 0.02, (ours, counted)
    every_expert = spec("llama").flops_per_token(m.model_copy(update={"num_experts_per_tok": m.num_experts}))
    assert every_expert / counted - 1 > 0.02  # counting every expert (the parameters) would be seen


@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_experts_compute_what_the_loop_computes_with_every_gradient(autocast):
    """torch's grouped product (three calls whatever E, no host read) against the loop over experts, on
    the same rows: outputs and the gradients of the rows and of all three stacked weights, bf16 (float32
    tensors under bf16 autocast, or bf16 tensors; both paths cast alike); float32 takes the loop.
    Experts 2 and 5 get no row; the loss is a plain sum (its gradient broadcast, strides 0: what the
    grouped product's backward refuses unless made dense)."""
    from parallel4d.models.moe import routing

    g = torch.Generator().manual_seed(0)
    e, h, width = 6, 16, 8
    counts = torch.tensor([3, 1, 0, 4, 2, 0])
    leaves = [torch.randn(int(counts.sum()), h, generator=g), torch.randn(e, width, h, generator=g),
              torch.randn(e, width, h, generator=g), torch.randn(e, h, width, generator=g)]
    if not autocast:
        leaves = [t.bfloat16() for t in leaves]
    results = []
    for ffn in (routing.grouped_ffn, routing.looped_ffn):
        args = [t.clone().requires_grad_() for t in leaves]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            assert routing.grouped_usable(args[0], args[1], args[3])
            out = ffn(args[0], counts, *args[1:])
        out.sum().backward()
        results.append([out] + [t.grad for t in args])
    for grouped, looped in zip(*results):  # bf16 products both: to bf16's rounding (8 bits)
        torch.testing.assert_close(grouped.float(), looped.float(), rtol=2e-2, atol=5e-2)
    wide = [t.float() for t in leaves]
    assert not routing.grouped_usable(wide[0], wide[1], wide[3])  # float32: the loop


def test_metrics_summary_and_plot_report_the_auxiliary_loss_and_expert_load(tmp_path):
    """A one-process MoE run (2 micro-batches, log every step): each metrics.jsonl record holds the step's
    ``aux_loss`` — the loss minus the dense model's token loss on the same batch before the step, at the
    first step — and ``expert_load`` (E shares summing to 1); summary.json's ``moe`` keeps the logged
    auxiliary losses and the last load; ``parallel4d plot`` draws the router's row."""
    import json

    import torch.nn.functional as F

    from conftest import run_in_this_process
    from parallel4d.data.batches import build_dataset
    from parallel4d.tools.plot import plot_run
    from parallel4d.training.metrics import read_records

    job = {**BASE, "train": {**BASE["train"], "steps": 2, "log_every": 1, "out_dir": str(tmp_path)},
           "optimizer": {**BASE["optimizer"], "warmup_steps": 1},
           "checkpoint": {"enabled": False}}
    summary = run_in_this_process(job, [])
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert len(r["expert_load"]) == 4 and sum(r["expert_load"]) == pytest.approx(1.0)
    cfg = make_config(job)
    model, (x, y) = build_dense(shape_from_config(cfg.model), seed=cfg.train.seed).double(), build_dataset(cfg).batch(0)
    token_loss = sum(F.cross_entropy(model.run(xm)[0].flatten(0, 1), ym.flatten()) for xm, ym in
                     zip(x.chunk(2), y.chunk(2))) / 2
    assert records[0]["aux_loss"] == pytest.approx(records[0]["loss"] - float(token_loss), rel=1e-9)
    moe = json.loads((tmp_path / "summary.json").read_text())["moe"]
    assert moe == summary["moe"] and [s for s, _ in moe["aux_loss"]] == [1, 2]
    assert moe["expert_load"] == records[-1]["expert_load"]
    assert plot_run(tmp_path).exists()


@pytest.mark.parametrize("aux", [True, False], ids=["aux loss", "no aux loss"])
def test_each_moe_layer_counts_its_picks_per_expert_once(aux):
    """The counts per expert serve the dispatch (its sort's block sizes) and the load-balancing loss's
    statistics: one scatter-add per MoE layer and forward, whether the loss is on or not (the layer counted
    once more for the loss than the dispatcher did). BASE: 3 layers, layer 1 dense."""
    from op_count import CountOps

    cfg = make_config({**BASE, "model": {**BASE["model"], "output_router_logits": aux}})
    model = build_dense(shape_from_config(cfg.model), seed=1).double()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with CountOps() as ops:
        _, state = model.run(tokens)
    assert ops.ops["aten.scatter_add.default"] == 2, ops.ops["aten.scatter_add.default"]
    assert sorted(state.routing) == ([0, 2] if aux else [])


def test_the_world_log_line_names_ep_where_experts_are_split():
    """The run's first line named the mesh's axes only: ep (drawn from the data replicas) was missing."""
    import types

    from parallel4d.training.loop import world_line

    mesh = types.SimpleNamespace(world_size=4, shape={"pp": 1, "dp": 2, "sp": 2, "tp_row": 1, "tp_col": 1})
    split = make_config({**BASE, "parallel": {"dp": 2, "sp": 2, "ep": 2}})
    assert world_line(split, mesh, 1_500_000) == ("[parallel4d] world 4 (pp=1, dp=2, sp=2, tp_row=1, tp_col=1, ep=2), "
                                                  "1.50M parameters per rank, 4 steps")
    assert "ep=" not in world_line(make_config({**BASE, "parallel": {"dp": 2, "sp": 2}}), mesh, 1)
