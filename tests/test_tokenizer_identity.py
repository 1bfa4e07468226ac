"""Which tokenizer a model reads (#45): a token file is compared with ``model.pretrained``'s
tokenizer.json by what decides the ids (model type, vocabulary, merges, added and special tokens,
normalizer, pre-tokenizer), not by the file's bytes; byte text (``data.source: text``) under a
tokenizer that is not byte-level is refused before any worker starts, with the command that
tokenizes it. Every tokenizer here is built by ``tokenizers`` itself, and each verdict is checked
against the ids ``tokenizers`` gives the same text."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.data.tokenizer_identity import fingerprint, id_parts, is_byte_level  # noqa: E402
from parallel4d.tools.cli import main  # noqa: E402

TEXTS = ["def add(a, b):\n    return a + b\n" * 20, "class Point:\n    x: int = 0\n    y: int = 0\n" * 15]


def _ids(path: Path, text: str = "".join(TEXTS)) -> list[int]:
    return tokenizers.Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids


def _bpe(directory: Path) -> Path:
    """A BPE tokenizer trained by `tokenizers` on :data:`TEXTS` (byte-level alphabet, merges,
    <|endoftext|>): its tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte → character table (the ByteLevel pre-tokenizer's), indexed by byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    table = dict(zip(printable, map(chr, printable))) | {b: chr(256 + n) for n, b in enumerate(others)}
    return [table[b] for b in range(256)]


def _byte_tokenizers(directory: Path) -> dict[str, Path]:
    """Tokenizers whose ids are a text's UTF-8 bytes, written as two real ones are: byte fallback
    (``<0x41>`` entries), and GPT-2's byte characters in byte order, each with <|endoftext|> at 256."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    fallback = Tokenizer(models.BPE(vocab={f"<0x{b:02X}>": b for b in range(256)}, merges=[], byte_fallback=True))
    chars = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_gpt2_byte_chars())}, merges=[]))
    chars.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    out = {}
    for name, tok in (("byte fallback", fallback), ("byte characters", chars)):
        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
        (directory / name).mkdir(parents=True)
        tok.save(str(directory / name / "tokenizer.json"))
        out[name] = directory / name / "tokenizer.json"
    return out


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A tiny gpt2 as a Hugging Face directory (config.json, safetensors; no tokenizer), vocabulary 320."""
    from parallel4d.models import hf
    from parallel4d.models.build import build_dense, shape_from_config

    out = tmp_path_factory.mktemp("weights")
    cfg = make_config({"model": {"vocab_size": 320, "hidden": 32, "layers": 2, "heads": 4, "seq_len": 32}})
    hf.save_hf(build_dense(shape_from_config(cfg.model), seed=0).state_dict(), cfg.model, out)
    return out


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return _bpe(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A text_root of two .py files and a notes/ folder of .txt files (both ≥ 1 KiB)."""
    root = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXTS):
        (root / f"{i}.py").write_text(text)
        (root / "notes").mkdir(exist_ok=True)
        (root / "notes" / f"{i}.txt").write_text(text.upper())
    return root


def _model(weights: Path, where: Path, tokenizer: Path | None = None, **files: str) -> Path:
    """A copy of ``weights`` at ``where`` with ``tokenizer`` as its tokenizer.json and ``files`` beside."""
    shutil.copytree(weights, where)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, where / "tokenizer.json")
    for name, text in files.items():
        (where / name.replace("_", ".")).write_text(text)
    return where


def _job(directory: Path, model: Path, data: dict) -> str:
    job = {"model": {"pretrained": str(model), "seq_len": 16}, "data": {"batch_size": 2, **data},
           "train": {"out_dir": str(directory / "run"), "steps": 2}}
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


# --- what decides the ids ------------------------------------------------------------------------

def _resaved_by_transformers(original: Path, out: Path) -> Path:
    """``original`` through transformers' ``save_pretrained``, which adds a post-processor."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(original), eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return out / "tokenizer.json"


def _edited(original: Path, out: Path, change) -> Path:
    doc = json.loads(original.read_text())
    change(doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(doc, indent=2))
    return out / "tokenizer.json"


def _drop_last_merge(doc):
    doc["model"]["merges"] = doc["model"]["merges"][:-1]


def _swap_two_vocabulary_entries(doc):
    tok = tokenizers.Tokenizer.from_str(json.dumps(doc))
    a, b = tok.encode(TEXTS[0]).tokens[:2]  # two tokens of the text's ids ("def", " add")
    vocab = doc["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]


def _lowercase(doc):
    doc["normalizer"] = {"type": "Lowercase"}


def _merges_as_strings(doc):  # as tokenizers before 0.20 wrote them
    doc["model"]["merges"] = [" ".join(pair) for pair in doc["model"]["merges"]]


def _unset_flags_left_out(doc):  # as versions before a flag existed wrote the model
    for flag in ("ignore_merges", "byte_fallback", "fuse_unk", "dropout"):
        doc["model"].pop(flag, None)


SAME = {"re-saved by transformers": None, "re-indented": lambda doc: None, "merges as strings": _merges_as_strings,
        "unset flags left out": _unset_flags_left_out}
OTHER = {"a merge dropped": (_drop_last_merge, "merges"), "two vocabulary ids swapped": (_swap_two_vocabulary_entries,
                                                                                        "vocabulary"),
         "a lowercase normalizer": (_lowercase, "normalizer")}


def _variant(bpe: Path, out: Path, name: str) -> Path:
    if name == "re-saved by transformers":
        return _resaved_by_transformers(bpe, out)
    return _edited(bpe, out, SAME.get(name) or OTHER[name][0])


@pytest.fixture(scope="module")
def token_file(bpe, tmp_path_factory) -> Path:
    """The texts tokenized with :func:`bpe` by ``parallel4d tokenize``."""
    out = tmp_path_factory.mktemp("tokens")
    inputs = []
    for i, text in enumerate(TEXTS):
        (out / f"{i}.py").write_text(text)
        inputs.append(str(out / f"{i}.py"))
    assert main(["tokenize", "--tokenizer", str(bpe), *inputs, "-o", str(out / "train.bin")]) == 0
    return out / "train.bin"


@pytest.mark.parametrize("name", SAME)
def test_a_tokenizer_giving_the_same_ids_is_the_models_tokenizer(bpe, weights, token_file, tmp_path, name, capsys):
    """The same tokenizer.json re-saved (transformers' save_pretrained adds a post-processor; another
    indentation; another tokenizers version's merges and flags): the token file trains under it."""
    variant = _variant(bpe, tmp_path / "tok", name)
    assert variant.read_bytes() != bpe.read_bytes() and _ids(variant) == _ids(bpe)  # another file, the same ids
    model = _model(weights, tmp_path / "model", variant)
    assert main(["validate", _job(tmp_path, model, {"source": "tokens", "path": str(token_file)})]) == 0, \
        capsys.readouterr().err


@pytest.mark.parametrize("name", OTHER)
def test_a_tokenizer_giving_other_ids_is_refused_naming_what_differs(bpe, weights, token_file, tmp_path, name,
                                                                     capsys):
    variant = _variant(bpe, tmp_path / "tok", name)
    assert _ids(variant) != _ids(bpe)  # the change reaches the text's ids
    model = _model(weights, tmp_path / "model", variant)
    assert main(["validate", _job(tmp_path, model, {"source": "tokens", "path": str(token_file)})]) == 2
    err = capsys.readouterr().err
    assert (f"data.path='{token_file}' was tokenized with {bpe.resolve()} but model.pretrained='{model}' has another "
            f"tokenizer.json (their {OTHER[name][1]} differ)") in err
    assert f"tokenize again with --tokenizer {model / 'tokenizer.json'}" in err


def test_the_fingerprint_hashes_each_part_that_decides_the_ids(bpe, tmp_path):
    parts = fingerprint(bpe)
    assert list(parts) == ["model", "vocab", "merges", "added_tokens", "normalizer", "pre_tokenizer"]
    doc = json.loads(bpe.read_text())
    assert id_parts(doc)["merges"] == [list(m) for m in doc["model"]["merges"]]
    for name, (_, part) in OTHER.items():
        changed = fingerprint(_variant(bpe, tmp_path / name, name))
        assert [p for p in parts if parts[p] != changed[p]] == [{"vocabulary": "vocab"}.get(part, part)], name


def _older_sidecar(token_file: Path, directory: Path) -> Path:
    """A copy of the token file whose sidecar is an older parallel4d's: the tokenizer file's sha256 only."""
    out = directory / "old.bin"
    out.write_bytes(token_file.read_bytes())
    meta = json.loads(token_file.with_suffix(".json").read_text())
    del meta["tokenizer_fingerprint"]
    out.with_suffix(".json").write_text(json.dumps(meta))
    return out


def test_an_older_sidecar_is_compared_through_the_tokenizer_file_it_names(bpe, weights, token_file, tmp_path, capsys):
    """A sidecar written before fingerprints holds the tokenizer file's sha256: while that file is there
    with those bytes, its fingerprint stands for the data's; once gone, the refusal says what to do."""
    old = _older_sidecar(token_file, tmp_path)
    model = _model(weights, tmp_path / "model", _resaved_by_transformers(bpe, tmp_path / "resaved"))
    job = _job(tmp_path, model, {"source": "tokens", "path": str(old)})
    assert main(["validate", job]) == 0, capsys.readouterr().err
    meta = json.loads(old.with_suffix(".json").read_text())
    old.with_suffix(".json").write_text(json.dumps({**meta, "tokenizer": str(tmp_path / "gone" / "tokenizer.json")}))
    assert main(["validate", job]) == 2
    err = capsys.readouterr().err
    gone = tmp_path / "gone" / "tokenizer.json"
    assert (f"data.path='{old}': its sidecar (written by an older parallel4d) records only the sha256 of the file "
            f"{gone}, not that of {model / 'tokenizer.json'} (model.pretrained's), and {gone} is gone or changed, so "
            f"what decides their ids cannot be compared; tokenize again with --tokenizer {model / 'tokenizer.json'}") in err
    (model / "tokenizer.json").write_bytes(bpe.read_bytes())  # the very file: equal sha256s still suffice
    assert main(["validate", job]) == 0, capsys.readouterr().err


# --- byte text under a tokenizer -----------------------------------------------------------------

def test_byte_text_under_a_bpe_model_is_refused_with_the_command_that_tokenizes_it(bpe, weights, corpus, tmp_path,
                                                                                    capsys, monkeypatch):
    """``data.source: text`` feeds bytes 0–255; a BPE model reads them as other tokens: refused by
    validate, naming data.source and the command, which (as the shell expands it) writes a token
    file the job then trains on."""
    model = _model(weights, tmp_path / "model", bpe)
    text = {"source": "text", "text_root": str(corpus), "text_glob": ["**/*.txt"]}
    assert main(["validate", _job(tmp_path, model, text)]) == 2
    err = capsys.readouterr().err
    size = tokenizers.Tokenizer.from_file(str(bpe)).get_vocab_size(with_added_tokens=True)
    merges = len(json.loads(bpe.read_text())["model"]["merges"])
    assert (f"data.source=text feeds the text's UTF-8 bytes as token ids 0–255, but model.pretrained='{model}' has a "
            f"BPE tokenizer of {size} tokens with {merges} merges ({model / 'tokenizer.json'}), not byte-level: to the "
            "model those ids are other tokens") in err
    command = err.split("tokenizer: `")[1].split("`")[0]
    assert command == f"parallel4d tokenize --tokenizer {model / 'tokenizer.json'} {corpus}/**/*.txt -o train.bin"
    assert ("(bash: `shopt -s globstar` first), then set data.source=tokens and data.path=train.bin and remove "
            "data.text_root and data.text_glob") in err
    monkeypatch.chdir(tmp_path)
    args = subprocess.run(["bash", "-O", "globstar", "-c", f"printf '%s\\n' {command.removeprefix('parallel4d ')}"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert sorted(args[3:-2]) == sorted(map(str, corpus.glob("**/*.txt")))
    assert main(args) == 0  # the command as printed
    assert main(["validate", _job(tmp_path, model, {"source": "tokens", "path": "train.bin"})]) == 0


def test_byte_text_without_text_glob_is_told_to_tokenize_every_py_file(bpe, weights, corpus, tmp_path, capsys):
    model = _model(weights, tmp_path / "model", bpe)
    assert main(["validate", _job(tmp_path, model, {"source": "text", "text_root": str(corpus)})]) == 2
    command = capsys.readouterr().err.split("tokenizer: `")[1].split("`")[0]
    inputs = command.split(" --tokenizer ")[1].split(" ", 1)[1]  # after the tokenizer's path
    files = subprocess.run(["bash", "-c", f"printf '%s\\n' {inputs}"], capture_output=True, text=True,
                           check=True).stdout.splitlines()[:-2]
    assert files == [str(corpus / "0.py"), str(corpus / "1.py")]  # the corpus's files, in its order


@pytest.mark.parametrize("name", ["byte fallback", "byte characters"])
def test_byte_text_under_a_byte_level_tokenizer_trains(weights, corpus, tmp_path, name, capsys):
    tokenizer = _byte_tokenizers(tmp_path / "tok")[name]
    text = "".join(TEXTS) + "héllo wörld 中文 🙂"
    assert _ids(tokenizer, text) == list(text.encode("utf-8"))  # what the byte corpus feeds
    model = _model(weights, tmp_path / "model", tokenizer)
    assert main(["validate", _job(tmp_path, model, {"source": "text", "text_root": str(corpus)})]) == 0, \
        capsys.readouterr().err


def test_a_model_without_tokenizer_files_takes_byte_text_as_its_exported_byte_models_do(weights, corpus, tmp_path):
    """parallel4d's byte models export no tokenizer (docs/models.md's fine-tune trains one on text):
    nothing says the ids are not bytes."""
    job = _job(tmp_path, _model(weights, tmp_path / "model"), {"source": "text", "text_root": str(corpus)})
    assert main(["validate", job]) == 0


def test_byte_text_under_a_sentencepiece_model_without_tokenizer_json_is_refused(weights, corpus, tmp_path, capsys):
    model = _model(weights, tmp_path / "model", tokenizer_model="not bytes")
    assert main(["validate", _job(tmp_path, model, {"source": "text", "text_root": str(corpus)})]) == 2
    err = capsys.readouterr().err
    assert (f"data.source=text feeds the text's UTF-8 bytes as token ids 0–255, but model.pretrained='{model}' has a "
            "tokenizer (tokenizer.model), to which those ids are other tokens, and no tokenizer.json to tokenize with; "
            f"write one with transformers (`AutoTokenizer.from_pretrained('{model}').save_pretrained('{model}')`)") in err


@pytest.mark.parametrize("change, why", [
    (lambda t: t.__setattr__("pre_tokenizer", tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)),
     "adds a space before each text"),
    (lambda t: t.__setattr__("pre_tokenizer", tokenizers.pre_tokenizers.Whitespace()), "drops spaces"),
    (lambda t: t.__setattr__("normalizer", tokenizers.normalizers.Lowercase()), "lowercases"),
])
def test_a_byte_tokenizer_that_changes_the_text_is_not_byte_level(tmp_path, change, why):
    path = _byte_tokenizers(tmp_path)["byte characters"]
    assert is_byte_level(path)
    tok = tokenizers.Tokenizer.from_file(str(path))
    change(tok)
    tok.save(str(path))
    assert _ids(path, "A  b") != list(b"A  b") and not is_byte_level(path), why


def test_gpt2s_byte_alphabet_in_its_own_order_is_not_byte_level(tmp_path):
    """GPT-2's first 256 ids are the bytes in another order ('!' is 0): not the byte corpus's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    order = sorted(_gpt2_byte_chars())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(order)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    assert _ids(tmp_path / "tokenizer.json", "ab") != list(b"ab") and not is_byte_level(tmp_path / "tokenizer.json")
