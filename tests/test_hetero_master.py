"""16-bit chunks with the master on the host (#29.1, #29.2), one process, compute device = CPU.

The reference is torch alone: the same GPT whose compute copy is bfloat16 (or float16), trained
with the same loop (micro-batches, a tied head, frozen parameters, activation checkpointing), and
whose float32 master weights are stepped by ``torch.optim.AdamW(foreach=False)`` from the compute
copy's gradients (``master.grad = p.grad.float()``), the compute copy then rounded from the master.
"""

import pytest
import torch

from parallel4d.hetero import wrap
from test_hetero import OPT, batch, build

STEPS, MICRO = 10, 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train(model, step, steps=STEPS):
    """Losses of ``steps`` steps of the user's loop; ``step()`` ends each."""
    losses = []
    for s in range(steps):
        for mb in range(MICRO):
            x, y = batch(s, mb)
            loss = model(x, y) / MICRO
            loss.backward()
            losses.append(loss.detach().float().item())
        step()
    return losses


def reference(dtype, steps=STEPS):
    """``(losses, master state dict)`` of torch alone: a ``dtype`` compute copy, float32 masters."""
    master, model = build(), build().to(dtype)  # same seed (build's checkpointing binds its own blocks)
    pairs = [(p, w) for p, w in zip(model.parameters(), master.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW([w for _, w in pairs], lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"],
                            weight_decay=OPT["weight_decay"], foreach=False)

    def step():
        for p, w in pairs:
            w.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, w in pairs:
                p.copy_(w)

    return train(model, step, steps), master.state_dict()


def hetero(dtype, budget=None, steps=STEPS):
    """``(losses, state dict, stats)`` of the same loop on hetero's 16-bit chunks."""
    m, opt = wrap(build(), OPT, dict(compute_device="cpu", device_budget_bytes=budget), compute_dtype=dtype)

    def step():
        opt.step()
        opt.zero_grad()

    losses = train(m, step, steps)
    return losses, m.state_dict(), opt.stats()


def max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)).item() for k in b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_chunks_equal_torch_adamw_on_float32_masters(dtype):
    ref_losses, ref_sd = reference(dtype)
    full, _, st = hetero(dtype, steps=1)
    assert st["compute_dtype"] == str(dtype)[6:] and st["master_dtype"] == "float32"
    minimum = st["min_feasible_budget_bytes"]
    for budget in (None, minimum, (minimum + st["model_data_bytes"]) // 2):
        losses, sd, st = hetero(dtype, budget)
        assert all(v.dtype == torch.float32 for v in sd.values())  # the master, not the compute copy
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-6, (budget, losses, ref_losses)
        assert max_rel(sd, ref_sd) <= 1e-6, budget
        assert st["peak_resident_bytes"] <= st["device_budget_bytes"]
