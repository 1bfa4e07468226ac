"""#33: Hypothesis draws jobs across the whole space — pp, dp, sp, tp; every schedule, waves, split
backward and hop cost; ring layouts and Ulysses; hetero with budgets from the minimum up (ZeRO where
dp·sp > 1); activation checkpointing; gpt2 and llama (GQA, tied and untied; a vocabulary the 2D grid
pads or not; mixture-of-experts layers of every shape, split over parallel.ep, in every layout — those
validate refuses counted as refused); LoRA adapters (rank, alpha, rsLoRA, targets, dropout) wherever
config/rules/lora.py accepts them for the layout drawn; FP8 linears (``train.fp8=rowwise``) wherever
config/rules/fp8.py accepts them; evaluation; a resume mid-run — and runs each through ``parallel4d check``'s own
code (:mod:`parallel4d.tools.check`): the shrunk job on gloo workers in float64 against one process, losses to
1e-10, every parameter to 1e-9 (an FP8 draw: FP8 on both sides over float32, at the check's FP8 tolerances).

A fixed time budget per run (``PARALLEL4D_FUZZ_SECONDS``, default 20 s, a new seed each run): a draw
that would end after it, at the slowest pace per rank so far, passes without running
(``PARALLEL4D_FUZZ_EXAMPLES``, default 40, bounds the draws generated). The seed is printed
(``PARALLEL4D_FUZZ_SEED`` sets it); every draw prints the one command that reruns it alone,
``parallel4d check configs/quickstart.yaml --set ...``. A draw the
config refuses is not a test of the layout (refusals: tests/test_config_fuzz.py)."""

import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, assume, given, seed, settings, strategies as st

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config
from conftest import run_in_this_process
from parallel4d.config.checks import dense_parameters
from parallel4d.tools.check import format_report, run_check, shrunk

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "configs" / "quickstart.yaml"
BUDGET_S = float(os.environ.get("PARALLEL4D_FUZZ_SECONDS", 20))  # the suite's 20 minutes: its 30 s ran to 56 s
SEED = int(os.environ.get("PARALLEL4D_FUZZ_SEED", random.randrange(2**32)))
MAX_WORLD = 8  # the CI's 2 cores
EXAMPLES = int(os.environ.get("PARALLEL4D_FUZZ_EXAMPLES", 40))  # more than the budget runs: the rest are free
KEEP_GOING = os.environ.get("PARALLEL4D_FUZZ_KEEP_GOING") == "1"  # a long run: count failures, go on
# per_rank: the most seconds a draw took per rank of its world (a world of 8 takes about 8 times a world of 1)
RUN: dict = {"start": None, "ran": 0, "refused": 0, "failed": [], "per_rank": 0.0, "over": False}


def summary() -> list[str]:
    """What this session's fuzzing did (conftest prints it at the end of every run that drew)."""
    lines = [f"layout fuzz: seed {SEED} (PARALLEL4D_FUZZ_SEED={SEED} reruns these draws), {RUN['ran']} draws run, "
             f"{RUN['ran'] - len(RUN['failed'])} equal, {len(RUN['failed'])} failed, {RUN['refused']} refused by "
             "the config"]
    return lines + [f"layout fuzz FAILED: {line}" for line in RUN["failed"]]


