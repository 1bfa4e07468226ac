"""FLOPs per token are right for every model family (#27.3): each spec's ``flops_per_token`` is within
2 % of what torch's ``FlopCounterMode`` counts for one forward and backward of the dense model, per
token, so ``summary.json``'s ``model_flops_per_second`` (and an MFU from it) is honest.

The attention runs on SDPA's math backend while counting: CPU's fused SDPA kernel is not in the flop
counter's registry (it would count 0), the math backend's products are. GPT's ``6·12·L·h² + 12·L·h·s``
(what every family was charged before) misses the LM head and, for Llama, grouped-query attention
and SwiGLU: the check sees the difference.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from parallel4d.config.schema import ModelConfig
from parallel4d.models.build import build_dense, family, shape_from_config
from parallel4d.models.registry import NAMES, SPECS, spec

SHAPES = {
    "gpt2, tied, ratio 4": {"arch": "gpt2", "vocab_size": 256, "seq_len": 64, "hidden": 64, "heads": 4, "layers": 2},
    "gpt2, untied, ratio 2, wide vocab": {"arch": "gpt2", "vocab_size": 1000, "seq_len": 32, "hidden": 96,
                                          "heads": 6, "layers": 3, "mlp_ratio": 2, "tie_embeddings": False},
    "llama, GQA 8/2, SwiGLU 172": {"arch": "llama", "vocab_size": 256, "seq_len": 64, "hidden": 64, "heads": 8,
                                   "kv_heads": 2, "layers": 2, "intermediate_size": 172},
    "llama, GQA 4/1, qkv bias, tied": {"arch": "llama", "vocab_size": 512, "seq_len": 48, "hidden": 128, "heads": 4,
                                       "kv_heads": 1, "layers": 2, "intermediate_size": 344, "qkv_bias": True,
                                       "tie_embeddings": True},
    # Qwen3's shape: heads of 32, twice hidden/heads (the attention is twice as wide as the residual)
    "llama, head_dim 32 > 64/4, q/k norms": {"arch": "llama", "vocab_size": 256, "seq_len": 32, "hidden": 64,
                                             "heads": 4, "kv_heads": 2, "layers": 2, "intermediate_size": 96,
                                             "head_dim": 32, "qk_norm": True},
}


def counted_per_token(m: ModelConfig, batch: int = 2) -> float:
    """FlopCounterMode's count of one forward and backward of the dense model of ``m``, per token."""
    model = build_dense(shape_from_config(m), seed=0)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    return counter.get_total_flops() / (batch * m.seq_len)


def gpt_formula(m: ModelConfig) -> float:
    """The count every family got before #27: GPT's blocks at mlp_ratio 4, no LM head."""
    return 6 * 12 * m.layers * m.hidden ** 2 + 12 * m.layers * m.hidden * m.seq_len


@pytest.mark.parametrize("case", list(SHAPES))
def test_flops_per_token_match_the_flop_counter(case):
    m = ModelConfig(**SHAPES[case])
    counted, ours = counted_per_token(m), spec(m.arch).flops_per_token(m)
    assert abs(ours / counted - 1) <= 0.02, (case, ours, counted)
    if m.arch == "llama":  # the old count was off for GQA and SwiGLU: the check can see it
        assert abs(gpt_formula(m) / counted - 1) > 0.02, (case, gpt_formula(m), counted)


def test_one_registry_entry_per_family():
    """Each family name and Hugging Face model_type once; model.arch's choices are the registry's; each
    spec's torch side is its own package's family.py and says it is that family."""
    assert len(set(NAMES)) == len(SPECS) == len(NAMES)
    types = [t for s in SPECS for t in s.hf_model_types]
    assert len(types) == len(set(types))
    assert set(ModelConfig.model_fields["arch"].annotation.__args__) == set(NAMES)
    for s in SPECS:
        assert s.torch_module == f"parallel4d.models.{s.name}.family"
        assert family(s.name).spec is s


def counted_per_stage(m: ModelConfig, batch: int = 2) -> list[float]:
    """FlopCounterMode's count of one forward and backward per token, stage by stage (``embed``,
    ``blocks.<i>``, ``head``: the dense model's children)."""
    model = build_dense(shape_from_config(m), seed=0)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    counts = {name.split(".", 1)[1]: sum(c.values()) for name, c in counter.get_flop_counts().items() if "." in name}
    names = ["embed", *(f"blocks.{i}" for i in range(m.layers)), "head"]
    return [counts.get(n, 0) / (batch * m.seq_len) for n in names]


@pytest.mark.parametrize("case", list(SHAPES))
def test_stage_flops_match_the_flop_counter_stage_by_stage(case):
    """What the pipeline's cut balances: each stage's training FLOPs within 2 % of the counter's (the
    embedding's lookup 0, the LM head's products as heavy as they are), summing to flops_per_token."""
    from parallel4d.engine.flops import flops_per_token, stage_flops
    from parallel4d.config.load import make_config

    m = ModelConfig(**SHAPES[case])
    ours, counted = spec(m.arch).stage_flops(m), counted_per_stage(m)
    assert ours[0] == counted[0] == 0 and len(ours) == m.layers + 2
    assert all(abs(a / b - 1) <= 0.02 for a, b in zip(ours[1:], counted[1:])), (case, ours, counted)
    cfg = make_config({"model": SHAPES[case]})
    assert stage_flops(cfg) == ours and sum(ours) == pytest.approx(flops_per_token(cfg), rel=1e-12)


def test_the_pipeline_cut_balances_compute_not_parameters():
    """A wide vocabulary: by parameter count the embedding's table would weigh as much as the LM head
    and take half of pp=2's first rank; by compute it weighs nothing and the head's V·h products are
    the heavy stage."""
    from parallel4d.config.load import make_config
    from parallel4d.engine.compose import pipeline_cut
    from parallel4d.models.build import build_stage
    from parallel4d.pipeline.partition import parameter_costs, partition

    cfg = make_config({"model": {"vocab_size": 4096, "seq_len": 16, "hidden": 64, "heads": 4, "layers": 4},
                       "parallel": {"pp": 2}, "pipeline": {"microbatches": 2}})
    by_parameters = partition(parameter_costs([build_stage(shape_from_config(cfg.model), i, meta=True)
                                               for i in range(6)]), 2)
    assert by_parameters == [range(0, 3), range(3, 6)]
    assert pipeline_cut(cfg, 2) == [range(0, 5), range(5, 6)]
