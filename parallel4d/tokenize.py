"""``parallel4d tokenize``: text files → a token file (``data.source: tokens``) with Hugging Face
``tokenizers``, in parallel over the files, each document followed by an end-of-document token."""

from __future__ import annotations

import json
from array import array
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path

from .config import ConfigError
from .token_files import dtype_for, sidecar_path

# the end-of-document tokens of common tokenizers, tried in this order
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


def _tokenizer_file(tokenizer: str) -> Path:
    path = Path(tokenizer)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--tokenizer {tokenizer}: no tokenizer.json there; give a tokenizer.json file or a "
                          "Hugging Face model directory holding one")
    return path


@lru_cache(maxsize=4)  # once per process, not once per file
def _load(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ConfigError(f"parallel4d tokenize needs Hugging Face tokenizers ({e.name} is missing): "
                          "pip install 'parallel4d[hf]'") from None
    return Tokenizer.from_file(str(path))


def _eos_id(tok, eos_token: str | None) -> int:
    names = (eos_token,) if eos_token else EOS_NAMES
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    raise ConfigError(f"the tokenizer has none of the end-of-document tokens {', '.join(names)}; name one with "
                      "--eos-token")


def _encode(job: tuple[str, str, int]) -> list[int]:
    tokenizer_file, text_file, eos = job
    text = Path(text_file).read_text(encoding="utf-8", errors="replace")
    return _load(Path(tokenizer_file)).encode(text, add_special_tokens=False).ids + [eos]


def tokenize(tokenizer: str, inputs: list[str], out: str, eos_token: str | None = None, workers: int = 1,
             progress: bool = True) -> dict:
    """Tokenize ``inputs`` (in this order) into ``out`` and its sidecar; returns the sidecar."""
    path = _tokenizer_file(tokenizer)
    tok = _load(path)
    eos, vocab = _eos_id(tok, eos_token), tok.get_vocab_size(with_added_tokens=True)
    for f in inputs:
        p = Path(f)
        if not p.is_file():
            raise ConfigError(f"{f}: no such file; give text files to tokenize")
        if p.stat().st_size == 0:
            raise ConfigError(f"{f} is empty; leave it out of the inputs")
    dtype = dtype_for(vocab)
    jobs = [(str(path), f, eos) for f in inputs]
    total = 0
    pool = ProcessPoolExecutor(max_workers=workers) if workers > 1 else None
    try:
        docs = pool.map(_encode, jobs) if pool else map(_encode, jobs)
        if progress:
            from tqdm import tqdm

            docs = tqdm(docs, total=len(jobs), unit="file", desc="tokenize")
        with open(out, "wb") as sink:
            for ids in docs:
                array("H" if dtype == "uint16" else "I", ids).tofile(sink)
                total += len(ids)
    finally:
        if pool:
            pool.shutdown()
    meta = {"dtype": dtype, "tokens": total, "vocab_size": vocab, "tokenizer": str(path.resolve()),
            "eos_token_id": eos, "files": len(inputs)}
    sidecar_path(out).write_text(json.dumps(meta, indent=1) + "\n")
    return meta
