"""``parallel4d tokenize``: text files → a token file (``data.source: tokens``) with Hugging Face
``tokenizers``, in parallel over the files, each document followed by an end-of-document token; or
chat/instruction data (``.jsonl`` files, or Hugging Face ``datasets`` saved to disk: :mod:`.chat`) → a token
file of conversations, each rendered with the model's chat template and followed by the end-of-document
token, and its loss mask
(:func:`~.token_files.loss_mask_path`: which tokens are answers, the only targets that carry loss).

Nothing a user has is written over by mistake or left half written: an output that is (or whose
sidecar is) one of the inputs or the tokenizer, by path or by inode, is refused, and so is one
:mod:`parallel4d.checkpoint.outputs` refuses (inside a checkpoint, a place that cannot be written); the
token file and its sidecar are written to temporary files beside them and renamed into place only when
both are complete, so a failure or Ctrl-C leaves an earlier output as it was and no temporary file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from array import array
from contextlib import nullcontext
from functools import lru_cache
from multiprocessing import Pool
from pathlib import Path

from parallel4d.config.errors import ConfigError
from parallel4d.checkpoint.files import fsync_dir, write_synced
from parallel4d.checkpoint.outputs import check_output, same_file, temporary_beside, through_link, user_path
from parallel4d.data.chat import chat_tokenizer, encode_conversation, is_saved_dataset, read_conversations
from parallel4d.data.token_files import (dtype_for, file_sha256, loss_mask_path, record_verified, sidecar_path,
                                         stamp_path)
from parallel4d.data.tokenizer_identity import fingerprint

# the end-of-document tokens of common tokenizers, tried in this order
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


def _tokenizer_file(tokenizer: str) -> Path:
    path = user_path(tokenizer)
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


def _check_inputs(inputs: list[Path]) -> None:
    for f in inputs:
        if is_saved_dataset(f):
            continue
        if f.is_dir():
            raise ConfigError(f"{f} is a directory, not a dataset saved by Hugging Face datasets (no state.json "
                              "there); give text files, .jsonl chat files or a directory `save_to_disk` wrote")
        if not f.is_file():
            raise ConfigError(f"{f}: no such file; give text files to tokenize")
        if f.stat().st_size == 0:
            raise ConfigError(f"{f} is empty; leave it out of the inputs")


def _refuse_aliases(out: Path, sources: list[tuple[Path, str]]) -> None:
    """ConfigError naming the path and the fix where writing ``out``, its sidecar or its stamp would
    write over one of ``sources`` (``(path, "an input")``, ``(path, "the tokenizer")``)."""
    side = sidecar_path(out)
    fix = f"choose another -o, e.g. {out.with_name(out.stem + '.tokens.bin')}"
    if same_file(out, side):
        raise ConfigError(f"-o {out}: its sidecar (the token file's name with .json) is {side}, the token file "
                          f"itself; name the token file {out.with_suffix('.bin')}")
    for target, what in ((out, "the token file"), (side, "its sidecar"), (stamp_path(out), "its stamp"),
                         (loss_mask_path(out), "its loss mask")):
        if target.is_dir():
            raise ConfigError(f"-o {out}: {what} {target} is a directory; give a file name, e.g. "
                              f"{target / 'tokens.bin'}")
        for source, kind in sources:
            if same_file(target, source):
                raise ConfigError(f"-o {out}: {what} {target} is {kind} ({source}), which tokenize would write "
                                  f"over; {fix}")


def _make_parent(out: Path) -> None:
    try:
        through_link(out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"-o {out}: cannot create its directory {out.parent} ({e.strerror}: {e.filename}); "
                          "choose a directory you can write to") from None


def _write_chunk(sink, data: bytes) -> None:
    sink.write(data)


def _write_tokens(tmp: Path, docs, dtype: str, mask_tmp: Path | None = None) -> tuple[int, int, str, dict | None]:
    """Each document's ids into ``tmp`` (``docs``: ids, or (ids, loss mask) pairs with ``mask_tmp``, the
    masks' bytes there): (tokens, largest id, sha256 of the bytes, the loss mask's sidecar entry or None)."""
    typecode = "H" if dtype == "uint16" else "I"
    total, max_id, digest, mask_digest, with_loss = 0, 0, hashlib.sha256(), hashlib.sha256(), 0
    with open(tmp, "wb") as sink, open(mask_tmp, "wb") if mask_tmp else nullcontext() as mask_sink:
        for doc in docs:
            ids, mask = doc if mask_sink else (doc, None)
            data = array(typecode, ids).tobytes()
            _write_chunk(sink, data)
            digest.update(data)
            total, max_id = total + len(ids), max(max_id, max(ids))
            if mask_sink:
                mask_sink.write(bytes(mask))
                mask_digest.update(bytes(mask))
                with_loss += sum(mask)
        for f in (sink, mask_sink) if mask_sink else (sink,):
            f.flush()
            os.fsync(f.fileno())
    mask_entry = {"sha256": mask_digest.hexdigest(), "tokens_with_loss": with_loss} if mask_tmp else None
    return total, max_id, digest.hexdigest(), mask_entry


def _rename_both(bin_tmp: Path, out: Path, side_tmp: Path, side: Path) -> None:
    """Both files into place. An interruption after the first rename still completes the second
    (decided from the files, not a flag a signal could land before), so the pair never mixes."""
    try:
        os.replace(bin_tmp, out)
    finally:
        if not bin_tmp.exists():
            os.replace(side_tmp, side)
    for directory in {out.parent, side.parent}:  # the renames themselves survive a power cut
        fsync_dir(directory)


def pool_worker_signals() -> None:
    """A pool's forked worker (a tokenizer here, ``plan --search``'s dry runs) leaves Ctrl-C to the parent, and
    dies at once when the parent ends the pool: a SIGTERM handler inherited from the parent would keep it
    running (waiting for native code to return, or blocked writing a result nobody reads any more), and the
    pool's exit, which joins its workers, would wait for ever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _documents(pool, jobs, progress: bool):
    docs = pool.imap(_encode, jobs) if pool else map(_encode, jobs)
    if progress:
        from tqdm import tqdm

        docs = tqdm(docs, total=len(jobs), unit="file", desc="tokenize")
    return docs


