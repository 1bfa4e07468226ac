"""LoRA adapters in and out as ``peft`` users move them (issue 49, part 2; ``checkpoint/adapters.py``,
``checkpoint/lora_base.py``, ``config/peft_adapter.py``), in float64, one process (in-process engines).

Each case makes a tiny random transformers model (tests/test_hf.py's), saves it as the base
(``save_pretrained``), wraps it with ``peft.get_peft_model``, gives the adapters random ``lora_B`` and saves
the adapter (``PeftModel.save_pretrained``). Then:

* ``model.lora: {adapter: DIR}`` alone fills rank/alpha/targets/rslora from the adapter and the engine starts
  from its weights: the engine's loss and the adapted model's logits equal peft's (1e-10); a field that
  disagrees, or an adapter feature the model lacks, is refused by name;
* a checkpoint of that job holds the adapters only and names the base (``lora_base.json``); ``export``
  writes the merged model, which transformers loads to peft's logits, and ``--adapter`` peft's adapter
  directory, which ``PeftModel.from_pretrained`` loads onto the original base to the same logits (llama and
  GPT-2's Conv1D); ``generate`` on the checkpoint picks the merged export's greedy tokens in transformers;
* a run of 4 steps equals 2 steps + a resume for 2 (losses and adapters); a resume on another base is refused
  naming both bases;
* MoE (Qwen3-MoE, Mixtral): the routed experts' adapters as peft 0.21 saves them for transformers 5's fused experts
  (``target_parameters``, the fused gate_up_proj's rank and alpha doubled) start the job, are checkpointed and
  resumed, merged into each expert's weights by export (transformers' logits = peft's), written back by
  ``--adapter`` as peft writes them, and read as an expert-parallel rank's slices; what the dense model cannot be
  is refused by key, and ``--adapter`` where peft would load the adapter otherwise.
"""

from __future__ import annotations

import json

import pytest

peft = pytest.importorskip("peft")

import torch  # noqa: E402
from test_hf import IMPORTS, B, S, _perturb, _tokens, float64_transformers  # noqa: E402

from parallel4d.checkpoint.export import export  # noqa: E402
from parallel4d.checkpoint.failures import UnusableCheckpoint  # noqa: E402
from parallel4d.checkpoint.lora_base import BASE_FILE  # noqa: E402
from parallel4d.config.errors import ConfigError  # noqa: E402
from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.models.build import build_dense, shape_from_config  # noqa: E402
from parallel4d.models.lora import LoraShape, adapted_modules, add_adapters, is_adapter  # noqa: E402

# (transformers model, peft target_modules, rank, alpha, rslora)
CASES = {
    "llama": ("llama-theta1e4", ["q_proj", "v_proj", "down_proj"], 4, 8.0, False),
    "gpt2 (Conv1D)": ("gpt2", ["c_attn", "c_proj", "c_fc"], 3, 5.0, True),
}


def _widened_float(self):
    return self.to(torch.promote_types(self.dtype, torch.float32))


def _patched(mp, model):
    """test_lora's float64 transformers (RMSNorm, rotary, the loss's ``.float()``)."""
    float64_transformers(mp, model)
    mp.setattr(torch.Tensor, "float", _widened_float)
    if model.config.model_type != "gpt2":
        model.set_attn_implementation("sdpa")
    return model


def _made_by_peft(case, tmp_path, mp):
    """``(peft model, base dir, adapter dir)``: the base saved before peft wraps it, random adapters saved."""
    name, targets, rank, alpha, rslora = CASES[case]
    torch.manual_seed(0)
    ref = IMPORTS[name]().double()
    _perturb(ref)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    ref.save_pretrained(base_dir)
    _patched(mp, ref)
    theirs = peft.get_peft_model(ref, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                      use_rslora=rslora, fan_in_fan_out=name == "gpt2"))
    return _saved_with_random_b(theirs, base_dir, adapter_dir)


