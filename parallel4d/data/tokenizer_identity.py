"""What a Hugging Face ``tokenizer.json`` turns text into, standard library only (``tokenizers``, an
optional extra, is imported by :func:`is_byte_level` alone).

Two tokenizers give the same ids to every text when the parts of their files that decide the ids
are equal: the model (its type and settings, vocabulary, merges), the added and special tokens, the
normalizer and the pre-tokenizer. What only surrounds the ids is left out: the post-processor (the
special tokens a template adds around a text; ``parallel4d tokenize`` encodes without them), the
decoder (ids back to text), truncation, padding and the format's version. So a file re-saved by
transformers' ``save_pretrained`` (which adds a post-processor) is the same tokenizer, and a file
whose merges, vocabulary or normalizer changed is another one. :func:`fingerprint` hashes each
part on its own (a token file's sidecar records them), so a refusal can name the parts that differ.

Byte-level (:func:`is_byte_level`): the ids of every text are its UTF-8 bytes, 0–255, as the byte
corpus (``data.source: text``) feeds them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

#: the parts of a tokenizer.json that decide a text's ids, in the order a refusal names them
ID_PARTS = ("model", "vocab", "merges", "added_tokens", "normalizer", "pre_tokenizer")
#: what each part is called in a message
PART_WORDS = {"model": "model type or settings", "vocab": "vocabulary", "merges": "merges",
              "added_tokens": "added or special tokens", "normalizer": "normalizer", "pre_tokenizer": "pre-tokenizer"}
#: files of a tokenizer that has no tokenizer.json (sentencepiece, or a slow tokenizer's vocabulary)
VOCABULARY_FILES = ("tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt")


def read_tokenizer_json(path: str | Path) -> dict:
    """The parsed ``tokenizer.json`` at ``path``; ValueError naming the file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e}); give a tokenizer.json that `tokenizers` wrote") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise ValueError(f"{path} has no \"model\" section: not a Hugging Face tokenizer.json")
    return doc


def _merge_pair(merge) -> list:
    """A merge as its pair: ``"a b"`` (tokenizers before 0.20) and ``["a", "b"]`` (since) alike."""
    return merge.split(" ") if isinstance(merge, str) else list(merge)


def id_parts(doc: dict) -> dict:
    """The parts of a parsed tokenizer.json that decide the ids (:data:`ID_PARTS`), written alike
    whichever ``tokenizers`` saved them: merges as pairs, a model setting that is null or false as
    absent (older versions leave out the flags newer ones write as false)."""
    model = dict(doc["model"])
    vocab, merges = model.pop("vocab", None), model.pop("merges", None) or []
    settings = {k: v for k, v in model.items() if v is not None and v is not False}
    added = sorted(doc.get("added_tokens") or [], key=lambda t: (t.get("id", -1), t.get("content", "")))
    return {"model": settings, "vocab": vocab, "merges": [_merge_pair(m) for m in merges], "added_tokens": added,
            "normalizer": doc.get("normalizer"), "pre_tokenizer": doc.get("pre_tokenizer")}


def _sha256_of(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(path: str | Path) -> dict[str, str]:
    """``{part: sha256}`` of each part of the tokenizer.json at ``path`` that decides the ids; equal
    fingerprints, equal ids for every text. ValueError naming the file when it is not one."""
    return {part: _sha256_of(value) for part, value in id_parts(read_tokenizer_json(path)).items()}


def differing_parts(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The parts (their words, :data:`PART_WORDS`) in which two fingerprints differ; [] for one tokenizer."""
    return [PART_WORDS.get(p, p) for p in dict.fromkeys([*ID_PARTS, *ours, *theirs]) if ours.get(p) != theirs.get(p)]


def describe(path: str | Path) -> str:
    """A tokenizer.json in a few words: ``a BPE tokenizer of 512 tokens with 250 merges``."""
    doc = read_tokenizer_json(path)
    model, vocab = doc["model"], doc["model"].get("vocab") or {}
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))  # Unigram's: a list
    size = len(ids | {t.get("id") for t in doc.get("added_tokens") or []})
    merges = len(model.get("merges") or [])
    return f"a {model.get('type', 'unknown')} tokenizer of {size} tokens" + (f" with {merges} merges" if merges else "")


def _utf8_probe() -> str:
    """A text holding every byte UTF-8 text can: all of ASCII (a letter first, then doubled spaces,
    so that a tokenizer adding a space before a text, dropping or merging spaces shows), every lead
    byte of a 2-, 3- and 4-byte character and every continuation byte."""
    pieces = [bytes([lead, 0x80]) for lead in range(0xC2, 0xE0)]  # 2-byte leads
    pieces += [bytes([0xC2, cont]) for cont in range(0x80, 0xC0)]  # every continuation byte
    pieces += [bytes([lead, 0xA0 if lead == 0xE0 else 0x80, 0x80]) for lead in range(0xE0, 0xF0)]
    pieces += [bytes([lead, 0x90 if lead == 0xF0 else 0x80, 0x80, 0x80]) for lead in range(0xF0, 0xF5)]
    ascii_ = "A  " + "".join(map(chr, range(128))) + "  a  "
    return ascii_ + "".join(p.decode("utf-8") for p in pieces) + " \n"


def is_byte_level(path: str | Path) -> bool:
    """Whether the tokenizer.json at ``path`` turns every text into its UTF-8 bytes, ids 0–255 (as
    the byte corpus and parallel4d's byte models do): a BPE model of at most 256 entries without
    merges and without a normalizer (so each character or byte maps to one entry of its own), that
    ``tokenizers`` itself encodes a text of every byte UTF-8 can hold into exactly those bytes.
    ValueError naming the file when it is not a tokenizer.json, ImportError without ``tokenizers``."""
    doc = read_tokenizer_json(path)
    model = doc["model"]
    if (model.get("type") != "BPE" or model.get("merges") or doc.get("normalizer") is not None
            or len(model.get("vocab") or {}) > 256):
        return False
    from tokenizers import Tokenizer  # the hf extra

    try:
        tok = Tokenizer.from_str(json.dumps(doc))
    except Exception as e:  # noqa: BLE001  tokenizers raises its own Exception for a file it cannot build
        raise ValueError(f"{path}: tokenizers cannot read it ({e})") from None
    probe = _utf8_probe()
    return tok.encode(probe, add_special_tokens=False).ids == list(probe.encode("utf-8"))
