"""Hugging Face models through the engine (#15.2-4): ``model.pretrained`` loads each rank's own
slices of a ``transformers`` checkpoint in any layout, training equals the ``transformers`` model
trained in one process with torch's AdamW, and ``parallel4d export`` gives back a directory
``from_pretrained`` loads with the trained model's logits."""

import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from conftest import run_workers  # noqa: E402
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.data.batches import build_dataset  # noqa: E402
from parallel4d.models import hf  # noqa: E402
from parallel4d.sequence.layout import local_positions  # noqa: E402
from test_hf import IMPORTS, S, SCALED, _perturb, _scaled, float64_transformers  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=5e5, tie_word_embeddings=False)
# q/k norms per head, heads of 16 (not 32/4), GQA 4:2
QWEN3 = dict(LLAMA, head_dim=16, rope_theta=1e6)
GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, activation_function="gelu_new",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
OPTIMIZER = {"lr": 3e-3, "weight_decay": 0.1}
STEPS = 20
SHORT = 10  # the 8-worker layouts other than llama's tp=4 × sp=2: the first 10 of the reference's 20 steps


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny random transformers models saved as float32 safetensors: {name: directory}."""
    out = {}
    for name, cls, conf, kwargs in [("llama", transformers.LlamaForCausalLM, transformers.LlamaConfig, LLAMA),
                                    ("qwen3", transformers.Qwen3ForCausalLM, transformers.Qwen3Config, QWEN3),
                                    ("gpt2", transformers.GPT2LMHeadModel, transformers.GPT2Config, GPT2)]:
        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp(name)
        cls(conf(**kwargs)).save_pretrained(directory)
        out[name] = str(directory)
    for name in SCALED:  # test_hf's Llamas of each scaled rotary (linear, dynamic, yarn, llama3)
        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp(name)
        _scaled(name, v=LLAMA["vocab_size"]).save_pretrained(directory)
        out[name] = str(directory)
    return out


def _job(directory: str, parallel: dict, pipeline: dict | None = None, steps: int = STEPS) -> dict:
    return {"model": {"pretrained": directory, "seq_len": 16}, "parallel": parallel,
            "pipeline": pipeline or {"microbatches": 1}, "data": {"source": "synthetic", "batch_size": 8},
            "optimizer": OPTIMIZER, "train": {"steps": steps, "timeout_s": 60}}


def _train(jobs: dict):
    """Each job through compose(): losses and the bytes of pretrained weights this rank read."""
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    out = {}
    for name, job in jobs.items():
        cfg = make_config(job)
        p = cfg.parallel
        engine = compose(cfg, init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=60))
        data = build_dataset(cfg)
        out[name] = [engine.train_step(*data.batch(s)) for s in range(cfg.train.steps)], engine.pretrained_bytes_read
    return out


def transformers_run(directory: str, job: dict) -> list[float]:
    """The checkpoint trained by transformers in one process: torch's AdamW on the whole batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    # the usual groups, by transformers' names: no weight decay on norms, biases and the embedding tables
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not any(
        e in n for e in ("embed_tokens", "wte", "wpe"))]
    rest = [p for p in model.parameters() if all(p is not d for d in decay)]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], **OPTIMIZER)
    data, losses = build_dataset(make_config(job)), []
    for step in range(job["train"]["steps"]):
        x, y = data.batch(step)
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _model_bytes(directory: str) -> int:
    from safetensors import safe_open

    with safe_open(f"{directory}/model.safetensors", framework="pt") as f:  # float32 tensors
        return sum(4 * torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())


def _eight_worker_jobs(jobs: dict, float64_dirs: dict, tokens, targets):
    return _train(jobs), _float64_gradients(float64_dirs, tokens, targets)


