"""The data's rules: the global batch's split (data replicas, grid rows, micro-batches), the data
source and what it reads (vocabulary, text corpus, token files), packed documents, and the held-out
validation data.
The token files' own rules live with their format in ``data/token_files.py``."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from parallel4d.config.rules.common import FIELD_NAMES, closest, divisors, near_multiples, or_list
from parallel4d.data.text_files import corpus_bytes, stdlib_root
from parallel4d.data.token_files import read_sidecar, token_file_problems
from parallel4d.data.tokenizer_identity import VOCABULARY_FILES, describe, is_byte_level

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config


def batch_problem(batch: int, microbatches: int, split: Iterable[tuple[str, int]] = (),
                  field: str = FIELD_NAMES["batch"], micro_field: str = FIELD_NAMES["microbatches"]) -> Optional[str]:
    """The global batch is cut into ``split``'s parts (named factors: ``("parallel.dp", 2), ("q", 2)``, or
    a bare number as ``("2", 2)``), each into ``microbatches``: ``batch % (∏split · microbatches) == 0``.
    None when it holds, else the message, with both fixes when changing the micro-batches suffices."""
    split = list(split)
    parts = math.prod(v for _, v in split)
    per = parts * microbatches
    if batch >= 1 and batch % per == 0:
        return None
    what = "·".join([n for n, _ in split] + [micro_field])
    if any(not n.isdigit() for n, _ in split):  # named factors: show their values too
        what += " = " + "·".join(str(v) for _, v in split + [("", microbatches)])
    fix = f"use {field}={near_multiples(batch, per)}"
    if batch >= parts and batch % parts == 0:
        fix += f" or {micro_field}={or_list(closest(divisors(batch // parts), microbatches))}"
    return f"{field}={batch} is not divisible by {what} = {per}; {fix}"


def batch_split_problems(cfg: Config) -> list[str]:
    """``data.batch_size`` over the data replicas, the grid rows and the micro-batches."""
    p = cfg.parallel
    return list(filter(None, [batch_problem(cfg.data.batch_size, cfg.pipeline.microbatches,
                                            [("parallel.dp", p.dp), ("q", p.q)])]))


def source_problems(cfg: Config) -> list[str]:
    """What ``data.source`` needs (a vocabulary it fits, a corpus, a token file), and the fields
    only another source reads."""
    d, m, out = cfg.data, cfg.model, []
    if d.source == "synthetic" and m.vocab_size < 2:
        out.append("model.vocab_size must be ≥ 2")
    if d.source == "text" and m.vocab_size < 256:
        out.append(f"data.source=text is byte-level and needs model.vocab_size≥256, got {m.vocab_size}; use 256")
    if d.source == "text" and (d.text_root or d.text_glob):
        out += _text_root_problems(d.text_root, d.text_glob)
    elif d.text_glob:
        out.append(f"data.text_glob is read with data.source=text, not {d.source}; remove it")
    if d.source == "tokens":
        out += (token_file_problems(d.path, m.vocab_size, m.seq_len) if d.path else
                ["data.source=tokens needs data.path (a .bin file from `parallel4d tokenize`)"])
    elif d.path:
        out.append(f"data.path is read with data.source=tokens, not {d.source}; set data.source=tokens "
                   "or remove data.path")
    return out


def byte_text_problems(cfg: Config) -> list[str]:
    """``data.source: text`` feeds each text's UTF-8 bytes as ids 0–255: refused under a
    ``model.pretrained`` whose tokenizer is not byte-level (:func:`.tokenizer_identity.is_byte_level`),
    to which those ids are other tokens. A directory with no tokenizer files at all (parallel4d's own
    byte models export none) has nothing to compare: its ids are taken as bytes, as they were trained.
    Run before any worker starts (``launcher.preflight``), with the model's files: it imports
    ``tokenizers`` (the hf extra) for a tokenizer.json of at most 256 entries."""
    d, pretrained = cfg.data, cfg.model.pretrained
    if d.source != "text" or not pretrained:
        return []
    tokenizer = Path(pretrained) / "tokenizer.json"
    if not tokenizer.is_file():
        others = [name for name in VOCABULARY_FILES if (Path(pretrained) / name).is_file()]
        if not others:
            return []
        return [f"data.source=text feeds the text's UTF-8 bytes as token ids 0–255, but model.pretrained="
                f"{pretrained!r} has a tokenizer ({', '.join(others)}), to which those ids are other tokens, and no "
                "tokenizer.json to tokenize with; write one with transformers (`AutoTokenizer.from_pretrained("
                f"{pretrained!r}).save_pretrained({pretrained!r})`), then {_tokenize_fix(cfg, tokenizer)}"]
    try:
        if is_byte_level(tokenizer):
            return []
        what = describe(tokenizer)
    except ImportError as e:
        return [f"data.source=text under model.pretrained={pretrained!r}: telling whether its tokenizer.json is "
                f"byte-level needs Hugging Face tokenizers ({e.name} is missing): pip install 'parallel4d[hf]'"]
    except ValueError as e:
        return [f"model.pretrained={pretrained!r}: its {e}"]
    return [f"data.source=text feeds the text's UTF-8 bytes as token ids 0–255, but model.pretrained={pretrained!r} "
            f"has {what} ({tokenizer}), not byte-level: to the model those ids are other tokens; "
            f"{_tokenize_fix(cfg, tokenizer)}"]


def _tokenize_fix(cfg: Config, tokenizer: Path) -> str:
    """The command that tokenizes ``data.source: text``'s corpus with ``tokenizer``, and the fields to set."""
    d = cfg.data
    root = shlex.quote(str(d.text_root or stdlib_root()))
    if d.text_glob:  # the shell expands the patterns as the corpus does (** under bash's globstar)
        inputs = " ".join(f"{root}/{pattern}" for pattern in d.text_glob)
        shell = " (bash: `shopt -s globstar` first)" if any("**" in p for p in d.text_glob) else ""
    else:  # every .py file, as the corpus walks them
        inputs = f"$(find {root} -name '*.py' -not -path '*/site-packages/*' -not -path '*/__pycache__/*' | sort)"
        shell = ""
    unset = [f for f, v in (("data.text_root", d.text_root), ("data.text_glob", d.text_glob)) if v]
    return (f"tokenize the text with the model's tokenizer: `parallel4d tokenize --tokenizer {shlex.quote(str(tokenizer))} "
            f"{inputs} -o train.bin`{shell}, then set data.source=tokens and data.path=train.bin"
            + (f" and remove {' and '.join(unset)}" if unset else ""))


