"""Invalid draws are the config's job (#33.4): a fuzzer draws job configurations over the whole space
of layouts, schedules and model shapes, and each goes through what ``parallel4d validate`` runs
(:func:`load_config`, then :func:`check_job` as a local launch on CPU).

* Raw draws (:func:`raw_configs`): every one is either accepted or refused with a ``ConfigError``
  whose every line names a field as ``section.field`` and says what to write instead; never another
  exception (TypeError, ZeroDivisionError, KeyError, pydantic's own text, ...). An accepted draw must
  also meet what the workers need of it, checked here independently of the rules
  (:func:`worker_problems`: the batch and sequence splits, the heads on the grid and the Ulysses
  groups, hetero's chunk alignment, and the pipeline's schedule and cut built as the engine builds
  them): an accepted draw that breaks one of those would crash in a worker.
* Mutation draws (:func:`mutations`): one of the shipped ``configs/*.yaml`` jobs with exactly one
  rule broken; each is refused, naming the field of that rule.

The default run takes a few seconds; ``PARALLEL4D_FUZZ_EXAMPLES=N`` draws N of each for a long run
(a failure prints hypothesis' seed and the falsifying config, as usual).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, note, settings, strategies as st

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config
from parallel4d.config.rules.pipeline import SCHEDULES
from parallel4d.launcher.preflight import check_job

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("PARALLEL4D_FUZZ_EXAMPLES", "0") or 0)
SETTINGS = dict(deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.filter_too_much])

# a field as the job file spells it; every line of a refusal names one
FIELD = re.compile(r"\b(parallel|pipeline|sequence|hetero|model|data|train|optimizer|checkpoint|tensor2d)\.[a-z_]+")
# words that start a fix (tests/test_hostile_configs.py's list); every line of a refusal holds one
FIX = re.compile(r"\b(use|set|write|remove|give|lower|raise|choose|keep|point|install|tokenize|delete|leave|start|"
                 r"fix|quote|pass|restore|move|unset|add)\b|did you mean")
# what pydantic says in its own words: never shown as it is
PYDANTIC = re.compile(r"pydantic|errors\.pydantic\.dev|For further information|\[type=[a-z_]+|input_value=")


def validate(data: dict):
    """What ``parallel4d validate`` runs on a job: the config, then the local launch's checks on CPU."""
    cfg = load_config(data)
    check_job(cfg, local=True, device_type="cpu")
    return cfg


def refusal_lines(message: str) -> list[str]:
    lines = [line[4:] for line in message.splitlines() if line.startswith("  - ")]
    return lines or [message]


def bad_lines(message: str) -> list[str]:
    """The lines of a refusal that name no field, say no fix, or show pydantic's own text."""
    return [line for line in refusal_lines(message)
            if not FIELD.search(line) or not FIX.search(line) or PYDANTIC.search(line)]


def outcome(data: dict):
    """``("accepted", cfg)`` or ``("refused", message)``; any other exception propagates."""
    try:
        return "accepted", validate(data)
    except ConfigError as e:
        return "refused", str(e)


# --- what a worker needs of an accepted config, checked apart from the rules -------------------

