"""Split backward (#17): W actions in validate and simulate, the split-backward generators, the
B/W split of one chunk's autograd graph, and end to end: every split schedule trains exactly like
one process (float64) with tensor, sequence and data parallelism on,
sending exactly the bytes its unsplit twin sends (nothing computed twice). Activation checkpointing
and hetero are refused with a split backward (tests/test_config.py)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import train_cases_in_one_job
from parallel4d.pipeline import Action, ScheduleError, one_f_one_b, simulate, validate
from parallel4d.pipeline import hanayo
from parallel4d.pipeline.hanayo import peak_activations
from parallel4d.pipeline.split_grad import input_gradient
from parallel4d.pipeline.zero_bubble import zb_h1, zbv

GRID = [(p, m) for p in (4, 8) for m in (p, 2 * p, 4 * p)]


def split(schedule, rank, actions):
    return dataclasses.replace(schedule, actions={**schedule.actions, rank: actions})


def with_w_after_each_b(s):
    """1F1B with each B followed at once by its W (the same timeline as the unsplit one)."""
    return dataclasses.replace(s, name="1f1b-split", actions={
        r: [x for a in acts for x in ([a, Action("W", a.microbatch, a.chunk)] if a.kind == "B" else [a])]
        for r, acts in s.actions.items()})


def test_a_w_before_its_b_or_a_missing_w_is_refused_naming_rank_and_action():
    s = with_w_after_each_b(one_f_one_b(2, 2))
    validate(s)
    r0 = s.actions[0]  # F0 F1 B0 W0 B1 W1
    early = [r0[0], r0[1], r0[3], r0[2], r0[4], r0[5]]
    with pytest.raises(ScheduleError, match=r"rank 0, action #2 W\(mb=0, chunk=0\) \[weight gradient\]: comes before "
                                            r"B\(mb=0, chunk=0\)"):
        validate(split(s, 0, early))
    with pytest.raises(ScheduleError, match=r"rank 0: missing W\(mb=1, chunk=0\) \[weight gradient\] "
                                            r"\(each F and B and W exactly once\)"):
        validate(split(s, 0, r0[:-1]))
    with pytest.raises(ScheduleError, match=r"rank 1, action #4 W\(mb=0, chunk=1\).*second time"):
        validate(split(s, 1, s.actions[1][:4] + [Action("W", 0, 1)] + s.actions[1][4:]))


def test_simulate_costs_b_and_w_apart_and_counts_activations_until_w():
    plain, s = one_f_one_b(4, 8), with_w_after_each_b(one_f_one_b(4, 8))
    a, b = simulate(plain, 1, 2), simulate(s, 1, 2, weight_cost=0.5)
    assert a.busy == b.busy == [24.0] * 4  # per rank 8 × (F 1 + B 1.5 + W 0.5) = 8 × (F 1 + B 2)
    # the input gradient leaves after B alone: each of the P-1 hops of the drain is weight_cost shorter
    assert a.makespan - b.makespan == pytest.approx(3 * 0.5)
    assert b.peak_activations == a.peak_activations == [4, 3, 2, 1]
    # W moved to the end of rank 0: its activations stay until then
    late = split(s, 0, [x for x in s.actions[0] if x.kind != "W"] + [x for x in s.actions[0] if x.kind == "W"])
    assert simulate(late).peak_activations[0] == 8 == peak_activations(late.actions[0])
    with pytest.raises(ValueError, match="weight_cost"):
        simulate(s, 1, 2, weight_cost=2)


@pytest.mark.parametrize("p, m", GRID)
def test_zb_h1_fills_1f1b_bubble_at_its_peak_memory(p, m):
    """Forward 1, backward 2 (B 1 + W 1), free transfers: ZB-H1's bubble (P-1)/(3m+P-1), a third of
    1F1B's idle time, at 1F1B's peak memory."""
    z, o = zb_h1(p, m), one_f_one_b(p, m)
    sz, so = simulate(z, 1, 2), simulate(o, 1, 2)
    assert z.split_backward and not o.split_backward
    assert max(sz.peak_activations) <= max(so.peak_activations) == p
    assert sz.bubble_ratio == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert sz.makespan * p - sum(sz.busy) == pytest.approx((so.makespan * p - sum(so.busy)) / 3)
    for r, acts in z.actions.items():
        assert sorted((a.kind, a.microbatch) for a in acts) == sorted(
            (k, i) for k in "FBW" for i in range(m))


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16)])
def test_split_hanayo_and_zbv_reach_zb_v_at_its_memory(p, m):
    """Free transfers, F 1, B 1, W 1: the V placement at ZB-V's memory (2P chunk activations: P
    stage activations) idles no more than torch's ZB-V order (benchmarks/pipeline_schedules.py:
    P=4 m=8 0.0588, m=16 0.0303, P=8 m=16 0.0680); two waves at the same bytes go lower."""
    torch_zbv = {(4, 8): 0.0588, (4, 16): 0.0303, (8, 16): 0.0680}[p, m]
    for s in (zbv(p, m), hanayo(p, m, 1, split_backward=True)):
        validate(s)
        sim = simulate(s, 1, 2, weight_cost=1)
        assert s.split_backward and max(sim.peak_activations) <= 2 * p
        assert sim.bubble_ratio <= torch_zbv + 1e-4, (s.name, sim.bubble_ratio)
    two = simulate(hanayo(p, m, 2, split_backward=True), 1, 2, weight_cost=1)
    assert max(two.peak_activations) <= 4 * p and two.bubble_ratio < 0.75 * torch_zbv


# --- one chunk's backward in two parts ---------------------------------------------------------

class _Shared(torch.nn.Module):
    """Two blocks, a norm weight, and one matrix used at two depths (a tied weight inside a chunk)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(6, 6).double()
        self.b = torch.nn.Linear(6, 6).double()
        self.norm = torch.nn.Parameter(torch.randn(6, generator=g, dtype=torch.float64))
        self.shared = torch.nn.Parameter(torch.randn(6, 6, generator=g, dtype=torch.float64))

    def forward(self, x):
        h = torch.tanh(self.a(x @ self.shared)) * self.norm
        return self.b(h) @ self.shared + h


