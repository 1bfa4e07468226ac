"""#33: ``parallel4d check JOB.yaml`` — the job's own layout and features on the smallest model its
rules accept, float64 on CPU, against one process; and the config gaps its runs found."""

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import parallel4d.launcher.launch as launch_module
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config
from conftest import run_in_this_process
from parallel4d.tools.check import (FLOAT64, FP8, Outcome, _where, compare, compare_parameters, format_report, into,
                                    nothing_to_compare, run_check, shrunk, sub_layouts, tolerance)
from parallel4d.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["4d", "hetero", "llama", "pipeline", "pipeline_zb", "quickstart", "sequence", "tensor2d"]
KEPT = ["parallel", "pipeline", "sequence"]  # whole sections the check keeps as the job has them


@functools.lru_cache(maxsize=None)
def plan_of(name: str):
    """``shrunk`` of configs/NAME.yaml, once per session (a hetero job's dry runs take seconds)."""
    return shrunk(ROOT / "configs" / f"{name}.yaml", [])


FOUR_D = ROOT / "configs" / "4d.yaml"  # Hanayo pp=2 × ring sp=2 × SUMMA tp=4 × hetero (ZeRO over dp·sp = 2)
# A Qwen3 as transformers writes its config.json: q/k norms, heads of 16 (not hidden/heads = 8), GQA 4:2
QWEN3 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=1e6,
             tie_word_embeddings=False)
QWEN3_16 = ["parallel.pp=2", "parallel.sp=2", "parallel.tp=4"]  # the layout the shared 16-worker job checks


def pretrained_qwen3_job(tmp: Path) -> Path:
    """A job file fine-tuning ``tmp/qwen3`` (a Qwen3 directory saved by transformers: the check reads its
    config.json only, so no weights are written)."""
    transformers = pytest.importorskip("transformers")
    transformers.Qwen3Config(**QWEN3).save_pretrained(tmp / "qwen3")
    job = tmp / "qwen3.yaml"
    job.write_text(f"model: {{pretrained: {json.dumps(str(tmp / 'qwen3'))}, seq_len: 16}}\n"
                   "data: {source: synthetic, batch_size: 8}\ntrain: {steps: 10}\n")
    return job


def sixteen_worker_prepare(tmp):
    """Before the shared 16-worker job (its dry run of hetero's least budget needs a process without a
    group): the check's overrides of configs/4d.yaml and of the pretrained Qwen3 at pp=2 sp=2 tp=4."""
    (tmp / "overrides.json").write_text(json.dumps(plan_of("4d").overrides))
    if importlib.util.find_spec("transformers") is not None:  # the hf extra: else its test skips
        job = pretrained_qwen3_job(tmp)
        (tmp / "qwen3.json").write_text(json.dumps([*QWEN3_16, *shrunk(job, QWEN3_16).overrides]))


def sixteen_worker_job(tmp):
    """On every rank of the suite's shared 16-worker job: the check's layout runs of configs/4d.yaml
    (``parallel4d check configs/4d.yaml`` starts 16 workers of its own: 30 s here, README) and of the
    pretrained Qwen3 (3 s more here)."""
    from parallel4d.training.loop import run_training

    cfg = load_config(FOUR_D, json.loads((tmp / "overrides.json").read_text()))
    out, qwen3 = tmp / "layout", tmp / "qwen3-layout"
    four_d = run_training(into(cfg, out)), str(out)
    if not (tmp / "qwen3.json").exists():
        return four_d, None
    cfg = load_config(tmp / "qwen3.yaml", json.loads((tmp / "qwen3.json").read_text()))
    return four_d, (run_training(into(cfg, qwen3)), str(qwen3), str(tmp / "qwen3.yaml"))


def test_the_check_of_the_16_rank_4d_job_is_equal(sixteen_workers, tmp_path):
    summary, out = sixteen_workers[0]["test_check"][0]
    plan = plan_of("4d")
    reference = plan.reference(FOUR_D, [])
    reference = into(reference, tmp_path)
    outcome = compare(plan.cfg, summary, run_in_this_process(reference, []), Path(out) / "checkpoints",
                      tmp_path / "checkpoints")
    report = "\n".join(format_report(FOUR_D, plan, outcome))
    assert plan.cfg.world_size == 16 and outcome.equal, report
    assert outcome.hetero_moved > 0, report  # the budget bites: chunks move every step


