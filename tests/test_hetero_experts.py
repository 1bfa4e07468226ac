"""MoE under hetero (#48.2): an expert no token chose in a step is not moved.

Under hetero the experts are one module each and run only when some token chose them (agreed over the data
replicas: :class:`~parallel4d.experts.Agreement`), so hetero's hooks move only their chunks; AdamW still steps
the others with a zero gradient, as the stacked tensor's zero rows. In this process, one rank, float64, a
device budget below the model: a router that no token leaves for experts 1 and 3 (their rows zero, experts 0
and 2 a large ± direction: every token picks one of those two) moves fewer bytes per step than the same job
made to run every expert, both equal to one process (losses 1e-10, parameters 1e-9); a step that runs other
experts than the first (every expert at step 1, the chosen ones after) diverges hetero's replayed trace,
which falls back cleanly, equal all the same. The same router under ZeRO over 4 ranks is in
tests/test_expert_parallel.py's 4-worker job.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

from parallel4d.experts import Agreement
from test_expert_parallel import BASE
from test_llama import check_pieces, dense_run

UNCHOSEN = (1, 3)  # the experts no token chooses under one_sided_router
JOB = {**BASE, "parallel": {}, "model": {**BASE["model"], "num_experts_per_tok": 1},
       "hetero": {"enabled": True, "chunk_elems": 2048, "device_budget_bytes": 150_000},
       "train": {**BASE["train"], "steps": 4}}  # step 2 diverges from step 1's trace, 3 records it, 4 replays it


@torch.no_grad()
def one_sided_router(model: torch.nn.Module) -> None:
    """Every MoE layer's router: experts 0 and 2 along ±10⁶ × the first hidden axis, the others zero — each
    token's top expert is 0 or 2 (its logits ±10⁶·x₀ against 0), the softmax saturated, so the router's
    gradient vanishes and the choice holds for every step."""
    from parallel4d.models.moe.layer import SparseMoE

    for module in model.modules():
        if isinstance(module, SparseMoE):
            w = module.gate.weight
            w.zero_()
            w[0, 0], w[2, 0] = 1e6, -1e6


def placed_with(prepare):
    """compose()'s place_experts, ``prepare`` applied to the stages (built from the seed) first."""
    from parallel4d.engine.experts import place_experts

    def place(cfg, mesh, stages):
        for stage in stages.values():
            prepare(stage)
        return place_experts(cfg, mesh, stages)
    return place


class EveryExpert:
    """An agreement that runs every expert while ``on`` (on zero rows where none chose it): what hetero moved
    before experts were skipped."""

    def __init__(self, real):
        self.real, self.on = real, True

    def most(self, counts):
        most = self.real.most(counts)
        return torch.ones_like(most).maximum(most) if self.on else most

    host = staticmethod(Agreement.host)


def train(forced_steps: int, job=JOB) -> dict:
    """``job`` with :func:`one_sided_router`, every expert run for its first ``forced_steps`` steps: the losses,
    this rank's pieces, each step's bytes moved and hetero's statistics."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose
    from parallel4d.models.moe.layer import SparseMoE

    cfg = make_config(job)
    with mock.patch("parallel4d.engine.compose.place_experts", placed_with(one_sided_router)):
        engine = compose(cfg, init_mesh())
    forced = []
    for module in engine.store.model.modules():
        if isinstance(module, SparseMoE):
            module.dispatcher.agreement = EveryExpert(module.dispatcher.agreement)
            forced.append(module.dispatcher.agreement)
    data, losses, moved, loads = build_dataset(cfg), [], [], []
    for step in range(cfg.train.steps):
        for f in forced:
            f.on = step < forced_steps
        losses.append(float(engine.train_step(*data.batch(step))))
        moved.append(engine.hetero_stats()["device_bytes_moved_per_step"])
        loads.append(engine.router_load()["expert_load"].tolist())
    pieces = {k[len("model."):]: [(tuple(off), view.detach().clone()) for off, view in v.pieces]
              for k, v in engine.state_dict().items() if k.startswith("model.")}
    out = {"losses": losses, "pieces": pieces, "moved": moved, "loads": loads, "stats": engine.hetero_stats()}
    engine.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every expert run at every step, none but the chosen ones, and every expert at step 1 only."""
    import torch.distributed as dist

    tmp = tmp_path_factory.mktemp("rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
    try:
        steps = JOB["train"]["steps"]
        return {"every": train(steps), "chosen": train(0), "first every": train(1)}
    finally:
        dist.destroy_process_group()


@functools.cache
def one_process():
    return dense_run(JOB, prepare=one_sided_router)


def check_equal(run: dict) -> None:
    want_losses, want = one_process()
    check_pieces([{"run": (run["losses"], run["pieces"])}], "run", want_losses, want)


def test_an_expert_no_token_chose_is_not_moved(runs):
    every, chosen = runs["every"], runs["chosen"]
    for load in chosen["loads"]:  # the router leaves experts 1 and 3 without a token at every step
        assert [load[e] for e in UNCHOSEN] == [0.0, 0.0] and min(load[0], load[2]) > 0, load
    assert all(c < e for c, e in zip(chosen["moved"], every["moved"])), (chosen["moved"], every["moved"])
    check_equal(chosen)
    check_equal(every)


def test_a_step_running_other_experts_than_the_first_falls_back_cleanly(runs):
    """Every expert at step 1, the chosen ones after: hetero's replayed trace diverges (it falls back to LRU
    and records the new one), nothing hangs, the results are the same; replaying the new trace, the last step
    moves less than every expert does."""
    first = runs["first every"]
    assert first["stats"]["trace_divergences"] >= 1
    assert runs["chosen"]["stats"]["trace_divergences"] == 0
    assert first["moved"][-1] < runs["every"]["moved"][-1]
    check_equal(first)


def test_experts_run_on_no_rows_where_the_agreement_says_so():
    """One module per expert: exactly the ``used`` experts run — an expert used elsewhere but without rows
    here on zero rows, so its weights get a (zero) gradient as on the ranks where it has rows — and the
    rows come out as the stacked experts' loop gives them."""
    from parallel4d.experts import HostCounts
    from parallel4d.models.moe.layer import Experts

    torch.manual_seed(0)
    stacked = Experts(8, 6, 4).double()
    for p in stacked.parameters():
        torch.nn.init.normal_(p)
    x, counts = torch.randn(5, 8, dtype=torch.float64), torch.tensor([2, 0, 3, 0])
    want = stacked(x, counts)
    each = Experts(8, 6, 4).double()
    each.load_state_dict(stacked.state_dict())
    each.by_expert()
    got = each(x, counts, HostCounts([2, 0, 3, 0], [True, True, True, False]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    grads = [[p.grad for p in expert.parameters()] for expert in each.each]
    assert all(g is not None and g.abs().sum() > 0 for g in grads[0] + grads[2])
    assert all(g is not None and g.abs().sum() == 0 for g in grads[1])  # run on zero rows
    assert all(g is None for g in grads[3])  # not run
