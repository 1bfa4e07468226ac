"""16-bit chunks with the master on the host (#29.1, #29.2), one process, compute device = CPU.

The reference is torch alone: the same GPT whose compute copy is bfloat16 (or float16), trained
with the same loop (micro-batches, a tied head, frozen parameters, activation checkpointing), and
whose float32 master weights are stepped by ``torch.optim.AdamW(foreach=False)`` from the compute
copy's gradients (``master.grad = p.grad.float()``), the compute copy then rounded from the master.
"""

import pytest
import torch

from parallel4d.hetero import wrap
from test_hetero import OPT, batch, build, one_thread  # noqa: F401 (one_thread: an autouse fixture, here too)

STEPS, MICRO = 10, 2


def train(model, step, steps=STEPS, rank=0, dp=1):
    """Losses of ``steps`` steps of the user's loop on this data replica's slice of each batch
    (the mean over its slice); ``step()`` ends each."""
    losses = []
    for s in range(steps):
        for mb in range(MICRO):
            x, y = batch(s, mb)
            n = x.shape[0] // dp
            loss = model(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]) / MICRO
            loss.backward()
            losses.append(loss.detach().float().item())
        step()
    return losses


def reference(dtype, steps=STEPS, master_dtype=torch.float32, opt_cfg=OPT):
    """``(losses, master state dict)`` of torch alone: a ``dtype`` compute copy, ``master_dtype`` masters; a
    frozen parameter has no master (hetero holds it in the chunks' dtype only): its value is the compute copy's."""
    master, model = build().to(master_dtype), build().to(dtype)  # same seed (the blocks' checkpointing is bound)
    with torch.no_grad():
        for p, w in zip(model.parameters(), master.parameters()):
            if not p.requires_grad:
                w.copy_(p)
    pairs = [(p, w) for p, w in zip(model.parameters(), master.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW([w for _, w in pairs], lr=opt_cfg["lr"], betas=opt_cfg["betas"], eps=opt_cfg["eps"],
                            weight_decay=opt_cfg["weight_decay"], foreach=False)

    def step():
        for p, w in pairs:
            w.grad = None if p.grad is None else p.grad.to(master_dtype)
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, w in pairs:
                p.copy_(w)

    return train(model, step, steps), master.state_dict()


def hetero(dtype, budget=None, steps=STEPS, master_dtype=torch.float32, opt_cfg=OPT, mesh=None, **fields):
    """``(losses, state dict, stats)`` of the same loop on hetero's ``dtype`` chunks (ZeRO over
    ``mesh``'s dp replicas, this rank's slice of each batch)."""
    m, opt = wrap(build().to(master_dtype), opt_cfg, dict(compute_device="cpu", device_budget_bytes=budget, **fields),
                  mesh=mesh, compute_dtype=dtype)

    def step():
        opt.step()
        opt.zero_grad()

    dp = 1 if mesh is None else mesh.size("dp")
    losses = train(m, step, steps, 0 if mesh is None else mesh.rank("dp"), dp)
    return losses, m.state_dict(), opt.stats()


def max_rel(a: dict, b: dict) -> float:
    """Largest per-tensor ‖a−b‖/‖b‖."""
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)).item() for k in b)


