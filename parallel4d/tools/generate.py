"""``parallel4d generate RUN_DIR``: sample text from a trained model in one process, with a KV cache.

The model comes from the newest checkpoint of a run (any layout: the checkpoint holds the dense
tensors, :func:`.gather.gather`) or from a Hugging Face directory (``parallel4d export``'s, or
any supported ``transformers`` model). Decoding runs the dense reference model's own modules
(the family's ``decode_embed`` and ``decode_block``, ``models/<family>/model.py``) one new token at
a time, keeping every layer's keys and values: ``[b, kv_heads, t, d]`` per layer, so a step costs
one token's work, not the context's.

Text: bytes for a byte-level model (``vocab_size`` 256, the corpus and synthetic data), else the
tokenizer a token file's sidecar names (``data.source: tokens``), the directory's ``tokenizer.json``
or the one a checkpoint carries from its ``model.pretrained`` (``pretrained/tokenizer.json``).

A LoRA job's checkpoint (``model.lora``: the adapters only, the base named) runs as its merged model: the
base it names (checked by fingerprint) with ``scaling · B·A`` added to each adapted weight, the model
``parallel4d export`` writes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.checkpoint.export import merged_state_dict
from parallel4d.checkpoint.hf_source import SOURCE_DIR
from parallel4d.checkpoint.resume import saved_config
from parallel4d.checkpoint.gather import gather, resolve_checkpoint, with_tied_head
from parallel4d.checkpoint.outputs import user_path
from parallel4d.checkpoint.steps import describe_checkpoint
from parallel4d.config.hf_fields import hf_max_positions
from parallel4d.models.build import build_dense, family, shape_from_config
from parallel4d.data.token_files import read_sidecar

Cache = list[tuple[torch.Tensor, torch.Tensor]]


# --- the model -----------------------------------------------------------------------------------

def model_source(source: str | Path) -> Path:
    """What :func:`load_model` reads for ``source`` (``~`` expanded): a Hugging Face directory as it is,
    else one ``step_*`` checkpoint — a run directory's or a checkpoint root's newest."""
    source = user_path(source)
    if (source / "config.json").is_file():
        return source
    return resolve_checkpoint(source / "checkpoints" if (source / "checkpoints").is_dir() else source)


def describe_source(path: Path) -> str:
    """:func:`model_source`'s ``path`` as ``parallel4d generate`` names it: the step and its run's
    checkpoints, or the Hugging Face directory."""
    return f"the Hugging Face model in {path}" if (path / "config.json").is_file() else describe_checkpoint(path)


def load_model(source: str | Path, base: str | Path | None = None) -> tuple[torch.nn.Module, dict]:
    """``(dense model in float32, eval mode; the job config dict)`` from a Hugging Face directory,
    a run directory (its newest checkpoint), a checkpoint root or one ``step_*`` directory; a LoRA job's
    checkpoint runs its base with the adapters merged (``checkpoint.export.merged_state_dict``: the base it
    names, checked by fingerprint; ``base``: its directory where it has moved), as ``parallel4d export`` writes it."""
    source = model_source(source)
    if (source / "config.json").is_file():
        positions = hf_max_positions(json.loads((source / "config.json").read_text()))
        data = {"model": {"pretrained": str(source), **({"seq_len": positions} if positions else {})}}
        cfg = make_config(data)
        from parallel4d.models.hf import load_hf_state_dict  # safetensors: the hf extra

        state = load_hf_state_dict(source, cfg.model)
    elif (data := saved_config(source)).get("model", {}).get("lora"):  # base + adapters, merged
        cfg = make_config(data)
        state = merged_state_dict(source, cfg.model, base)
        cfg = make_config({**data, "model": {**data["model"], "lora": None}})  # the merged model is a plain one
    else:
        cfg = make_config(data)
        with tempfile.TemporaryDirectory() as tmp:
            dense = gather(source, Path(tmp) / "model.pt", progress=False)
            state = with_tied_head(torch.load(dense, weights_only=True)["model"], cfg.model.tie_embeddings)
    model = build_dense(shape_from_config(cfg.model), seed=0)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.float().eval(), {**data, "model": cfg.model.model_dump(mode="json")}


# --- one decoding step ---------------------------------------------------------------------------

@torch.no_grad()
def forward_cached(model, tokens: torch.Tensor, cache: Cache | None) -> tuple[torch.Tensor, Cache]:
    """Logits ``[b, t, V]`` of ``tokens`` ``[b, t]`` that follow the ``cache``'s tokens (None: none),
    and the cache extended by them; equal to ``model(all tokens)[:, -t:]``."""
    start = 0 if cache is None else cache[0][0].shape[2]
    fam = family(model.shape.arch)
    x = fam.decode_embed(model.embed, tokens, start)
    new: Cache = []
    for i, block in enumerate(model.blocks):
        x, kv = fam.decode_block(block, x, None if cache is None else cache[i], start)
        new.append(kv)
    return model.head(x), new


# --- sampling ------------------------------------------------------------------------------------

def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> torch.Tensor:
    """The next token ``[b]`` from last-position logits ``[b, V]``: greedy at temperature 0."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)