def test_the_check_of_a_pretrained_qwen3_at_pp2_sp2_tp4_is_equal(sixteen_workers, tmp_path):
    """#45: every job with model.pretrained was refused ("raise --max-workers"): the shrunk shapes
    clashed with its config.json. Its layout on 16 ranks, random weights, against one process."""
    if sixteen_workers[0]["test_check"][1] is None:
        pytest.skip("transformers (the hf extra) is not installed")
    summary, out, job = sixteen_workers[0]["test_check"][1]
    plan = shrunk(job, QWEN3_16)
    reference = into(plan.reference(job, QWEN3_16), tmp_path)
    outcome = compare(plan.cfg, summary, run_in_this_process(reference, []), Path(out) / "checkpoints",
                      tmp_path / "checkpoints")
    assert plan.cfg.world_size == 16 and outcome.equal, "\n".join(format_report(job, plan, outcome))


@pytest.mark.parametrize("layout", [["parallel.sp=2"], ["parallel.tp=4"], ["parallel.pp=2"], ["parallel.dp=2"]],
                         ids=["sp2", "tp4", "pp2", "dp2"])
def test_check_of_a_pretrained_job_keeps_its_layout_family_and_options_with_random_weights(layout, tmp_path):
    job = pretrained_qwen3_job(tmp_path)
    want = load_config(job, layout)
    plan = shrunk(job, layout)
    small = plan.cfg
    m, s = want.model, small.model
    assert small.parallel == want.parallel and s.pretrained is None
    assert "model.pretrained: random weights" in plan.notes[0]
    assert (s.arch, s.qk_norm, s.tie_embeddings, s.rope_theta, s.norm_eps) == \
        (m.arch, m.qk_norm, m.tie_embeddings, m.rope_theta, m.norm_eps)
    assert s.heads // s.kv_heads == m.heads // m.kv_heads  # GQA's group
    assert s.heads * s.head_dim * m.hidden == s.hidden * m.heads * m.head_dim  # heads wider than hidden/heads
    assert s.hidden < m.hidden and s.layers < m.layers
    assert plan.reference(job, layout).world_size == 1  # and the one-process reference loads too


