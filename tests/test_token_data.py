"""Their own data (#16.1): ``parallel4d tokenize`` (Hugging Face ``tokenizers``) writes a token file
and its sidecar; ``data.source: tokens`` trains on it memory-mapped, reading a step's windows only;
a file that cannot feed the model is refused before anything runs, naming the file and the fix."""

import json
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