@pytest.mark.parametrize("needs_input", [True, False])
def test_b_gives_the_input_gradient_and_w_every_weight_gradient_once(needs_input):
    model = _Shared()
    x0 = torch.randn(5, 6, dtype=torch.float64)
    g = torch.randn(5, 6, dtype=torch.float64)
    x = x0.clone().requires_grad_(needs_input)
    model(x).backward(g)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_x = x.grad
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(needs_input)
    (gx,), weights = input_gradient((model(x),), (g,), (x,))
    assert all(p.grad is None for p in model.parameters())  # B touched no weight
    if needs_input:
        torch.testing.assert_close(gx, want_x, rtol=1e-13, atol=0)
    else:
        assert gx is None  # chunk 0: token ids; W is the whole backward
    weights.run()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-13, atol=0, msg=n)


class _Carrying(torch.nn.Module):
    """A chunk whose message carries a small vector beside the activation: ``(x, s) → (y, s')`` with ``s'``
    the carried ``s`` plus statistics of ``x`` through a weight (a router's probability sums, say)."""

    def __init__(self):
        super().__init__()
        self.block, self.gate = _Shared(), torch.nn.Linear(6, 3).double()

    def forward(self, x, s):
        return self.block(x), s + torch.softmax(self.gate(x), -1).sum(0)