@torch.no_grad()
def sample(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 50,
           seed: int = 0) -> torch.Tensor:
    """``prompt`` ``[b, p]`` followed by ``max_new_tokens`` sampled tokens. The context is the
    model's ``seq_len``: past it, the cache restarts from the last ``seq_len/2`` tokens."""
    if temperature < 0:
        raise ValueError(f"--temperature must be ≥ 0 (0: greedy), got {temperature}")
    gen = torch.Generator().manual_seed(seed)
    window = model.shape.seq_len
    tokens = prompt
    logits, cache = forward_cached(model, prompt[:, -window:], None)
    for _ in range(max_new_tokens):
        nxt = _pick(logits[:, -1].float(), temperature, top_k, gen)[:, None]
        tokens = torch.cat((tokens, nxt), 1)
        if cache[0][0].shape[2] >= window:  # no position left: re-read the recent half
            logits, cache = forward_cached(model, tokens[:, -(window // 2):], None)
        else:
            logits, cache = forward_cached(model, nxt, cache)
    return tokens


# --- text ----------------------------------------------------------------------------------------

def text_codec(source: str | Path, cfg: dict):
    """``(encode: str → list[int], decode: list[int] → str)`` for the model of ``source``."""
    source = user_path(source)
    data = cfg.get("data") or {}
    tokenizer = None
    if data.get("source") == "tokens" and data.get("path"):
        tokenizer = read_sidecar(data["path"]).get("tokenizer")
    elif (source / "tokenizer.json").is_file():
        tokenizer = str(source / "tokenizer.json")
    elif (source / SOURCE_DIR / "tokenizer.json").is_file():  # a checkpoint carrying model.pretrained's tokenizer
        tokenizer = str(source / SOURCE_DIR / "tokenizer.json")
    if tokenizer is None:
        if cfg["model"]["vocab_size"] > 256:
            raise ConfigError(f"{source}: a vocabulary of {cfg['model']['vocab_size']} is not bytes and no tokenizer "
                              "is known (a token file's sidecar or the directory's tokenizer.json names it)")
        return (lambda s: list(s.encode("utf-8"))), (lambda ids: bytes(i for i in ids if i < 256).decode(
            "utf-8", errors="replace"))
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ConfigError(f"decoding with {tokenizer} needs Hugging Face tokenizers ({e.name} is missing): "
                          "pip install 'parallel4d[hf]'") from None
    tok = Tokenizer.from_file(str(tokenizer))
    return (lambda s: tok.encode(s, add_special_tokens=False).ids), tok.decode


def generate(source: str | Path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = 50, seed: int = 0, base: str | Path | None = None) -> str:
    """The prompt and its continuation as text (see the module docstring; ``base``: a LoRA checkpoint's base
    where it has moved)."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be ≥ 0, got {max_new_tokens}")
    source = model_source(source)
    model, cfg = load_model(source, base)
    encode, decode = text_codec(source, cfg)
    ids = encode(prompt)
    if not ids:
        raise ValueError("--prompt is empty: give at least one character to continue")
    out = sample(model, torch.tensor([ids]), max_new_tokens, temperature, top_k, seed)
    return decode(out[0].tolist())
