"""Split backward as schedule data (#17, first part): W actions in validate and simulate, and the
zb_h1 generator. The executor refuses such schedules until it runs them."""

import dataclasses

import pytest

from parallel4d.pipeline import Action, ScheduleError, one_f_one_b, simulate, validate
from parallel4d.pipeline.hanayo import peak_activations
from parallel4d.pipeline.zero_bubble import zb_h1

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
    """Forward 1, backward 2 (B 1 + W 1), free transfers."""
    z, o = zb_h1(p, m), one_f_one_b(p, m)
    sz, so = simulate(z, 1, 2), simulate(o, 1, 2)
    assert z.split_backward and not o.split_backward
    assert max(sz.peak_activations) <= max(so.peak_activations) == p
    assert sz.bubble_ratio < 0.7 * so.bubble_ratio, (sz.bubble_ratio, so.bubble_ratio)
    for r, acts in z.actions.items():
        assert sorted((a.kind, a.microbatch) for a in acts) == sorted(
            (k, i) for k in "FBW" for i in range(m))


def test_the_executor_refuses_a_split_schedule_until_it_runs_one(single_rank):
    from parallel4d.mesh import init_mesh
    from parallel4d.pipeline.executor import PipelineExecutor

    with pytest.raises(ValueError, match="splits the backward.*executor does not run it yet"):
        PipelineExecutor(zb_h1(1, 2), init_mesh(), {0: None}, None, [1, 2, 3], None)
