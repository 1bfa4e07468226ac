"""Low-rank adapters (``model.lora``, ``parallel4d/models/lora.py``, issue 49's first part) against
``peft.get_peft_model`` over transformers' LlamaForCausalLM, Qwen3ForCausalLM and GPT2LMHeadModel, in
float64, one process.

Each case builds a tiny random transformers model (tests/test_hf.py's), maps its weights into the dense
model through the family's name map, adds our adapters on the config's targets and peft's on the same
``target_modules``, gives the adapters random ``lora_B`` (peft starts it at zero, which would make
every ``lora_A`` gradient zero) and copies ours into peft's through :func:`peft_names`; then compares
logits, loss, every adapter gradient (1e-10) and, after 20 AdamW steps (ours through the project's
optimizer builder), every adapter (1e-9) — the base unchanged bit for bit, with no gradient and no
optimizer state. The float64 patch of transformers is tests/test_hf.py's, with test_moe.py's
``Tensor.float`` that keeps float64 (transformers' own loss of ``labels``).

Also: peft's initialisation (``lora_A`` uniform in ±1/√in, ``lora_B`` zeros: the adapted model starts
as its base), and the config's refusals (a target the family lacks, a layout adapters do not run in yet: 2D tp, hetero,
DeepSpeed, MoE). Dropout on the adapter input is the counter-based draw of ``models/dropout.py`` (a ``lora``
site per adapter): equal to peft with its ``lora_dropout`` modules replaced by those sites. The layouts (data,
ring/Ulysses sequence, Hanayo and zero-bubble pipelines, recomputation, packing, compile) are trained in
tests/test_expert_parallel.py's 4-worker job against one process.
"""

from __future__ import annotations

import math

import pytest

peft = pytest.importorskip("peft")

import torch  # noqa: E402
from test_hf import IMPORTS, _perturb, _tokens, float64_transformers  # noqa: E402

from parallel4d.config.errors import ConfigError  # noqa: E402
from parallel4d.config.hf_fields import model_fields_from_hf  # noqa: E402
from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.models.build import build_dense, shape_from_config  # noqa: E402
from parallel4d.models.context import Draw, ForwardContext  # noqa: E402
from parallel4d.models.dropout import keep_scale, site_key  # noqa: E402
from parallel4d.models.hf import p4d_to_hf  # noqa: E402
from parallel4d.models.lora import LoraShape, adapted_modules, add_adapters, is_adapter, peft_names  # noqa: E402
from parallel4d.optim.optimizer import build_optimizer  # noqa: E402

S = 16
# (transformers model, peft target_modules, rank, alpha, rslora): every family's targets, both scalings
CASES = {
    "llama all seven": ("llama-theta1e4", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], 4, 8.0, False),
    "qwen3 attention, rslora": ("qwen3", ["q_proj", "k_proj", "v_proj", "o_proj"], 4, 6.0, True),
    "gpt2 c_attn c_proj c_fc (Conv1D)": ("gpt2", ["c_attn", "c_proj", "c_fc"], 3, 5.0, False),
}


def _ours_from(ref, targets, rank, alpha, rslora, dropout=0.0):
    """The dense model of ``ref``'s config.json fields and weights, adapted on ``targets``; the config's model."""
    lora = {"rank": rank, "alpha": alpha, "targets": targets, "rslora": rslora, "dropout": dropout}
    m = make_config({"model": {**model_fields_from_hf(ref.config.to_dict()), "seq_len": S, "lora": lora}}).model
    model = build_dense(shape_from_config(m), seed=7).double()
    theirs = dict(ref.state_dict())
    loaded = model.load_state_dict({p4d: (theirs[hf].t() if how == "t" else theirs[hf]).clone()
                                    for p4d, (hf, how) in p4d_to_hf(m).items()}, strict=False)
    tied = ["head.weight"] if m.tie_embeddings else []  # the token table's Parameter itself
    assert loaded.missing_keys == tied and not loaded.unexpected_keys, loaded
    modules = adapted_modules(m)
    add_adapters(model, modules, LoraShape.of(m.lora), seed=3)
    return model, modules