@st.composite
def jobs(draw) -> tuple[list[str], float | None, int | None]:
    """``(overrides of configs/quickstart.yaml, hetero's device budget as a share of the model's bytes or
    None, the step to resume after or None)``: the check keeps that share at its shape, or the least
    budget its rules accept (a share of 0.001: the minimum)."""
    tp = draw(st.sampled_from([1, 4]))
    sp = draw(st.sampled_from([s for s in (1, 2, 4) if s * tp <= MAX_WORLD]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if p * sp * tp <= MAX_WORLD]))
    dp = draw(st.sampled_from([d for d in (1, 2) if d * pp * sp * tp <= MAX_WORLD]))
    out = [f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.sp={sp}", f"parallel.tp={tp}"]
    m = draw(st.sampled_from([1, 2, 4])) * (pp if pp > 1 else 1)
    out += _pipeline(draw, pp) + [f"pipeline.microbatches={m}"]
    if sp > 1:
        out.append(f"sequence.layout={draw(st.sampled_from(['contiguous', 'zigzag']))}")
        out.append(f"sequence.ulysses={draw(st.sampled_from([1, 2]))}")
    out += _model(draw) + [f"data.batch_size={dp * int(tp ** 0.5) * m * 2}", "model.seq_len=32"]
    out.append(f"train.activation_checkpointing={draw(st.sampled_from(['none', 'blocks']))}")
    if draw(st.booleans()):
        out.append("train.eval_every=2")
    out += _experts(draw, dp * sp) if "model.arch=llama" in out else []  # the family with MoE
    budget = draw(st.sampled_from([None, 0.001, 0.2, 0.5]))
    out.append(f"hetero.enabled={budget is not None or draw(st.booleans())}")
    resume = draw(st.sampled_from([None, None, None, 1, 2]))
    out += _lora(draw, out)
    return out + _fp8(draw, out), budget, resume


#: each family's peft target_modules names (the config's rule: its spec's lora_targets)
LORA_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
                "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def _lora(draw, job: list[str]) -> list[str]:
    """``model.lora`` (rank, alpha, rsLoRA, a subset of the family's targets, dropout) where the config's rules
    accept it for the layout ``job`` drew (config/rules/lora.py decides, not this fuzzer); none otherwise or
    half the time. The check runs its adapters without dropout, as the model's (tools/check.py)."""
    if not draw(st.booleans()):
        return []
    arch = next(o.split("=", 1)[1] for o in job if o.startswith("model.arch="))
    every = LORA_TARGETS[arch]
    targets = draw(st.one_of(st.just(every), st.lists(st.sampled_from(every), min_size=1, unique=True)))
    lora = {"rank": draw(st.sampled_from([1, 2, 4])), "alpha": draw(st.sampled_from([1, 8, 16])),
            "rslora": draw(st.booleans()), "targets": targets, "dropout": draw(st.sampled_from([0.0, 0.1]))}
    out = [f"model.lora={json.dumps(lora)}"]
    try:
        load_config(BASE, [*job, *out])
    except ConfigError:
        return []
    return out


def _fp8(draw, job: list[str]) -> list[str]:
    """``train.fp8=rowwise`` where the config's rules accept it for the job drawn (config/rules/fp8.py decides, not
    this fuzzer); none otherwise or half the time. The check runs an FP8 job in FP8 on both sides, over float32
    parameters, at FP8's tolerances, AdamW's eps at least 1e-5, and over ``parallel.sp`` a reference running the
    ring's attention kernel (tools/check.py: ``FP8_EPS``, ``reference_kernel``)."""
    if not draw(st.booleans()):
        return []
    out = ["train.fp8=rowwise"]
    try:
        load_config(BASE, [*job, *out])
    except ConfigError:
        return []
    return out


def _pipeline(draw, pp: int) -> list[str]:
    if pp == 1:
        return []
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "hanayo", "zb_h1", "zbv"]))
    out = [f"pipeline.schedule={schedule}"]
    if schedule == "hanayo":
        out += [f"pipeline.waves={draw(st.sampled_from([1, 2]))}",
                f"pipeline.split_backward={draw(st.booleans())}"]
    if schedule in ("hanayo", "zb_h1", "zbv"):
        out.append(f"pipeline.hop_cost={draw(st.sampled_from(['null', 'auto', '0.5']))}")
    return out


def _model(draw) -> list[str]:
    arch = draw(st.sampled_from(["gpt2", "llama"]))
    out = [f"model.arch={arch}", "model.hidden=32", "model.heads=4", "model.layers=8",
           f"model.tie_embeddings={draw(st.booleans())}",
           f"model.vocab_size={draw(st.sampled_from([257, 256]))}"]  # 257 (first: the early draws): padded to 258
    if arch == "llama":
        out.append(f"model.kv_heads={draw(st.sampled_from([4, 2, 1]))}")  # MHA, GQA, MQA
        out.append(f"model.qk_norm={draw(st.booleans())}")
    return out


