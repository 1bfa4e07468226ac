"""The config's rules, collected: every technique's rules (one module each in ``config/rules/``) in
the order their messages are listed, plus the model family's fields and the sizes that fit no
machine."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from parallel4d.config.rules import data, deepspeed, fp8, hetero, lora, moe, pipeline, sequence, tensor2d, training
from parallel4d.config.rules.common import DTYPE_BYTES, closest, divisors, fixed_fields, or_list

if TYPE_CHECKING:  # annotations only: the schema imports these rules
    from parallel4d.config.schema import Config, ModelConfig

from parallel4d.models.registry import spec


def cross_field_problems(cfg: Config) -> list[str]:
    """Every rule that ties fields together; one readable message per broken rule."""
    return [problem for rule in _RULES for problem in rule(cfg)]


def _model_problems(cfg: Config) -> list[str]:
    """The family's rules; a pretrained model's on the grid are :func:`_grid_problems`' (said with the
    layouts that fit), so only those that hold at any grid are its here."""
    pretrained = "model.hidden" in fixed_fields(cfg.model)
    return _family_problems(cfg.model, 1 if pretrained else cfg.parallel.q)


def _on_the_grid(m: ModelConfig, q: int) -> list[str]:
    """What the model's shape breaks on a q×q grid alone: the 2D rules and the family's, less those
    it breaks without a grid."""
    def rules(side: int) -> list[str]:
        return tensor2d.tensor2d_problems(side, m.hidden, m.heads, m.vocab_size, head_dim=m.head_dim) + \
            _family_problems(m, side)
    alone = set(rules(1))
    return [p for p in rules(q) if p not in alone]


_FIELD = re.compile(r"model\.\w+=\S+?(?=[ ;,]|$)")


def _grid_problems(cfg: Config) -> list[str]:
    """The model on its ``parallel.tp`` grid (:func:`~parallel4d.config.rules.tensor2d.grid_problems`).
    A pretrained model's shape is its config.json's: what it breaks on this grid is said in one
    message whose fix is the grids it splits over, never a model field the job cannot change."""
    m, q = cfg.model, cfg.parallel.q
    if "model.hidden" not in fixed_fields(m):
        return tensor2d.grid_problems(cfg)
    broken = _on_the_grid(m, q)
    if not broken:
        return []
    fields = list(dict.fromkeys(f.group(0) for f in map(_FIELD.match, broken) if f))
    fits = [side * side for side in divisors(m.hidden) if not _on_the_grid(m, side)]
    one = len(fields) == 1
    return [f"parallel.tp={q * q} (a {q}×{q} grid) does not split the pretrained model: {', '.join(fields)} "
            f"{'is' if one else 'are'} not divisible by q={q}, and model.pretrained's config.json sets "
            f"{'it' if one else 'them'}; use parallel.tp={or_list(closest(fits, q * q))}"]


def _moe_problems(cfg: Config) -> list[str]:
    """MoE layers: in a family that has them (it reads ``model.num_experts``), in a layout they run in."""
    return moe.layout_problems(cfg, "num_experts" in spec(cfg.model.arch).fields)


def _lora_problems(cfg: Config) -> list[str]:
    """Low-rank adapters: targets of the family (its spec's peft names), a layout they run in."""
    return lora.problems(cfg, spec(cfg.model.arch).lora_targets)


def _lr_schedule_problems(cfg: Config) -> list[str]:
    return training.lr_schedule_problems(cfg.optimizer, cfg.train.steps)


def _fused_problems(cfg: Config) -> list[str]:
    return list(filter(None, [training.fused_problem(cfg.train.fused)]))


def _family_problems(m: ModelConfig, q: int) -> list[str]:
    """Fields that belong to another model family, and what this family needs (its spec's rules)."""
    return spec(m.arch).problems(m, q)


MAX_PARAMETERS = 2**45  # ~3.5e13: 128 TiB in float32, twenty times the largest models trained
MAX_WORLD = 2**20


def dense_parameters(m: ModelConfig) -> int:
    """About how many parameters the dense model of ``m`` has (norms and biases left out; its family's count)."""
    return spec(m.arch).dense_parameters(m)


def largest_block(m: ModelConfig, q: int) -> int:
    """Elements of the largest parameter a rank holds: the token table (its vocabulary padded to the
    grid) or an MLP matrix, each cut in q² blocks by the 2D grid."""
    return max(tensor2d.padded_vocab(m.vocab_size, q) * m.hidden, m.hidden * m.mlp_width) // (q * q)


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
    item = DTYPE_BYTES[hetero.compute_dtype(cfg)]  # the device chunks' element
    mixed = hetero.compute_dtype(cfg) != cfg.train.parameters  # 16-bit chunks, the master on the host
    on_cpu = next((f"{f}=cpu" for f, v in (("train.device", cfg.train.device), ("hetero.compute_device",
                                                                                  h.compute_device)) if v == "cpu"), "")
    return out + hetero.budget_problems(h, largest_block(m, p.q), item, p.dp * p.sp, mixed, on_cpu)


#: every cross-field rule, in the order their messages are listed
_RULES = (_grid_problems, sequence.ring_problems, data.batch_split_problems, pipeline.layout_problems,
          hetero.tied_head_problems, pipeline.recompute_problems, pipeline.hop_cost_problems, pipeline.compile_problems,
          hetero.split_backward_problems, _model_problems, _moe_problems, _lora_problems,
          _size_problems, _lr_schedule_problems, training.tensorboard_problems, deepspeed.section_problems,
          data.source_problems, data.validation_problems, data.packing_problems, training.dtype_problems, hetero.reduce_dtype_problems,
          hetero.compute_dtype_problems, _fused_problems, deepspeed.float16_problems, deepspeed.dropout_problems,
          fp8.problems)
