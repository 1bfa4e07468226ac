"""Learning-rate schedules and parameter groups (#16.3), against torch's own schedulers and optimizer.

* ``optimizer.schedule`` (constant | cosine | linear, with warm-up and ``min_lr``) gives, step by
  step, the learning rates of torch's ``LinearLR`` warm-up followed by ``CosineAnnealingLR`` /
  ``LinearLR`` (chained with ``SequentialLR``);
* the usual groups: no weight decay on norm gains, biases and the token / position tables unless
  configured;
* hetero's chunked optimizer is a ``torch.optim.Optimizer``: torch's schedulers drive it, and with
  the groups it trains bit for bit like ``torch.optim.AdamW(foreach=False)`` under the same scheduler.
Every layout trains with these (tests/test_llama.py runs its layouts with a cosine schedule).
"""

import pytest
import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.hetero import wrap
from parallel4d.models.gpt2.model import GPTShape, build_gpt
from parallel4d.optim.optimizer import build_optimizer, lr_at, lr_lambda, param_groups

LR, MIN_LR, WARMUP, DECAY = 3e-3, 3e-4, 3, 12


def _torch_lrs(kind: str, steps: int) -> list[float]:
    """torch's schedulers: a LinearLR warm-up from lr/WARMUP, then the decay to MIN_LR by step DECAY."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1)
    if kind == "cosine":
        decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=DECAY - WARMUP, eta_min=MIN_LR)
    elif kind == "linear":
        decay = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=MIN_LR / LR,
                                                  total_iters=DECAY - WARMUP)
    else:
        decay = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[WARMUP])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedules_equal_torch_schedulers(kind):
    fields = {"lr": LR, "warmup_steps": WARMUP, "schedule": kind}
    if kind != "constant":
        fields.update(min_lr=MIN_LR, decay_steps=DECAY)
    cfg = make_config({"optimizer": fields, "train": {"steps": 20}})
    ours = [lr_at(s, cfg.optimizer, cfg.train.steps) for s in range(DECAY + 1)]
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64),
                               torch.tensor(_torch_lrs(kind, DECAY + 1), dtype=torch.float64), rtol=1e-9, atol=0)
    after = [lr_at(s, cfg.optimizer, cfg.train.steps) for s in range(DECAY, 20)]
    assert after == [MIN_LR if kind != "constant" else LR] * len(after)  # torch's cosine would rise again
    # decay_steps defaults to train.steps
    default = make_config({"optimizer": {**fields, "decay_steps": None}, "train": {"steps": DECAY}})
    assert [lr_at(s, default.optimizer, DECAY) for s in range(DECAY)] == ours[:DECAY]


@pytest.mark.parametrize("fields, words", [
    ({"schedule": "cosine", "min_lr": 1e-2}, "optimizer.min_lr=0.01 is above optimizer.lr=0.001"),
    ({"min_lr": 1e-4}, "optimizer.min_lr=0.0001 applies to a decaying schedule but optimizer.schedule=constant"),
    ({"schedule": "linear", "warmup_steps": 10, "decay_steps": 5}, "optimizer.decay_steps=5 ends the linear decay "
                                                                    "before optimizer.warmup_steps=10"),
    ({"schedule": "cosine", "warmup_steps": 10}, "train.steps=10 ends the cosine decay before"),
    ({"schedule": "exponential"}, "optimizer.schedule"),
])
def test_schedule_fields_that_cannot_work_are_refused(fields, words):
    with pytest.raises(ConfigError, match="invalid configuration") as err:
        make_config({"optimizer": fields, "train": {"steps": 10}})
    assert words in str(err.value), str(err.value)


def _gpt():
    return build_gpt(GPTShape(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, tie_embeddings=True), seed=0)


def test_no_weight_decay_on_norms_biases_and_embeddings_unless_configured():
    model = _gpt()
    cfg = make_config({"optimizer": {"weight_decay": 0.1}}).optimizer
    decayed, plain = (set(map(id, g["params"])) for g in param_groups(model.named_parameters(), cfg))
    names = {id(p): n for n, p in model.named_parameters()}
    # by an independent rule: the 2-D weights of the blocks' Linear layers decay, nothing else
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - {id(model.embed.tok.weight)}
    assert decayed == linear and {names[i] for i in decayed} and all(".blocks." in f".{names[i]}" for i in decayed)
    assert plain == set(names) - linear
    assert param_groups(model.named_parameters(), cfg)[1]["weight_decay"] == 0.0
    every = make_config({"optimizer": {"weight_decay": 0.1, "decay_norms_and_biases": True,
                                       "decay_embeddings": True}}).optimizer
    assert len(param_groups(model.named_parameters(), every)) == 1  # one group, all decayed


def test_hetero_optimizer_is_driven_by_torch_schedulers_like_torch_adamw():
    """hetero.wrap with the groups, stepped by torch's LambdaLR over our cosine schedule, and the
    same model with torch.optim.AdamW(foreach=False) under the same scheduler: bit-equal after 6 steps."""
    cfg = make_config({"optimizer": {"lr": 1e-2, "weight_decay": 0.1, "warmup_steps": 2, "schedule": "cosine",
                                     "min_lr": 1e-3}, "train": {"steps": 6}})
    ref = _gpt()
    ref_opt = torch.optim.AdamW(param_groups(ref.named_parameters(), cfg.optimizer), lr=cfg.optimizer.lr,
                                betas=cfg.optimizer.betas, eps=cfg.optimizer.eps, foreach=False)
    model = _gpt()
    groups = param_groups(model.named_parameters(), cfg.optimizer)
    model, opt = wrap(model, cfg.optimizer, {"enabled": True, "compute_device": "cpu", "chunk_elems": 4096,
                                             "device_budget_bytes": 100000}, param_groups=groups)
    assert isinstance(opt, torch.optim.Optimizer) and len(opt.param_groups) == 2
    assert opt.stats()["device_budget_bytes"] < opt.stats()["model_data_bytes"]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(cfg)) for o in (ref_opt, opt)]
    lrs = []
    for step in range(cfg.train.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 64, (4, 16), generator=g)
        for m, o, s in zip((ref, model), (ref_opt, opt), scheds):
            m(x, torch.roll(x, -1, dims=1)).backward()
            o.step()
            o.zero_grad()
            s.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [lr_at(s + 1, cfg.optimizer, cfg.train.steps) for s in range(cfg.train.steps)]
    got, want = model.state_dict(), ref.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())


def test_build_optimizer_applies_the_groups():
    model = _gpt()
    cfg = make_config({"optimizer": {"weight_decay": 0.1}}).optimizer
    opt = build_optimizer(model.named_parameters(), cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
