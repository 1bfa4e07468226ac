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
as its base), and the config's refusals (a target the family lacks, a layout other than one process).
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


@pytest.mark.parametrize("case", list(CASES))
def test_lora_equals_peft_in_float64(case, monkeypatch):
    with monkeypatch.context() as mp:
        model, theirs, names = _prepare(case, mp)
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
        tokens, targets = _tokens(1)

        out = theirs(input_ids=tokens, labels=tokens)
        loss = model(tokens, targets)
        d_logits = (model(tokens) - out.logits).abs().max().item()
        d_loss = abs(loss.item() - out.loss.item())
        out.loss.backward()
        loss.backward()
        d_grad = _worst(model, theirs, names, "grad")
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
    """``model.lora.dropout`` in training: the same masks as peft's ``lora_dropout`` when torch's
    generator starts alike (both draw one mask per adapted linear, in the forward's order), so the same
    loss and gradients; a different seed gives another loss (the dropout is on)."""
    with monkeypatch.context() as mp:
        model, theirs, names = _prepare("llama all seven", mp, dropout=0.25)
        tokens, targets = _tokens(2)
        torch.manual_seed(5)
        out = theirs(input_ids=tokens, labels=tokens)
        torch.manual_seed(5)
        loss = model(tokens, targets)
        out.loss.backward()
        loss.backward()
        torch.manual_seed(6)
        other = model(tokens, targets).item()
    print(f"\nlora dropout 0.25: loss {abs(loss.item() - out.loss.item()):.1e}, "
          f"grads {_worst(model, theirs, names, 'grad'):.1e}")
    assert abs(loss.item() - out.loss.item()) < 1e-10 and _worst(model, theirs, names, "grad") < 1e-10
    assert abs(other - loss.item()) > 1e-6


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
    ({"parallel": {"dp": 2}}, ["parallel.dp=2"]),
    ({"parallel": {"tp": 4}}, ["parallel.tp=4"]),
    ({"hetero": {"enabled": True}, "parallel": {"dp": 2, "pp": 2}}, ["parallel.pp=2"]),
    ({"train": {"compile": "blocks"}}, ["train.compile=blocks"]),
    ({"model": {"lora": {"rank": 2, "alpha": 4, "targets": ["q_proj"], "adapter": "somewhere"}}},
     ["model.lora.adapter='somewhere'", "remove model.lora.adapter"]),
    ({"model": {"lora": {"rank": 0, "alpha": 4, "targets": ["q_proj"]}}}, ["model.lora.rank", "1 or more"]),
])
def test_lora_outside_one_process_is_refused_naming_the_field_and_fix(sections, words):
    job = {"model": {"arch": "llama", "hidden": 64, "heads": 4, "lora": {"rank": 2, "alpha": 4, "targets": ["q_proj"]}},
           "data": {"batch_size": 8}}
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value}
    with pytest.raises(ConfigError) as e:
        make_config(job)
    assert all(w in str(e.value) for w in words), str(e.value)
    if "parallel" in sections or "hetero" in sections or "train" in sections:
        assert "runs in one process for now" in str(e.value) and "or remove model.lora" in str(e.value)


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
