"""Their own data (#16.1): ``parallel4d tokenize`` (Hugging Face ``tokenizers``) writes a token file
and its sidecar; ``data.source: tokens`` trains on it memory-mapped, reading a step's windows only;
a file that cannot feed the model is refused before anything runs, naming the file and the fix."""

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from parallel4d.tools.cli import main  # noqa: E402
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.data.batches import build_dataset  # noqa: E402

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
from parallel4d.config.load import make_config
from parallel4d.data.batches import build_dataset
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
    from parallel4d.data.batches import build_validation

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
    from parallel4d.data.batches import build_validation

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


@pytest.mark.parametrize("rows", [range(2, 4), [1, 5]], ids=["a block", "a share of each of 2 micro-batches"])
def test_a_rank_reads_only_its_rows(tmp_path, rows):
    """``batch(step, rows)`` reads those windows from the file and no other; they equal the same rows
    of the whole batch (the engine takes only them: ``engine.local_rows``, a rank's rows of each micro-batch)."""
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
    part = ds.batch(5, rows)
    assert len(reads) == 2 and all(r.stop - r.start == 9 for r in reads)
    others = [r for r in range(8) if r not in rows]
    for got, want in zip(part, whole):
        assert torch.equal(got[list(rows)], want[list(rows)]) and not got[others].any()


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
    from parallel4d.tools.generate import text_codec

    encode, decode = text_codec(token_file.parent, {"data": {"source": "tokens", "path": str(token_file)},
                                                    "model": {"vocab_size": 320}})
    tok = tokenizers.Tokenizer.from_file(tokenizer)
    text = "def add(a, b):\n    return a + b\n"
    assert encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert decode(encode(text)) == tok.decode(tok.encode(text, add_special_tokens=False).ids)
    assert len(encode(text)) < len(text.encode())  # tokens, not bytes


# ---- #26: inputs and outputs never alias; the writes are all or nothing; token files verified ----

def _snapshot(directory):
    """Every file under ``directory`` (dot files too) and its bytes."""
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def workdir(tokenizer, tmp_path):
    """Two text inputs, a copy of the tokenizer and a notes.json text input, side by side."""
    for i, text in enumerate(TEXTS):
        (tmp_path / f"{i}.txt").write_text(text)
    (tmp_path / "notes.json").write_text(TEXTS[0])
    (tmp_path / "tokenizer.json").write_bytes(open(tokenizer, "rb").read())
    (tmp_path / "tok.bpe").write_bytes(open(tokenizer, "rb").read())  # a tokenizer file by another name
    return tmp_path


