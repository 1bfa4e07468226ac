"""#46: under 16-bit chunks the master state where it fits, and the host rows' updates beside the training
thread (one process, compute device = CPU: "device" and "host" are both CPU memory, every placement,
copy and wait runs).

The reference for exactness is hetero itself with every row's master on the host and its updates run in
order on the training thread (``updates.inline``): a placement or the worker changes where and when the
arithmetic runs, never its result, so float32 chunks over float64 masters agree bit for bit. Against
torch alone (``torch.optim.AdamW`` on float32 masters): ``test_hetero_master``, whose budgets include a
mid-way placement.
"""

import threading
import time

import pytest
import torch

from parallel4d.hetero import wrap
from parallel4d.hetero.budget import master_row_bytes
from parallel4d.hetero.master import DEVICE, HOST
from test_hetero import OPT, build, one_thread  # noqa: F401 (one_thread: an autouse fixture, here too)
from test_hetero_master import train

OPT64 = dict(OPT, lr=1e-3, eps=1e-5)
STEPS = 4


def hetero(budget, dtype=torch.float32, master=torch.float64, steps=STEPS, inline=False, slow=None, fail=None,
           in_backward=False, **fields):
    """``(losses, state dict, optimizer state, stats, runtime)`` of the loop on ``dtype`` chunks over
    ``master`` masters; ``inline``: the host updates on the training thread, in order; ``slow``: seconds
    each host update sleeps first; ``fail``: the row whose host update raises."""
    m, opt = wrap(build().to(master), OPT64, dict(compute_device="cpu", device_budget_bytes=budget, **fields),
                  compute_dtype=dtype)
    rt = m._hetero_runtime
    rt.updates.inline = inline
    opt.update_in_backward(in_backward)
    if slow is not None or fail is not None:
        update = rt.master.update

        def instrumented(row, *a, **k):
            if threading.current_thread() is threading.main_thread() and rt.master.place[row.index] == HOST:
                raise AssertionError("a host row updated on the training thread")
            if row.index == fail:
                raise OSError("disk on fire")
            if slow and rt.master.place[row.index] == HOST:
                time.sleep(slow)
            update(row, *a, **k)
        rt.master.update = instrumented

    def step():
        opt.step()
        opt.zero_grad()

    losses = train(m, step, steps)
    return losses, m.state_dict(), opt.state_dict()["state"], opt.stats(), rt


def sizes():
    """``(model data bytes, one row's master bytes, trainable rows)`` of the test model."""
    rt = hetero(None, steps=0)[4]
    return rt.model_data_bytes, master_row_bytes(rt.layout), rt.layout.trainable_rows


def same(a, b) -> bool:
    """Bit for bit: losses, every master parameter, every Adam moment."""
    (la, sa, oa), (lb, sb, ob) = a[:3], b[:3]
    return (la == lb and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
            and all(torch.equal(oa[n][k], ob[n][k]) for n in ob for k in ("exp_avg", "exp_avg_sq")))


def test_every_row_whose_master_fits_lives_on_the_device_and_the_result_is_the_all_host_one_bit_for_bit():
    data, row, rows = sizes()
    everything = hetero(data, inline=True)  # all the budget in compute chunks: every master on the host
    assert everything[3]["optimizer_rows_on_device"] == 0 and everything[3]["optimizer_rows_on_host"] == rows
    for budget, on_device in ((None, rows), (data + 2 * row, 2), (data + 2 * row - 1, 1), (data, 0),
                              (everything[3]["min_feasible_budget_bytes"], 0)):
        got = hetero(budget)
        st = got[3]
        assert (st["optimizer_rows_on_device"], st["optimizer_rows_on_host"]) == (on_device, rows - on_device), budget
        assert st["optimizer_device_bytes"] == on_device * row
        assert st["device_optimizer_rows"] == STEPS * on_device and st["host_optimizer_rows"] == STEPS * (rows - on_device)
        assert same(got, everything), budget
        if on_device:  # the first layers first: the rows the traced forward reaches first
            order = [i for i in got[4].adam.order if got[4].layout.rows[i].trainable]
            assert {i for i in order if got[4].master.place[i] == DEVICE} == set(order[:on_device])
            assert got[4].layout.rows[order[0]].records[0].name.startswith("embed")


def test_when_everything_fits_nothing_crosses_to_the_host_or_is_updated_there():
    st, rt = hetero(None)[3:]
    assert st["host_optimizer_rows"] == 0 and st["optimizer_rows_on_host"] == 0
    frozen = [row for row in rt.layout.rows if not row.trainable]  # 16-bit chunks alone: read once, never updated
    # what crosses: the frozen rows' first upload (the plain path's model.to(device)); after it nothing
    assert st["total"]["loads"] == len(frozen) and st["total"]["writebacks"] == 0
    assert st["last_iteration"]["moved_bytes"] == 0 and st["last_iteration"]["device_fills"] == 0
    # no master state on the host: the frozen rows have none, only their chunks' 16-bit backings
    assert st["optimizer_host_bytes"] == 0 and not set(rt.master.W) & {row.index for row in frozen}
    assert st["frozen_host_bytes"] == len(frozen) * st["chunk_bytes"] > 0


