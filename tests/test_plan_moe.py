"""``parallel4d plan`` of mixture-of-experts models (#48.4): the dry run routes under an assumed uniform load
(parallel4d/planning/moe.py) and counts the experts' memory, all-to-all bytes and FLOPs.

On one rank what the plan counts depends on a layer's ``T·k`` routed rows alone, not on how they spread, so
the plan is held to a real one-process step with the router's own (random) choices, within the 10 % the dense
plans are held to (tests/test_plan.py). The all-to-all bytes over ep ranks are held to what
:class:`~parallel4d.experts.ExpertParallel` counts in the suite's 16-worker job, at the uniform load.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
import torch
import yaml

from conftest import assert_plan_matches
from parallel4d.config.load import load_config
from parallel4d.config.rules.common import human_bytes
from parallel4d.distributed.comm import CommStats
from parallel4d.engine.flops import flops_per_token
from parallel4d.experts import ExpertParallel
from parallel4d.experts.dispatch import A2A, COUNTS
from parallel4d.planning.dry_run import _fake_world, moe_layer_activations, plan
from parallel4d.planning.moe import (UniformExpertParallel, UniformLoad, all_to_all_bytes, counts_bytes, figures,
                                     uniform_counts)
from parallel4d.planning.trace import total
from parallel4d.tools.cli import main

E, K, H, I, L = 8, 2, 64, 32, 2  # experts, top-k, hidden, expert width, layers
TINY = {"model": {"arch": "llama", "vocab_size": 256, "seq_len": 32, "hidden": H, "heads": 4, "layers": L,
                  "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": I},
        "data": {"batch_size": 4}, "checkpoint": {"enabled": False}}

CASES = {
    "top-2 of 8": {},
    "shared expert, auxiliary loss, recomputation, 5 layers (from two shallow dry runs)": {
        "model": {"layers": 5, "shared_expert_intermediate_size": 48, "output_router_logits": True},
        "train": {"activation_checkpointing": "blocks"}},
    "a dense layer among 5 (dry-run whole)": {"model": {"layers": 5, "mlp_only_layers": [1]}},
    "top-4 of 16 in bfloat16, 2 micro-batches": {
        "model": {"num_experts": 16, "num_experts_per_tok": 4}, "train": {"dtype": "bfloat16"},
        "pipeline": {"microbatches": 2}},
}


def _job(tmp_path, extra: dict):
    data = {k: dict(v) for k, v in TINY.items()}
    for section, fields in extra.items():
        data[section] = {**data.get(section, {}), **fields}
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.contextmanager
def _one_rank(tmp_path):
    """A one-rank gloo group in this process, destroyed on leaving (the plan's dry run needs none)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _real_step(cfg, tmp_path) -> dict:
    """``summary.json``'s ``memory`` of one real step of ``cfg`` on one rank: the router's own choices."""
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    with _one_rank(tmp_path):
        torch.manual_seed(0)
        engine = compose(cfg, init_mesh(1, 1, 1, 1))
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.model.seq_len))
        engine.train_step(tokens, tokens, measure_memory=True)
        return {"memory": {"step": 1, "per_rank": [engine.memory]}}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_of_an_moe_model_is_within_10_percent_of_a_real_step(case, tmp_path):
    path = _job(tmp_path, CASES[case])
    cfg = load_config(path)
    worst = assert_plan_matches(path, [], _real_step(cfg, tmp_path))
    assert {"parameters", "gradients", "optimizer_state", "activations"} <= set(worst)


def test_plan_prints_the_experts_memory_flops_and_the_uniform_load(tmp_path, capsys):
    """Every expert of both layers on the one rank: ``E·3·h·I`` float32 weights per layer, as many gradient
    bytes, twice as many in Adam's moments; the line names the active parameters MFU counts and the
    assumption."""
    path = _job(tmp_path, {})
    (rank,) = plan(load_config(path))
    weights = L * E * 3 * H * I * 4
    assert rank.expert_parameters == weights
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("experts"))
    assert f"{E} per MoE layer × {L} layers, top-{K}, every expert on each rank" in line
    assert f"parameters {human_bytes(weights)}, gradients {human_bytes(weights)}" in line
    assert f"activations {human_bytes(moe_layer_activations(load_config(path)))} per MoE layer and micro-batch" in line
    assert "routing assumed uniform" in out and "all-to-all over ep 0 B per step" in out
    assert "MFU counts these" in out