def test_check_of_one_process_says_there_is_nothing_to_compare_and_exits_0(tmp_path, capsys):
    """#45: a one-worker job (here a pretrained one) was refused with "raise --max-workers", exit 2."""
    job = pretrained_qwen3_job(tmp_path)
    for argv in ([str(job)], [str(ROOT / "configs" / "quickstart.yaml"), "--set", "parallel.dp=1"]):
        assert main(["check", *argv]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and "is the reference itself: nothing to compare" in out[0], out


#: a one-process FP8 job with something to compare (recomputed blocks: the forward's FP8 products run twice)
FP8_JOB = ["parallel.dp=1", "train.dtype=bfloat16", "train.fp8=rowwise", "train.activation_checkpointing=blocks"]


def test_check_of_an_fp8_job_runs_fp8_over_float32_on_both_sides():
    """#50.3: the check ran an FP8 job in float64 without FP8 (float64 refuses it) and said "not checked". Now both
    the layout and its one-process reference keep train.fp8, over float32 parameters, held to the FP8 tolerances."""
    plan = shrunk(ROOT / "configs" / "quickstart.yaml", FP8_JOB)
    reference = plan.reference(ROOT / "configs" / "quickstart.yaml", FP8_JOB)
    for cfg in (plan.cfg, reference):
        assert (cfg.train.fp8, cfg.train.parameters, cfg.train.autocast) == ("rowwise", "float32", "none")
    assert tolerance(plan.cfg) == FP8 and tolerance(shrunk(ROOT / "configs" / "quickstart.yaml", []).cfg) == FLOAT64
    assert any("train.fp8=rowwise: checked in float32" in note for note in plan.notes), plan.notes


def test_check_of_an_fp8_job_runs_adamw_above_float32_noise_and_over_sp_a_reference_on_the_rings_kernel():
    """#50.3: an FP8 job's check (both sides) runs AdamW's eps at least 1e-5 — at the job's 1e-8, AdamW turned the
    float32 noise of GPT-2's key-bias gradient (zero in exact arithmetic) into steps 1.05e-5 to 1.53e-5 apart,
    beyond FP8's tolerance, in 5 of 24 draws over sp; every parameter within 3.0e-7 at 1e-5 — and over
    ``parallel.sp`` a one-process reference running the ring's attention kernel (``sequence.kernel=blockwise``):
    against SDPA's float32 roundings an e4m3 rounding may flip. Each said in the notes. A float64 check keeps the
    job's eps and SDPA (code nobody here wrote); an FP8 job's larger eps is kept."""
    job = ROOT / "configs" / "quickstart.yaml"
    fp8_sp = ["parallel.dp=1", "parallel.sp=2", "train.fp8=rowwise"]
    plan = shrunk(job, fp8_sp)
    reference = plan.reference(job, fp8_sp)
    assert (plan.cfg.parallel.sp, reference.parallel.sp, reference.sequence.kernel) == (2, 1, "blockwise")
    assert plan.cfg.optimizer.eps == reference.optimizer.eps == 1e-5
    assert any("optimizer.eps=1e-08: checked at 1e-05" in n for n in plan.notes), plan.notes
    assert any("sequence.kernel=blockwise" in n for n in plan.notes), plan.notes
    for overrides in (["parallel.dp=1", "parallel.sp=2"], ["parallel.dp=2", "train.fp8=rowwise"]):
        plain = shrunk(job, overrides)
        assert plain.reference(job, overrides).sequence.kernel == "auto", overrides
        assert plain.cfg.optimizer.eps == (1e-8 if "train.fp8=rowwise" not in overrides else 1e-5), overrides
    wide = shrunk(job, [*fp8_sp, "optimizer.eps=1e-3"])
    assert wide.cfg.optimizer.eps == 1e-3 and not any("optimizer.eps" in n for n in wide.notes), wide.notes


def test_an_fp8_check_takes_a_few_flipped_elements_within_adamws_reach_as_equal_and_no_more():
    """#50.3: FP8's rounding is discontinuous, so a float32 reordering can flip an e4m3 rounding and part one element
    by more than float32's reordering (2 of 48 fuzzer draws, tp=4 × sp=2). The FP8 check takes up to one element in
    a thousand so, each within 2⁻⁴·lr·steps, as equal and counts them; one more element, or one farther off,
    differs; float64 takes none."""
    cfg = shrunk(ROOT / "configs" / "quickstart.yaml", ["parallel.dp=2", "train.fp8=rowwise"]).cfg
    limit = FP8.flip_limit(cfg)
    assert limit == 2 ** -4 * cfg.optimizer.lr * cfg.train.steps
    g = torch.Generator().manual_seed(0)
    ref = {"blocks.0.attn.qkv.weight": torch.rand(40, 50, dtype=torch.float64, generator=g) + 0.5,
           "head.weight": torch.rand(10, 10, dtype=torch.float64, generator=g) + 0.5}  # 2,100 elements: 2 may flip
    close = {k: v * (1 + 1e-7) for k, v in ref.items()}  # float32's reordering

    def with_off(*offs):
        mine = {k: v.clone() for k, v in close.items()}
        for (i, j), by in offs:
            mine["blocks.0.attn.qkv.weight"][i, j] += by
        return mine

    found = compare_parameters(cfg, FP8, close, ref)
    assert found.first is None and found.flipped is None, found
    found = compare_parameters(cfg, FP8, with_off(((3, 4), 1e-4), ((5, 6), 2e-5)), ref)
    assert found.first is None and found.flipped == (2, 2100, pytest.approx(1e-4, rel=0.01)), found
    found = compare_parameters(cfg, FP8, with_off(((3, 4), 1e-4), ((5, 6), 2e-5), ((7, 8), 2e-5)), ref)
    assert found.first is not None and found.first.index == (3, 4) and found.flipped is None, found
    found = compare_parameters(cfg, FP8, with_off(((3, 4), 2 * limit)), ref)
    assert found.first is not None and found.flipped is None, found
    assert compare_parameters(cfg, FLOAT64, with_off(((3, 4), 1e-8)), ref).first is not None


def test_check_of_an_fp8_job_is_equal_to_fp8_in_one_process_and_tells_it_from_a_reference_without_fp8(tmp_path):
    """#50.3: the check of a one-process FP8 job (its recomputed blocks against plain ones, in this process) is
    EQUAL at the FP8 tolerances, counts the linears that ran in FP8 on both sides and says so in its verdict; the
    same layout against a reference without FP8 DIFFERS (the tolerances tell e4m3's rounding from float32's)."""
    job = ROOT / "configs" / "quickstart.yaml"
    plan = shrunk(job, FP8_JOB)
    outcome = run_check(job, FP8_JOB, plan, tmp_path / "fp8", train=lambda cfg: run_in_this_process(cfg, []))
    report = "\n".join(format_report(job, plan, outcome))
    linears = 4 * plan.cfg.model.layers  # gpt2's blocks: attention's qkv and output, the MLP's two (not the LM head)
    assert outcome.equal and outcome.tolerance == FP8, report
    assert outcome.fp8 == (linears, linears), report
    assert "FP8 (rowwise) on both sides" in report.splitlines()[-1] and "within 1e-06" in report, report
    assert "in FP8 (rowwise) over float32 parameters on CPU" in report.splitlines()[0], report

    plain = into(plan.reference(job, FP8_JOB), tmp_path / "plain", fp8="none")  # the same reference without FP8
    against = compare(plan.cfg, run_in_this_process(plain, []), json.loads((tmp_path / "fp8" / "one" / "summary.json")
                      .read_text()), tmp_path / "plain" / "checkpoints", tmp_path / "fp8" / "one" / "checkpoints")
    assert not against.equal and against.first_loss_step == 1 and against.fp8 == (0, linears), against
    assert "tolerances: FP8 (rowwise) in one process only" in "\n".join(format_report(job, plan, against))


def test_check_of_one_process_with_hetero_still_compares():
    """hetero's chunks are what the one-process reference leaves out: something to compare."""
    assert nothing_to_compare(ROOT / "configs" / "hetero.yaml", ["parallel.dp=1", "data.batch_size=8"]) is None
    assert nothing_to_compare(ROOT / "configs" / "quickstart.yaml",
                              ["parallel.dp=1", "train.activation_checkpointing=blocks"]) is None


def test_check_exits_1_naming_the_first_step_and_tensor_that_differ(monkeypatch, capsys):
    """A layout run that is not the job (another initialization seed, injected where the check starts
    its runs): exit 1, the first step whose loss differs, the first tensor in the model's order."""
    real = launch_module.launch

    def launch(cfg, overrides=None):
        if cfg.train.out_dir.endswith("layout"):
            cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"seed": cfg.train.seed + 1})})
        return real(cfg, overrides)

    monkeypatch.setattr(launch_module, "launch", launch)
    assert main(["check", str(ROOT / "configs" / "quickstart.yaml"), "--steps", "2"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS: the loss of step 1 first" in out, out
    assert "DIFFERS: first tensor embed.tok.weight[" in out and "against one process's" in out, out


def test_where_names_the_pp_rank_that_holds_a_tensor():
    """1F1B puts the head on the last rank; ZB-V's V brings it back to rank 0 beside the embedding."""
    base = ["parallel.pp=2", "model.layers=2", "pipeline.microbatches=2", "data.batch_size=4"]
    one_f = load_config(ROOT / "configs" / "quickstart.yaml", [*base, "pipeline.schedule=1f1b"])
    assert _where(one_f, "embed.tok.weight").endswith("on pp rank 0")
    assert _where(one_f, "head.weight").endswith("on pp rank 1")
    zbv = load_config(ROOT / "configs" / "quickstart.yaml", [*base, "pipeline.schedule=zbv"])
    assert _where(zbv, "head.weight").endswith("on pp rank 0")
    assert _where(load_config(ROOT / "configs" / "quickstart.yaml"), "head.weight") == ""  # no pipeline


@pytest.mark.parametrize("name", CONFIGS)
def test_check_keeps_the_layout_and_features_and_shrinks_the_model(name):
    path = ROOT / "configs" / f"{name}.yaml"
    job, plan = load_config(path), plan_of(name)
    small = plan.cfg
    for section in KEPT:
        assert getattr(small, section) == getattr(job, section), section
    m, s = job.model, small.model
    assert (s.arch, s.tie_embeddings, s.qk_norm, s.qkv_bias) == (m.arch, m.tie_embeddings, m.qk_norm, m.qkv_bias)
    assert s.heads // (s.kv_heads or s.heads) == m.heads // (m.kv_heads or m.heads)  # GQA's group kept
    assert small.hetero.enabled == job.hetero.enabled and small.train.activation_checkpointing == \
        job.train.activation_checkpointing
    assert (small.train.dtype, small.train.steps, small.train.device) == ("float64", 3, "cpu")
    assert s.layers <= m.layers and s.hidden <= m.hidden and s.seq_len <= m.seq_len
    assert small.data.batch_size <= job.data.batch_size
    assert s.hidden < m.hidden or s.hidden == 8  # shrunk, or already the least the check uses


def test_check_shrinks_each_dimension_to_the_least_the_rules_accept():
    """configs/pipeline.yaml (Hanayo W=2 on 4 ranks: 16 chunks): 14 layers is the least; one fewer is
    refused, and so is a batch below dp·q·micro-batches and a sequence the ring cannot split."""
    path = ROOT / "configs" / "pipeline.yaml"
    plan = plan_of("pipeline")
    assert plan.cfg.model.layers == 14 and plan.cfg.data.batch_size == plan.cfg.pipeline.microbatches
    with pytest.raises(ConfigError):
        load_config(path, [*plan.overrides, "model.layers=13"])
    ring = plan_of("sequence")
    assert ring.cfg.model.seq_len == 8  # 8 tokens at least; the ring's 4 ranks take 2 each


def test_sub_layout_keeps_every_axis_above_one_within_the_limit():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["parallel.pp=8", "parallel.dp=8", "model.layers=8",
                                                            "pipeline.microbatches=8", "data.batch_size=64"])
    assert sub_layouts(cfg, 16)[0] == {"pp": 8, "dp": 2, "sp": 1, "tp": 1, "ep": 1}
    assert all(d["pp"] > 1 and d["dp"] > 1 and d["sp"] == d["tp"] == 1 for d in sub_layouts(cfg, 16))
    plan = shrunk(ROOT / "configs" / "quickstart.yaml", ["parallel.pp=8", "parallel.dp=8", "model.layers=8",
                                                         "pipeline.microbatches=8", "data.batch_size=64"],
                  max_workers=16)
    assert plan.cfg.world_size == 16 and "world size 64 > 16 local workers" in plan.notes[0]
    with pytest.raises(ConfigError, match="--max-workers"):
        shrunk(ROOT / "configs" / "4d.yaml", [], max_workers=8)  # pp, sp > 1 and tp ≥ 4: 16 at least


def test_check_refuses_a_deepspeed_job_naming_the_section():
    with pytest.raises(ConfigError, match="^deepspeed: .*Remove the deepspeed: section"):
        shrunk(ROOT / "configs" / "deepspeed.yaml", [])


def test_chunk_elems_not_a_multiple_of_the_replicas_shards_is_refused_by_validate():
    """Found by the check of configs/4d.yaml (its chunk scaled to 551): validate accepted it and every
    worker then failed building its chunks. 4d.yaml has dp·sp = 2 replicas: a multiple of 128."""
    with pytest.raises(ConfigError, match=r"hetero\.chunk_elems=4100 must be a multiple of 64·2 = 128.*use "
                                          r"hetero\.chunk_elems=4224"):
        load_config(ROOT / "configs" / "4d.yaml", ["hetero.chunk_elems=4100"])
    load_config(ROOT / "configs" / "4d.yaml", ["hetero.chunk_elems=4224"])


def test_dynamic_budget_with_data_replicas_is_refused_by_validate():
    """Accepted by validate, then refused by every worker of a dp·sp > 1 job at start."""
    with pytest.raises(ConfigError, match=r"hetero\.dynamic_budget=true with 2 data replicas"):
        load_config(ROOT / "configs" / "hetero.yaml", ["hetero.dynamic_budget=true"])
    load_config(ROOT / "configs" / "hetero.yaml", ["hetero.dynamic_budget=true", "parallel.dp=1",
                                                   "data.batch_size=8"])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="auto finds a GPU there")
