"""``parallel4d generate`` (#16.6): KV-cached decoding equals the model run on the whole text, greedy
decoding equals ``transformers``' own ``generate``, and a checkpoint of a parallel layout samples the
same text as its Hugging Face export."""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from parallel4d import launch  # noqa: E402
from parallel4d.tools.cli import main  # noqa: E402
from parallel4d.checkpoint.export import export  # noqa: E402
from parallel4d.tools.generate import forward_cached, load_model, sample  # noqa: E402
from test_hf import IMPORTS, V  # noqa: E402

FAMILIES = ["llama-theta1e4", "llama-yarn", "qwen2", "qwen3", "gpt2"]  # yarn: scaled rotary and its cos/sin factor


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """A tiny random transformers model, saved, and parallel4d's model loaded from its directory."""
    torch.manual_seed(0)
    ref = IMPORTS[request.param]().double().eval()
    directory = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(directory)
    model, cfg = load_model(directory)
    return ref, model.double(), cfg


def test_cached_decoding_equals_the_whole_forward(family):
    """A 5-token prompt, then one token at a time: each step's logits equal the model's on all the
    tokens so far (float64, 1e-10)."""
    _, model, _ = family
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    logits, cache = forward_cached(model, tokens[:, :5], None)
    steps = [logits]
    for t in range(5, 16):
        logits, cache = forward_cached(model, tokens[:, t:t + 1], cache)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    assert cache[0][0].shape[2] == 16


def test_greedy_decoding_equals_transformers_generate(family):
    ref, model, cfg = family
    prompt = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(2))
    theirs = ref.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = sample(model, prompt, 12, temperature=0)
    assert torch.equal(ours, theirs), (ours, theirs)


def test_past_the_context_the_cache_restarts(family):
    """Beyond ``seq_len`` tokens the model rereads its recent half: still equal to running the model
    on those tokens from scratch."""
    _, model, _ = family
    window = model.shape.seq_len
    prompt = torch.randint(0, V, (1, window - 2), generator=torch.Generator().manual_seed(3))
    out = sample(model, prompt, 6, temperature=0)
    assert out.shape[1] == window + 4 and torch.equal(out[:, :window - 2], prompt)
    # token `window` still sees the whole window; the next one, after the restart, the last half
    assert out[0, window].item() == model(out[:, :window])[0, -1].argmax().item()
    ctx = out[:, window + 1 - window // 2: window + 1]
    assert out[0, window + 1].item() == model(ctx)[0, -1].argmax().item()


def test_dynamic_rotary_decodes_as_transformers_generate(tmp_path):
    """Dynamic rotary past max_position_embeddings (8) while decoding: each new token is rotated with
    the frequencies of the length so far, the cached keys keep theirs — transformers' ``generate``
    does the same, step for step (float64 weights; its rotary table and logits are float32: 1e-5)."""
    import json

    from parallel4d.config.load import make_config
    from parallel4d.models import hf
    from parallel4d.models.build import build_dense, shape_from_config

    torch.manual_seed(0)
    ref = IMPORTS["llama-dynamic"]().double().eval()
    ref.save_pretrained(tmp_path)
    fields = hf.model_fields_from_hf(json.loads((tmp_path / "config.json").read_text()))
    cfg = make_config({"model": {**fields, "seq_len": 16}}).model
    model = build_dense(shape_from_config(cfg)).double()
    model.load_state_dict(hf.load_hf_state_dict(tmp_path, cfg))
    prompt = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(5))
    theirs = ref.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                          output_logits=True)
    logits, cache = forward_cached(model, prompt, None)
    for step, want in enumerate(theirs.logits):
        torch.testing.assert_close(logits[:, -1].float(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")
        logits, cache = forward_cached(model, theirs.sequences[:, 4 + step:5 + step], cache)
    assert cache[0][0].shape[2] == 14


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A byte-level gpt2 trained 4 steps under tp=4 (4 workers), and its Hugging Face export."""
    out = tmp_path_factory.mktemp("gen") / "run"
    launch({"parallel": {"tp": 4}, "model": {"vocab_size": 256, "seq_len": 32, "hidden": 32, "heads": 4, "layers": 2},
            "data": {"source": "text", "batch_size": 4}, "train": {"steps": 4, "out_dir": str(out)}})
    return out, export(out / "checkpoints", out.parent / "hf")


def _generate(capsys, source, *args):
    """``parallel4d generate SOURCE --prompt "def " ...`` in this process: (exit code, stdout, stderr)."""
    code = main(["generate", str(source), "--prompt", "def ", "--max-new-tokens", "40", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_export_of_a_tied_gpt2_run_loads_in_transformers(trained):
    """``parallel4d export`` of a tied-embedding checkpoint (it failed: 'head.weight' missing): transformers
    loads it and computes the logits of the model ``generate`` loads from the run."""
    from transformers import AutoModelForCausalLM

    run, exported = trained
    theirs = AutoModelForCausalLM.from_pretrained(exported).eval()
    ours, cfg = load_model(run)
    assert cfg["model"]["tie_embeddings"] and theirs.config.tie_word_embeddings
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_generate_from_a_run_and_from_its_export(trained, capsys):
    """The same text from a run and its export; stderr names what was loaded (#45: nothing did), stdout
    holds only the text."""
    run, exported = trained
    code, a, err = _generate(capsys, run, "--seed", "3")
    assert code == 0 and a.startswith("def ") and len(a.encode()) >= 20
    assert err == f"parallel4d: generating from step 4 of {run / 'checkpoints'}\n", err
    assert _generate(capsys, exported, "--seed", "3")[2] == f"parallel4d: generating from the Hugging Face model in " \
                                                            f"{exported}\n"
    assert _generate(capsys, run, "--seed", "3")[1] == a  # the seed decides
    assert _generate(capsys, exported, "--seed", "3")[1] == a  # the same model either way
    assert _generate(capsys, run, "--seed", "4")[1] != a
    proc = subprocess.run([sys.executable, "-m", "parallel4d", "generate", str(run), "--prompt", "def ",
                           "--max-new-tokens", "40", "--seed", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == a, proc.stderr  # and as a command


def test_generate_refuses_what_it_cannot_do(trained, tmp_path, capsys):
    run, _ = trained
    for args, code, words in ((["--temperature", "-1"], 2, "--temperature must be ≥ 0"),
                              (["--max-new-tokens", "-2"], 2, "--max-new-tokens must be ≥ 0")):
        got = _generate(capsys, run, *args)
        assert got[0] == code and words in got[2], got
    got = _generate(capsys, tmp_path)
    assert got[0] == 2 and "neither a checkpoint" in got[2], got  # a refusal (#45: it was 1)