def model_rel(a: dict, b: dict) -> float:
    """‖a−b‖/‖b‖ over every parameter at once."""
    diff = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b)
    return (diff / sum((b[k].double() ** 2).sum() for k in b)).sqrt().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_chunks_equal_torch_adamw_on_float32_masters(dtype):
    ref_losses, ref_sd = reference(dtype)
    full, _, st = hetero(dtype, steps=1)
    assert st["compute_dtype"] == str(dtype)[6:] and st["master_dtype"] == "float32"
    minimum, row = st["min_feasible_budget_bytes"], 3 * st["chunk_elems"] * 4  # a row's float32 W, M, V
    # every master on the device; the least budget; half the compute chunks; every compute chunk and two
    # rows' masters on the device (#46: the placement mid-way)
    for budget in (None, minimum, (minimum + st["model_data_bytes"]) // 2, st["model_data_bytes"] + 2 * row):
        losses, sd, st = hetero(dtype, budget)
        assert st["optimizer_rows_on_device"] == {None: st["optimizer_rows_on_device"] + st["optimizer_rows_on_host"],
                                                  st["model_data_bytes"] + 2 * row: 2}.get(budget, 0), budget
        assert all(v.dtype == torch.float32 for v in sd.values())  # the master, not the compute copy
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-6, (budget, losses, ref_losses)
        assert max_rel(sd, ref_sd) <= 1e-6, budget
        assert st["peak_resident_bytes"] <= st["device_budget_bytes"]


OPT64 = dict(OPT, lr=1e-3, eps=1e-5)  # float32 compute: see test_hetero_zero on noise-level gradients


def _zero_worker():
    """dp = 2: float32 chunks on float64 masters, and bfloat16 on float32, resident and at the
    minimum budget; losses (the mean over both replicas) and masters against torch in one process."""
    import torch.distributed as dist
    from parallel4d.distributed.mesh import init_mesh

    torch.set_num_threads(1)
    from test_lora_hetero import LORA_ZERO, lora_hetero_job
    from test_llama import train_layouts

    out = train_layouts({LORA_ZERO: lora_hetero_job({"dp": 2})}, with_hetero_stats=True)  # a LoRA base under ZeRO
    mesh = init_mesh(dp=dist.get_world_size())
    for dtype, master, cfg in ((torch.float32, torch.float64, OPT64), (torch.bfloat16, torch.float32, OPT)):
        ref_losses, ref_sd = reference(dtype, master_dtype=master, opt_cfg=cfg)
        budget, row = None, 3 * 8192 // mesh.size("dp") * master.itemsize  # a row's W, M, V window
        for label in ("resident", "mid", "minimum"):
            losses, sd, st = hetero(dtype, budget, master_dtype=master, opt_cfg=cfg, mesh=mesh, chunk_elems=8192)
            mean = torch.tensor(losses, dtype=torch.float64)
            dist.all_reduce(mean)
            mean = (mean / mesh.size("dp")).tolist()
            out[str(dtype), label] = {
                "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(mean, ref_losses)),
                "param_rel": max_rel(sd, ref_sd), "model_rel": model_rel(sd, ref_sd), "stats": st}
            # mid: every compute chunk (and the shard slot) resident, two rows' masters on the device
            budget = st["arena_bytes"] + 2 * row if label == "resident" else st["min_feasible_budget_bytes"]
    out["order"] = _recorded_order(mesh)
    return out


def _recorded_order(mesh):
    """bf16 chunks, everything resident and at half the model data, prefetching off and on: the third
    step's log of copies, collectives and accesses, the losses and the final state."""
    half = hetero(torch.bfloat16, steps=0, mesh=mesh, chunk_elems=8192)[2]["model_data_bytes"] // 2
    runs = {}
    for budget, depth in ((None, 0), (None, 2), (half, 0), (half, 2)):
        m, opt = wrap(build(), OPT, dict(compute_device="cpu", chunk_elems=8192, device_budget_bytes=budget),
                      mesh=mesh, compute_dtype=torch.bfloat16)
        transfers = m._hetero_runtime.mgr.transfers
        m._hetero_runtime.mgr.prefetch_depth = depth  # on CUDA by default; the CPU has nothing to overlap

        def step():
            opt.step()
            opt.zero_grad()

        losses = train(m, step, 2, mesh.rank("dp"), 2)
        transfers.log = []  # the third step: the trace recorded at the first is replayed
        losses += train(m, step, 1, mesh.rank("dp"), 2)
        runs[budget is not None, depth] = {"losses": losses, "log": transfers.log, "state": m.state_dict(),
                       "chunks": {c.cid: (c.kind, c.index) for c in m._hetero_runtime.mgr.chunks}}
    return runs


@pytest.fixture(scope="module")
def zero_job():
    """One spawned dp = 2 job for the tests below: :func:`_zero_worker`'s results per rank."""
    from conftest import run_workers

    return run_workers(_zero_worker, 2, timeout_s=300)


def test_sixteen_bit_chunks_under_zero_equal_one_process(zero_job):
    for r in zero_job:
        f32 = r["torch.float32", "minimum"]
        assert f32["stats"]["reduce_scatters"]["on_eviction"] > 0  # the sharded staging really spilled
        assert [r["torch.float32", label]["stats"]["optimizer_rows_on_device"] for label in ("mid", "minimum")] == [2, 0]
        for label in ("resident", "mid", "minimum"):
            got = r["torch.float32", label]  # float32 sums in another order: a bias summed over every
            # token drifts most (head.ln_f.bias 1.5e-6 after 10 steps), the model as a whole ~1e-7
            assert got["loss_rel"] <= 1e-6 and got["model_rel"] <= 1e-6 and got["param_rel"] <= 1e-5, (label, got)
            # bf16 sums in another order round differently (3 digits), and Adam turns a noise-level
            # gradient's rounding into a full step (the key bias): the losses stay within bf16's rounding
            bf = r["torch.bfloat16", label]
            assert bf["loss_rel"] <= 2e-2, (label, bf["loss_rel"])
        sent = [r[dtype, "resident"]["stats"]["total"]["reduce_scatter_bytes"] for dtype in ("torch.bfloat16", "torch.float32")]
        assert 2 * sent[0] == sent[1] > 0  # bf16 gradients are reduced in bf16



def test_lora_under_hetero_zero_equals_one_process(zero_job):
    """A frozen LoRA base under ZeRO over dp=2 (float64, a budget below the model): losses and every parameter
    equal one process's; each rank keeps its half of every frozen row (its PS shard) and nothing else of it."""
    from test_lora_hetero import LORA_ZERO, check_against_one_process, lora_hetero_job

    check_against_one_process(zero_job, LORA_ZERO, lora_hetero_job({"dp": 2}))
    for r in zero_job:
        st = r["hetero"]
        assert st["dp"] == 2 and st["total"]["loads"] > 0 and st["total"]["reduce_scatter_bytes"] > 0
        assert st["frozen_rows"] > 0 and st["frozen_host_bytes"] == st["frozen_rows"] * 8 * st["chunk_elems"] // 2


def test_gathers_are_posted_ahead_of_the_compute_that_needs_them(zero_job):
    """#29.3: with the trace replayed and the parameters resident, every ZeRO all-gather but the step's
    first is posted while an earlier chunk is in use (prefetched; on CUDA it runs beside that compute;
    at half the model data most are: a prefetch never evicts what is needed sooner or unsaved), and a
    gradient reduce-scatter is waited for after the next row's compute; prefetching changes no number."""
    for r in zero_job:
        runs = r["order"]
        for tight in (False, True):
            assert runs[tight, 0]["losses"] == runs[tight, 2]["losses"]
            assert all(torch.equal(runs[tight, 0]["state"][k], v) for k, v in runs[tight, 2]["state"].items())
        ahead = {tight: _gathers_posted_ahead(runs[tight, 2]["log"]) for tight in (False, True)}
        print("gathers posted ahead / all (resident, half):", ahead)
        assert ahead[False][0] == ahead[False][1] - 1 > 2 and ahead[True][0] >= 2 * ahead[True][1] // 3
        log, chunks = runs[True, 2]["log"], runs[True, 2]["chunks"]
        accesses = [i for i, (what, _) in enumerate(log) if what == "access"]
        overlapped = []
        for i, (what, cid) in enumerate(log):
            if what == "reduce_scatter":  # until its shard is added (the GS access), other rows compute?
                shard = next(j for j in accesses if j > i and chunks[log[j][1]] == ("grad_shard", chunks[cid][1]))
                overlapped.append(any(chunks[log[j][1]][0] in ("param", "grad") for j in accesses if i < j < shard))
        print("reduce-scatters overlapped with compute:", overlapped)
        assert sum(overlapped) >= len(overlapped) // 2 > 0


def _gathers_posted_ahead(log) -> tuple[int, int]:
    """``(posted ahead, all)`` gathers of a log: ahead = posted at another chunk's access, and that
    chunk's next access comes after another chunk's (a compute to overlap with)."""
    accesses = [i for i, (what, _) in enumerate(log) if what == "access"]
    ahead, gathers = 0, [(i, cid) for i, (what, cid) in enumerate(log) if what == "gather"]
    for i, cid in gathers:
        if log[i - 1] == ("access", cid):  # posted by its own use
            continue
        nxt = next(j for j in accesses if j > i and log[j][1] == cid)
        ahead += any(log[j][1] != cid for j in accesses if i < j < nxt)
    return ahead, len(gathers)