def _peft_of(ref, targets, rank, alpha, rslora, dropout=0.0):
    conv1d = ref.config.model_type == "gpt2"  # peft's setting for transformers' Conv1D (its merge transposes)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout,
                             use_rslora=rslora, fan_in_fan_out=conv1d)
    return peft.get_peft_model(ref, config)


def _adapters_into_peft(model, theirs, modules):
    """Random ``lora_B`` in ours, then every adapter of ours copied into peft's (one to one)."""
    names = peft_names(modules, in_memory=True)
    params = dict(theirs.named_parameters())
    assert set(names.values()) == {n for n, p in params.items() if p.requires_grad}, "not peft's adapters"
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for ours, name in names.items():
            p = model.get_parameter(ours)
            if ours.endswith("lora_B"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            params[name].copy_(p)
    return names


def _worst(model, theirs, names, what):
    """Max |ours − peft's| over every adapter (``what``: "grad" or "data")."""
    params = dict(theirs.named_parameters())
    return max((getattr(model.get_parameter(o), what) - getattr(params[t], what)).abs().max().item()
               for o, t in names.items())


def _widened_float(self):
    return self.to(torch.promote_types(self.dtype, torch.float32))


def _prepare(case, mp, dropout=0.0):
    name, targets, rank, alpha, rslora = CASES[case]
    torch.manual_seed(0)
    ref = IMPORTS[name]().double().train()
    _perturb(ref)
    float64_transformers(mp, ref)
    mp.setattr(torch.Tensor, "float", _widened_float)  # transformers' labels loss upcasts with .float()
    if name != "gpt2":
        ref.set_attn_implementation("sdpa")  # test_hf's: transformers' eager softmax is float32
    model, modules = _ours_from(ref, targets, rank, alpha, rslora, dropout)
    theirs = _peft_of(ref, targets, rank, alpha, rslora, dropout)
    names = _adapters_into_peft(model, theirs, modules)
    return model.train(), theirs.train(), names


def _once(model, theirs, tokens, targets, worst_grad):
    """One forward and backward of ours and peft's on ``tokens``: peft's output and the largest differences
    ``(logits, loss, adapter gradients)`` (``worst_grad()`` after both backwards)."""
    out = theirs(input_ids=tokens, labels=tokens)
    loss = model(tokens, targets)
    d_logits = (model(tokens) - out.logits).abs().max().item()
    d_loss = abs(loss.item() - out.loss.item())
    out.loss.backward()
    loss.backward()
    return out, (d_logits, d_loss, worst_grad())


@pytest.mark.parametrize("case", list(CASES))
def test_lora_equals_peft_in_float64(case, monkeypatch):
    with monkeypatch.context() as mp:
        model, theirs, names = _prepare(case, mp)
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
        tokens, targets = _tokens(1)

        out, (d_logits, d_loss, d_grad) = _once(model, theirs, tokens, targets,
                                                lambda: _worst(model, theirs, names, "grad"))
        assert out.logits.dtype == torch.float64 and out.logits.abs().max() > 1.0
        assert min(model.get_parameter(o).grad.abs().max().item() for o in names) > 0  # every adapter learns
        assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))  # none kept
        assert d_logits < 1e-10 and d_loss < 1e-10 and d_grad < 1e-10, (d_logits, d_loss, d_grad)

        # 20 AdamW steps: ours through the project's optimizer (groups over trainable parameters), peft's plain
        opt_cfg = make_config({"optimizer": {"lr": 1e-2, "weight_decay": 0.1}}).optimizer
        ours_opt = build_optimizer(model.named_parameters(), opt_cfg)
        their_opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2,
                                      weight_decay=0.1)
        for step in range(20):
            tokens, targets = _tokens(100 + step)
            for opt in (ours_opt, their_opt):
                opt.zero_grad()
            theirs(input_ids=tokens, labels=tokens).loss.backward()
            model(tokens, targets).backward()
            for opt in (ours_opt, their_opt):
                opt.step()
        d_params = _worst(model, theirs, names, "data")
        moved = max((model.get_parameter(o) - 0).abs().max().item() for o in names)
        print(f"\n{case}: logits {d_logits:.1e}, loss {d_loss:.1e}, adapter grads {d_grad:.1e}, "
              f"adapters after 20 AdamW steps {d_params:.1e}")
        assert moved > 0 and d_params < 1e-9
        assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not is_adapter(n))
        held = {id(p) for p in ours_opt.state}
        assert held == {id(model.get_parameter(o)) for o in names}, "optimizer state beyond the adapters"