def worker_problems(cfg) -> list[str]:
    """What the workers would raise on (or silently get wrong) for a config the rules accepted:
    independent of ``parallel4d.config.rules``, from the workers' own requirements."""
    p, pl, m, s, h, d = cfg.parallel, cfg.pipeline, cfg.model, cfg.sequence, cfg.hetero, cfg.data
    q = math.isqrt(p.tp)
    out = []
    if q * q != p.tp:
        out.append("tp not square")
    # engine/batch.py: rows over dp·q, then micro-batches; at least one row each
    if d.batch_size % (p.dp * q * pl.microbatches):
        out.append("batch does not split over dp·q·microbatches")
    # 2D layers: hidden and heads in q blocks (the vocabulary is padded to q); whole heads
    for name, v in (("hidden", m.hidden), ("heads", m.heads), ("kv_heads", m.kv_heads_or_heads)):
        if v % q:
            out.append(f"model.{name} not divisible by q")
    if m.head_dim is None and m.hidden % m.heads:
        out.append("hidden not divisible by heads")
    if m.heads % m.kv_heads_or_heads:
        out.append("kv_heads does not divide heads")
    if m.arch == "llama" and m.head_size % 2:
        out.append("odd rotary head size")
    # sequence/ring.py, sequence/ulysses.py: the ring of sp/ulysses, its pieces, the heads per group
    if p.sp > 1:
        if p.sp % s.ulysses:
            out.append("ulysses does not divide sp")
        else:
            ring = p.sp // s.ulysses
            pieces = 2 * ring if s.layout == "zigzag" else ring
            if m.seq_len % pieces or m.seq_len % p.sp:
                out.append("seq_len does not split over the ring")
            if s.ulysses > 1 and ((m.heads // q) % s.ulysses or (m.kv_heads_or_heads // q) % s.ulysses):
                out.append("heads do not split over the Ulysses group")
    if m.arch == "gpt2" and m.seq_len > m.positions:
        out.append("seq_len past gpt2's position table")
    # hetero/layout.py: a chunk holds the largest parameter and is a multiple of 64 · (dp·sp)
    if h.enabled and h.chunk_elems is not None and h.chunk_elems % (64 * p.dp * p.sp):
        out.append("hetero.chunk_elems not a multiple of 64·dp·sp")
    if m.lora is not None:
        out += _lora_problems(cfg)
    if m.num_experts:
        out += _expert_problems(cfg)
    elif p.ep > 1:
        out.append("parallel.ep > 1 without experts")
    if p.pp > 1:
        out += _pipeline_problems(cfg)
    return out


#: the linears models/lora.py finds by peft's names in each family (models/<family>/spec.py's name maps)
FAMILY_LINEARS = {"llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
                  "gpt2": {"c_attn", "c_proj", "c_fc"}}


def _lora_problems(cfg) -> list[str]:
    """What the adapters need (models/lora.py): linears the family has, a rank of 1 or more, a dropout
    probability; on an MoE model's experts gate_proj and up_proj together (one fused adapter) and no dropout."""
    m, lora = cfg.model, cfg.model.lora
    out = [] if set(lora.targets) <= FAMILY_LINEARS[m.arch] else ["a LoRA target the family lacks"]
    if lora.rank < 1 or not 0 <= lora.dropout < 1 or lora.alpha <= 0:
        out.append("LoRA rank, alpha or dropout out of range")
    if m.num_experts and ({"gate_proj", "up_proj"} & set(lora.targets)) not in (set(), {"gate_proj", "up_proj"}):
        out.append("the experts' gate_proj without up_proj (fused)")
    if m.num_experts and lora.dropout and {"gate_proj", "up_proj", "down_proj"} & set(lora.targets):
        out.append("dropout on the experts' adapters")
    return out


def _expert_problems(cfg) -> list[str]:
    """What an MoE model's workers need: the llama family's layers, a top-k among the experts (torch.topk),
    the layers mlp_only_layers names, and the ep ranks drawn from the dp·sp replicas each holding a whole
    share of the experts (``Mesh.ep_split``, ``ExpertParallel``)."""
    p, m = cfg.parallel, cfg.model
    out = [] if m.arch == "llama" else ["experts outside the llama family"]
    if m.num_experts_per_tok is None or not 1 <= m.num_experts_per_tok <= m.num_experts:
        out.append("top-k not among the experts")
    if any(i >= m.layers for i in m.mlp_only_layers):
        out.append("mlp_only_layers past the layers")
    if (p.dp * p.sp) % p.ep or m.num_experts % p.ep:
        out.append("ep does not split the replicas or the experts")
    return out


def _pipeline_problems(cfg) -> list[str]:
    """The schedule and the cut, built as ``engine.compose.build_pipeline`` builds them."""
    from parallel4d.engine.flops import stage_flops
    from parallel4d.pipeline import make_schedule
    from parallel4d.pipeline.partition import partition

    pl, p = cfg.pipeline, cfg.parallel
    try:
        schedule = make_schedule(pl.schedule, p.pp, pl.microbatches, waves=pl.waves,
                                 chunks_per_rank=pl.chunks_per_rank, split_backward=pl.split_backward,
                                 p2p_cost=pl.hop_cost if isinstance(pl.hop_cost, float) else None)
        partition(stage_flops(cfg), schedule.num_chunks)
    except Exception as e:  # noqa: BLE001 - any failure here is a worker's crash
        return [f"pipeline build: {type(e).__name__}: {e}"]
    return []


# --- raw draws over the whole space ------------------------------------------------------------

def small(lo: int, hi: int, common=()):
    """Integers in [lo, hi], the usual values drawn more often."""
    return st.one_of(st.sampled_from(common), st.integers(lo, hi)) if common else st.integers(lo, hi)


HOP_COST = st.one_of(st.none(), st.just("auto"), st.floats(-2, 5, allow_nan=False), st.integers(-3, 3),
                     st.sampled_from([0, 0.5, 1e6, 1e7]))


# mixtures of experts (#48): the fields, often together (an MoE model), often alone (a dense one's stray field)
MOE_FIELDS = {"num_experts": small(0, 16, (0, 4, 4, 8)), "num_experts_per_tok": st.one_of(st.none(), small(1, 16, (1, 2))),
              "moe_intermediate_size": st.one_of(st.none(), st.sampled_from([8, 16, 24]), st.integers(-1, 64)),
              "shared_expert_intermediate_size": st.sampled_from([0, 16]), "norm_topk_prob": st.booleans(),
              "decoder_sparse_step": small(0, 4, (1, 2)), "mlp_only_layers": st.lists(st.integers(-1, 20), max_size=3),
              "router_aux_loss_coef": st.one_of(st.sampled_from([0.001, 0.5]), st.floats(-1, 2, allow_nan=False)),
              "output_router_logits": st.booleans()}



def moe_models():
    """The MoE fields of a model the rules mostly accept: 4 or 8 experts, top-1 or 2, the options drawn."""
    return st.fixed_dictionaries(
        {"num_experts": st.sampled_from([4, 8]), "num_experts_per_tok": st.sampled_from([1, 2])},
        optional={f: MOE_FIELDS[f] for f in ("moe_intermediate_size", "shared_expert_intermediate_size",
                                             "norm_topk_prob", "router_aux_loss_coef", "output_router_logits")}
        | {"mlp_only_layers": st.lists(st.integers(0, 1), max_size=1, unique=True),
           "decoder_sparse_step": st.sampled_from([1, 2])})


# low-rank adapters (#49): the fields valid and not; targets of either family, misspelt, the experts' half alone
LORA_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "c_attn", "c_proj", "c_fc",
              "qproj", "lm_head"]


#: targets a peft user names for each family (most draws take the drawn family's, so many are accepted)
FAMILY_TARGETS = {"llama": [["q_proj", "v_proj"], ["q_proj", "gate_proj", "up_proj", "down_proj"]],
                  "gpt2": [["c_attn", "c_fc"], ["c_attn", "c_proj", "c_fc"]]}


def lora_sections(arch: str):
    """A ``model.lora`` section for a ``model.arch`` family: rank, alpha, dropout, rsLoRA, targets (mostly the
    family's, else any names), sometimes an adapter directory."""
    return st.fixed_dictionaries(
        {"rank": small(0, 8, (1, 2, 4)), "alpha": st.one_of(st.sampled_from([1, 8, 16.0]), st.floats(-1, 64, allow_nan=False)),
         "targets": st.one_of(st.sampled_from(FAMILY_TARGETS[arch]), st.sampled_from(FAMILY_TARGETS[arch]),
                              st.lists(st.sampled_from(LORA_NAMES), min_size=1, max_size=5))},
        optional={"dropout": st.one_of(st.sampled_from([0.0, 0.1]), st.floats(-0.5, 1.5, allow_nan=False)),
                  "rslora": st.booleans(), "adapter": st.just("somewhere")})


@st.composite
def raw_configs(draw) -> dict:
    """A job dict over the whole space; many draws are invalid."""
    parallel = draw(st.fixed_dictionaries({}, optional={
        "pp": small(1, 16, (1, 1, 2, 4)), "dp": small(1, 16, (1, 1, 2)), "sp": small(1, 16, (1, 1, 2, 4)),
        "tp": small(1, 16, (1, 1, 4, 4, 9, 16)), "ep": small(1, 16, (1, 1, 2, 4))}))
    pipeline = draw(st.fixed_dictionaries({}, optional={
        "schedule": st.sampled_from(SCHEDULES), "microbatches": small(1, 16, (1, 2, 4, 8)),
        "waves": small(1, 4, (1, 2)), "chunks_per_rank": small(1, 4, (2,)), "split_backward": st.booleans(),
        "hop_cost": HOP_COST}))
    sequence = draw(st.fixed_dictionaries({}, optional={
        "layout": st.sampled_from(["contiguous", "zigzag"]), "ulysses": small(1, 8, (1, 2, 4))}))
    hetero = draw(st.fixed_dictionaries({}, optional={
        "enabled": st.booleans(),
        "device_budget_bytes": st.one_of(st.none(), st.sampled_from([1, 1000, 4096, 200_000, 6_000_000, 2**40]),
                                         st.integers(1, 10**8)),
        "chunk_elems": st.one_of(st.none(), st.sampled_from([8, 64, 4096, 16384, 65536]), st.integers(1, 10**6)),
        "dynamic_budget": st.booleans()}))
    arch = draw(st.sampled_from(["gpt2", "llama"]))
    model = {"arch": arch, **draw(st.fixed_dictionaries({}, optional={
        "heads": small(1, 16, (2, 4, 8)), "kv_heads": st.one_of(st.none(), small(1, 16, (1, 2, 4))),
        "hidden": st.one_of(st.sampled_from([16, 32, 48, 64, 96, 128, 256]), st.integers(1, 300)),
        "head_dim": st.one_of(st.none(), st.sampled_from([4, 8, 16, 7])),
        "seq_len": st.one_of(st.sampled_from([8, 16, 32, 64, 128, 96]), st.integers(1, 200)),
        "layers": small(1, 40, (1, 2, 4, 6, 14)),
        "vocab_size": st.one_of(st.sampled_from([64, 256, 257, 1000]), st.integers(2, 4096)),
        "tie_embeddings": st.booleans(), "max_positions": st.one_of(st.none(), small(1, 256, (64, 128)))}))}
    kind = draw(st.sampled_from(["dense", "stray MoE fields", "an MoE model"]))
    if kind == "stray MoE fields":
        model.update(draw(st.fixed_dictionaries({}, optional=MOE_FIELDS)))
    elif kind == "an MoE model":  # coherent fields (of the llama family), ep among the replicas: many accepted
        model.update(arch="llama", **draw(moe_models()))
        replicas = parallel.get("dp", 1) * parallel.get("sp", 1)
        parallel["ep"] = draw(st.sampled_from([e for e in (1, 2, 4) if replicas % e == 0]))
    if draw(st.sampled_from([False, False, True])):  # model.lora, its fields valid or not (#49)
        model["lora"] = draw(lora_sections(model["arch"]))
    data = draw(st.fixed_dictionaries({}, optional={
        "batch_size": small(1, 64, (8, 16, 32)), "packing": st.sampled_from(["none", "documents"]),
        "eod_token": st.one_of(st.none(), st.integers(0, 5000))}))
    train = draw(st.fixed_dictionaries({}, optional={
        "activation_checkpointing": st.sampled_from(["none", "blocks"]),
        "eval_every": st.one_of(st.none(), st.integers(1, 20)), "resume": st.booleans(),
        "dtype": st.sampled_from(["float32", "float64", "bfloat16", "float16"]),
        "compile": st.sampled_from(["none", "none", "blocks"])}))
    # train.fp8 (#50): absent, a recipe (or one it lacks) in any job, or an FP8 job of one process without hetero
    # (where FP8 runs today; its other fields still drawn): else accepted FP8 jobs are one in thousands of draws
    fp8 = draw(st.sampled_from([None, None, None, "rowwise", "tensorwise", "an FP8 job"]))
    if fp8 == "an FP8 job":
        parallel, hetero = {}, {k: v for k, v in hetero.items() if k != "enabled"}
    if fp8 is not None:
        train["fp8"] = "rowwise" if fp8 == "an FP8 job" else fp8
    sections = {"parallel": parallel, "pipeline": pipeline, "sequence": sequence, "hetero": hetero, "model": model,
                "data": data, "train": {**train, "out_dir": "runs/fuzz"}, "checkpoint": {"enabled": False}}
    return {k: v for k, v in sections.items() if v}


def checked_outcome(data: dict):
    """Validate ``data``; assert the property; return :func:`outcome`'s ``(kind, config or message)``."""
    note(f"config: {data}")
    kind, got = outcome(data)
    if kind == "refused":
        bad = bad_lines(got)
        assert not bad, f"a refusal line names no field or no fix: {bad}\nconfig: {data}"
        return kind, got
    problems = worker_problems(got)
    assert not problems, f"accepted, but a worker would fail: {problems}\nconfig: {data}"
    return kind, got


def check_draw(data: dict) -> str:
    """Validate ``data``; assert the property; return "accepted" or "refused"."""
    return checked_outcome(data)[0]


@settings(max_examples=EXAMPLES or 300, **SETTINGS)
@given(raw_configs())
def test_raw_draws_are_accepted_whole_or_refused_naming_a_field_and_a_fix(data):
    check_draw(data)


# --- mutation draws: a shipped job with exactly one rule broken -------------------------------

BASES = {name: yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
         for name in ("4d", "pipeline", "pipeline_zb", "sequence", "tensor2d", "hetero", "llama")}


def _q(d: dict) -> int:
    return math.isqrt(d.get("parallel", {}).get("tp", 1))


def _get(d: dict, dotted: str, default=None):
    section, field = dotted.split(".")
    return d.get(section, {}).get(field, default)


def _set(d: dict, **dotted) -> dict:
    """A copy of ``d`` with ``section__field=value`` set."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for key, value in dotted.items():
        section, field = key.split("__")
        out.setdefault(section, {})[field] = value
    return out


def _not_multiple(draw, m: int, lo: int = 1, hi: int = 64) -> int:
    """A value in [lo, hi] that is not a multiple of ``m`` (m ≥ 2)."""
    return draw(st.integers(lo, hi).filter(lambda v: v % m))


def _chunks(d: dict) -> int:
    from parallel4d.config.rules.pipeline import num_chunks
    pl = d.get("pipeline", {})
    return num_chunks(pl.get("schedule", "1f1b"), _get(d, "parallel.pp", 1), pl.get("waves", 1),
                      pl.get("chunks_per_rank", 2))


# Each mutation: (name, applies to the base?, draw → (the broken job, the field its refusal names)).
# The rules are those of parallel4d/config/rules/*.py and the model families' specs.
def _tp_not_square(draw, d):
    return _set(d, parallel__tp=draw(st.sampled_from([2, 3, 5, 6, 7, 8, 10, 12, 15]))), "parallel.tp"


def _heads_per_column(draw, d):
    q = _q(d)
    return _set(d, model__heads=_not_multiple(draw, q, 1, 16)), "model.heads"


def _hidden_per_grid(draw, d):
    q = _q(d)
    return _set(d, model__hidden=_not_multiple(draw, q, 1, 256)), "model.hidden"


def _seq_not_by_sp(draw, d):
    sp = _get(d, "parallel.sp")
    return _set(d, sequence__layout="contiguous", model__seq_len=_not_multiple(draw, sp, 1, 64)), "model.seq_len"


def _zigzag_seq_not_by_2sp(draw, d):
    sp = _get(d, "parallel.sp")
    odd = draw(st.integers(0, 10)) * 2 + 1
    return _set(d, sequence__layout="zigzag", model__seq_len=sp * odd, model__max_positions=sp * odd), \
        "model.seq_len"


def _batch_split(draw, d):
    per = _get(d, "parallel.dp", 1) * _q(d) * _get(d, "pipeline.microbatches", 1)
    if per == 1:  # only a change of the split itself can break it
        return _set(d, parallel__dp=2, data__batch_size=draw(st.integers(0, 20)) * 2 + 1), "data.batch_size"
    return _set(d, data__batch_size=_not_multiple(draw, per, 1, 4 * per)), "data.batch_size"


def _split_backward_refused(draw, d):
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    mb = _get(d, "parallel.pp")  # interleaved takes m ≤ pp
    return _set(d, pipeline__schedule=schedule, pipeline__split_backward=True, pipeline__hop_cost=None,
                pipeline__waves=1, pipeline__microbatches=mb), "pipeline.split_backward"


def _hop_cost_fixed_order(draw, d):
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    mb = _get(d, "parallel.pp")
    return _set(d, pipeline__schedule=schedule, pipeline__split_backward=False, pipeline__waves=1,
                pipeline__microbatches=mb, pipeline__hop_cost=draw(st.sampled_from(["auto", 0.5, 0, 2]))), \
        "pipeline.hop_cost"


def _hop_cost_out_of_range(draw, d):
    value = draw(st.one_of(st.floats(-1e6, -1e-3), st.just(1e7), st.sampled_from(["fast", [1], True])))
    return _set(d, pipeline__hop_cost=value), "pipeline.hop_cost"


def _ulysses_not_dividing_sp(draw, d):
    sp = _get(d, "parallel.sp")
    return _set(d, sequence__ulysses=draw(st.integers(2, 16).filter(lambda u: sp % u))), "sequence.ulysses"


def _ulysses_not_dividing_heads(draw, d):
    q, sp = _q(d), _get(d, "parallel.sp")
    heads = _get(d, "model.heads")  # ulysses = sp divides sp; heads per column not a multiple of it
    kv = _get(d, "model.kv_heads")
    per = heads // q
    if per % sp == 0 and (kv is None or (kv // q) % sp == 0):
        return None
    return _set(d, sequence__ulysses=sp), "model.heads" if per % sp else "model.kv_heads"


def _kv_heads_not_dividing(draw, d):
    heads = _get(d, "model.heads")
    kv = draw(st.integers(1, 2 * heads).filter(lambda k: heads % k))
    return _set(d, model__kv_heads=kv), "model.kv_heads"


def _too_few_layers(draw, d):
    chunks = _chunks(d)
    return _set(d, model__layers=draw(st.integers(1, chunks - 3))), "model.layers"


def _hetero_budget_tiny(draw, d):
    return _set(d, hetero__device_budget_bytes=draw(st.integers(1, 4096))), "hetero.device_budget_bytes"


def _hetero_dynamic_budget_on_cpu(draw, d):
    h = {**d.get("hetero", {}), "dynamic_budget": True, "device_budget_bytes": None}
    return {**_set(d, train__device="cpu"), "hetero": h}, "hetero.device_budget_bytes"


def _hetero_chunk_small(draw, d):
    from parallel4d.config.checks import largest_block
    cfg = load_config(d)
    step = 64 * cfg.parallel.dp * cfg.parallel.sp  # aligned: only the size rule broken
    largest = largest_block(cfg.model, cfg.parallel.q)
    return _set(d, hetero__chunk_elems=step * draw(st.integers(1, (largest - 1) // step))), "hetero.chunk_elems"


def _hetero_split_backward(draw, d):
    return _set(d, pipeline__schedule="hanayo", pipeline__split_backward=True, model__tie_embeddings=False), \
        "hetero.enabled"


def _hetero_tied_two_ends(draw, d):
    return _set(d, pipeline__schedule=draw(st.sampled_from(["1f1b", "gpipe"])), pipeline__waves=1,
                pipeline__split_backward=False, pipeline__hop_cost=None, model__tie_embeddings=True), \
        "hetero.enabled"


def _recompute_split_backward(draw, d):
    return _set(d, train__activation_checkpointing="blocks"), "train.activation_checkpointing"


def _interleaved_microbatches(draw, d):
    pp = _get(d, "parallel.pp")
    m = draw(st.integers(pp + 1, 4 * pp).filter(lambda m: m % pp))
    chunks = pp * 2
    return _set(d, pipeline__schedule="interleaved", pipeline__chunks_per_rank=2, pipeline__split_backward=False,
                pipeline__hop_cost=None, pipeline__microbatches=m, data__batch_size=m * _get(d, "parallel.dp", 1)
                * _q(d), model__layers=max(_get(d, "model.layers", 2), chunks)), "pipeline.microbatches"


def _gpt2_seq_past_positions(draw, d):
    seq = _get(d, "model.seq_len", 64)
    return _set(d, model__max_positions=draw(st.integers(1, seq - 1))), "model.seq_len"


def _llama_odd_head(draw, d):
    return _set(d, model__head_dim=draw(st.integers(0, 15)) * 2 + 1), "model.head_dim"


def _gpt2_llama_field(draw, d):
    field, value = draw(st.sampled_from([("kv_heads", 1), ("head_dim", 16), ("qk_norm", True), ("qkv_bias", True),
                                         ("rope_theta", 5e5)]))
    return _set(d, **{f"model__{field}": value}), f"model.{field}"


def _packing_without_eod(draw, d):
    return _set(d, data__packing="documents", data__eod_token=None), "data.eod_token"


def _eod_past_vocab(draw, d):
    vocab = _get(d, "model.vocab_size", 256)
    return _set(d, data__packing="documents", data__eod_token=draw(st.integers(vocab, vocab + 1000))), \
        "data.eod_token"


def _eod_without_packing(draw, d):
    return _set(d, data__packing="none", data__eod_token=draw(st.integers(0, 255))), "data.eod_token"


def _float64_autocast(draw, d):
    return _set(d, train__param_dtype="float64", train__autocast_dtype=draw(st.sampled_from(["bfloat16", "float16"]))), \
        "train.autocast_dtype"


def _too_many_workers(draw, d):
    return _set(d, train__max_local_workers=draw(st.integers(1, _world(d) - 1))), "train.max_local_workers"


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}  # a valid MoE model's fields


def _moe(d: dict, **dotted) -> dict:
    """``d`` as an MoE model (:data:`MOE`) with ``dotted`` over it."""
    return _set(d, **{**{f"model__{k}": v for k, v in MOE.items()}, **dotted})


def _ep_not_splitting(draw, d):
    replicas = _get(d, "parallel.dp", 1) * _get(d, "parallel.sp", 1)
    ep = draw(st.integers(2, 16).filter(lambda e: replicas % e or MOE["num_experts"] % e))
    return _moe(d, parallel__ep=ep), "parallel.ep"


def _top_k_past_experts(draw, d):
    return _moe(d, model__num_experts_per_tok=draw(st.integers(5, 16))), "model.num_experts_per_tok"


def _mlp_only_past_layers(draw, d):
    return _moe(d, model__mlp_only_layers=[draw(st.integers(_get(d, "model.layers", 4), 40))]), "model.mlp_only_layers"


def _moe_field_on_a_dense_model(draw, d):
    field, value = draw(st.sampled_from([("num_experts_per_tok", 2), ("moe_intermediate_size", 16),
                                         ("output_router_logits", True), ("mlp_only_layers", [0])]))
    return _set(d, model__num_experts=0, **{f"model__{field}": value}), "model.num_experts"


def _experts_in_gpt2(draw, d):
    return _moe(d), "model.num_experts"


def _world(d: dict) -> int:
    return math.prod(_get(d, f"parallel.{a}", 1) for a in ("pp", "dp", "sp", "tp"))


def _is(key, pred):
    return lambda d: pred(_get(d, key, None))


_pp = _is("parallel.pp", lambda v: (v or 1) > 1)
_sp = _is("parallel.sp", lambda v: (v or 1) > 1)
_tp = _is("parallel.tp", lambda v: (v or 1) > 1)
_hetero = _is("hetero.enabled", bool)
_gpt2 = _is("model.arch", lambda v: v in (None, "gpt2"))
_llama = _is("model.arch", lambda v: v == "llama")

MUTATIONS = [
    ("tp not a square", lambda d: True, _tp_not_square),
    ("heads not divisible by the grid side", _tp, _heads_per_column),
    ("hidden not divisible by the grid side", _tp, _hidden_per_grid),
    ("seq_len not divisible by sp", _sp, _seq_not_by_sp),
    ("zigzag seq_len not divisible by 2·sp", _sp, _zigzag_seq_not_by_2sp),
    ("batch not divisible by dp·q·microbatches", lambda d: True, _batch_split),
    ("split_backward with a schedule that refuses it", _pp, _split_backward_refused),
    ("hop_cost with a fixed order", _pp, _hop_cost_fixed_order),
    ("hop_cost out of range", lambda d: True, _hop_cost_out_of_range),
    ("ulysses not dividing sp", lambda d: _sp(d) and _get(d, "parallel.sp") < 16, _ulysses_not_dividing_sp),
    ("ulysses not dividing the heads", _sp, _ulysses_not_dividing_heads),
    ("kv_heads not dividing heads", _llama, _kv_heads_not_dividing),
    ("too few layers for the chunks", lambda d: _pp(d) and _chunks(d) >= 4, _too_few_layers),
    ("hetero budget below a chunk", _hetero, _hetero_budget_tiny),
    ("hetero chunk below the largest parameter", _hetero, _hetero_chunk_small),
    ("hetero dynamic budget on the CPU without a size", _hetero, _hetero_dynamic_budget_on_cpu),
    ("hetero with a split backward", lambda d: _hetero(d) and _pp(d), _hetero_split_backward),
    ("hetero with a tied head on two pp ranks", lambda d: _hetero(d) and _pp(d), _hetero_tied_two_ends),
    ("activation checkpointing under a split backward",
     lambda d: _pp(d) and _get(d, "pipeline.split_backward", False), _recompute_split_backward),
    ("interleaved micro-batches neither ≤ pp nor a multiple", _pp, _interleaved_microbatches),
    ("gpt2 seq_len past its positions", _gpt2, _gpt2_seq_past_positions),
    ("llama odd rotary head size", _llama, _llama_odd_head),
    ("a llama field under gpt2", _gpt2, _gpt2_llama_field),
    ("packed documents without an end-of-document token", lambda d: True, _packing_without_eod),
    ("end-of-document token past the vocabulary", lambda d: True, _eod_past_vocab),
    ("end-of-document token without packing", lambda d: True, _eod_without_packing),
    ("autocast over float64 parameters", lambda d: True, _float64_autocast),
    ("more workers than train.max_local_workers", lambda d: _world(d) > 1, _too_many_workers),
    ("parallel.ep not splitting the replicas or the experts", _llama, _ep_not_splitting),
    ("top-k past the experts", _llama, _top_k_past_experts),
    ("mlp_only_layers past the layers", _llama, _mlp_only_past_layers),
    ("an MoE field on a dense model", lambda d: True, _moe_field_on_a_dense_model),
    ("experts in gpt2", _gpt2, _experts_in_gpt2),
]


@st.composite
def mutations(draw):
    """``(mutation name, base name, broken job, field)``: a shipped job with one rule broken."""
    base = draw(st.sampled_from(sorted(BASES)))
    d = BASES[base]
    options = [(name, fn) for name, applies, fn in MUTATIONS if applies(d)]
    name, fn = draw(st.sampled_from(options))
    broken = fn(draw, d)
    if broken is None:  # this base cannot break that rule alone
        from hypothesis import assume
        assume(False)
    return (name, base, *broken)


def check_mutation(name: str, base: str, data: dict, field: str) -> str:
    note(f"{name} in configs/{base}.yaml: {data}")
    kind, got = outcome(data)
    assert kind == "refused", f"{name} (configs/{base}.yaml) was accepted: {data}"
    assert field in got, f"{name}: the refusal does not name {field}: {got}"
    bad = bad_lines(got)
    assert not bad, f"{name}: a refusal line names no field or no fix: {bad}"
    return kind


def test_the_shipped_jobs_are_valid():
    for name, data in BASES.items():
        assert outcome(data)[0] == "accepted", name


@settings(max_examples=EXAMPLES or 200, **SETTINGS)
@given(mutations())
def test_one_broken_rule_is_refused_naming_its_field(case):
    check_mutation(*case)


# --- regressions: accepted by validate, then failed in a worker (found by the dry run of accepted draws) ---

def test_hetero_budget_of_one_chunk_is_refused_naming_hetero_device_budget_bytes():
    """One chunk passed the rule ("a budget holds one chunk"), then every worker raised "too small":
    without data replicas the optimizer pins P, G, M, V of a row (4 chunks); under ZeRO a module's
    parameter and gradient chunks plus the shard slots. Lower bounds, never above what hetero needs."""
    one_chunk = {"hetero": {"enabled": True, "device_budget_bytes": 65536 * 4}, "model": {"hidden": 128},
                 "train": {"out_dir": "runs/fuzz"}}  # the largest parameter: 128·512 elements of float32
    kind, got = outcome(one_chunk)
    assert kind == "refused" and "hetero.device_budget_bytes=262144" in got and "≥1048576" in got, got
    assert not bad_lines(got)
    zero = {**one_chunk, "parallel": {"dp": 2}}  # 2 chunks of 65536 + 4 shard slots of 32768 elements
    kind, got = outcome(zero)
    assert kind == "refused" and "≥1048576" in got, got
    sixteen = {**one_chunk, "hetero": {"enabled": True, "device_budget_bytes": 200_000},  # 2 chunks, 2 bytes
               "train": {"dtype": "bfloat16", "out_dir": "runs/fuzz"}}
    kind, got = outcome(sixteen)
    assert kind == "refused" and "≥262144" in got, got
    assert outcome({**one_chunk, "hetero": {"enabled": True, "device_budget_bytes": 4 * 65536 * 4}})[0] == "accepted"


def test_hetero_dynamic_budget_on_the_cpu_without_a_budget_is_refused_naming_hetero_device_budget_bytes():
    """hetero/budget.py raised in every worker: a CPU has no device memory to size the budget from."""
    for device in ({"train": {"device": "cpu", "out_dir": "runs/fuzz"}},
                   {"hetero": {"enabled": True, "dynamic_budget": True, "compute_device": "cpu"}}):
        data = {"hetero": {"enabled": True, "dynamic_budget": True}, **device}
        kind, got = outcome(data)
        assert kind == "refused" and "hetero.dynamic_budget=true on the CPU" in got, (data, got)
        assert "hetero.device_budget_bytes" in got and not bad_lines(got)
    given_budget = {"hetero": {"enabled": True, "dynamic_budget": True, "device_budget_bytes": 10**7},
                    "train": {"device": "cpu", "out_dir": "runs/fuzz"}}
    assert outcome(given_budget)[0] == "accepted"


def test_the_raw_draws_reach_every_moe_field_and_parallel_ep_accepted_and_refused():
    """#48: the raw draws set parallel.ep and each MoE field, and among them are MoE models validate
    accepts and ones it refuses, ep > 1 among them (generation and validation only: no worker; a fixed
    seed: the same draws each run)."""
    seen = set()

    @settings(max_examples=200, database=None, **{**SETTINGS, "derandomize": True})
    @given(raw_configs())
    def draw(data):
        model, ep = data["model"], data.get("parallel", {}).get("ep", 1)
        seen.update(f"model.{f}" for f in MOE_FIELDS if f in model)
        seen.update(["parallel.ep > 1"] if ep > 1 else [])
        if model.get("num_experts"):
            seen.add(f"an MoE model {check_draw(data)}")

    draw()
    want = {f"model.{f}" for f in MOE_FIELDS} | {"parallel.ep > 1", "an MoE model accepted", "an MoE model refused"}
    assert want <= seen, sorted(want - seen)


class _Covered(Exception):
    """Every wanted draw seen: ends a coverage run early."""


def test_the_raw_draws_reach_model_lora_accepted_and_refused():
    """#49: the raw draws set model.lora with each of its fields, and among them are jobs validate accepts and
    ones it refuses, on a dense model and an MoE one (a fixed seed; up to 3000 draws, stopping once each is
    seen: accepted LoRA jobs are a few percent of the raw draws, so a fixed few hundred can miss one)."""
    want = {f"model.lora.{f}" for f in ("rank", "alpha", "targets", "dropout", "rslora", "adapter")} | \
        {f"LoRA on {k} {o}" for k in ("a dense model", "an MoE model") for o in ("accepted", "refused")}
    seen = set()

    @settings(max_examples=3000, database=None, phases=[Phase.generate], **{**SETTINGS, "derandomize": True})
    @given(raw_configs())
    def draw(data):
        lora = data["model"].get("lora")
        if lora is None:
            return
        seen.update(f"model.lora.{f}" for f in lora)
        kind = "an MoE model" if data["model"].get("num_experts") else "a dense model"
        seen.add(f"LoRA on {kind} {check_draw(data)}")
        if want <= seen:
            raise _Covered

    with contextlib.suppress(_Covered):
        draw()
    assert want <= seen, sorted(want - seen)


#: what the FP8 draws' refusals say (config/rules/fp8.py; pydantic's choice of the recipe, as load_config words it)
REFUSAL = {"an unknown recipe refused": "train.fp8: Input should be",
           "FP8 in float64 refused": "train.fp8=rowwise with train.dtype=float64"}


def test_the_raw_draws_reach_train_fp8_accepted_and_refused():
    """#50: the raw draws set train.fp8, and among them are FP8 jobs validate accepts, FP8 jobs in float64 refused
    naming train.fp8 and the dtype, and a recipe FP8 does not have refused naming train.fp8 (a fixed seed; up to
    3000 draws, stopping once each is seen; each validated until its case is seen)."""
    want = {"FP8 accepted", "FP8 in float64 refused", "an unknown recipe refused"}
    seen = set()

    @settings(max_examples=3000, database=None, phases=[Phase.generate], **{**SETTINGS, "derandomize": True})
    @given(raw_configs())
    def draw(data):
        train = data.get("train", {})
        if want <= seen:
            raise _Covered
        if train.get("fp8", "none") == "none":
            return
        case = "an unknown recipe refused" if train["fp8"] != "rowwise" else \
            "FP8 in float64 refused" if train.get("dtype") == "float64" else "FP8 accepted"
        if case in seen:  # validated until seen only: the raw draws' own test checks every outcome
            return
        kind, got = checked_outcome(data)
        if (kind == "accepted") if case == "FP8 accepted" else (kind == "refused" and REFUSAL[case] in got):
            seen.add(case)

    with contextlib.suppress(_Covered):
        draw()
    assert want <= seen, sorted(want - seen)
