"""Their own data (#16.1): ``parallel4d tokenize`` (Hugging Face ``tokenizers``) writes a token file
and its sidecar; ``data.source: tokens`` trains on it memory-mapped, reading a step's windows only;
a file that cannot feed the model is refused before anything runs, naming the file and the fix."""

import json
import re
import subprocess
import sys

import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from parallel4d.cli import main  # noqa: E402
from parallel4d.config import ConfigError, make_config  # noqa: E402
from parallel4d.data import build_dataset  # noqa: E402

TEXTS = ["def add(a, b):\n    return a + b\n" * 20, "class Point:\n    x: int = 0\n    y: int = 0\n" * 15]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A small BPE tokenizer trained by `tokenizers` itself, with <|endoftext|>: its tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def token_file(tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    inputs = []
    for i, text in enumerate(TEXTS):
        (tmp / f"{i}.py").write_text(text)
        inputs.append(str(tmp / f"{i}.py"))
    assert main(["tokenize", "--tokenizer", tokenizer, *inputs, "-o", str(tmp / "train.bin"), "--workers", "2"]) == 0
    return tmp / "train.bin"


def test_tokenize_writes_each_document_and_its_end_token(tokenizer, token_file):
    tok = tokenizers.Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    want = [i for text in TEXTS for i in tok.encode(text, add_special_tokens=False).ids + [eos]]
    meta = json.loads(token_file.with_suffix(".json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokens"] == len(want) and meta["eos_token_id"] == eos
    assert meta["vocab_size"] == tok.get_vocab_size() <= 300
    got = torch.from_file(str(token_file), size=meta["tokens"], dtype=torch.uint16).to(torch.int64)
    assert got.tolist() == want


def test_a_tokens_job_trains_on_the_files_windows(token_file):
    cfg = make_config({"data": {"source": "tokens", "path": str(token_file), "batch_size": 4},
                       "model": {"vocab_size": 320, "seq_len": 16}})
    meta = json.loads(token_file.with_suffix(".json").read_text())
    every = torch.from_file(str(token_file), size=meta["tokens"], dtype=torch.uint16).to(torch.int64)
    x, y = build_dataset(cfg).batch(3)
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    for row, nxt in zip(x, y):  # each row is a window of the file
        starts = [s for s in range(len(every) - 16) if torch.equal(every[s:s + 16], row)]
        assert starts and torch.equal(every[starts[0] + 1:starts[0] + 17], nxt)
    from parallel4d import launch

    out = launch({**cfg.model_dump(mode="json"), "train": {"steps": 30, "out_dir": str(token_file.parent / "run"),
                                                           "log_every": 100},
                  "optimizer": {"lr": 3e-3}})
    assert out["losses"][-1] < 0.7 * out["losses"][0]


def test_a_big_token_file_is_never_read_whole(tmp_path):
    """A 2 GiB token file (sparse): building the dataset and reading 20 batches of 64 windows grows the
    process's peak resident memory by less than 1/8 of the file. (What it grows by, ~90 MB, is mostly
    the kernel's fault-around: each window maps up to 64 kB of file pages around the 1 kB it reads.)"""
    path = tmp_path / "big.bin"
    tokens = 2**30
    with open(path, "wb") as f:
        f.truncate(2 * tokens)
    path.with_suffix(".json").write_text(json.dumps({"dtype": "uint16", "tokens": tokens, "vocab_size": 256}))
    script = f"""
import resource
from parallel4d.config import make_config
from parallel4d.data import build_dataset
def peak(): return int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]) * 1024
cfg = make_config({{"data": {{"source": "tokens", "path": {str(path)!r}, "batch_size": 64}},
                   "model": {{"seq_len": 512}}}})
before = peak()
data = build_dataset(cfg)
for step in range(20):
    data.batch(step)
print(peak() - before)
"""
    grown = int(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout)
    assert grown < 2 * tokens / 8, grown


def test_token_files_that_cannot_feed_the_model_are_refused(token_file, tmp_path):
    def refused(path, **model):
        with pytest.raises(ConfigError) as err:
            make_config({"data": {"source": "tokens", "path": str(path)}, "model": {"seq_len": 16, **model}})
        return str(err.value)

    msg = refused(token_file, vocab_size=256)
    assert f"data.path='{token_file}' was tokenized with a vocabulary of" in msg and "model.vocab_size≥" in msg
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    empty.with_suffix(".json").write_text(json.dumps({"dtype": "uint16", "tokens": 0, "vocab_size": 256}))
    assert "is empty; tokenize some text into it" in refused(empty)
    cut = tmp_path / "cut.bin"
    cut.write_bytes(token_file.read_bytes()[:-2])
    cut.with_suffix(".json").write_text(token_file.with_suffix(".json").read_text())
    assert "(truncated or another file's sidecar?)" in refused(cut, vocab_size=320)
    alone = tmp_path / "alone.bin"
    alone.write_bytes(b"\0" * 100)
    assert "cannot read its sidecar" in refused(alone)
    with pytest.raises(ConfigError, match="data.source=tokens needs data.path"):
        make_config({"data": {"source": "tokens"}})
    assert main(["tokenize", "--tokenizer", str(tmp_path), str(empty), "-o", str(tmp_path / "x.bin")]) == 2


def counting_file(path, n):
    """A token file whose token at position i is i: a window's first token is where it starts."""
    torch.arange(n, dtype=torch.int32).numpy().tofile(path)
    path.with_suffix(".json").write_text(json.dumps({"dtype": "uint32", "tokens": n, "vocab_size": n}))
    return path


def test_validation_holds_out_the_end_of_the_data(tmp_path):
    """``data.val_fraction``: training windows lie in the first part, validation windows in the last
    (the same ones at every evaluation); without it, training draws from the whole file."""
    from parallel4d.data import build_validation

    n, seq = 4000, 8
    path = counting_file(tmp_path / "count.bin", n)
    base = {"data": {"source": "tokens", "path": str(path), "batch_size": 64}, "model": {"vocab_size": n, "seq_len": seq}}
    cfg = make_config({**base, "data": {**base["data"], "val_fraction": 0.25}, "train": {"eval_every": 10}})
    train, val = build_dataset(cfg), build_validation(cfg)
    cut = int(n * 0.75)
    train_starts = torch.cat([train.batch(step)[0][:, 0] for step in range(20)])
    val_starts = torch.cat([val.batch(k)[0][:, 0] for k in range(4)])
    assert train_starts.max() + seq + 1 <= cut and train_starts.min() < cut // 4  # spread over the first part
    assert val_starts.min() >= cut and val_starts.max() + seq + 1 <= n
    assert torch.equal(val.batch(2)[0], val.batch(2)[0])
    whole = torch.cat([build_dataset(make_config(base)).batch(step)[0][:, 0] for step in range(20)])
    assert whole.max() > cut  # without a fraction the whole file trains


def test_text_validation_holds_out_the_end_of_the_corpus():
    from parallel4d.data import build_validation

    text = make_config({"data": {"source": "text", "val_fraction": 0.1, "max_bytes": 100_000},
                        "model": {"vocab_size": 256, "seq_len": 16}, "train": {"eval_every": 5}})
    corpus, held = build_dataset(text), build_validation(text)
    assert corpus.hi == held.source.lo == int(len(corpus.data) * 0.9) and held.source.hi == len(corpus.data)


@pytest.mark.parametrize("data, train, words", [
    ({"source": "text", "val_fraction": 0.1}, {}, "train.eval_every is unset"),
    ({"source": "text"}, {"eval_every": 5}, "train.eval_every needs held-out data: set data.val_fraction"),
    ({"source": "synthetic", "val_fraction": 0.1}, {"eval_every": 5}, "synthetic data has nothing to hold out"),
    ({"source": "text", "val_path": "x.bin"}, {"eval_every": 5}, "data.val_path is a token file"),
    ({"source": "text", "val_path": "x.bin", "val_fraction": 0.1}, {"eval_every": 5}, "keep one"),
    ({"source": "synthetic", "val_fraction": 1.5}, {}, "data.val_fraction"),
])
def test_validation_fields_that_cannot_work_are_refused(data, train, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        make_config({"data": data, "train": train})


def test_a_validation_token_file_is_checked_like_the_training_one(token_file, tmp_path):
    alone = tmp_path / "val.bin"
    alone.write_bytes(b"\0" * 100)
    with pytest.raises(ConfigError, match=re.escape(f"data.val_path='{alone}': cannot read its sidecar")):
        make_config({"data": {"source": "tokens", "path": str(token_file), "val_path": str(alone)},
                     "model": {"vocab_size": 320, "seq_len": 8}, "train": {"eval_every": 5}})


def test_a_rank_reads_only_its_rows(tmp_path):
    """``batch(step, rows)`` reads those windows from the file and no other; they equal the same rows
    of the whole batch (the engine takes only them: ``engine.local_rows``)."""
    path = counting_file(tmp_path / "count.bin", 4000)
    ds = build_dataset(make_config({"data": {"source": "tokens", "path": str(path), "batch_size": 8},
                                    "model": {"vocab_size": 4000, "seq_len": 8}}))
    whole = ds.batch(5)
    reads = []

    class Recorded:
        def __init__(self, tokens):
            self.tokens = tokens

        def __len__(self):
            return len(self.tokens)

        def __getitem__(self, index):
            reads.append(index)
            return self.tokens[index]

    ds.tokens = Recorded(ds.tokens)
    part = ds.batch(5, range(2, 4))
    assert len(reads) == 2 and all(r.stop - r.start == 9 for r in reads)
    for got, want in zip(part, whole):
        assert torch.equal(got[2:4], want[2:4]) and not got[:2].any() and not got[4:].any()


def test_text_globs_pick_the_corpus_files(tmp_path):
    """``data.text_glob``: the files any pattern matches, in path order; patterns that match too
    little are refused naming the field."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("B" * 600)
    (tmp_path / "docs" / "a.md").write_text("A" * 600)
    (tmp_path / "skip.py").write_text("P" * 600)
    cfg = make_config({"data": {"source": "text", "text_root": str(tmp_path), "text_glob": ["**/*.md"],
                                "max_bytes": 1200}, "model": {"vocab_size": 256, "seq_len": 16}})
    corpus = build_dataset(cfg).data
    assert bytes(corpus.tolist()) == b"A" * 600 + b"B" * 600
    with pytest.raises(ConfigError, match=re.escape("data.text_glob=['*.md'] matches 0 bytes of files")):
        make_config({"data": {"source": "text", "text_root": str(tmp_path), "text_glob": ["*.md"]}})
    with pytest.raises(ConfigError, match="holds 600 bytes of .py files"):
        make_config({"data": {"source": "text", "text_root": str(tmp_path)}})
    with pytest.raises(ConfigError, match="data.text_glob is read with data.source=text"):
        make_config({"data": {"text_glob": ["*.md"]}})


def test_generate_decodes_with_the_token_files_tokenizer(tokenizer, token_file):
    """``parallel4d generate`` on a run of a token file: text in and out through the tokenizer its
    sidecar names, as ``tokenizers`` itself encodes and decodes."""
    from parallel4d.generate import text_codec

    encode, decode = text_codec(token_file.parent, {"data": {"source": "tokens", "path": str(token_file)},
                                                    "model": {"vocab_size": 320}})
    tok = tokenizers.Tokenizer.from_file(tokenizer)
    text = "def add(a, b):\n    return a + b\n"
    assert encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert decode(encode(text)) == tok.decode(tok.encode(text, add_special_tokens=False).ids)
    assert len(encode(text)) < len(text.encode())  # tokens, not bytes