@pytest.fixture(scope="module")
def eight_workers(checkpoints, float64_checkpoints):
    """One 8-worker job for both 8-worker checks: the training runs and the float64 gradients."""
    jobs = {"tp=4 × sp=2": _job(checkpoints["llama"], {"tp": 4, "sp": 2}),
            "Hanayo pp=2 × tp=4": _job(checkpoints["llama"], {"pp": 2, "tp": 4}, {"schedule": "hanayo",
                                                                                  "microbatches": 2}, steps=SHORT),
            "qwen3 tp=4 × sp=2": _job(checkpoints["qwen3"], {"tp": 4, "sp": 2}, steps=SHORT)}
    return jobs, run_workers(_eight_worker_jobs, 8, jobs, float64_checkpoints, *FLOAT64_BATCH, timeout_s=300)


def test_a_pretrained_llama_trains_like_transformers_in_every_layout(checkpoints, eight_workers):
    """A LlamaForCausalLM checkpoint (GQA, rope 5e5) under 2D tp=4 × ring sp=2 and Hanayo pp=2 ×
    2D tp=4, and a Qwen3ForCausalLM one (q/k norms, heads of 16 ≠ hidden/heads) under tp=4 × sp=2 (8
    workers): AdamW steps in float32 equal transformers' model trained with torch's AdamW in one
    process (rel 1e-4), 20 of them (the loss falls by 10 %) for llama at tp=4 × sp=2 and their first 10
    for the other two layouts; each rank read under half of the model's bytes."""
    jobs, results = eight_workers
    wants = {}
    for name, job in jobs.items():
        directory = job["model"]["pretrained"]
        if directory not in wants:
            wants[directory] = torch.tensor(transformers_run(directory, _job(directory, {})), dtype=torch.float64)
            assert len(wants[directory]) == STEPS and wants[directory][-1] < 0.9 * wants[directory][0]
    assert sorted(job["train"]["steps"] for job in jobs.values()) == [SHORT, SHORT, STEPS]
    for rank_results, _ in results:
        for name, (losses, read) in rank_results.items():
            directory = jobs[name]["model"]["pretrained"]
            assert len(losses) == jobs[name]["train"]["steps"], name
            torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), wants[directory][:len(losses)],
                                       rtol=1e-4, atol=0, msg=lambda m, n=name: f"{n}: {m}")
            total = _model_bytes(directory)
            assert 0 < read < 0.5 * total, (name, read, total)


# --- float64 under 2D × ring: logits, loss and every gradient equal transformers' (#15.4) ---

FLOAT64_VOCAB = 61  # test_hf's: the 2×2 grid pads it to 62 (a row no token uses, out of the softmax)
def _float64_batch():
    """Tokens and targets ``[4, S]``, the last real id (in the padded block) among both."""
    window = torch.randint(0, FLOAT64_VOCAB, (4, S + 1), generator=torch.Generator().manual_seed(5))
    window[1, 3:5] = FLOAT64_VOCAB - 1
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


FLOAT64_BATCH = _float64_batch()


@pytest.fixture(scope="module")
def float64_checkpoints(tmp_path_factory):
    """test_hf's tiny transformers models (Llama with GQA at rope 1e4 and 5e5 and with each scaled
    rotary, Qwen2 with qkv biases, Qwen3 with q/k norms and heads of 16, Mistral tied, GPT-2), norm gains
    and biases perturbed, saved: {case: directory}."""
    out = {}
    for case, make in IMPORTS.items():
        torch.manual_seed(0)
        model = make(FLOAT64_VOCAB)
        _perturb(model)
        directory = tmp_path_factory.mktemp(case)
        model.save_pretrained(directory)
        out[case] = str(directory)
    return out