def test_a_dynamic_budget_places_the_master_rows_from_the_warm_up_trace():
    data, row, rows = sizes()
    everything = hetero(data, inline=True)
    # the capacity leaves room for the arena, the traced non-model peak and two rows' master at 80 %
    got = hetero(data + 3 * row, dynamic_budget=True)
    st = got[3]
    assert 0 < st["optimizer_rows_on_device"] < rows, st
    assert st["trace_divergences"] == 0
    assert same(got, everything)


def test_host_updates_run_beside_the_next_forward_in_forward_order():
    """A host row's update runs while an earlier row's forward computes (the worker is slowed down so that
    the order is certain on any machine); each row's upload waits for its update."""
    data, _, _ = sizes()
    m, opt = wrap(build().to(torch.float64), OPT64, dict(compute_device="cpu", device_budget_bytes=data),
                  compute_dtype=torch.float32)
    rt = m._hetero_runtime
    update = rt.master.update
    rt.master.update = lambda row, *a, **k: (time.sleep(0.15), update(row, *a, **k))

    def step():
        opt.step()
        opt.zero_grad()

    train(m, step, 1)  # the warm-up: its trace gives the forward order
    rt.updates.wait_all()
    rt.mgr.transfers.log = log = []
    train(m, step, 2)
    rt.updates.wait_all()
    cid_row = {c.cid: c.index for c in rt.mgr.chunks}
    order = [i for i in rt.adam.order if rt.layout.rows[i].trainable]
    started = [d for w, d in log if w == "host_update"]
    assert started[:len(order)] == order  # in forward order
    overlapped = []
    for k, r in enumerate(order):
        a = log.index(("host_update", r))
        b = log.index(("host_update_done", r))
        earlier = set(order[:k])
        overlapped.append(any(w == "access" and cid_row[d] in earlier for w, d in log[a:b]))
        # the row's parameters are uploaded after its update, never before
        assert next(i for i, e in enumerate(log) if e == ("upload", r) and i > a) > b
    print("host updates overlapped with an earlier row's forward:", overlapped)
    assert sum(overlapped) >= len(order) - 1


def test_the_worker_gives_the_sequential_result_bit_for_bit():
    data, row, _ = sizes()
    for budget in (data, data + row):
        assert same(hetero(budget), hetero(budget, inline=True)), budget


def test_a_failing_host_update_ends_the_step_with_its_error_never_a_hang():
    data, _, _ = sizes()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"host optimizer's update of row \d+ failed: OSError: disk on fire"):
        hetero(data, fail=0)
    assert time.perf_counter() - t0 < 60


def test_with_no_scale_to_wait_for_host_updates_start_in_the_backward_and_change_nothing():
    """``update_in_backward``: a host row is handed to the worker once its last gradient of the step is
    written (the warm-up counted them), while the backward goes on to the earlier rows — bit for bit the
    sequential result."""
    data, row, rows = sizes()
    everything = hetero(data, inline=True)
    for budget in (data, data + row):
        got = hetero(budget, in_backward=True)
        assert same(got, everything), budget
        assert got[3]["host_optimizer_rows"] == STEPS * got[3]["optimizer_rows_on_host"]
    m, opt = wrap(build().to(torch.float64), OPT64, dict(compute_device="cpu", device_budget_bytes=data),
                  compute_dtype=torch.float32)
    rt = m._hetero_runtime
    opt.update_in_backward()

    def step():
        opt.step()
        opt.zero_grad()

    train(m, step, 1)
    rt.updates.wait_all()
    rt.mgr.transfers.log = log = []
    train(m, step, 1)
    rt.updates.wait_all()  # the last row handed over may not have started yet
    grads = {c.cid: c.index for c in rt.mgr.chunks if c.kind == "grad"}
    last_grad_write = max(i for i, (w, d) in enumerate(log) if w == "access" and d in grads)
    queued = [i for i, (w, _) in enumerate(log) if w == "host_update_queued"]  # handed over (when the worker
    assert len(queued) == rows and sum(i < last_grad_write for i in queued) == rows - 1, log  # starts: its cores)
    # what would make it inexact is refused: a scale after the fact, a gradient after the update
    train(m, lambda: None, 1)
    opt.scale_next_step(0.5)
    with pytest.raises(RuntimeError, match="scaled .* after rows were updated in the backward"):
        opt.step()