def test_dynamic_budget_where_auto_finds_only_the_cpu_is_refused_by_validate(capsys):
    """``hetero: {enabled: true, dynamic_budget: true}`` with the devices at ``auto`` on a machine
    without a GPU: validate passed it and every worker failed (found by the config fuzzer's dry runs)."""
    job = ["hetero.enabled=true", "hetero.dynamic_budget=true", "hetero.device_budget_bytes=null",
           "parallel.dp=1", "data.batch_size=8"]
    assert main(["validate", str(ROOT / "configs" / "hetero.yaml"), *(f"--set={o}" for o in job)]) == 2
    err = capsys.readouterr().err
    assert "hetero.dynamic_budget=true on the CPU (train.device=auto finds no GPU on this machine)" in err, err



# --- #48: mixture-of-experts jobs and parallel.ep ---------------------------------------------------

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# 16 experts top-2 split over ep=8 of dp=8 (the 8 data replicas), a shared expert, layers 0 and 3 dense
MOE_JOB = ["model.arch=llama", "model.num_experts=16", "model.num_experts_per_tok=2", "model.moe_intermediate_size=64",
           "model.shared_expert_intermediate_size=96", "model.mlp_only_layers=[0, 3]", "model.output_router_logits=true",
           "model.router_aux_loss_coef=0.5", "parallel.dp=8", "parallel.ep=8", "data.source=synthetic",
           "data.val_fraction=null", "data.batch_size=16"]