_CORPUS_MIN_BYTES = 1024  # data.read_corpus refuses less


def _text_root_problems(root: str | None, patterns: list[str] | None) -> list[str]:
    """What ``data.read_corpus`` would refuse in a worker: no directory, or too few bytes of its files."""
    where = f"data.text_root={root!r}" if root else "the standard library (data.text_root unset)"
    if root and not Path(root).is_dir():
        return [f"data.text_root={root!r} is not a directory; point it at a folder of text files or leave it "
                "unset to use Python's standard library"]
    found = corpus_bytes(root, patterns, _CORPUS_MIN_BYTES)
    if found >= _CORPUS_MIN_BYTES:
        return []
    if patterns:
        return [f"data.text_glob={patterns} matches {found} bytes of files under {where} and data.source=text "
                f"needs ≥ {_CORPUS_MIN_BYTES}; fix the patterns (relative to data.text_root, e.g. '**/*.md')"]
    return [f"{where} holds {found} bytes of .py files (without data.text_glob the corpus reads .py files only) "
            f"and data.source=text needs ≥ {_CORPUS_MIN_BYTES}; point it at a folder of .py files, set "
            "data.text_glob, or leave data.text_root unset to use Python's standard library"]


def eod_token(cfg: Config) -> int | None:
    """The end-of-document token of packed documents: ``data.eod_token``, else the token file's
    ``eos_token_id`` (``parallel4d tokenize`` ends every file with it); None when neither says."""
    d = cfg.data
    if d.eod_token is not None or d.source != "tokens" or not d.path:
        return d.eod_token
    try:
        eos = read_sidecar(d.path).get("eos_token_id")
    except ValueError:  # source_problems names the unreadable sidecar
        return None
    return eos if isinstance(eos, int) else None