def _saved_with_random_b(theirs, base_dir, adapter_dir):
    """peft's model ``theirs`` with every ``lora_B`` drawn (seeded; peft starts them at zero, which would
    hide the adapter) and saved to ``adapter_dir``: ``(theirs in eval mode, base_dir, adapter_dir)``."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    theirs.save_pretrained(adapter_dir)
    return theirs.eval(), base_dir, adapter_dir


def _job(base_dir, adapter_dir, tmp_path, **lora):
    return {"model": {"pretrained": str(base_dir), "seq_len": S, "lora": {"adapter": str(adapter_dir), **lora}},
            "data": {"batch_size": B}, "train": {"dtype": "float64", "steps": 4, "out_dir": str(tmp_path / "run")},
            "optimizer": {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.1}}


def _engine(cfg):
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    return compose(cfg, init_mesh())


def _adapted_dense(cfg, engine):
    """The dense model with the engine's parameters (its base and adapters), float64, eval."""
    model = build_dense(shape_from_config(cfg.model), seed=0).double()
    add_adapters(model, adapted_modules(cfg.model), LoraShape.of(cfg.model.lora))
    state = {engine.dense[n][0]: p.detach() for n, p in engine.store.model.named_parameters()}
    if cfg.model.tie_embeddings:
        state["head.weight"] = state["embed.tok.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def _peft_logits(theirs, tokens):
    with torch.no_grad():
        return theirs(input_ids=tokens).logits


@pytest.mark.parametrize("case", ["llama"])
def test_peft_adapter_dir_fills_model_lora_and_starts_the_adapters_at_its_weights(case, tmp_path, monkeypatch,
                                                                                   single_rank):
    with monkeypatch.context() as mp:
        theirs, base_dir, adapter_dir = _made_by_peft(case, tmp_path, mp)
        cfg = make_config(_job(base_dir, adapter_dir, tmp_path))
        lora = cfg.model.lora
        assert (lora.rank, lora.alpha, sorted(lora.targets), lora.rslora) == (4, 8.0, ["down_proj", "q_proj",
                                                                                     "v_proj"], False)
        engine = _engine(cfg)
        tokens, targets = _tokens(3)
        with torch.no_grad():
            ours = _adapted_dense(cfg, engine)(tokens)
            loss = float(engine.evaluate(tokens, targets))
            want = theirs(input_ids=tokens, labels=tokens)
        engine.close()
    d_logits = (ours - want.logits).abs().max().item()
    print(f"\nadapter dir → engine: logits {d_logits:.1e}, loss {abs(loss - want.loss.item()):.1e}")
    assert want.logits.dtype == torch.float64 and d_logits < 1e-10 and abs(loss - want.loss.item()) < 1e-10


def test_adapter_dir_that_disagrees_or_uses_what_lora_lacks_is_refused_by_field(tmp_path, monkeypatch):
    from parallel4d.launcher.preflight import check_job

    with monkeypatch.context() as mp:
        _, base_dir, adapter_dir = _made_by_peft("llama", tmp_path, mp)
    with pytest.raises(ConfigError) as e:
        make_config(_job(base_dir, adapter_dir, tmp_path, rank=8, targets=["v_proj", "q_proj", "down_proj"]))
    said = str(e.value)
    assert "model.lora.rank=8" in said and "has r=4" in said and "remove model.lora.rank" in said, said
    assert "model.lora.targets" not in said, said  # the same names in another order agree
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))  # not its tensors' rank
    with pytest.raises(ConfigError) as e:
        check_job(make_config(_job(base_dir, adapter_dir, tmp_path)), local=False)  # before any worker starts
    said = str(e.value)
    assert "model.lora.adapter=" in said and "lora_A.weight' is [4, " in said and "this model's is [2, " in said, said
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConfigError) as e:
        make_config(_job(base_dir, adapter_dir, tmp_path))
    assert "use_dora=True (DoRA" in str(e.value) and "model.lora.adapter=" in str(e.value), str(e.value)


