"""Mesh groups checked against an independent computation at world 8 and 16."""

import itertools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import run_workers
from parallel4d.distributed.mesh import AXES, init_mesh, mesh_shape


def _expected_coords(shape):
    """rank -> coordinate tuple, by plain enumeration (row-major, pp outermost)."""
    return {r: c for r, c in enumerate(itertools.product(*(range(n) for n in shape)))}


MESH_TIMEOUT_S = 123.0  # not torch's default for groups (30 min), nor the world group's


def group_timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _check_mesh(pp, dp, sp, tp):
    mesh = init_mesh(pp=pp, dp=dp, sp=sp, tp=tp, timeout_s=MESH_TIMEOUT_S)
    me = dist.get_rank()
    # What every process *actually* reports as its coordinates.
    mine = torch.tensor([mesh.coords[a] for a in AXES])
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    actual = {r: tuple(int(x) for x in c) for r, c in enumerate(everyone)}
    assert actual == _expected_coords(mesh_shape(pp, dp, sp, tp))
    for dim, axis in enumerate(AXES):
        members = dist.get_process_group_ranks(mesh.group(axis))
        # Independent: the ranks whose coords differ from mine only along `axis`.
        expect = sorted(r for r, c in actual.items()
                        if all(c[k] == actual[me][k] for k in range(len(AXES)) if k != dim))
        assert sorted(members) == expect, (axis, members, expect)
        assert mesh.ranks_along(axis) == expect
        assert mesh.rank(axis) == actual[me][dim]
        assert mesh.size(axis) == len(expect)
        assert mesh.global_rank(axis, mesh.rank(axis)) == me
        assert group_timeout(mesh.group(axis)) == timedelta(seconds=MESH_TIMEOUT_S), axis
        # The group really communicates among exactly those ranks.
        t = torch.tensor([float(me)])
        dist.all_reduce(t, group=mesh.group(axis))
        assert t.item() == float(sum(expect))
    return mesh.coords


def _check_meshes(layouts, group_over=False):
    """Several meshes over the same workers (one start-up for all of them: the suite
    runs on 2 cores, where starting 16 processes costs ~20 s)."""
    out = [_check_mesh(**sizes) for sizes in layouts]
    if group_over:
        _check_group_over()
    return out


def test_mesh_world_8():
    layouts = [dict(pp=2, dp=1, sp=1, tp=4), dict(pp=1, dp=2, sp=1, tp=4), dict(pp=2, dp=2, sp=2, tp=1)]
    per_rank = run_workers(_check_meshes, 8, layouts, preload=())
    assert len(per_rank) == 8
    for i in range(len(layouts)):
        assert len({tuple(coords[i].values()) for coords in per_rank}) == 8


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job (tests/conftest.py)."""
    return _check_meshes([dict(pp=2, dp=1, sp=2, tp=4)], group_over=True)


def test_mesh_world_16_and_group_over_several_axes(sixteen_workers):
    per_rank = [results["test_mesh"] for results in sixteen_workers]
    assert len({tuple(coords[0].values()) for coords in per_rank}) == 16


def test_mesh_rejects_bad_sizes():
    with pytest.raises(ValueError, match="perfect square"):
        mesh_shape(tp=8)
    with pytest.raises(ValueError, match="parallel.dp"):
        mesh_shape(dp=0)


def _check_group_over():
    mesh = init_mesh(pp=1, dp=2, sp=2, tp=2 * 2, timeout_s=MESH_TIMEOUT_S)
    me = dist.get_rank()
    group = mesh.group_over("sp", "dp")
    assert group_timeout(group) == timedelta(seconds=MESH_TIMEOUT_S)
    pair = mesh.new_group([0, 1])  # collective: every rank creates it, ranks 0 and 1 are in it
    if me in (0, 1):
        assert group_timeout(pair) == timedelta(seconds=MESH_TIMEOUT_S)
    members = dist.get_process_group_ranks(group)
    # independent: the ranks sharing my pp, tp_row and tp_col coordinates
    layout = _expected_coords(mesh_shape(1, 2, 2, 4))
    mine = layout[me]
    expect = sorted(r for r, c in layout.items() if (c[0], c[3], c[4]) == (mine[0], mine[3], mine[4]))
    assert sorted(members) == expect
    assert dist.get_rank(group) == mesh.rank_over("dp", "sp") == mesh.rank("dp") * 2 + mesh.rank("sp")
    t = torch.tensor([float(me)])
    dist.all_reduce(t, group=group)
    assert t.item() == float(sum(expect))



def _threads_around_two_runs(jobs, tmp):
    """This process's thread count before, then after each run of ``jobs`` (a gc between), in one job."""
    import gc
    import os

    from conftest import train_in_job

    import time

    def threads(settle_to: int) -> int:
        # a thread joined in Python (hetero's host worker: shutdown(wait=True)) leaves /proc a moment after the
        # join returns: wait up to 5 s for the count to come back; a thread left running stays counted
        deadline = time.monotonic() + 5.0
        while (n := len(os.listdir("/proc/self/task"))) > settle_to and time.monotonic() < deadline:
            time.sleep(0.01)
        return n

    counts = [len(os.listdir("/proc/self/task"))]
    for i, cfg in enumerate(jobs):
        train_in_job(cfg, [f"train.out_dir={tmp}/run{i}"])
        gc.collect()
        counts.append(threads(counts[0]))
    return counts


def test_a_process_that_trains_again_keeps_nothing_of_the_run_before(tmp_path):
    """run_training takes its hooks off and destroys the groups its mesh made (the default group aside):
    a process that trains again does not pile up groups and their communication threads (gloo's
    poll every few milliseconds). pp=2 × dp=2 (the pipeline's own groups, the data replicas', the
    gradient buckets' hooks), then hetero with ZeRO over dp=4."""
    from test_ddp import job

    plain = job(parallel={"pp": 2, "dp": 2}, pipeline={"microbatches": 2})
    hetero = job(parallel={"dp": 4}, hetero={"enabled": True, "chunk_elems": 4096})
    per_rank = run_workers(_threads_around_two_runs, 4, [plain, plain, hetero, hetero], str(tmp_path), timeout_s=120)
    for counts in per_rank:
        assert counts == [counts[0]] * len(counts), counts