def packing_problems(cfg: Config) -> list[str]:
    """``data.packing: documents``: an end-of-document token the vocabulary holds, and nothing that
    cannot follow documents (DeepSpeed's engine, a compiled block, dynamic rotary)."""
    d, m = cfg.data, cfg.model
    if d.packing == "none":
        return ([] if d.eod_token is None else
                [f"data.eod_token={d.eod_token} is read with data.packing=documents; set data.packing=documents "
                 "or remove data.eod_token"]) + _unpacked_mask_problems(cfg)
    eod, out = eod_token(cfg), []
    if eod is None:
        where = ("its sidecar names no eos_token_id (tokenized by an older parallel4d); " if d.source == "tokens"
                 else "")
        out.append(f"data.packing=documents needs the end-of-document token: {where}set data.eod_token to the id "
                   "that ends each document")
    elif eod >= m.vocab_size:
        out.append(f"data.eod_token={eod} is not below model.vocab_size={m.vocab_size}; use the tokenizer's "
                   "end-of-document id")
    if cfg.deepspeed is not None:
        out.append("data.packing=documents with a deepspeed: section: each micro-batch's documents are passed by "
                   "parallel4d's own engine only; remove one of them")
    if cfg.train.compile != "none":
        out.append(f"data.packing=documents with train.compile={cfg.train.compile}: the documents change every "
                   "micro-batch and would recompile each block; set train.compile=none")
    scaling = m.rope_scaling
    if scaling is not None and scaling.rope_type == "dynamic":
        out.append("data.packing=documents with model.rope_scaling rope_type=dynamic: dynamic rotary scales by "
                   "the sequence's length, which packed documents do not define; use linear, yarn or llama3 "
                   "scaling, or data.packing=none")
    return out


def _has_loss_mask(path: str | None) -> bool:
    try:
        return bool(path) and "loss_mask" in read_sidecar(path)
    except ValueError:  # source_problems names the unreadable sidecar
        return False


def has_loss_mask(cfg: Config) -> bool:
    """Whether the job's token files (``data.path``, ``data.val_path``) carry a loss mask (chat data): the
    ranks' and micro-batches' shares of a batch then hold different numbers of valid targets, and the engine
    weighs each one's summed loss by the whole batch's count (``engine/batch.py`` loss_weight)."""
    d = cfg.data
    return d.source == "tokens" and any(_has_loss_mask(f) for f in (d.path, d.val_path))


def _unpacked_mask_problems(cfg: Config) -> list[str]:
    """A token file with a loss mask (chat data) under a ``deepspeed:`` section only where one loss averages
    the whole batch: DeepSpeed's engine takes each rank's and micro-batch's mean of its own answer tokens,
    whose count differs between them, so a split batch would average means (parallel4d's own engine weighs
    every token by the whole batch's count: exact in every layout)."""
    d, p = cfg.data, cfg.parallel
    split = [f"{name}={n}" for name, n in (("parallel.dp", p.dp), ("parallel.sp", p.sp), ("parallel.tp", p.tp),
                                           ("pipeline.microbatches", cfg.pipeline.microbatches)) if n > 1]
    masked = [(field, f) for field, f in (("data.path", d.path), ("data.val_path", d.val_path)) if _has_loss_mask(f)]
    if cfg.deepspeed is None or d.source != "tokens" or not split or not masked:
        return []
    return [f"{masked[0][0]}={masked[0][1]!r} has a loss mask (chat data) and {', '.join(split)} split the batch "
            "under a deepspeed: section, whose engine averages each part's own answer tokens (their counts differ); "
            "remove the deepspeed: section (parallel4d's engine weighs every answer token by the whole batch's "
            "count in every layout)"]


def validation_problems(cfg: Config) -> list[str]:
    """The held-out data (``data.val_path`` or ``data.val_fraction``) and ``train.eval_every``: one
    without the other, or with a source or a trainer that cannot hold out."""
    d, t, m = cfg.data, cfg.train, cfg.model
    if d.val_path and d.val_fraction:
        return ["data.val_path and data.val_fraction both name validation data; keep one"]
    if d.val_path and d.source != "tokens":
        return [f"data.val_path is a token file, read with data.source=tokens, not {d.source}; use "
                "data.val_fraction to hold out part of the text"]
    if d.val_fraction and d.source == "synthetic":
        return ["data.val_fraction: synthetic data has nothing to hold out (validation draws sequences training "
                "never does); remove data.val_fraction"]
    if (d.val_path or d.val_fraction) and t.eval_every is None:
        return ["data.val_path / data.val_fraction set aside validation data but train.eval_every is unset; set "
                "train.eval_every (e.g. 100) or remove them"]
    if t.eval_every is not None and d.source != "synthetic" and not (d.val_path or d.val_fraction):
        return ["train.eval_every needs held-out data: set data.val_fraction (e.g. 0.05) or, with "
                "data.source=tokens, data.val_path"]
    if t.eval_every is not None and cfg.deepspeed is not None:
        return ["train.eval_every is not supported with a deepspeed: section yet; remove one of them"]
    if d.val_path:
        return token_file_problems(d.val_path, m.vocab_size, m.seq_len, field="data.val_path")
    return []