@pytest.mark.parametrize("case", list(CASES))
def test_lora_checkpoint_exports_merged_and_peft_adapter_and_generates(case, tmp_path, monkeypatch, single_rank):
    """The checkpoint (adapters only, base named) → export merged (transformers' logits = peft's), export
    --adapter (PeftModel.from_pretrained on the original base = peft's), generate (= greedy tokens of the
    merged export in transformers)."""
    from transformers import AutoModelForCausalLM

    from parallel4d.checkpoint import dcp as checkpoint
    from parallel4d.tools.cli import main
    from parallel4d.tools.generate import load_model, sample
    from parallel4d.training.checkpoints import save_checkpoint

    with monkeypatch.context() as mp:
        theirs, base_dir, adapter_dir = _made_by_peft(case, tmp_path, mp)
        cfg = make_config(_job(base_dir, adapter_dir, tmp_path))
        engine = _engine(cfg)
        saved = save_checkpoint(engine, cfg)
        engine.close()
        keys = checkpoint.dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata
        adapters = _names(cfg)
        assert {k for k in keys if k.startswith("model.")} == {f"model.{n}" for n in adapters}
        assert {k for k in keys if k.startswith("optim.")} == {f"optim.{n}.{s}" for n in adapters
                                                               for s in ("step", "exp_avg", "exp_avg_sq")}
        record = json.loads((saved / BASE_FILE).read_text())
        assert record["pretrained"] == str(base_dir.resolve()) and len(record["fingerprint"]) == 64

        tokens, _ = _tokens(4)
        want = _peft_logits(theirs, tokens)
        merged = export(saved, tmp_path / "merged")
        loaded = _patched(mp, AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64)).eval()
        d_merged = (_peft_logits(loaded, tokens) - want).abs().max().item()

        only = tmp_path / "adapter_out"  # through the command line, as a user types it
        assert main(["export", str(saved), str(only), "--adapter"]) == 0
        assert sorted(p.name for p in only.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        base = _patched(mp, AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64))
        reloaded = peft.PeftModel.from_pretrained(base, only).eval()
        d_adapter = (_peft_logits(reloaded, tokens) - want).abs().max().item()

        model, _ = load_model(saved)
        prompt = tokens[:1, :5]

        moved = base_dir.rename(tmp_path / "moved_base")  # the base named by the checkpoint has gone elsewhere
        with pytest.raises(ConfigError) as e:
            export(saved, tmp_path / "merged_again")
        assert "which is not there now" in str(e.value) and "--base DIR" in str(e.value), str(e.value)
        again = export(saved, tmp_path / "merged_again", base=moved)
        assert (again / "model.safetensors").read_bytes() == (merged / "model.safetensors").read_bytes()
        with torch.no_grad():
            assert torch.equal(load_model(saved, base=moved)[0](prompt), model(prompt))
        ours = sample(model, prompt, 8, temperature=0.0, top_k=None, seed=0)
        merged32 = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        theirs_tokens = merged32.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    print(f"\n{case}: merged export {d_merged:.1e}, --adapter export {d_adapter:.1e}, generate {ours.tolist()}")
    assert d_merged < 1e-10 and d_adapter < 1e-10, (d_merged, d_adapter)
    assert ours.tolist() == theirs_tokens.tolist()


def _names(cfg):
    return {f"{m}.{p}" for m in adapted_modules(cfg.model) for p in ("lora_A", "lora_B")}