def _write_both(jobs, out: Path, meta: dict, workers: int, progress: bool, chat: bool = False) -> dict:
    """The token file and its sidecar (``meta`` completed), with ``chat`` its loss mask too, into place
    together (the mask first: the sidecar, renamed last, decides which files a reader takes); the sidecar.
    ``jobs``: text files' :func:`_encode` jobs, or with ``chat`` the (ids, mask) of each conversation."""
    dest, side = through_link(out), through_link(sidecar_path(out))
    mask_dest = through_link(loss_mask_path(out))
    with temporary_beside(dest, "-o") as bin_tmp, temporary_beside(side, "-o") as side_tmp, \
            temporary_beside(mask_dest, "-o") if chat else nullcontext() as mask_tmp:
        if chat:
            total, max_id, sha, mask_entry = _write_tokens(bin_tmp, jobs, meta["dtype"], mask_tmp)
        else:  # on the way out the pool's processes are ended where they are: an interruption waits for none
            with Pool(workers, initializer=pool_worker_signals) if workers > 1 else nullcontext() as pool:
                total, max_id, sha, mask_entry = _write_tokens(bin_tmp, _documents(pool, jobs, progress),
                                                               meta["dtype"])
        meta = {"dtype": meta["dtype"], "tokens": total, **meta, "max_id": max_id, "sha256": sha}
        if mask_entry:
            meta["loss_mask"] = mask_entry
        write_synced(side_tmp, json.dumps(meta, indent=1) + "\n")
        if chat:
            os.replace(mask_tmp, mask_dest)
        _rename_both(bin_tmp, dest, side_tmp, side)
    record_verified(out, sha)  # the bytes just written: the first launch need not hash them again
    if mask_entry:
        record_verified(loss_mask_path(out), mask_entry["sha256"])
    return meta


def _chat_documents(path: Path, files: list[Path], eos: int) -> list[tuple[list[int], list[int]]]:
    """Every conversation of the ``.jsonl`` ``files``, checked line by line before any is rendered
    (:mod:`.chat`), then rendered with the chat template of ``path``'s directory and ended by ``eos``
    (no loss on it: it is parallel4d's document boundary, not the template's end of turn): (ids, mask)."""
    conversations = [(f, read_conversations(f)) for f in files]  # every line checked first
    tok, out = chat_tokenizer(path.parent), []
    for f, convs in conversations:
        for k, messages in enumerate(convs):
            ids, mask = encode_conversation(tok, messages, f"{f} (conversation {k + 1})")
            out.append((ids + [eos], mask + [0]))
    return out


def _is_chat(files: list[Path]) -> bool:
    """Whether the inputs are chat/instruction data (``.jsonl`` files, datasets saved to disk: all or none)."""
    chat = [f.suffix == ".jsonl" or is_saved_dataset(f) for f in files]
    if any(chat) and not all(chat):
        raise ConfigError("the inputs mix chat data (.jsonl files, saved datasets) and text files; tokenize each "
                          "kind into its own token file")
    return all(chat)


def tokenize(tokenizer: str, inputs: list[str], out: str, eos_token: str | None = None, workers: int = 1,
             progress: bool = True) -> dict:
    """Tokenize ``inputs`` (in this order) into ``out`` and its sidecar; returns the sidecar."""
    path, files = _tokenizer_file(tokenizer), [user_path(f) for f in inputs]
    _check_inputs(files)
    sources = [(f, "an input") for f in files] + [(path, "the tokenizer")]
    out_path = user_path(out)
    _refuse_aliases(out_path, sources)
    check_output(out_path, "-o", sources)  # inside a checkpoint, a directory, a place that cannot be written
    chat = _is_chat(files)
    tok = _load(path)
    eos, vocab = _eos_id(tok, eos_token), tok.get_vocab_size(with_added_tokens=True)
    meta = {"dtype": dtype_for(vocab), "vocab_size": vocab, "tokenizer": str(path.resolve()),
            "tokenizer_sha256": file_sha256(path), "tokenizer_fingerprint": fingerprint(path), "eos_token_id": eos,
            "files": len(inputs)}
    jobs = _chat_documents(path, files, eos) if chat else [(str(path), str(f), eos) for f in files]
    _make_parent(out_path)
    try:
        return _write_both(jobs, out_path, meta, workers, progress, chat)
    except OSError as e:  # a full disk, an input gone: nothing was renamed into place
        raise ConfigError(f"-o {out}: tokenizing failed ({e.strerror}: {e.filename}); {out} and its sidecar were "
                          "left as they were; free the space or fix the file and run it again") from None