def _float64_gradients(directories: dict, tokens, targets):
    """Each checkpoint loaded under 2D tp=4 × ring sp=2 (zigzag) in float64, one forward and
    backward of the ``[B, S]`` batch: {case: ((tp_row, tp_col, sp rank), this rank's logits
    ``[B/2, S/2, Vp/2]`` (V padded to 62), its replica's loss, its pieces of every parameter's gradient,
    the largest gradient outside every piece (the padded rows'))}."""
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    out = {}
    for case, directory in directories.items():
        cfg = make_config({"model": {"pretrained": directory, "seq_len": tokens.shape[1]},
                           "parallel": {"tp": 4, "sp": 2}, "sequence": {"layout": "zigzag"},
                           "data": {"source": "synthetic", "batch_size": tokens.shape[0]},
                           "train": {"dtype": "float64", "timeout_s": 60}})
        mesh = init_mesh(tp=4, sp=2, timeout_s=60)
        engine = compose(cfg, mesh)
        with torch.no_grad():
            logits = engine.local_batch(tokens)
            for stage in engine.model.stages().values():
                logits = stage(logits)
        loss = engine.compute_gradients(tokens, targets)
        grads, outside = {}, 0.0
        for name, p in engine.model.named_parameters():
            dense, _, cut = engine.dense[name]
            grads[dense] = [(tuple(off), view.clone()) for off, view in cut(p.grad)]
            rest = p.grad.clone()
            for _, view in cut(rest):
                view.zero_()
            outside = max(outside, rest.abs().max().item())
        out[case] = ((mesh.rank("tp_row"), mesh.rank("tp_col"), mesh.rank("sp")), logits, float(loss), grads,
                     outside)
    return out


def _transformers_float64(directory: str, tokens, targets, mp):
    """transformers' model of ``directory`` in float64 (test_hf.float64_transformers): logits,
    loss and its parameters (with their gradients), plus the job's model config."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").double()
    float64_transformers(mp, ref)
    cfg = make_config({"model": {"pretrained": directory, "seq_len": tokens.shape[1]}}).model
    if cfg.arch == "llama":
        ref.set_attn_implementation("sdpa")  # eager takes the softmax in float32
    logits = ref(input_ids=tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return logits.detach(), loss.item(), ref, cfg


def test_pretrained_models_under_2d_and_ring_equal_transformers_in_float64(float64_checkpoints, eight_workers,
                                                                           monkeypatch):
    """Each test_hf model at tp=4 × sp=2 (zigzag), float64, its vocabulary of 61 padded to the grid: every
    rank's block of the logits (its real columns), the mean of the replicas' losses and every rank's piece
    of every parameter's gradient equal transformers' within 1e-10 (absolute); together the pieces cover
    every parameter, and the padded rows' gradients (outside every piece) are zero."""
    tokens, targets = FLOAT64_BATCH
    b, v = tokens.shape[0] // 2, -(-FLOAT64_VOCAB // 2)
    results = [f64 for _, f64 in eight_workers[1]]
    for case, directory in float64_checkpoints.items():
        with monkeypatch.context() as mp:
            logits, loss, ref, cfg = _transformers_float64(directory, tokens, targets, mp)
        names = hf.p4d_to_hf(cfg)
        worst, replica_losses, seen = 0.0, {}, set()
        for rank_results in results:
            (row, col, sp), block, replica_loss, grads, outside = rank_results[case]
            assert outside == 0.0, (case, "a padded row got a gradient", outside)
            positions = list(local_positions(tokens.shape[1], sp, 2, "zigzag"))
            want = logits[row * b:(row + 1) * b, positions, col * v:(col + 1) * v]
            assert block.dtype == torch.float64 and block.shape[:-1] == want.shape[:-1], (case, block.shape)
            assert block.shape[-1] == v and want.shape[-1] == (v if col == 0 else FLOAT64_VOCAB - v)
            worst = max(worst, (block[..., :want.shape[-1]] - want).abs().max().item())
            replica_losses.setdefault(sp, replica_loss)
            assert replica_losses[sp] == replica_loss  # equal on every grid rank of a replica
            for dense, boxes in grads.items():
                seen.add(dense)
                hf_name, how = names[dense]
                g = ref.get_parameter(hf_name).grad
                g = g.t() if how == "t" else g
                for off, t in boxes:
                    box = g[tuple(slice(o, o + n) for o, n in zip(off, t.shape))]
                    worst = max(worst, (t - box).abs().max().item())
        assert seen == set(names), (case, set(names) ^ seen)
        d_loss = abs(sum(replica_losses.values()) / len(replica_losses) - loss)
        print(f"\n{case} at tp=4 × sp=2: logits and gradients within {worst:.1e}, loss {d_loss:.1e}")
        assert logits.abs().max() > 1.0 and worst < 1e-10 and d_loss < 1e-10, (case, worst, d_loss)


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory):
    """A 32 MB LlamaForCausalLM checkpoint (float32)."""
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("big")
    big = dict(LLAMA, vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**big)).save_pretrained(directory)
    return str(directory)