@pytest.mark.parametrize("needs_input", [True, False])
def test_b_and_w_of_a_chunk_of_several_inputs_and_outputs(needs_input):
    """B gives each input's gradient (the activation's and the carried vector's), W every weight gradient
    once, as one backward does; with inputs that need no gradient (chunk 0) W is the whole backward."""
    model = _Carrying()
    g = torch.Generator().manual_seed(1)
    x0, s0 = torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    gy, gs = torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    x, s = x0.clone().requires_grad_(needs_input), s0.clone().requires_grad_(needs_input)
    torch.autograd.backward(model(x, s), (gy, gs))
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_x = (x.grad, s.grad)
    model.zero_grad(set_to_none=True)
    x, s = x0.clone().requires_grad_(needs_input), s0.clone().requires_grad_(needs_input)
    gxs, weights = input_gradient(model(x, s), (gy, gs), (x, s))
    assert all(p.grad is None for p in model.parameters())
    for got, expected in zip(gxs, want_x, strict=True):
        if needs_input:
            torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)
        else:
            assert got is None
    weights.run()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-13, atol=0, msg=n)


def test_an_input_handed_on_unchanged_gets_its_gradient_back():
    """A chunk without the layers that add to the carried vector returns it as it came: B hands its
    gradient straight back."""
    x, s = torch.randn(2, 6, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64,
                                                                                    requires_grad=True)
    layer = torch.nn.Linear(6, 6).double()
    gy, gs = torch.randn(2, 6, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    (gx, got), weights = input_gradient((layer(x), s), (gy, gs), (x, s))
    torch.testing.assert_close(gx, gy @ layer.weight, rtol=1e-13, atol=0)
    assert got is gs
    weights.run()
    torch.testing.assert_close(layer.weight.grad, gy.T @ x.detach(), rtol=1e-13, atol=0)


class _Stacked(torch.nn.Module):
    """Rows through one slice each of a stacked weight ``[2, 6, 6]`` (an MoE layer's experts, looped): two
    matrix products, two boundary nodes, one parameter."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(2),
                                                dtype=torch.float64))

    def forward(self, x):
        return torch.cat([x[:2] @ self.w[0], x[2:] @ self.w[1]])


def test_w_accumulates_a_parameter_shared_by_several_boundary_nodes_once():
    """One accumulation per W, as one backward makes (what the data-parallel buckets count per micro-batch),
    with the one-backward gradient."""
    model, g = _Stacked(), torch.randn(5, 6, dtype=torch.float64)
    x0 = torch.randn(5, 6, dtype=torch.float64)
    model(x0.clone().requires_grad_()).backward(g)
    want = model.w.grad.clone()
    model.w.grad = None
    accumulated = []
    model.w.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.clone()))
    x = x0.clone().requires_grad_()
    _, weights = input_gradient((model(x),), (g,), (x,))
    weights.run()
    assert len(accumulated) == 1
    torch.testing.assert_close(model.w.grad, want, rtol=1e-13, atol=0)


# --- end to end -------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["train.dtype=float64", "train.steps=3", "pipeline.microbatches=4"]
SPLIT_RUNS = {  # 8 workers each; configs/pipeline.yaml's model
    "zb_h1-pp2-tp4": ["parallel.pp=2", "parallel.tp=4", "pipeline.schedule=zb_h1"],
    "zbv-pp4-sp2": ["parallel.pp=4", "parallel.sp=2", "pipeline.schedule=zbv"],
    "hanayo-split-w2-pp2-sp2-dp2": ["parallel.pp=2", "parallel.sp=2", "parallel.dp=2", "pipeline.schedule=hanayo",
                                    "pipeline.waves=2", "pipeline.split_backward=true"],
    "hanayo-split-w1-pp4-dp2": ["parallel.pp=4", "parallel.dp=2", "pipeline.schedule=hanayo", "pipeline.waves=1",
                                "pipeline.split_backward=true"],
}


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split")
    return train_cases_in_one_job(8, ROOT / "configs" / "pipeline.yaml", SPLIT_RUNS, STEPS, tmp), tmp


@pytest.mark.parametrize("case", list(SPLIT_RUNS))
def test_split_schedules_train_like_one_process(case, split_runs, tmp_path_factory):
    """Losses to 1e-10 and every parameter after 3 AdamW steps to 1e-9 against pp=1 (float64)."""
    from test_e2e import assert_float64_match, reference

    summaries, tmp = split_runs
    got = summaries[case]
    ref, ref_out = reference("pipeline", tmp_path_factory, STEPS)
    assert got["world_size"] == 8
    assert_float64_match(got, tmp / case, ref, ref_out)


def test_split_backward_sends_what_the_unsplit_backward_sends(split_runs):
    """zb_h1 at pp=2 × tp=4 against its unsplit twin, 1F1B, as ``parallel4d plan`` runs it (its dry run
    gives the bytes a run sends exactly): every rank sends the same bytes along each axis in its first
    step, so B and W each run their half of every SUMMA product once (with both halves in both passes,
    pp rank 1's tp bytes grow by 65 %). Its activations live until W: on pp rank 1, two where 1F1B
    holds one. ``parallel4d plan`` of zb_h1 itself is within 10 % of the run, rank by rank."""
    from conftest import assert_plan_matches
    from parallel4d.config.load import load_config
    from parallel4d.planning.dry_run import plan

    summaries, _ = split_runs
    got = summaries["zb_h1-pp2-tp4"]
    measured = got["memory"]["per_rank"]
    assert any(":summa_atb" in k for k in got["bytes_communicated"]["sent"])  # weight gradients, in W
    config = ROOT / "configs" / "pipeline.yaml"
    twin = plan(load_config(config, [*SPLIT_RUNS["zb_h1-pp2-tp4"], *STEPS, "pipeline.schedule=1f1b",
                                     "pipeline.split_backward=false"]))
    for g, rank in enumerate(measured):
        assert rank["sent_by_axis"] == twin[g // 4].sent_by_axis, g
        if g >= 4:  # pp rank 1
            assert rank["activations"] == pytest.approx(2 * twin[1].activations, rel=0.05)
    assert_plan_matches(config, [*SPLIT_RUNS["zb_h1-pp2-tp4"], *STEPS], got)


def test_the_schedule_cli_shows_w_and_refuses_a_split_it_cannot_make(tmp_path, capsys):
    from parallel4d.tools.cli import main

    def schedule_command(argv):
        return main(["schedule", *argv])

    assert schedule_command(["--schedule", "hanayo", "--split-backward", "--pp", "2", "-m", "4",
                             "--plot", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "hanayo(W=1, split)" in out and "W0.c" in out and "backward=2 of which W=1" in out
    assert (tmp_path / "t.png").stat().st_size > 0
    assert schedule_command(["--schedule", "zbv", "--pp", "2", "-m", "4", "--weight-cost", "0.5"]) == 0
    assert "backward=2 of which W=0.5" in capsys.readouterr().out
    assert schedule_command(["--schedule", "1f1b", "--split-backward"]) == 2
    assert "split_backward applies to hanayo, not 1f1b" in capsys.readouterr().err


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16)])
def test_zbv_built_for_a_hop_idles_no_more_than_torchs_zb_v_at_it(p, m):
    """A hop costing half a stage's forward (one chunk forward, at two chunks per rank): torch's own ZB-V
    order (``ScheduleZBVZeroBubble``'s ``pipeline_order``, read through benchmarks/pipeline_schedules.py)
    against our zbv built for that hop (``p2p_cost``), in one simulator, at ZB-V's memory (2P chunks)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from pipeline_schedules import torch_order

    theirs, ours = torch_order("torch ZB-V", p, m), zbv(p, m, p2p_cost=1.0)
    got, want = (simulate(s, 1, 2, 1.0, weight_cost=1) for s in (ours, theirs))
    assert max(got.peak_activations) <= 2 * p == max(want.peak_activations)
    assert got.bubble_ratio <= want.bubble_ratio + 1e-9, (got.bubble_ratio, want.bubble_ratio)
