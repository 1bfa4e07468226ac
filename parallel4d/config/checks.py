"""The config's rules, collected: every technique's rules (one module each in ``config/rules/``) in
the order their messages are listed, plus the model family's fields and the sizes that fit no
machine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from parallel4d.config.rules import data, deepspeed, hetero, pipeline, sequence, tensor2d, training
from parallel4d.config.rules.common import divisors, not_divisible, or_list

if TYPE_CHECKING:  # annotations only: the schema imports these rules
    from parallel4d.config.schema import Config, ModelConfig


def cross_field_problems(cfg: Config) -> list[str]:
    """Every rule that ties fields together; one readable message per broken rule."""
    return [problem for rule in _RULES for problem in rule(cfg)]


def _model_problems(cfg: Config) -> list[str]:
    return _family_problems(cfg.model, cfg.parallel.q)


def _lr_schedule_problems(cfg: Config) -> list[str]:
    return training.lr_schedule_problems(cfg.optimizer, cfg.train.steps)


def _fused_problems(cfg: Config) -> list[str]:
    return list(filter(None, [training.fused_problem(cfg.train.fused)]))


def _family_problems(m: ModelConfig, q: int) -> list[str]:
    """Fields that belong to one model family, and what that family needs."""
    out = []
    # a value other than the default in another family's field (a dumped config holds every field)
    defaults = type(m).model_fields
    if m.arch == "gpt2":
        if m.kv_heads not in (None, m.heads):
            out.append(f"model.kv_heads={m.kv_heads} with model.arch=gpt2: grouped-query attention is llama's; "
                       "remove model.kv_heads or set model.arch=llama")
        out += [f"model.{f}={getattr(m, f)} is a llama field and model.arch=gpt2 does not read it; remove it or "
                "set model.arch=llama" for f in ("rope_theta", "qkv_bias") if getattr(m, f) != defaults[f].default]
        if m.intermediate_size not in (None, m.mlp_ratio * m.hidden):
            out.append(f"model.intermediate_size={m.intermediate_size} with model.arch=gpt2: its MLP is "
                       f"model.mlp_ratio·hidden = {m.mlp_ratio * m.hidden} wide; set model.mlp_ratio or remove "
                       "model.intermediate_size")
        return out
    if m.activation != defaults["activation"].default:
        out.append(f"model.activation={m.activation} is gpt2's (llama's MLP is SwiGLU); remove it")
    kv = m.kv_heads_or_heads
    if m.heads % kv:
        out.append(f"model.kv_heads={kv} must divide model.heads={m.heads} (each key/value head serves a group of "
                   f"query heads); use {or_list(d for d in divisors(m.heads) if d <= m.heads)}")
    if m.hidden % m.heads == 0 and (m.hidden // m.heads) % 2:
        out.append(f"model.hidden/model.heads = {m.hidden // m.heads} is odd, and rotary embeddings rotate pairs of "
                   "dimensions; use an even head size")
    by = f"q={q} (parallel.tp={q * q} is a {q}×{q} grid: each grid column holds whole key/value heads and an MLP block)"
    out += filter(None, [not_divisible("model.kv_heads", kv, q, by),
                         not_divisible("model.intermediate_size", m.mlp_width, q, by)])
    return out


MAX_PARAMETERS = 2**45  # ~3.5e13: 128 TiB in float32, twenty times the largest models trained
MAX_WORLD = 2**20


def dense_parameters(m: ModelConfig) -> int:
    """About how many parameters the dense model of ``m`` has (norms and biases left out)."""
    h, kv = m.hidden, m.kv_heads_or_heads
    tables = m.vocab_size * h * (1 if m.tie_embeddings else 2)
    if m.arch == "gpt2":
        return tables + m.seq_len * h + m.layers * (4 * h * h + 2 * h * m.mlp_width)
    return tables + m.layers * (2 * h * h + 2 * h * (h // m.heads) * kv + 3 * h * m.mlp_width)


def largest_block(m: ModelConfig, q: int) -> int:
    """Elements of the largest parameter a rank holds: the token table or an MLP matrix, each cut in
    q² blocks by the 2D grid."""
    return max(m.vocab_size * m.hidden, m.hidden * m.mlp_width) // (q * q)


def _size_problems(cfg: "Config") -> list[str]:
    """Sizes that fit no machine: the model, the world, a hetero budget below one chunk."""
    m, p, h, out = cfg.model, cfg.parallel, cfg.hetero, []
    n = dense_parameters(m)
    if n > MAX_PARAMETERS:
        out.append(f"model: {m.layers} layers of hidden {m.hidden}, vocab {m.vocab_size} make about {n:.2e} "
                   f"parameters, more than {MAX_PARAMETERS:.1e} ({4 * MAX_PARAMETERS / 2**40:.0f} TiB in float32), "
                   "which no cluster holds; lower model.hidden, model.layers or model.vocab_size")
    if p.world_size > MAX_WORLD:
        out.append(f"parallel.pp·dp·sp·tp = {p.world_size} ranks is more than {MAX_WORLD}; lower the parallel sizes")
    item = 8 if cfg.train.parameters == "float64" else 4
    return out + hetero.budget_problems(h, largest_block(m, p.q), item)


#: every cross-field rule, in the order their messages are listed
_RULES = (tensor2d.grid_problems, sequence.ring_problems, data.batch_split_problems, pipeline.layout_problems,
          hetero.tied_head_problems, pipeline.recompute_problems, hetero.split_backward_problems, _model_problems,
          _size_problems, _lr_schedule_problems, training.tensorboard_problems, deepspeed.section_problems,
          data.source_problems, data.validation_problems, training.dtype_problems, hetero.reduce_dtype_problems,
          _fused_problems, deepspeed.float16_problems)