def _four_worker_jobs(gpt2_job: dict, big: str):
    return _train({"tp=4": gpt2_job}), _peak_while_loading(big)


@pytest.fixture(scope="module")
def four_workers(checkpoints, big_llama):
    job = _job(checkpoints["gpt2"], {"tp": 4}, steps=5)
    return job, run_workers(_four_worker_jobs, 4, job, big_llama, timeout_s=300)


def test_a_pretrained_gpt2_loads_through_the_2d_layout(checkpoints, four_workers):
    """GPT2LMHeadModel (Conv1D weights, fused c_attn read as three boxes per grid column) at tp=4:
    its training equals transformers' (rel 1e-4, 5 steps)."""
    job, results = four_workers
    want = torch.tensor(transformers_run(checkpoints["gpt2"], job), dtype=torch.float64)
    for trained, _ in results:
        torch.testing.assert_close(torch.tensor(trained["tp=4"][0], dtype=torch.float64), want, rtol=1e-4, atol=0)


CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?"  # a character tokenizer's, ids 1..60
SOURCE_FILES = {"tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}),
                "special_tokens_map.json": json.dumps({"unk_token": "<unk>"}),
                "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}


def _with_tokenizer(source: str, directory) -> None:
    """A copy of checkpoint ``source`` with a tokenizer's files and a weights file no export carries."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    shutil.copytree(source, directory)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(directory / "tokenizer.json"))
    for name, text in SOURCE_FILES.items():
        (directory / name).write_text(text)
    torch.save({}, directory / "training_args.bin")


@pytest.mark.parametrize("family,dtype", [("gpt2", "float64"), ("llama", "float32"), ("qwen3", "float32"),
                                          *((name, "float32") for name in SCALED)])
def test_round_trip_transformers_parallel4d_export_transformers(checkpoints, tmp_path, capsys, family, dtype):
    """transformers → parallel4d (seq_len 16 of the model's 32 / 64 positions; 3 AdamW steps in one
    process; gpt2 in float64) → ``parallel4d export`` → from_pretrained: the original's tensor names
    and shapes, its config.json key by key (only dtype changed, by the float64 training), the trained
    tensors exactly as checkpointed (gpt2's position rows past 16 as loaded, the first 16 trained),
    the tokenizer and generation files byte for byte (no weights file carried), every file readable by
    others, the step exported said; transformers' logits of the export are those of the checkpoint's
    dense model (the rotary as trained: plain, each scaled one, Qwen3's), and ``parallel4d generate``
    continues a prompt from the export."""
    from conftest import run_in_this_process
    from parallel4d.tools.cli import main
    from parallel4d.checkpoint.gather import gather, with_tied_head
    from parallel4d.tools.generate import load_model

    source, out = tmp_path / "source", tmp_path / "hf"
    _with_tokenizer(checkpoints[family], source)
    job = {**_job(str(source), {}, steps=3), "train": {"steps": 3, "dtype": dtype, "out_dir": str(tmp_path / "run")}}
    run_in_this_process(job, [])
    umask = os.umask(0o022)  # what the export's files get from the process
    capsys.readouterr()
    try:
        assert main(["export", str(tmp_path / "run" / "checkpoints"), str(out)]) == 0
    finally:
        os.umask(umask)
    assert capsys.readouterr().out == f"exported step 3 of {tmp_path / 'run' / 'checkpoints'} to {out}\n"
    names = {p.name for p in source.iterdir()} - {"training_args.bin"}
    assert {p.name for p in out.iterdir()} == names
    assert [oct(p.stat().st_mode & 0o777) for p in (out, *out.iterdir())] == ["0o755"] + ["0o644"] * len(names)
    for name in names - {"config.json", "model.safetensors"}:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name

    original, exported = (json.loads((d / "config.json").read_text()) for d in (source, out))
    assert original["dtype"] == "float32" and exported["dtype"] == dtype
    changed = {k for k in {*original, *exported} if original.get(k) != exported.get(k)}
    assert changed == (set() if dtype == "float32" else {"dtype"}), changed
    theirs = transformers.AutoModelForCausalLM.from_pretrained(source)
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.config.to_dict() == {**theirs.config.to_dict(), "_name_or_path": str(out), "dtype": dtype}
    back_state, their_state = back.state_dict(), theirs.state_dict()
    assert {k: v.shape for k, v in back_state.items()} == {k: v.shape for k, v in their_state.items()}

    cfg = make_config(job).model
    saved = with_tied_head(torch.load(gather(tmp_path / "run" / "checkpoints", tmp_path / "dense.pt", progress=False))
                           ["model"], cfg.tie_embeddings)
    for dense, (name, how) in hf.p4d_to_hf(cfg).items():
        want = saved[dense].t() if how == "t" else saved[dense]
        assert back_state[name].dtype == getattr(torch, dtype) and torch.equal(back_state[name], want), name
    ours, _ = load_model(tmp_path / "run")  # the checkpoint as parallel4d's dense model computes it
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(back.float().eval()(input_ids=tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)
    if family == "gpt2":
        rows, loaded = back_state["transformer.wpe.weight"], their_state["transformer.wpe.weight"].double()
        assert rows.shape[0] == 32 and torch.equal(rows[16:], loaded[16:])  # never read: as loaded
        assert (rows[:16] != loaded[:16]).any(1).all()  # each trained row moved

    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "Hello", "--max-new-tokens", "8", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Hello") and len(text.rstrip("\n")) > len("Hello"), text


def test_own_gpt2_keeps_its_position_rows_past_seq_len(tmp_path):
    """Our own gpt2 with model.max_positions 32 > seq_len 16 (one process, 3 steps): the table has 32
    rows, the 16 read are trained, the others leave training as drawn (no gradient, no weight decay);
    the export says n_positions 32 and carries no tokenizer (no model.pretrained)."""
    from conftest import run_in_this_process
    from parallel4d.checkpoint.export import export
    from parallel4d.checkpoint.gather import gather
    from parallel4d.models.build import build_stage, shape_from_config

    job = {"model": {"vocab_size": 64, "seq_len": 16, "max_positions": 32, "hidden": 32, "heads": 4, "layers": 2},
           "data": {"source": "synthetic", "batch_size": 4}, "optimizer": OPTIMIZER,
           "train": {"steps": 3, "out_dir": str(tmp_path / "run")}}
    run_in_this_process(job, [])
    rows = torch.load(gather(tmp_path / "run" / "checkpoints", tmp_path / "dense.pt", progress=False))["model"][
        "embed.pos.weight"]
    drawn = build_stage(shape_from_config(make_config(job).model), 0).pos.weight.detach()
    assert rows.shape == (32, 32) and torch.equal(rows[16:], drawn[16:])
    assert (rows[:16] != drawn[:16]).any(1).all()
    out = export(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["n_positions"] == 32
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_pretrained_fields_and_files_are_checked_before_training(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match=r"model.hidden=64 but .*config.json makes it 32"):
        make_config({"model": {"pretrained": checkpoints["llama"], "hidden": 64}})
    cfg = make_config({"model": {"pretrained": checkpoints["llama"], "seq_len": 16}})
    assert (cfg.model.arch, cfg.model.kv_heads, cfg.model.rope_theta, cfg.model.tie_embeddings) == \
        ("llama", 2, 5e5, False)
    with pytest.raises(ConfigError, match=r"model.seq_len=64 is more than model.max_positions=32 \(model.pretrained's "
                                          r"n_positions\), the rows of gpt2's learned position table; lower model.seq_len"):
        make_config({"model": {"pretrained": checkpoints["gpt2"], "seq_len": 64}})
    assert make_config({"model": {"pretrained": checkpoints["gpt2"], "seq_len": 32}}).model.max_positions == 32
    with pytest.raises(ConfigError, match=r"model.seq_len=64 is more than model.max_positions=48, .* or raise "
                                          r"model.max_positions"):
        make_config({"model": {"seq_len": 64, "max_positions": 48}})
    with pytest.raises(ConfigError, match=r"model.pretrained=.*cannot read .*config.json"):
        make_config({"model": {"pretrained": str(tmp_path)}})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match=r"'bert' is not supported; supported: gpt2, llama, mistral, qwen2"):
        make_config({"model": {"pretrained": str(tmp_path)}})
    # a truncated weight file is named by launch's preflight, before any worker
    from parallel4d import launch

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "model.safetensors"):
        data = open(f"{checkpoints['llama']}/{f}", "rb").read()
        (broken / f).write_bytes(data[: len(data) // 2] if f.endswith("safetensors") else data)
    with pytest.raises(ConfigError, match=r"model.safetensors"):
        launch({**_job(str(broken), {}), "train": {"steps": 1, "out_dir": str(tmp_path / "out")}})
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize("family, layout, said, fixed", [
    # hidden 32, heads 4, kv_heads 2 on a 3×3 grid; kv_heads 2 on a 4×4 one
    ("qwen3", {"parallel": {"tp": 9}}, "use parallel.tp=4", {"parallel": {"tp": 4}}),
    ("qwen3", {"parallel": {"tp": 16}}, "use parallel.tp=4", {"parallel": {"tp": 4}}),
    ("qwen3", {"parallel": {"pp": 4}, "pipeline": {"schedule": "zbv"}}, "use parallel.pp≤3",  # 8 chunks, 6 stages
     {"parallel": {"pp": 3}, "pipeline": {"schedule": "zbv"}}),
    ("gpt2", {"parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b"}, "hetero": {"enabled": True}},
     "use pipeline.schedule=hanayo or zbv", {"parallel": {"pp": 2}, "pipeline": {"schedule": "hanayo"},
                                            "hetero": {"enabled": True}}),  # a tied head on two pp ranks
])
def test_refusals_for_a_pretrained_model_suggest_the_layout_never_its_shape(checkpoints, family, layout, said, fixed):
    """#45: ``parallel.tp=9`` suggested model.heads=3 or 6, model.kv_heads=3 and model.vocab_size=510 or
    513 for a Qwen3, each then refused because config.json fixes it. The fix offered loads."""
    job = _job(checkpoints[family], {})
    with pytest.raises(ConfigError) as err:
        make_config({**job, **layout})
    msg = str(err.value)
    assert not re.search(r"\b(use|or) model\.", msg) and "model.tie_embeddings=false" not in msg, msg
    assert said in msg, msg
    assert family == "gpt2" or "model.pretrained's config.json sets" in msg, msg  # the grid's and layers' say why
    make_config({**job, **fixed})


def _peak_while_loading(directory: str):
    """This rank's growth of peak resident memory (VmHWM, reset first) while its model (built by
    compose(), with ``model.pretrained``) is loaded again from the checkpoint, and the bytes read."""
    from parallel4d.engine.pretrained import load_pretrained
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    cfg = make_config({**_job(directory, {"tp": 4}, steps=1), "model": {"pretrained": directory, "seq_len": 16}})
    engine = compose(cfg, init_mesh(tp=4, timeout_s=60))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak is the current resident size from here on
    base = status("VmRSS:")
    read = load_pretrained(engine.model, engine.dense, cfg.model)
    return status("VmHWM:") - base, read


def test_loading_a_pretrained_model_keeps_each_rank_below_the_model_size(big_llama, four_workers):
    """A 32 MB Llama checkpoint at tp=4: while a rank reads its slices into its model, its peak
    resident memory grows by less than the model (file pages it touches included)."""
    total = _model_bytes(big_llama)
    assert total > 30e6
    for _, (grown, read) in four_workers[1]:
        assert read < 0.3 * total, (read, total)
        assert grown < total, (grown, total)