def test_check_of_an_moe_job_keeps_ep_above_one_and_the_experts_at_a_smaller_shape():
    """An ep=8 job on 4 workers: ep is kept > 1 (dividing the sub-layout's dp·sp and the experts), the
    experts shrunk to at least 2 per ep rank with the top-k kept, the expert widths cut, the dense layers
    of mlp_only_layers still among the fewer layers beside an MoE layer; the report names ep."""
    from parallel4d.models.moe.spec import MoeShape, sparse_layers

    want = load_config(QUICKSTART, MOE_JOB)
    plan = shrunk(QUICKSTART, MOE_JOB, max_workers=4)
    p, m, j = plan.cfg.parallel, plan.cfg.model, want.model
    assert plan.cfg.world_size == 4 and p.ep > 1 and (p.dp * p.sp) % p.ep == 0, p
    assert 2 * p.ep <= m.num_experts <= j.num_experts and m.num_experts % p.ep == 0, (p, m.num_experts)
    assert m.num_experts < j.num_experts  # shrunk: 16 experts were more than 2 per rank
    assert (m.num_experts_per_tok, m.output_router_logits, m.router_aux_loss_coef) == (2, True, 0.5)
    assert m.moe_intermediate_size < j.moe_intermediate_size and \
        0 < m.shared_expert_intermediate_size < j.shared_expert_intermediate_size
    sparse = sparse_layers(MoeShape.of(m), m.layers)
    assert m.layers < j.layers and sparse and len(sparse) < m.layers, (m.layers, m.mlp_only_layers)
    assert f"ep={p.ep}" in plan.notes[0]  # the sub-layout's note
    assert plan.reference(QUICKSTART, MOE_JOB).parallel.ep == 1