def test_lora_dropout_on_the_adapter_input_as_peft_applies_it(monkeypatch):
    """``model.lora.dropout`` in training: peft with each adapter's ``lora_dropout`` module replaced by our
    site of that adapter (the masks are ours: counter-based, not torch's RNG; where peft applies them is
    peft's — the adapter's input only) gives our loss and adapter gradients (1e-10); another step draws
    other masks (the dropout is on), evaluation none."""
    with monkeypatch.context() as mp:
        model, theirs, names = _prepare("llama all seven", mp, dropout=0.25)
        for ours, peft_name in names.items():
            if ours.endswith(".lora_A"):  # peft's module: its lora_A.default.weight's owner's owner
                module = theirs.get_submodule(peft_name[: -len(".lora_A.default.weight")])
                module.lora_dropout["default"] = model.get_submodule(ours[: -len(".lora_A")]).lora_dropout
        tokens, targets = _tokens(2)
        with model.context.drawing(Draw(step=4)):
            out = theirs(input_ids=tokens, labels=tokens)
        loss = model(tokens, targets, step=4)
        out.loss.backward()
        loss.backward()
        other = model(tokens, targets, step=5).item()
        evaluated = model.eval()(tokens, targets, step=4).item()
        plain = theirs.eval()(input_ids=tokens, labels=tokens).loss.item()
    d_loss, d_grad = abs(loss.item() - out.loss.item()), _worst(model, theirs, names, "grad")
    print(f"\nlora dropout 0.25: loss {d_loss:.1e}, grads {d_grad:.1e}")
    assert d_loss < 1e-10 and d_grad < 1e-10
    assert abs(other - loss.item()) > 1e-6 and abs(evaluated - loss.item()) > 1e-6
    assert abs(evaluated - plain) < 1e-10


