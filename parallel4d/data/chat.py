"""Chat and instruction data for ``parallel4d tokenize``: JSONL lines (or the rows of a Hugging Face
``datasets`` dataset saved to disk with ``save_to_disk``) → conversations → token ids and the loss mask
that says which tokens are answers (the assistant's turns).

A line (a row) is one conversation, either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles
``system``, ``user``, ``assistant``, ``tool``) or ``{"prompt": ..., "completion": ...}`` (read as a user
turn and the assistant's answer). Every line is checked before anything is rendered or written: bad
JSON, a message without a role or string content, an unknown role, or a conversation with no assistant
turn is refused naming the file and the line.

A conversation is rendered with the model's own chat template (``chat_template`` of the tokenizer
directory's ``tokenizer_config.json``) by transformers' ``apply_chat_template``, so the text is exactly
the one transformers renders, and tokenized as transformers tokenizes it (the rendered text, no special
tokens added).

Which tokens are answers — incremental rendering, not ``return_assistant_tokens_mask``: transformers'
mask needs a template that marks the answers with ``{% generation %}``, which few shipped templates do
(for the others it returns zeros). Rendering the conversation up to each message instead works with any
template: the assistant turn ``i`` is the text between the rendering of messages ``< i`` with the
generation prompt (``<|im_start|>assistant\\n`` and the like: the prompt, no loss) and the rendering of
messages ``≤ i`` (the answer and its end-of-turn text: loss). The spans are found in characters and
mapped to the tokens of the whole text through the tokenizer's offsets, so the ids are those of the
whole text (a token is an answer's when its first character is). A template whose rendering of the first
messages is not a prefix of the whole (one that rewrites earlier turns, as Qwen3's drops their
reasoning) is refused naming the line, rather than guessed.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from parallel4d.config.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")


def _line_problem(record) -> str | None:
    """What makes one parsed JSONL line no conversation (None: it is one)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return "messages is not a non-empty list"
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                return f"message {k} lacks role or content (each is {{\"role\": ..., \"content\": ...}})"
            if m["role"] not in ROLES:
                return f"message {k} has role {m['role']!r}, not one of {', '.join(ROLES)}"
            if not isinstance(m["content"], str):
                return f"message {k}'s content is not a string"
        if not any(m["role"] == "assistant" for m in messages):
            return "no assistant turn (nothing would carry loss)"
        return None
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                return f"{key} is missing or not a string"
        return None
    return "neither messages nor prompt/completion"


def _messages(record: dict) -> list[dict]:
    if "messages" in record:
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def _conversation(record, where: str, what: str) -> list[dict]:
    """The messages of one parsed record (a JSONL line, a dataset row); ConfigError naming ``where``
    (``file:line``) and the fix when it is no conversation (``what``: a line, a row)."""
    problem = _line_problem(record)
    if problem:
        raise ConfigError(f"{where}: {problem}; each {what} is one conversation: "
                          '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", '
                          '"content": ...}]} or {"prompt": ..., "completion": ...}')
    return _messages(record)


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory Hugging Face ``datasets`` wrote with ``save_to_disk`` (its arrow
    files, ``state.json`` and ``dataset_info.json``; a ``DatasetDict``'s holds ``dataset_dict.json`` and a
    directory per split)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _dataset_conversations(path: Path) -> list[list[dict]]:
    """Every row of the dataset saved at ``path`` (:func:`is_saved_dataset`), read by ``datasets`` itself
    (``load_from_disk``: its arrow files memory-mapped, its features decoded as ``datasets`` decodes them)."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ConfigError(f"{path} is a DatasetDict (splits {', '.join(splits) or 'none'}); give one split's "
                          f"directory, e.g. {path / (splits[0] if splits else 'train')}")
    try:
        from datasets import load_from_disk
    except ImportError as e:
        raise ConfigError(f"{path} is a dataset saved by Hugging Face datasets, which reads it ({e.name} is "
                          "missing): pip install 'parallel4d[hf]'") from None
    # a column a row does not use reads None there (the dataset's columns are the union of its rows' keys)
    return [_conversation({key: v for key, v in row.items() if v is not None}, f"{path} row {k}", "row")
            for k, row in enumerate(load_from_disk(str(path)))]


def _jsonl_conversations(path: Path) -> list[list[dict]]:
    out = []
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{number}: not JSON ({e.msg}); each line is one conversation: "
                                  '{"messages": [{"role": "user", "content": ...}, ...]} or '
                                  '{"prompt": ..., "completion": ...}') from None
            out.append(_conversation(record, f"{path}:{number}", "line"))
    return out


def read_conversations(path: Path) -> list[list[dict]]:
    """Every conversation of JSONL file ``path`` (blank lines skipped) or of the dataset saved at ``path``
    (:func:`is_saved_dataset`; row ``k`` as a line), each a list of messages; ConfigError naming the file
    and line (the row) of the first malformed one."""
    out = _dataset_conversations(path) if is_saved_dataset(path) else _jsonl_conversations(path)
    if not out:
        raise ConfigError(f"{path} holds no conversation; leave it out of the inputs")
    return out


@lru_cache(maxsize=4)
def chat_tokenizer(directory: Path):
    """transformers' tokenizer of ``directory`` (its chat template with it); ConfigError if it has none."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(f"tokenizing chat data needs transformers ({e.name} is missing): "
                          "pip install 'parallel4d[hf]'") from None
    tok = AutoTokenizer.from_pretrained(str(directory))
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"--tokenizer {directory}: its tokenizer_config.json has no chat_template, which chat "
                          "data (.jsonl inputs) is rendered with; give the model directory whose tokenizer has one")
    return tok


def _render(tok, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def answer_spans(tok, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of its assistant turns
    (module doc). ``where``: ``file:line``, named when the template does not render prefixes."""
    text, spans = _render(tok, messages, False), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = _render(tok, messages[:i], True) if i else "", _render(tok, messages[:i + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError(f"{where}: the chat template does not render the conversation's first messages as "
                              f"a prefix of the whole (message {i}), so its answers cannot be told from its "
                              "prompts; use a template that renders earlier turns unchanged")
        spans.append((len(before), len(through)))
    return text, spans


def encode_conversation(tok, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation (as ``apply_chat_template(tokenize=True)`` gives them) and
    its loss mask (1 on the assistant turns' tokens, 0 elsewhere), as long as the ids."""
    text, spans = answer_spans(tok, messages, where)
    encoding = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoding["offset_mapping"]]
    return list(encoding["input_ids"]), mask