def test_lora_resume_equals_one_run_and_refuses_another_base(tmp_path, monkeypatch, single_rank):
    """4 steps = 2 steps, a checkpoint (adapters and their optimizer state only), a fresh engine resumed
    from it for 2 more: losses and adapters equal bit for bit; a resume on another base is refused naming both."""
    from parallel4d.checkpoint.resume import check_resume_base
    from parallel4d.training.checkpoints import load_checkpoint, save_checkpoint

    with monkeypatch.context() as mp:
        _, base_dir, adapter_dir = _made_by_peft("llama", tmp_path, mp)
    cfg = make_config(_job(base_dir, adapter_dir, tmp_path))
    batches = [_tokens(20 + i) for i in range(4)]

    def run(engine, steps):
        return [float(engine.train_step(*batches[s])) for s in steps]

    whole = _engine(cfg)
    want_losses, want = run(whole, range(4)), {n: p.detach().clone() for n, p in whole.store.model.named_parameters()}
    whole.close()
    first = _engine(cfg)
    losses = run(first, range(2))
    saved = save_checkpoint(first, cfg)
    first.close()
    second = _engine(cfg)
    assert load_checkpoint(second, cfg.checkpoint_dir) == saved and second.step == 2
    losses += run(second, range(2, 4))
    got = {n: p.detach() for n, p in second.store.model.named_parameters()}
    second.close()
    assert losses == want_losses
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    assert any(is_adapter(n) and n.endswith("lora_A") and not torch.equal(got[n], 0 * got[n]) for n in got)

    other = tmp_path / "other_base"  # the same architecture, other weights
    ref = IMPORTS["llama-theta1e4"]().double()
    _perturb(ref, seed=5)
    ref.save_pretrained(other)
    moved = make_config({**_job(other, adapter_dir, tmp_path), "train": {**_job(other, adapter_dir, tmp_path)["train"],
                                                                          "resume": True}})
    with pytest.raises(ConfigError) as e:
        check_resume_base(moved.checkpoint_dir, moved)
    said = str(e.value)
    assert str(base_dir.resolve()) in said and str(other.resolve()) in said and "model.pretrained" in said, said
    third = _engine(moved)
    with pytest.raises(UnusableCheckpoint):
        load_checkpoint(third, moved.checkpoint_dir)
    third.close()


def test_export_adapter_of_a_checkpoint_without_lora_is_refused(tmp_path, single_rank):
    from parallel4d.training.checkpoints import save_checkpoint

    cfg = make_config({"model": {"arch": "llama", "vocab_size": 64, "seq_len": 8, "hidden": 16, "heads": 2,
                                 "layers": 1}, "data": {"batch_size": 2}, "train": {"out_dir": str(tmp_path / "run")}})
    engine = _engine(cfg)
    saved = save_checkpoint(engine, cfg)
    engine.close()
    assert not (saved / BASE_FILE).exists()  # only a LoRA job's checkpoints name a base
    with pytest.raises(ConfigError) as e:
        export(saved, tmp_path / "adapter", adapter=True)
    assert "not a LoRA job's checkpoint" in str(e.value) and "without --adapter" in str(e.value), str(e.value)


# --- MoE: the routed experts' adapters as peft 0.21 saves them for transformers 5's fused experts ------------
MOE_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# test_moe's model → the target_modules a peft user writes for every linear of it (Mixtral's experts: w1, w3, w2)
MOE_PEFT = {"qwen3_moe top-2 of 4": MOE_ALL, "mixtral top-2 of 4": ["q_proj", "k_proj", "v_proj", "o_proj", "w1",
                                                                    "w2", "w3"]}


def _moe_made_by_peft(tmp_path, mp, case="qwen3_moe top-2 of 4"):
    """``(peft model, base dir, adapter dir)`` of test_moe's ``case`` (float64, perturbed) with peft's LoRA on
    every linear as a peft user names them (:data:`MOE_PEFT`; its conversion puts the experts' on
    ``experts.gate_up_proj`` at rank 2r, alpha 2·alpha, and ``experts.down_proj``), every ``lora_B`` random, the
    adapter saved."""
    import test_moe

    test_moe.float64_transformers(mp)
    torch.manual_seed(0)
    ref = test_moe.CASES[case]().double()
    test_moe._perturb(ref)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    ref.save_pretrained(base_dir)
    theirs = peft.get_peft_model(ref, peft.LoraConfig(r=2, lora_alpha=6.0, target_modules=MOE_PEFT[case]))
    return _saved_with_random_b(theirs, base_dir, adapter_dir)


def _moe_job(base_dir, adapter_dir, tmp_path):
    import test_moe

    return {"model": {"pretrained": str(base_dir), "seq_len": test_moe.S, "lora": {"adapter": str(adapter_dir)}},
            "data": {"batch_size": test_moe.B}, "train": {"dtype": "float64", "out_dir": str(tmp_path / "run")}}