def _experts(draw, replicas: int) -> list[str]:
    """Mixture-of-experts layers (or none) in any layout — which layouts they run in is the config's
    rule (a refused draw is counted as refused): 4 or 8 experts, top-1, top-2 or every expert, split over
    an ep dividing the ``replicas`` data-replica ranks; a shared expert, dense layers (``mlp_only_layers``,
    ``decoder_sparse_step``), renormalised top-k and the load-balancing loss (a micro-batch's: every
    layout's micro-batch i is the check's one process's, engine/batch.py), each or not."""
    if not draw(st.booleans()):
        return []
    e = draw(st.sampled_from([4, 8]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4) if replicas % d == 0]))
    out = [f"model.num_experts={e}", f"model.num_experts_per_tok={draw(st.sampled_from([2, 1, e]))}",
           "model.moe_intermediate_size=16", f"model.norm_topk_prob={draw(st.booleans())}", f"parallel.ep={ep}"]
    shared = draw(st.sampled_from([0, 24]))
    out += [f"model.shared_expert_intermediate_size={shared}"] if shared else []
    step = draw(st.sampled_from([1, 1, 2]))
    out += [f"model.decoder_sparse_step={step}"] if step > 1 else []
    dense = draw(st.sampled_from([[], [], [0], [1, 6]]))  # of model.layers=8
    out += [f"model.mlp_only_layers=[{','.join(map(str, dense))}]"] if dense else []
    aux = draw(st.booleans())
    out.append(f"model.output_router_logits={aux}")
    return out + ([f"model.router_aux_loss_coef={draw(st.sampled_from([0.5, 0.01]))}"] if aux else [])


def _with_budget(job: list[str], share: float | None) -> list[str]:
    """``job`` with a hetero device budget of ``share`` of its model's bytes (the check scales it)."""
    if share is None:
        return job
    cfg = load_config(BASE, job)
    return [*job, f"hetero.device_budget_bytes={max(1, int(share * dense_parameters(cfg.model) * 4))}"]


def _train(cfg):
    """A one-process reference in this process (no spawn); anything else as ``launch`` runs it."""
    if cfg.world_size > 1:
        from parallel4d import launch

        return launch(cfg)
    return run_in_this_process(cfg, [])


def command(job: list[str], resume: int | None) -> str:
    """The one command that reruns a draw alone."""
    sets = " ".join(f"--set {shlex.quote(o)}" for o in job)
    return f"parallel4d check configs/quickstart.yaml {sets}" + (f" --steps 4 --resume-at {resume}" if resume else "")


@settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@seed(SEED)
@given(jobs())
def test_a_drawn_layout_trains_as_one_process(draw):
    RUN["start"] = RUN["start"] or time.monotonic()
    if RUN["ran"] == 0 and RUN["refused"] == 0:
        print(f"\nlayout fuzz: seed {SEED} (PARALLEL4D_FUZZ_SEED={SEED} reruns these draws)", file=sys.stderr)
    if RUN["over"]:  # the budget is spent (the rest of the draws: Hypothesis's generation only)
        return
    job, share, resume = draw
    try:
        job = _with_budget(job, share)
        plan = shrunk(BASE, job, steps=4 if resume else 3, max_workers=MAX_WORLD)
    except ConfigError:
        RUN["refused"] += 1
        assume(False)
    world = plan.cfg.world_size
    if time.monotonic() - RUN["start"] + RUN["per_rank"] * world > BUDGET_S:  # it would end after the budget
        RUN["over"] = True
        return
    line = command(job, resume)
    print(f"layout fuzz draw {RUN['ran'] + 1}: {line}", file=sys.stderr)
    RUN["ran"] += 1
    began = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as out:
            outcome = run_check(BASE, job, plan, out, train=_train, resume_at=resume)
        RUN["per_rank"] = max(RUN["per_rank"], (time.monotonic() - began) / world)
        assert outcome.equal, "\n".join([f"seed {SEED}; rerun alone: {line}", *format_report(BASE, plan, outcome)])
    except Exception as e:
        RUN["failed"].append(f"{line}\n    {type(e).__name__}: {str(e)[-600:]}")
        if not KEEP_GOING:
            raise


