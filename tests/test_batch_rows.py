"""Which rows of the global batch a rank trains on (``engine/batch.py``), in this process: micro-batch-major,
so that micro-batch ``i`` of every layout is one process's micro-batch ``i`` (rows ``[i·B/m, (i+1)·B/m)``),
each rank (dp d, tp_row r) holding block ``d·q + r`` of it — what a micro-batch's statistics (the MoE
load-balancing loss) need to equal one process's."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from parallel4d.engine.batch import local_batch, local_rows, microbatch_rows


def mesh_at(dp: int, q: int, d: int = 0, r: int = 0, sp: int = 1):
    """A stand-in mesh: ``dp`` data replicas × a q×q grid (``tp_row`` size q), at dp rank ``d``, grid row ``r``."""
    sizes, ranks = {"dp": dp, "tp_row": q, "sp": sp}, {"dp": d, "tp_row": r}
    return types.SimpleNamespace(size=lambda axis: sizes.get(axis, 1), rank=lambda axis: ranks.get(axis, 0),
                                 device=torch.device("cpu"))


@pytest.mark.parametrize("dp, q, m", [(2, 1, 2), (1, 2, 2), (2, 2, 2), (2, 1, 4), (4, 1, 1), (1, 1, 3)])
def test_each_layouts_microbatch_i_is_one_process_microbatch_i(dp, q, m):
    """For every rank: its rows of micro-batch i are block ``d·q + r`` of rows ``[i·B/m, (i+1)·B/m)``
    (contiguous, ascending); together the ranks hold each micro-batch once, and the whole batch once."""
    batch = 2 * dp * q * m
    per = batch // m
    held = {i: [] for i in range(m)}
    for d, r in itertools.product(range(dp), range(q)):
        mesh = mesh_at(dp, q, d, r)
        spans = microbatch_rows(mesh, batch, m)
        assert len(spans) == m
        for i, rows in enumerate(spans):
            block = d * q + r
            assert rows == range(i * per + block * per // (dp * q), i * per + (block + 1) * per // (dp * q))
            held[i] += list(rows)
        assert local_rows(mesh, batch, m) == [row for rows in spans for row in rows] == sorted(local_rows(mesh, batch, m))
    for i, rows in held.items():
        assert sorted(rows) == list(range(i * per, (i + 1) * per))


def test_at_one_microbatch_a_rank_holds_its_block_of_the_batch():
    """m = 1 is the contiguous block ``d·q + r`` of the batch (the layout before micro-batches mattered)."""
    assert local_rows(mesh_at(2, 2, d=1, r=0), 8) == [4, 5]
    assert local_rows(mesh_at(4, 1, d=3), 8) == [6, 7]


def test_the_local_batch_chunked_in_m_is_the_ranks_share_of_each_microbatch():
    """``local_batch(..., microbatches=m).chunk(m)[i]`` is exactly the rows of micro-batch i the rank holds
    (sp = 2: the rows' sequence shard, zigzag)."""
    x = torch.arange(16 * 8).reshape(16, 8)
    for d in range(2):
        mesh = mesh_at(2, 1, d=d)
        got = local_batch(mesh, x, microbatches=4).chunk(4)
        for i, rows in enumerate(microbatch_rows(mesh, 16, 4)):
            assert torch.equal(got[i], x[rows.start:rows.stop])
    sharded = local_batch(mesh_at(2, 1, d=1, sp=2), x, "zigzag", microbatches=2)
    assert sharded.shape == (8, 4) and torch.equal(sharded[:, 0] // 8, torch.tensor([4, 5, 6, 7, 12, 13, 14, 15]))


def test_a_batch_that_does_not_split_names_the_fields_and_a_fix():
    """A ValueError naming data.batch_size, the factors and what to use (config/rules/data.py's message)."""
    with pytest.raises(ValueError, match=r"data\.batch_size=6 is not divisible by parallel\.dp·q·pipeline\."
                                         r"microbatches = 2·1·2 = 4; use data\.batch_size="):
        local_rows(mesh_at(2, 1), 6, 2)