@pytest.mark.parametrize("case", list(MOE_PEFT))
def test_moe_lora_checkpoint_exports_merged_and_peft_adapter_resumes_and_generates(case, tmp_path, monkeypatch,
                                                                                     single_rank):
    """Qwen3-MoE and Mixtral with peft's adapters on attention and every routed expert: the adapter directory peft saved
    starts the job (its loss = peft's); the checkpoint holds the experts' adapters and resumes; export merged
    (each expert's weights plus its scaled product: transformers' logits = peft's), --adapter (peft's format,
    target_parameters: PeftModel.from_pretrained on the base = peft's), generate (= the merged model's greedy
    tokens in transformers)."""
    import test_moe
    from transformers import AutoModelForCausalLM

    from parallel4d.checkpoint import dcp as checkpoint
    from parallel4d.models.lora import adapter_names
    from parallel4d.tools.cli import main
    from parallel4d.tools.generate import load_model, sample
    from parallel4d.training.checkpoints import load_checkpoint, save_checkpoint

    with monkeypatch.context() as mp:
        theirs, base_dir, adapter_dir = _moe_made_by_peft(tmp_path, mp, case)
        cfg = make_config(_moe_job(base_dir, adapter_dir, tmp_path))
        assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.targets) == (2, 6.0, sorted(MOE_ALL))
        tokens, targets = test_moe._batch(3)
        want = theirs(input_ids=tokens, labels=tokens)
        engine = _engine(cfg)
        loss = float(engine.evaluate(tokens, targets))
        saved = save_checkpoint(engine, cfg)
        adapters = {n: p.detach().clone() for n, p in engine.store.model.named_parameters() if is_adapter(n)}
        engine.close()
        keys = checkpoint.dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata
        names = adapter_names(cfg.model)
        assert any(".experts.adapters.gate_up_proj." in n for n in names)
        assert {k for k in keys if k.startswith("model.")} == {f"model.{n}" for n in names}
        again = _engine(cfg)  # a resume reads the experts' adapters back
        assert load_checkpoint(again, cfg.checkpoint_dir) == saved
        assert all(torch.equal(p, adapters[n]) for n, p in again.store.model.named_parameters() if is_adapter(n))
        again.close()

        merged = export(saved, tmp_path / "merged")
        eager = dict(dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")  # test_moe's
        loaded = AutoModelForCausalLM.from_pretrained(merged, **eager).eval()
        d_merged = (_peft_logits(loaded, tokens) - want.logits).abs().max().item()

        only = tmp_path / "adapter_out"
        assert main(["export", str(saved), str(only), "--adapter"]) == 0
        written = json.loads((only / "adapter_config.json").read_text())
        peft_wrote = json.loads((adapter_dir / "adapter_config.json").read_text())
        for key in ("r", "lora_alpha", "target_parameters", "rank_pattern", "alpha_pattern", "target_modules"):
            assert sorted(written[key]) == sorted(peft_wrote[key]) if isinstance(written[key], list) else \
                written[key] == peft_wrote[key], (key, written[key], peft_wrote[key])
        base = AutoModelForCausalLM.from_pretrained(base_dir, **eager)
        d_base = (_peft_logits(base.eval(), tokens) - want.logits).abs().max().item()  # what the adapters change
        reloaded = peft.PeftModel.from_pretrained(base, only).eval()
        d_adapter = (_peft_logits(reloaded, tokens) - want.logits).abs().max().item()

        model, _ = load_model(saved)
        prompt = tokens[:1, :5]
        ours = sample(model, prompt, 8, temperature=0.0, top_k=None, seed=0)
        theirs_tokens = loaded.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    d_loss = abs(loss - want.loss.item())
    print(f"\n{case} LoRA: the adapters change the logits by {d_base:.2f}, loss {loss:.6f}; adapter dir → loss "
          f"{d_loss:.1e}, merged export {d_merged:.1e}, --adapter export "
          f"{d_adapter:.1e}, generate {ours.tolist()}")
    assert d_base > 0.1 and d_loss < 1e-10 and d_merged < 1e-10 and d_adapter < 1e-10, (d_loss, d_merged,
                                                                                         d_adapter)
    assert ours.tolist() == theirs_tokens.tolist()


def test_peft_expert_adapter_is_read_as_an_expert_parallel_rank_slices_it(tmp_path, monkeypatch):
    """An expert-parallel rank holding experts 2 and 3 of 4 reads just their rows of peft's ``lora_A``
    ``[E·r, in]`` and columns of ``lora_B`` ``[out, r·E]``: equal to the whole tensors in our layout, cut."""
    from parallel4d.checkpoint.adapters import load_adapter
    from parallel4d.models.hf import dense_shapes
    from parallel4d.models.lora import adapter_names, expert_peft_names, expert_tensor_from_peft
    from safetensors.torch import load_file

    with monkeypatch.context() as mp:
        _, base_dir, adapter_dir = _moe_made_by_peft(tmp_path, mp)
    cfg = make_config(_moe_job(base_dir, adapter_dir, tmp_path))
    stored, peft_of = load_file(adapter_dir / "adapter_model.safetensors"), expert_peft_names(cfg.model)
    experts = [n for n in adapter_names(cfg.model) if n in peft_of]
    assert len(experts) == 8  # 2 layers × (gate_up_proj, down_proj) × (lora_A, lora_B)
    whole = {n: expert_tensor_from_peft(n.rsplit(".", 1)[-1], stored[peft_of[n]], 4) for n in experts}
    pieces = {n: ((4, *w.shape[1:]), [((2, 0, 0), torch.zeros_like(w[2:]))]) for n, w in whole.items()}
    load_adapter(pieces, cfg.model)
    for n, (_, [(_, got)]) in pieces.items():
        assert torch.equal(got, whole[n][2:]), n
    shapes = dense_shapes(cfg.model)
    e, width, hidden = shapes["blocks.0.mlp.experts.gate_proj"]
    assert whole["blocks.0.mlp.experts.adapters.gate_up_proj.lora_B"].shape == (e, 2 * width, 4)  # rank 2r
    assert whole["blocks.0.mlp.experts.adapters.down_proj.lora_A"].shape == (e, 2, width)


@pytest.mark.parametrize("change, words", [
    ({"target_parameters": ["mlp.gate.weight"]}, ["target_parameters=['mlp.gate.weight']",
                                                  "mlp.experts.gate_up_proj"]),
    ({"rank_pattern": {r".*\.gate_up_proj": 2}}, ["rank_pattern=", "rank_pattern={'.*\\\\.gate_up_proj': 4}"]),
    ({"alpha_pattern": {}}, ["alpha_pattern={}", "alpha_pattern={'.*\\\\.gate_up_proj': 12.0}"]),
])
def test_peft_expert_adapter_config_model_lora_cannot_be_is_refused_by_key(change, words, tmp_path, monkeypatch):
    with monkeypatch.context() as mp:
        _, base_dir, adapter_dir = _moe_made_by_peft(tmp_path, mp)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        make_config(_moe_job(base_dir, adapter_dir, tmp_path))
    assert all(w in str(e.value) for w in words) and "model.lora.adapter=" in str(e.value), str(e.value)


def test_export_adapter_peft_would_load_otherwise_is_refused_and_the_merged_model_written(tmp_path, single_rank):
    """A Qwen3-MoE (q/k norms, no shared expert) with a dense MLP layer (decoder_sparse_step=2) adapted on
    gate/up/down: peft moves those names to the routed experts for that type, so --adapter is refused naming
    why and the fix; the merged export is written."""
    from parallel4d.training.checkpoints import save_checkpoint

    model = {"arch": "llama", "vocab_size": 64, "seq_len": 8, "hidden": 16, "heads": 2, "layers": 2, "qk_norm": True,
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "decoder_sparse_step": 2,
             "lora": {"rank": 2, "alpha": 4, "targets": ["q_proj", "gate_proj", "up_proj", "down_proj"]}}
    cfg = make_config({"model": model, "data": {"batch_size": 2}, "train": {"out_dir": str(tmp_path / "run")}})
    engine = _engine(cfg)
    saved = save_checkpoint(engine, cfg)
    engine.close()
    with pytest.raises(ConfigError) as e:
        export(saved, tmp_path / "adapter", adapter=True)
    said = str(e.value)
    assert "dense MLP layers" in said and "qwen3_moe" in said and "without --adapter" in said, said
    assert not (tmp_path / "adapter").exists()
    assert (export(saved, tmp_path / "merged") / "model.safetensors").is_file()