def test_the_fuzzer_draws_experts_and_ep_in_every_layout_and_the_moe_shapes():
    """#48: the draws put MoE layers (split over parallel.ep > 1) beside pipelines, the 2D grid and hetero
    alike — whichever of them validate refuses is the config's call, counted as refused — with every MoE
    shape the rules know: 4 or 8 experts, top-1, top-2 and every expert, a shared expert, dense layers
    (mlp_only_layers, decoder_sparse_step), renormalised top-k, the auxiliary loss on and off — on also where
    the data rows split over dp or the grid's rows with several micro-batches (a micro-batch's loss, each
    rank holding a share of every micro-batch). Generation only."""
    seen = set()

    @settings(max_examples=400, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(48)
    @given(jobs())
    def draw(case):
        job = dict(o.split("=", 1) for o in case[0])
        if int(job.get("model.num_experts", 0)):
            e, k = job["model.num_experts"], job["model.num_experts_per_tok"]
            seen.update({f"experts={e}", "top-k all" if k == e else f"top-k {k}",
                         *(f"{a}>1" for a in ("pp", "tp", "ep") if int(job[f"parallel.{a}"]) > 1),
                         *(["hetero"] if job["hetero.enabled"] == "True" else []),
                         *(f for f in ("model.shared_expert_intermediate_size", "model.mlp_only_layers",
                                       "model.decoder_sparse_step", "model.router_aux_loss_coef") if f in job),
                         *(f"{f}={job.get(f)}" for f in ("model.norm_topk_prob", "model.output_router_logits")),
                         *(f"aux loss, {a}>1, micro-batches>1" for a in ("dp", "tp") if int(job[f"parallel.{a}"]) > 1
                           and int(job["pipeline.microbatches"]) > 1 and job["model.output_router_logits"] == "True")})

    draw()
    want = {"experts=4", "experts=8", "top-k 1", "top-k 2", "top-k all", "pp>1", "tp>1", "ep>1", "hetero",
            "model.shared_expert_intermediate_size", "model.mlp_only_layers", "model.decoder_sparse_step",
            "model.router_aux_loss_coef", "model.norm_topk_prob=True", "model.norm_topk_prob=False",
            "model.output_router_logits=True", "model.output_router_logits=False",
            "aux loss, dp>1, micro-batches>1", "aux loss, tp>1, micro-batches>1"}
    assert want <= seen, sorted(want - seen)


#: layouts config/rules/lora.py accepts LoRA in (one process, an MoE model's experts over ep=2 of dp=2): where
#: the coverage below looks at what the LoRA draw gives
LORA_LAYOUTS = {"llama, one process": ["parallel.dp=1", "model.arch=llama"],
                "gpt2, one process": ["parallel.dp=1", "model.arch=gpt2"],
                "llama MoE, dp=2, ep=2": ["parallel.dp=2", "model.arch=llama", "model.num_experts=4",
                                          "model.num_experts_per_tok=2", "model.moe_intermediate_size=16",
                                          "parallel.ep=2"]}


def test_the_fuzzer_draws_lora_where_the_rules_accept_it():
    """#49: the draws carry ``model.lora`` only in jobs the config's rules accept with it (config/rules/lora.py
    decides the layouts: every LoRA job the fuzzer draws loads), and where they accept it the draw covers every
    rank, alpha, rsLoRA on and off, dropout, every target and subsets of each family's, the routed experts'
    adapters at parallel.ep > 1. Generation only."""
    seen, refused = set(), []

    @settings(max_examples=200, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(49)
    @given(jobs())
    def whole(case):
        if any(o.startswith("model.lora=") for o in case[0]):
            try:
                load_config(BASE, case[0])
            except ConfigError as e:
                refused.append(str(e))

    @settings(max_examples=150, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(49)
    @given(st.sampled_from(list(LORA_LAYOUTS)), st.data())
    def accepted(name, data):
        job = LORA_LAYOUTS[name]
        drawn = data.draw(st.composite(_lora)(job))
        if not drawn:
            return
        lora, arch = json.loads(drawn[0].split("=", 1)[1]), name.split(",")[0].split()[0]
        every = len(lora["targets"]) == len(LORA_TARGETS[arch])
        seen.update({f"rank {lora['rank']}", f"alpha {lora['alpha']}", f"rslora={lora['rslora']}",
                     f"dropout={lora['dropout'] > 0}", f"{arch} {'every' if every else 'some'} targets"})
        if "parallel.ep=2" in job and {"gate_proj", "up_proj", "down_proj"} & set(lora["targets"]):
            seen.add("experts' adapters at ep>1")

    whole()
    accepted()
    assert not refused, refused[:3]
    want = {"rank 1", "rank 2", "rank 4", "alpha 1", "alpha 16", "rslora=True", "rslora=False", "dropout=True",
            "dropout=False", "gpt2 every targets", "gpt2 some targets", "llama every targets", "llama some targets",
            "experts' adapters at ep>1"}
    assert want <= seen, sorted(want - seen)


#: candidate layouts for train.fp8 (config/rules/fp8.py decides which accept it: today every axis of a dense model
#: but ep): the coverage below expects the draw exactly where the rules accept FP8
FP8_LAYOUTS = {"gpt2, one process": ["parallel.dp=1", "model.arch=gpt2"],
               "llama, one process": ["parallel.dp=1", "model.arch=llama"],
               "dp=2": ["parallel.dp=2"], "pp=2": ["parallel.dp=1", "parallel.pp=2"],
               "sp=2": ["parallel.dp=1", "parallel.sp=2"], "tp=4": ["parallel.dp=1", "parallel.tp=4"],
               "hetero": ["parallel.dp=1", "hetero.enabled=true"],
               "MoE": ["parallel.dp=1", "model.arch=llama", "model.num_experts=4", "model.num_experts_per_tok=2",
                       "model.moe_intermediate_size=16"],
               "LoRA": ["parallel.dp=1", 'model.lora={"rank": 2, "targets": ["c_attn"]}']}


def _accepts(job: list[str]) -> bool:
    try:
        load_config(BASE, job)
        return True
    except ConfigError:
        return False


def test_the_fuzzer_draws_fp8_exactly_where_the_rules_accept_it():
    """#50.3: the draws carry ``train.fp8=rowwise`` only in jobs the config's rules accept with it (every FP8 job the
    fuzzer draws loads), in each layout the rules accept FP8 in — half the time — and in none they refuse it in
    (config/rules/fp8.py decides, not this fuzzer: a layout whose refusal lifts is drawn with FP8 from then on). The
    check runs an FP8 draw in FP8 on both sides (tools/check.py). Generation only."""
    accepted = {name for name, job in FP8_LAYOUTS.items() if _accepts([*job, "train.fp8=rowwise"])}
    seen, refused = set(), []

    @settings(max_examples=100, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(50)
    @given(jobs())
    def whole(case):
        if "train.fp8=rowwise" in case[0] and not _accepts(case[0]):
            refused.append(case[0])

    @settings(max_examples=120, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(50)
    @given(st.sampled_from(list(FP8_LAYOUTS)), st.data())
    def layouts(name, data):
        seen.add((name, bool(data.draw(st.composite(_fp8)(FP8_LAYOUTS[name])))))

    whole()
    layouts()
    assert not refused, refused[:3]
    assert "gpt2, one process" in accepted and accepted <= set(FP8_LAYOUTS)
    assert {"dp=2", "sp=2", "tp=4", "pp=2", "hetero"} <= accepted, accepted
    want = {(name, drawn) for name in FP8_LAYOUTS for drawn in ((True, False) if name in accepted else (False,))}
    assert seen == want, (sorted(want - seen), sorted(seen - want))