def test_check_report_names_ep_and_the_experts():
    plan = shrunk(QUICKSTART, MOE_JOB, max_workers=4)
    m = plan.cfg.model
    outcome = Outcome(losses=[1.0], reference_losses=[1.0], validation=[], tensors=1, worst=("", 0.0),
                      first_loss_step=None, first_tensor=None)
    head = "\n".join(format_report(QUICKSTART, plan, outcome)[:2])
    assert f"ep={plan.cfg.parallel.ep}" in head, head
    assert f"experts={m.num_experts} top_k=2 moe_intermediate_size={m.moe_intermediate_size}" in head, head


def test_sub_layouts_of_an_ep_job_keep_ep_above_one_and_count_no_ranks_for_it():
    cfg = load_config(QUICKSTART, MOE_JOB)
    layouts = sub_layouts(cfg, 4)
    assert layouts and all(d["ep"] > 1 and d["ep"] <= 8 for d in layouts)
    assert layouts[0]["dp"] == 4 and layouts[0]["ep"] == 4  # the largest world and ep first
    assert all(d["ep"] == 1 for d in sub_layouts(load_config(QUICKSTART), 2))


def test_check_of_an_moe_job_with_a_sparse_step_shrinks_the_layers_keeping_both_kinds():
    """decoder_sparse_step=2 and mlp_only_layers=[1, 6] of 8 layers: the first check kept all 8 (cutting or
    clamping the list left no MoE layer among fewer); now 2, one dense and one MoE layer."""
    from parallel4d.models.moe.spec import MoeShape, sparse_layers

    job = [*MOE_JOB, "parallel.dp=2", "parallel.ep=2", "model.layers=8", "model.decoder_sparse_step=2",
           "model.mlp_only_layers=[1, 6]"]
    m = shrunk(QUICKSTART, job).cfg.model
    assert m.layers == 2 and len(sparse_layers(MoeShape.of(m), m.layers)) == 1, (m.layers, m.mlp_only_layers)


def test_check_of_a_routing_moe_job_keeps_more_experts_than_the_top_k():
    """A top-2 job at ep=1 shrunk to 2 workers: its router chooses 2 of 16, so the shrunk model keeps more
    experts than its top-k (the first shrink gave 2 experts of top-2: every token to every expert, no routing,
    and a load-balancing loss that cannot tell which tokens share a micro-batch)."""
    job = [*MOE_JOB, "parallel.dp=2", "parallel.ep=1"]
    m = shrunk(QUICKSTART, job, max_workers=2).cfg.model
    assert m.num_experts_per_tok == 2 < m.num_experts < 16, m.num_experts