def test_lora_dropout_masks_the_adapter_input_by_dense_element_and_leaves_the_base_input():
    """An adapted linear in training: base(x) + scaling·B·A·(x ⊙ keep), keep the ``lora`` site's mask of
    each dense element (sample, global position, input feature; :func:`~parallel4d.models.dropout.keep_scale`
    of its stage and part), not torch's RNG (a reseeded torch draws the same); a shard of the batch (rows
    2..3 as micro-batch or data replica, positions 4..11 as a sequence shard) gets the whole's slice."""
    m = make_config({"model": {"arch": "llama", "hidden": 32, "heads": 4, "layers": 2, "seq_len": 16,
                               "lora": {"rank": 4, "alpha": 8, "dropout": 0.3, "targets": ["q_proj", "v_proj"]}},
                     "train": {"seed": 9}}).model
    model = build_dense(shape_from_config(m), seed=9).double().train()
    add_adapters(model, adapted_modules(m), LoraShape.of(m.lora), seed=9)
    v = model.get_submodule("blocks.1.self_attn.v_proj")  # stage 2, the second of the stage's adapters
    with torch.no_grad():
        v.lora_B.copy_(torch.randn(v.lora_B.shape, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(4, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    keep = keep_scale(site_key(9, 3, 2, "lora", 2), 0.3, [torch.arange(4), torch.arange(16), torch.arange(32)],
                      torch.float64)
    want = x @ v.weight.T + ((x * keep) @ v.lora_A.T @ v.lora_B.T) * v.scaling
    with torch.no_grad(), model.context.drawing(Draw(step=3)):
        torch.manual_seed(0)
        got = v(x)
        torch.manual_seed(1)
        again = v(x)
    assert v.lora_dropout.stage == 2 and v.lora_dropout.part == 2 and 0 < float((keep == 0).double().mean()) < 0.5
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, again)
    shard = ForwardContext(9, positions=torch.arange(4, 12))
    v.lora_dropout.context = shard
    with torch.no_grad(), shard.drawing(Draw(step=3, first_row=2)):
        part = v(x[2:4, 4:12])
    torch.testing.assert_close(part, want[2:4, 4:12], rtol=1e-12, atol=1e-12)


def test_lora_starts_as_peft_initialises_it_and_scales_by_alpha_over_rank():
    """``lora_A`` uniform in ±1/√in (kaiming_uniform(a=√5)), ``lora_B`` zero (the adapted model is its
    base), the product scaled alpha/r (rsLoRA alpha/√r); only the adapters trainable."""
    m = make_config({"model": {"arch": "llama", "hidden": 64, "heads": 4, "layers": 1,
                               "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "down_proj"]}}}).model
    model = build_dense(shape_from_config(m), seed=1)
    tokens = torch.randint(0, m.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    before = model(tokens)
    add_adapters(model, adapted_modules(m), LoraShape.of(m.lora))
    q = model.get_submodule("blocks.0.self_attn.q_proj")
    down = model.get_submodule("blocks.0.mlp.down_proj")
    bound = 1 / math.sqrt(64)
    assert q.lora_A.shape == (8, 64) and q.lora_B.shape == (64, 8) and down.lora_A.shape == (8, m.mlp_width)
    assert 0.8 * bound < q.lora_A.abs().max() <= bound and not q.lora_B.any()
    assert torch.equal(model(tokens), before)
    assert q.scaling == 2.0 and LoraShape(8, 16.0, rslora=True).scaling == 16 / math.sqrt(8)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["blocks.0.mlp.down_proj.lora_A", "blocks.0.mlp.down_proj.lora_B",
                         "blocks.0.self_attn.q_proj.lora_A", "blocks.0.self_attn.q_proj.lora_B"]


@pytest.mark.parametrize("arch, target, words", [
    ("llama", "c_attn", ["model.lora.targets names 'c_attn'", "model.arch=llama", "q_proj, k_proj"]),
    ("gpt2", "q_proj", ["model.lora.targets names 'q_proj'", "model.arch=gpt2", "c_attn, c_proj, c_fc"]),
    ("llama", "qproj", ["did you mean 'q_proj'"]),
])
def test_lora_target_the_family_lacks_is_refused(arch, target, words):
    with pytest.raises(ConfigError) as e:
        make_config({"model": {"arch": arch, "lora": {"rank": 2, "alpha": 4, "targets": [target]}}})
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("sections, words", [
    ({"deepspeed": {"zero_optimization": {"stage": 1}}}, ["with a deepspeed: section"]),
    ({"model": {"lora": {"rank": 2, "alpha": 4, "targets": ["q_proj"], "adapter": "somewhere"}}},
     ["model.lora.adapter='somewhere'", "cannot read", "point model.lora.adapter at a directory peft's"]),
    ({"model": {"lora": {"rank": 0, "alpha": 4, "targets": ["q_proj"]}}}, ["model.lora.rank", "1 or more"]),
])
def test_lora_in_a_layout_it_does_not_run_in_yet_is_refused_naming_the_field_and_fix(sections, words):
    with pytest.raises(ConfigError) as e:
        make_config(_lora_job(sections))
    assert all(w in str(e.value) for w in words), str(e.value)
    if "deepspeed" in sections:
        assert "remove the deepspeed: section or model.lora" in str(e.value), str(e.value)


@pytest.mark.parametrize("sections", [
    {"parallel": {"dp": 2, "sp": 2}, "train": {"activation_checkpointing": "blocks"}},
    {"parallel": {"sp": 2}, "sequence": {"ulysses": 2}},
    {"parallel": {"pp": 2}, "pipeline": {"schedule": "zb_h1", "microbatches": 2}},
    {"parallel": {"pp": 2}, "pipeline": {"schedule": "hanayo", "waves": 1, "microbatches": 2}},
    {"train": {"compile": "blocks"}},
    {"parallel": {"tp": 4}, "model": {"lora": {"rank": 2, "alpha": 4, "targets": ["q_proj"], "dropout": 0.1}}},
])
def test_lora_is_accepted_with_data_sequence_pipeline_and_2d_parallelism_and_compile(sections):
    make_config(_lora_job(sections))


def _lora_job(sections: dict) -> dict:
    """A small llama job with adapters on ``q_proj``; ``sections`` merged into its sections."""
    job = {"model": {"arch": "llama", "hidden": 64, "heads": 4, "lora": {"rank": 2, "alpha": 4, "targets": ["q_proj"]}},
           "data": {"batch_size": 8}}
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value}
    return job


def test_engine_trains_only_the_adapters_as_one_process_does(single_rank):
    """``model.lora`` through compose() (one process, two micro-batches, recomputed blocks, warm-up, cosine
    decay, clipping): the losses (1e-10) and every parameter (1e-9) equal the dense model's with the same
    adapters (seeded ``train.seed``) trained by the same optimizer; the base does not move, and the store
    keeps gradients and optimizer state for the adapters only."""
    from test_llama import BASE, _job, dense_run, train_layouts

    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    lora = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}
    job = _job({}, {"microbatches": 2}, model={"lora": lora},
               train={**BASE["train"], "activation_checkpointing": "blocks"})
    cfg = make_config(job)
    want_losses, want = dense_run(job, prepare=lambda m: add_adapters(m, adapted_modules(cfg.model),
                                                                      LoraShape.of(cfg.model.lora), cfg.train.seed))
    losses, pieces = train_layouts({"lora": job})["lora"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-10, atol=0)
    assert set(pieces) == set(want)
    for dense, [(_, t)] in pieces.items():
        torch.testing.assert_close(t, want[dense], rtol=1e-9, atol=1e-12, msg=lambda m, d=dense: f"{d}: {m}")
    base = build_dense(shape_from_config(cfg.model), seed=cfg.train.seed).double().state_dict()
    assert all(torch.equal(pieces[n][0][1], base[n]) for n in want if not is_adapter(n))
    assert any(not torch.equal(pieces[n][0][1], 0 * pieces[n][0][1]) for n in want if n.endswith("lora_B"))

    engine = compose(cfg, init_mesh())
    adapters = {id(p) for n, p in engine.store.model.named_parameters() if is_adapter(n)}
    assert len(adapters) == 2 * 3 * cfg.model.layers
    assert {id(p) for p in engine.store.params} == adapters
    assert {id(p) for g in engine.store.optimizer.param_groups for p in g["params"]} == adapters
    engine.close()


def test_compiled_blocks_with_adapter_dropout_train_as_one_process(single_rank, monkeypatch):
    """``train.compile: blocks`` (dynamo and AOTAutograd: test_compile's seam) with adapter dropout 0.1 through
    compose() in one process: the losses (1e-10) and every parameter (1e-9) are the eager dense model's with the
    same adapters and masks (each adapter's site a graph break, read eagerly every micro-batch)."""
    from test_llama import BASE, _job, dense_run, train_layouts

    from parallel4d.engine import compile as compile_module

    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    lora = {"rank": 4, "alpha": 8, "targets": ["q_proj", "up_proj"], "dropout": 0.1}
    job = _job({}, {"microbatches": 2}, model={"layers": 1, "lora": lora},
               train={**BASE["train"], "steps": 3, "compile": "blocks"})
    cfg = make_config(job)
    want_losses, want = dense_run(job, prepare=lambda m: add_adapters(m, adapted_modules(cfg.model),
                                                                      LoraShape.of(cfg.model.lora), cfg.train.seed))
    losses, pieces = train_layouts({"compiled": job})["compiled"]
    assert all(want[n].abs().max() > 0 for n in want if n.endswith("lora_B"))  # the adapters learnt
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-10, atol=0)
    assert set(pieces) == set(want)
    for dense, [(_, t)] in pieces.items():
        torch.testing.assert_close(t, want[dense], rtol=1e-9, atol=1e-12, msg=lambda m, d=dense: f"{d}: {m}")


# --- MoE layers: the routed experts' adapters as peft 0.21 puts them on transformers 5's fused experts --------
MOE_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (test_moe's transformers model, targets, rank, alpha, rslora, peft's target_parameters beside target_modules)
MOE_CASES = {
    # what a peft user writes: target_modules only; peft's conversion for Qwen3-MoE puts gate_proj + up_proj on
    # experts.gate_up_proj (rank 2r, alpha 2·alpha) and down_proj on experts.down_proj
    "qwen3_moe all seven, peft's target_modules": ("qwen3_moe top-2 of 4", MOE_ALL, 2, 6.0, False, None),
    # peft leaves Qwen2-MoE's routed experts alone for these names (no conversion for its type): the same adapters
    # asked for explicitly beside the shared expert's and the dense layer's linears
    "qwen2_moe shared expert, dense layer 0, rslora, target_parameters": (
        "qwen2_moe shared expert, mlp_only_layers=[0]", ["v_proj", "gate_proj", "up_proj", "down_proj"], 3, 5.0,
        True, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "qwen3_moe experts' gate and up only": ("qwen3_moe top-2 of 4", ["gate_proj", "up_proj"], 2, 4.0, False, None),
}


def _moe_prepare(case, mp):
    """test_moe's transformers model (float64, perturbed), ours from it with adapters, peft's over it, and
    ``{our adapter: (peft's parameter, ours → peft's layout)}`` after copying ours (random ``lora_B``) in."""
    import test_moe
    from parallel4d.models.lora import expert_peft_names, expert_tensor_to_peft

    model_case, targets, rank, alpha, rslora, parameters = MOE_CASES[case]
    test_moe.float64_transformers(mp)
    torch.manual_seed(0)
    ref = test_moe.CASES[model_case]().double().train()
    test_moe._perturb(ref)
    model, _ = test_moe._ours_from(ref)
    lora = {"rank": rank, "alpha": alpha, "targets": targets, "rslora": rslora}
    m = make_config({"model": {**model_fields_from_hf(ref.config.to_dict()), "seq_len": test_moe.S,
                               "lora": lora}}).model
    modules = adapted_modules(m)
    add_adapters(model, modules, LoraShape.of(m.lora), seed=3)
    config = dict(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora)
    if parameters:  # the fused gate_up adapter's rank and alpha doubled, as peft's own conversion writes them
        config = dict(config, target_modules=[t for t in targets if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                                              ] + ["gate_proj", "up_proj", "down_proj"],
                      target_parameters=parameters, rank_pattern={r".*\.gate_up_proj": 2 * rank},
                      alpha_pattern={r".*\.gate_up_proj": 2 * alpha})
    theirs = peft.get_peft_model(ref, peft.LoraConfig(**config)).train()
    params = dict(theirs.named_parameters())
    names = {o: (t, lambda part, x: x) for o, t in peft_names(modules, in_memory=True).items()}
    names.update({o: (t, expert_tensor_to_peft) for o, t in expert_peft_names(m, in_memory=True).items()})
    assert set(t for t, _ in names.values()) == {n for n, p in params.items() if p.requires_grad}, "not peft's"
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for ours, (name, layout) in names.items():
            p = model.get_parameter(ours)
            if ours.endswith("lora_B"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            params[name].copy_(layout(ours.rsplit(".", 1)[-1], p))
    return model.train(), theirs, names


def _moe_worst(model, theirs, names, what):
    params = dict(theirs.named_parameters())
    return max((layout(o.rsplit(".", 1)[-1], getattr(model.get_parameter(o), what)) - getattr(params[t], what))
               .abs().max().item() for o, (t, layout) in names.items())


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_lora_on_moe_layers_equals_peft_in_float64(case, monkeypatch):
    """Attention, the shared expert's and dense layers' linears, and every routed expert's adapter (stacked
    ``[E, r, in]`` / ``[E, out, r]``, peft's ``[E·r, in]`` / ``[out, r·E]``): logits, loss (with the
    load-balancing term), every adapter gradient (1e-10) and every adapter after 20 AdamW steps (1e-9)."""
    import test_moe

    with monkeypatch.context() as mp:
        model, theirs, names = _moe_prepare(case, mp)
        tokens, targets = test_moe._batch(1)
        _, (d_logits, d_loss, d_grad) = _once(model, theirs, tokens, targets,
                                              lambda: _moe_worst(model, theirs, names, "grad"))
        assert min(model.get_parameter(o).grad.abs().max().item() for o in names) > 0  # every adapter learns
        assert any(".experts.adapters." in o for o in names)
        assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))
        assert d_logits < 1e-10 and d_loss < 1e-10 and d_grad < 1e-10, (d_logits, d_loss, d_grad)
        opt_cfg = make_config({"optimizer": {"lr": 1e-2, "weight_decay": 0.1}}).optimizer
        opts = [build_optimizer(model.named_parameters(), opt_cfg),
                torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)]
        for step in range(20):
            tokens, targets = test_moe._batch(100 + step)
            for opt in opts:
                opt.zero_grad()
            theirs(input_ids=tokens, labels=tokens).loss.backward()
            model(tokens, targets).backward()
            for opt in opts:
                opt.step()
        d_params = _moe_worst(model, theirs, names, "data")
    print(f"\n{case}: logits {d_logits:.1e}, loss {d_loss:.1e}, adapter grads {d_grad:.1e}, "
          f"adapters after 20 AdamW steps {d_params:.1e}")
    assert d_params < 1e-9


MOE_MODEL = {"arch": "llama", "hidden": 64, "heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}


@pytest.mark.parametrize("lora, sections, words", [
    ({"targets": ["gate_proj", "down_proj"]}, {}, ["names 'gate_proj' but not 'up_proj'", "add 'up_proj'"]),
    ({"targets": ["q_proj", "down_proj"], "dropout": 0.1}, {},
     ["model.lora.dropout=0.1 with the experts targeted (down_proj)", "set model.lora.dropout=0"]),
])
def test_lora_on_experts_where_peft_or_the_layout_cannot_is_refused(lora, sections, words):
    """The routed experts' adapters: gate_proj and up_proj together (fused), no dropout (peft refuses it
    there)."""
    job = {"model": {**MOE_MODEL, "lora": {"rank": 2, "alpha": 4, **lora}}, "data": {"batch_size": 8}, **sections}
    with pytest.raises(ConfigError) as e:
        make_config(job)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("sections", [{"parallel": {"dp": 2, "ep": 2}}, {"parallel": {"tp": 4}},
                                      {"parallel": {"dp": 2, "ep": 2}, "hetero": {"enabled": True}}])
def test_lora_on_an_moe_model_at_ep_2_on_the_2d_grid_or_under_hetero_is_accepted(sections):
    cfg = make_config({"model": {**MOE_MODEL, "lora": {"rank": 2, "alpha": 4, "targets": MOE_ALL}},
                       "data": {"batch_size": 8}, **sections})
    assert cfg.model.lora.targets == MOE_ALL and cfg.hetero.enabled == ("hetero" in sections)


@pytest.mark.parametrize("model, targets", [
    ({"arch": "llama", "hidden": 32, "heads": 4, "kv_heads": 2, "layers": 2, "intermediate_size": 48}, MOE_ALL),
    ({"arch": "gpt2", "hidden": 32, "heads": 4, "layers": 2}, ["c_attn", "c_proj", "c_fc"]),
    ({**MOE_MODEL, "layers": 3, "mlp_only_layers": [0], "shared_expert_intermediate_size": 24, "intermediate_size": 40},
     MOE_ALL),
    ({**MOE_MODEL, "layers": 2, "decoder_sparse_step": 2}, ["q_proj", "down_proj"]),
])
def test_the_configs_adapter_count_is_the_models(model, targets):
    """``config/rules/lora.adapter_parameters`` (torch-free: launch's memory estimate and plan) counts the
    adapters the model holds once they are added: the dense ones (attention, dense layers' MLPs, the shared
    expert) and the routed experts' (what parallel.ep splits) apart."""
    from parallel4d.config.rules.lora import adapter_parameters
    from parallel4d.engine.model import model_shape
    from parallel4d.models.build import build_dense

    cfg = make_config({"model": {**model, "lora": {"rank": 3, "alpha": 6, "targets": targets}},
                       "data": {"batch_size": 8}})
    built = build_dense(model_shape(cfg), seed=0)
    add_adapters(built, adapted_modules(cfg.model), LoraShape.of(cfg.model.lora))
    counted = {"dense": 0, "experts": 0}
    for name, p in built.named_parameters():
        if is_adapter(name):
            counted["experts" if ".experts.adapters." in name else "dense"] += p.numel()
    assert adapter_parameters(cfg.model) == (counted["dense"], counted["experts"]), counted


def test_a_rank_holding_no_adapter_builds_an_optimizer_over_nothing():
    """A LoRA pipeline rank may hold only the frozen head (the layout fuzzer's gpt2 of 1 layer at pp=2: rank 1
    holds [head]): its optimizer is one empty group that steps on nothing, not torch's "empty parameter list"."""
    head = torch.nn.Linear(4, 4)
    head.requires_grad_(False)
    opt = build_optimizer(head.named_parameters(), make_config({}).optimizer)
    assert [g["params"] for g in opt.param_groups] == [[]]
    opt.step()