@pytest.mark.parametrize("out, words", [
    ("0.txt", "the token file {d}/0.txt is an input"),
    ("tok.bpe", "the token file {d}/tok.bpe is the tokenizer"),
    ("tokenizer.bin", "its sidecar {d}/tokenizer.json is the tokenizer"),
    ("notes.bin", "its sidecar {d}/notes.json is an input"),
    ("fresh.json", "its sidecar (the token file's name with .json) is {d}/fresh.json, the token file itself; "
                   "name the token file {d}/fresh.bin"),
    ("hard.bin", "the token file {d}/hard.bin is an input ({d}/1.txt)"),
    ("soft.bin", "the token file {d}/soft.bin is an input ({d}/0.txt)"),
])
def test_tokenize_refuses_an_output_that_would_write_over_its_inputs(workdir, capsys, out, words):
    """``-o`` onto an input, onto the tokenizer, a sidecar that is one of them or the token file
    itself, and a hard or symbolic link to an input: exit 2 with one line naming the path and the
    fix, and not a byte written anywhere."""
    import os

    os.link(workdir / "1.txt", workdir / "hard.bin")
    os.symlink(workdir / "0.txt", workdir / "soft.bin")
    before = _snapshot(workdir)
    inputs = [str(workdir / n) for n in ("0.txt", "1.txt", "notes.json")]
    tok = workdir / ("tok.bpe" if out == "tok.bpe" else "tokenizer.json")
    code = main(["tokenize", "--tokenizer", str(tok), *inputs, "-o", str(workdir / out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words.format(d=workdir) in err, err
    assert "choose another -o" in err or "name the token file" in err
    assert _snapshot(workdir) == before


def test_tokenize_creates_the_output_directory(tokenizer, workdir):
    out = workdir / "data" / "deep" / "train.bin"
    assert main(["tokenize", "--tokenizer", tokenizer, str(workdir / "0.txt"), "-o", str(out)]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["tokens"] * 2 == out.stat().st_size > 0


def test_tokenize_through_a_symlink_writes_its_target(tokenizer, workdir):
    """A token file kept elsewhere behind a link stays there: the link is followed, not replaced."""
    import os

    (workdir / "big-disk").mkdir()
    (workdir / "big-disk" / "train.bin").write_bytes(b"old")
    os.symlink(workdir / "big-disk" / "train.bin", workdir / "train.bin")
    assert main(["tokenize", "--tokenizer", tokenizer, str(workdir / "0.txt"), "-o", str(workdir / "train.bin")]) == 0
    assert (workdir / "train.bin").is_symlink() and (workdir / "big-disk" / "train.bin").stat().st_size > 3
    assert json.loads((workdir / "train.json").read_text())["tokens"] * 2 == (workdir / "train.bin").stat().st_size


def test_tokenize_records_the_checksum_largest_id_and_tokenizer(tokenizer, token_file):
    import hashlib

    meta = json.loads(token_file.with_suffix(".json").read_text())
    ids = torch.from_file(str(token_file), size=meta["tokens"], dtype=torch.uint16).to(torch.int64)
    assert meta["sha256"] == hashlib.sha256(token_file.read_bytes()).hexdigest()
    assert meta["max_id"] == int(ids.max()) and meta["tokenizer"] == str(Path(tokenizer).resolve())
    assert meta["tokenizer_sha256"] == hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()


def _fail_on_second_document(monkeypatch, error):
    import parallel4d.data.tokenize as tokenize_module

    real, calls = tokenize_module._write_chunk, []

    def write_then_fail(sink, data):
        calls.append(len(data))
        real(sink, data[: len(data) // 2])  # a document half written
        if len(calls) == 2:
            raise error
        real(sink, data[len(data) // 2:])

    monkeypatch.setattr(tokenize_module, "_write_chunk", write_then_fail)
    return calls


@pytest.mark.parametrize("error, code, words", [
    (KeyboardInterrupt(), 130, "tokenize interrupted; nothing was half written"),
    (OSError(28, "No space left on device", "train.bin"), 2, "(No space left on device: train.bin); {out} and its "
                                                              "sidecar were left as they were"),
])
def test_an_interrupted_tokenize_leaves_the_earlier_output_and_no_temporary_file(tokenizer, workdir, capsys,
                                                                                 monkeypatch, error, code, words):
    out = workdir / "data" / "train.bin"
    args = ["tokenize", "--tokenizer", tokenizer, str(workdir / "0.txt"), str(workdir / "1.txt"), "-o", str(out)]
    assert main(args[:-3] + args[-2:]) == 0  # the earlier output: the first file alone
    before = _snapshot(workdir)
    calls = _fail_on_second_document(monkeypatch, error)
    assert main(args) == code and len(calls) == 2
    assert words.format(out=out) in capsys.readouterr().err
    assert _snapshot(workdir) == before  # no temporary file left, no byte of the earlier output changed


def test_an_interruption_between_the_two_renames_still_pairs_the_files(tokenizer, workdir, monkeypatch):
    """Ctrl-C just after the token file is renamed into place: its sidecar follows, never the new
    file with the old sidecar."""
    import hashlib
    import os

    import parallel4d.data.tokenize as tokenize_module

    out = workdir / "train.bin"
    assert main(["tokenize", "--tokenizer", tokenizer, str(workdir / "0.txt"), "-o", str(out)]) == 0
    renamed, real = [], os.replace

    def replace_then_interrupt(src, dst):
        real(src, dst)
        renamed.append(dst)
        if len(renamed) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(tokenize_module.os, "replace", replace_then_interrupt)
    assert main(["tokenize", "--tokenizer", tokenizer, str(workdir / "1.txt"), "-o", str(out)]) == 130
    assert [Path(p).name for p in renamed] == ["train.bin", "train.json"]
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert not [p for p in workdir.iterdir() if p.name.endswith(".tmp")]


def _copy_token_file(token_file, directory, name="train.bin"):
    """The fixture's token file and sidecar under ``name`` (no stamp: not verified yet)."""
    out = directory / name
    out.write_bytes(token_file.read_bytes())
    out.with_suffix(".json").write_text(token_file.with_suffix(".json").read_text())
    return out


def _job_file(directory, data, **model):
    import yaml

    job = {"data": {"source": "tokens", **data}, "model": {"vocab_size": 320, "seq_len": 16, **model},
           "train": {"out_dir": str(directory / "run"), "steps": 2}}
    if "val_path" in data:
        job["train"]["eval_every"] = 1
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _flip_a_token(path, offset=7):
    """Another id at token ``offset``, still inside the vocabulary: only a checksum can tell."""
    with open(path, "r+b") as f:
        f.seek(2 * offset)
        old = int.from_bytes(f.read(2), sys.byteorder)
        f.seek(2 * offset)
        f.write((old ^ 1).to_bytes(2, sys.byteorder))


@pytest.mark.parametrize("field", ["data.path", "data.val_path"])
def test_a_token_file_changed_since_tokenize_is_refused_before_any_worker_starts(token_file, tmp_path, capsys,
                                                                                   monkeypatch, field):
    launch_module = importlib.import_module("parallel4d.launcher.launch")  # the package's `launch` is the function

    good = _copy_token_file(token_file, tmp_path, "good.bin")
    changed = _copy_token_file(token_file, tmp_path)
    data = {"path": str(changed)} if field == "data.path" else {"path": str(good), "val_path": str(changed)}
    job = _job_file(tmp_path, data)
    assert main(["validate", job]) == 0  # as written: accepted (and stamped)
    _flip_a_token(changed)
    assert main(["validate", job]) == 2
    want = (f"{field}='{changed}' changed since `parallel4d tokenize` wrote it (its sha256 differs from the one in "
            f"{changed.with_suffix('.json')}); tokenize it again")
    assert want in capsys.readouterr().err

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker started")

    monkeypatch.setattr(launch_module, "spawn", no_worker)
    with pytest.raises(ConfigError) as err:
        launch_module.launch(job)
    assert want in str(err.value)


def test_a_verified_token_file_is_hashed_once_until_it_changes(token_file, tmp_path, monkeypatch):
    """The stamp beside the file spares an unchanged file the hashing; a touch (mtime) or another file
    in its place (inode) hashes it again."""
    import os
    import time

    from parallel4d.data import token_files

    real, hashed = token_files.file_sha256, []
    monkeypatch.setattr(token_files, "file_sha256", lambda path, label=None: hashed.append(path) or real(path, label))
    path = _copy_token_file(token_file, tmp_path)
    time.sleep(0.05)  # a stamp in the clock tick of the file's last change is not trusted (racily clean)
    assert token_files.content_problems(path) == [] and len(hashed) == 1
    assert token_files.stamp_path(path).is_file()
    assert token_files.content_problems(path) == [] and len(hashed) == 1
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert token_files.content_problems(path) == [] and len(hashed) == 2
    time.sleep(0.05)
    assert token_files.content_problems(path) == [] and len(hashed) == 2
    os.replace(_copy_token_file(token_file, tmp_path, "copy.bin"), path)  # the same bytes in a new inode
    assert token_files.content_problems(path) == [] and len(hashed) == 3


def test_a_token_file_that_cannot_be_stamped_is_checked_every_time(token_file, tmp_path, monkeypatch):
    """Where the stamp cannot be written (here a directory stands in its place, as in a read-only data
    directory the rename fails), the check still passes, hashing each time, and leaves no temporary file."""
    from parallel4d.data import token_files

    real, hashed = token_files.file_sha256, []
    monkeypatch.setattr(token_files, "file_sha256", lambda path, label=None: hashed.append(path) or real(path, label))
    path = _copy_token_file(token_file, tmp_path)
    token_files.stamp_path(path).mkdir()
    assert token_files.content_problems(path) == [] and token_files.content_problems(path) == []
    assert len(hashed) == 2 and sorted(p.name for p in tmp_path.iterdir()) == [".train.bin.verified", "train.bin",
                                                                              "train.json"]


def test_hashing_a_big_file_says_how_far_it_is(token_file, tmp_path, monkeypatch, capsys):
    from parallel4d.data import token_files

    monkeypatch.setattr(token_files, "PROGRESS_BYTES", 1)
    monkeypatch.setattr(token_files, "HASH_BLOCK", 64)  # many blocks: the file is never read whole
    path = _copy_token_file(token_file, tmp_path)
    assert token_files.content_problems(path) == []
    err = capsys.readouterr().err
    assert f"[parallel4d] checking data.path='{path}': hashing" in err and "hashed" in err and "MB/s" in err


def test_an_old_sidecar_without_a_checksum_is_accepted_with_a_warning(tmp_path, capsys):
    path = counting_file(tmp_path / "count.bin", 400)
    assert main(["validate", _job_file(tmp_path, {"path": str(path)}, vocab_size=400)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"warning: data.path='{path}': its sidecar records no sha256" in err
    assert "tokenize it again to record one" in err


@pytest.mark.parametrize("field", ["data.path", "data.val_path"])
def test_an_id_beyond_the_vocabulary_names_the_file_and_the_offset(tmp_path, field):
    """An old sidecar (no checksum, no max_id) over a file with id 999 at token 5, every window covering
    it: the batch refuses it naming file, offsets and value, instead of an IndexError in the embedding."""
    from parallel4d.data.batches import build_validation

    path = tmp_path / "bad.bin"
    ids = torch.ones(11, dtype=torch.int16)
    ids[5] = 999
    ids.numpy().tofile(path)
    path.with_suffix(".json").write_text(json.dumps({"dtype": "uint16", "tokens": 11, "vocab_size": 100}))
    good = counting_file(tmp_path / "good.bin", 100)
    data = {"path": str(path)} if field == "data.path" else {"path": str(good), "val_path": str(path)}
    cfg = make_config({"data": {"source": "tokens", "batch_size": 2, **data}, "model": {"vocab_size": 100,
                                                                                          "seq_len": 8},
                       "train": {"eval_every": 1} if field == "data.val_path" else {}})
    source = build_dataset(cfg) if field == "data.path" else build_validation(cfg)
    with pytest.raises(ValueError, match=re.escape(f"{field}='{path}' holds token id 999 at token offset 5 (byte "
                                                   "offset 10), not below model.vocab_size=100")):
        source.batch(0)


def test_a_sidecars_largest_id_is_checked_against_the_vocabulary(token_file, tmp_path):
    """A sidecar whose vocab_size understates its ids (hand-edited, or another tool's): its max_id is
    what the embedding must cover."""
    path = _copy_token_file(token_file, tmp_path)
    meta = {**json.loads(path.with_suffix(".json").read_text()), "vocab_size": 20}
    path.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=re.escape(f"data.path='{path}' holds token id {meta['max_id']} (its "
                                                    f"sidecar's max_id) but model.vocab_size=40; set "
                                                    f"model.vocab_size≥{meta['max_id'] + 1}, or tokenize with the "
                                                    "model's tokenizer")):
        make_config({"data": {"source": "tokens", "path": str(path)}, "model": {"vocab_size": 40, "seq_len": 16}})
    make_config({"data": {"source": "tokens", "path": str(path)},
                 "model": {"vocab_size": meta["max_id"] + 1, "seq_len": 16}})


@pytest.mark.parametrize("field, value, words", [
    ("tokens", "5", "tokens '5' (an integer ≥ 0)"),
    ("vocab_size", True, "vocab_size True (an integer ≥ 1)"),
    ("max_id", -1, "max_id -1 (an integer ≥ 0)"),
    ("sha256", "abc", "sha256 'abc' (64 lowercase hex digits)"),
    ("tokenizer_fingerprint", {"vocab": "abc"}, "tokenizer_fingerprint {'vocab': 'abc'} (each part's 64 lowercase "
                                                "hex digits)"),
])
def test_a_sidecar_with_a_field_of_the_wrong_type_is_refused(token_file, tmp_path, field, value, words):
    path = _copy_token_file(token_file, tmp_path)
    meta = {**json.loads(path.with_suffix(".json").read_text()), field: value}
    path.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=re.escape(words + "; write it again with `parallel4d tokenize`")):
        make_config({"data": {"source": "tokens", "path": str(path)}, "model": {"vocab_size": 320, "seq_len": 16}})


def test_data_tokenized_with_another_tokenizer_than_the_pretrained_models_is_refused(tokenizer, token_file,
                                                                                     tmp_path, capsys):
    from parallel4d.models.build import build_dense, shape_from_config
    from parallel4d.models import hf

    model = tmp_path / "model"
    dense = make_config({"model": {"vocab_size": 320, "hidden": 32, "layers": 2, "heads": 4, "seq_len": 32}})
    hf.save_hf(build_dense(shape_from_config(dense.model), seed=0).state_dict(), dense.model, model)  # validate reads it
    (model / "tokenizer.json").write_bytes(Path(tokenizer).read_bytes())
    path = _copy_token_file(token_file, tmp_path)
    job = _job_file(tmp_path, {"path": str(path)}, pretrained=str(model))
    assert main(["validate", job]) == 0  # the model's own tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    other = Tokenizer(models.BPE())  # trained on other text: other merges and vocabulary
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(["print('hello, world')\n" * 30], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    other.save(str(model / "tokenizer.json"))
    assert main(["validate", job]) == 2
    err = capsys.readouterr().err
    assert (f"data.path='{path}' was tokenized with {Path(tokenizer).resolve()} but model.pretrained='{model}' has "
            f"another tokenizer.json (their vocabulary, merges differ)") in err
    assert f"tokenize again with --tokenizer {model / 'tokenizer.json'}" in err


def test_a_packed_tokens_job_ends_documents_at_the_files_end_token(token_file, single_rank):
    """``data.packing: documents`` on a file `parallel4d tokenize` wrote: the end-of-document token is the
    sidecar's eos_token_id (no data.eod_token), documents start after it, its target is ignored, and a
    step trains on the rest."""
    from parallel4d.config.rules.data import eod_token
    from parallel4d.data.packing import IGNORE, document_starts
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.batch import packed_step
    from parallel4d.engine.compose import compose

    eos = json.loads(token_file.with_suffix(".json").read_text())["eos_token_id"]
    cfg = make_config({"data": {"source": "tokens", "path": str(token_file), "batch_size": 4, "packing": "documents"},
                       "model": {"vocab_size": 320, "seq_len": 64}, "train": {"dtype": "float64"}})
    assert eod_token(cfg) == eos and cfg.data.eod_token is None
    data = build_dataset(cfg)
    x, y = next(b for b in map(data.batch, range(50)) if (b[0] == eos).any())  # windows crossing documents
    mesh = init_mesh(timeout_s=60)
    step = packed_step(mesh, x, y, eos, 1)
    assert torch.equal(step.targets == IGNORE, x == eos)
    assert torch.equal(step.microbatches[0].documents.ids, document_starts(x, eos).long().cumsum(1))
    engine = compose(cfg, mesh)
    assert engine.eod == eos and torch.isfinite(engine.train_step(x, y))