def test_the_plan_of_an_moe_model_on_the_grid_holds_whole_experts_and_routes_a_ranks_share(tmp_path):
    """tp=4 (q=2) × dp=2, ep=2: each grid rank holds its E/ep experts whole (the grid splits the tokens, not
    the experts: models/moe/tp2d.py), and the all-to-all figure — the rank's ``1/q`` of its grid row's tokens —
    is what the dry run's ExpertParallel stand-in sent over ep."""
    cfg = load_config(_job(tmp_path, {"parallel": {"tp": 4, "dp": 2, "ep": 2}, "data": {"batch_size": 8}}))
    (rank,) = plan(cfg)
    assert rank.expert_parameters == L * (E // 2) * 3 * H * I * 4
    assert rank.sent_by_axis["ep"] == figures(cfg).all_to_all


def test_the_planned_flops_count_only_the_experts_each_token_reaches(tmp_path):
    """The time model's ops (the dry run's traced products) and MFU's FLOPs per token agree: forward matrix
    products ``2·N`` per token over the active matrices ``N`` (router, k experts, attention, head), the
    backward twice that; every expert's weights would count ``E/k`` times more for the experts."""
    cfg = load_config(_job(tmp_path, {}))
    (rank,) = plan(cfg, timed=True)
    tokens = cfg.data.batch_size * cfg.model.seq_len
    m = cfg.model
    attention_scores = 12 * m.layers * m.seq_len * m.heads * m.head_size
    active = (flops_per_token(cfg) - attention_scores) / 6
    assert total(rank.ops, "matmul", "forward") == pytest.approx(2 * active * tokens, rel=1e-12)
    assert total(rank.ops, "matmul", "backward") == pytest.approx(4 * active * tokens, rel=1e-12)
    every = cfg.model_copy(update={"model": m.model_copy(update={"num_experts_per_tok": E})})
    table = m.vocab_size * m.hidden * (not m.tie_embeddings)  # an untied token table: looked up, not multiplied
    assert figures(cfg).active_parameters == active + table
    assert (flops_per_token(every) - flops_per_token(cfg)) / 6 == L * (E - K) * 3 * H * I


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_moe_layers_planned_activations_are_what_the_layer_saves_with_its_routers_choices(dtype, tmp_path):
    """``plan``'s per-layer figure (fake tensors, uniform load) against the layer itself on real tensors,
    random weights routing as they will: the same bytes (every expert gets rows here; the rows' total is
    ``T·k`` however they spread), bfloat16 autocast included."""
    from dataclasses import replace

    from parallel4d.engine.memory import SavedActivations
    from parallel4d.models.moe.layer import SparseMoE
    from parallel4d.models.moe.spec import MoeShape

    cfg = load_config(_job(tmp_path, {"train": {"dtype": dtype}}))
    torch.manual_seed(0)
    layer = SparseMoE(replace(MoeShape.of(cfg.model), shared_width=0), H, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(cfg.data.batch_size * cfg.model.seq_len, H, requires_grad=True)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16")
    with SavedActivations(layer.parameters()) as meter, autocast:
        layer(x)
    assert moe_layer_activations(cfg) == meter.peak > x.numel() * 4


def test_uniform_counts_spread_the_slots_over_the_experts():
    assert uniform_counts(16, 8) == [2] * 8
    assert uniform_counts(10, 4) == [3, 3, 2, 2] and sum(uniform_counts(7, 16)) == 7


# --- all-to-all bytes over ep ranks -----------------------------------------------------------------

T_EP, E_EP, K_EP, H_EP = 16, 16, 2, 4  # tokens per rank, experts, top-k, hidden: T·k a multiple of E
EP_SIZES = (2, 4, 16)


def _uniform_tokens(dtype=torch.float64):
    """``x [T, H]``, ``ids [T, K]`` spreading the ``T·K`` slots evenly over the experts, ``weights [T, K]``."""
    x = torch.randn(T_EP, H_EP, dtype=dtype, requires_grad=True)
    ids = (torch.arange(T_EP * K_EP) % E_EP).view(T_EP, K_EP)
    return x, ids, torch.rand(T_EP, K_EP, dtype=dtype)


def _experts(local: int, dtype=torch.float64):
    w = torch.randn(local, H_EP, H_EP, dtype=dtype, requires_grad=True)

    def apply(rows, counts):
        return torch.cat([p @ w[e] for e, p in enumerate(rows.split(counts.tolist()))])
    return apply


def _measured(ep: int, recompute: bool) -> dict:
    """On every rank: one forward and backward through ExpertParallel over groups of ``ep`` consecutive
    ranks at the uniform load (``recompute``: the forward run again in the backward, as activation
    checkpointing does); the bytes its CommStats counted."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(s, s + ep)), timeout=timedelta(seconds=120)) for s in range(0, world, ep)]
    stats = CommStats()
    par = ExpertParallel(E_EP, groups[rank // ep], stats)
    x, ids, weights = _uniform_tokens()
    fn = _experts(E_EP // ep)
    if recompute:
        y = torch.utils.checkpoint.checkpoint(lambda a: par(a, ids, weights, fn), x, use_reentrant=False)
    else:
        y = par(x, ids, weights, fn)
    y.sum().backward()
    return {"rows": stats.sent[A2A], "counts": stats.sent[COUNTS]}


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job (tests/conftest.py)."""
    return {(ep, recompute): _measured(ep, recompute) for ep in EP_SIZES for recompute in (False, True)}


@pytest.mark.parametrize("recompute", [False, True])
def test_all_to_all_bytes_are_what_expert_parallel_sends(recompute, sixteen_workers):
    passes = 2 if recompute else 1
    for ep in EP_SIZES:
        want_rows = all_to_all_bytes(T_EP, K_EP, H_EP, ep, 8, passes)
        want_counts = counts_bytes(E_EP, ep, passes)
        for rank, r in enumerate(sixteen_workers):
            got = r["test_plan_moe"][ep, recompute]
            assert (got["rows"], got["counts"]) == (want_rows, want_counts), (rank, ep, got)


@pytest.mark.parametrize("ep, autocast", [(2, False), (4, False), (4, True)])
def test_the_plans_stand_in_sends_what_the_formula_says_on_fake_tensors(ep, autocast):
    """The dry run's stand-in for an ExpertParallel dispatcher (fake tensors, the fake process group: no
    host read of split sizes) counts the same bytes as the formula the 16-worker job checks; under bfloat16
    autocast the rows go out in float32 and the experts' outputs come back in bfloat16 (as in a real
    step); its output has the input's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    import torch.distributed as dist

    dtype = torch.float32 if autocast else torch.float64
    with _fake_world(0, ep), FakeTensorMode(allow_non_fake_inputs=True), UniformLoad(), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        stats = CommStats()
        stand_in = UniformExpertParallel(ExpertParallel(E_EP, dist.group.WORLD, stats))
        x, ids, weights = _uniform_tokens(dtype)
        y = stand_in(x, ids, weights, _experts(E_EP // ep, dtype))
        y.float().sum().backward()
        assert y.shape == x.shape
    size = dtype.itemsize
    assert stats.sent[A2A] == all_to_all_bytes(T_EP, K_EP, H_EP, ep, size, 1, 2 if autocast else size)
    assert stats.sent[COUNTS] == counts_bytes(E_EP, ep)


# --- plan --search ----------------------------------------------------------------------------------


def test_search_assembles_an_moe_model_from_its_unit_runs_and_shows_its_experts(tmp_path):
    """The unit dry runs' block is an MoE block: assembled, the candidate's parameters, expert weights,
    optimizer state and every product's FLOPs are the whole dry run's, its activations within the 0.5 %
    tests/test_planning.py holds dense models to; the ranking shows the experts' bytes per device."""
    from parallel4d.planning import profiles
    from parallel4d.planning.search import Ranked, assembled, format_search, unit
    from parallel4d.planning.cost import predict

    cfg = load_config(_job(tmp_path, {"model": {"layers": 3}, "pipeline": {"microbatches": 2}}))
    whole = plan(cfg, timed=True)[0]
    parts = assembled(cfg, unit(cfg, {}))[0]
    for f in ("parameters", "gradients", "optimizer_state", "expert_parameters"):
        assert getattr(parts, f) == pytest.approx(getattr(whole, f), rel=1e-6, abs=8), f
    assert parts.activations == pytest.approx(whole.activations, rel=5e-3)
    for phase in ("forward", "backward"):
        assert total(parts.ops, "matmul", phase) == pytest.approx(total(whole.ops, "matmul", phase), rel=1e-6)
    prediction = predict(cfg, [parts], profiles.load("h100"))
    lines = format_search([Ranked([], cfg, parts.device_bytes, prediction, ranks=[parts])], 2**30, 1)
    assert lines[0].split()[-2:] == ["experts", "all-to-all"]
    f = figures(cfg, parts.expert_parameters)
    assert lines[1].split()[-4:] == [*human_bytes(f.parameters + f.gradients + f.optimizer_state).split(), "0", "B"]
    assert f.parameters == 3 * E * 3 * H * I * 4
