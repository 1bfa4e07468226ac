"""Packed documents in ring attention: each query attends its own document only, exactly as dense
attention under the block-diagonal mask, and block pairs of different documents are not computed."""

import math

import pytest
import torch
import torch.distributed as dist

from conftest import run_workers
from parallel4d.sequence import gather_sequence, ring_attention, split_sequence
from parallel4d.sequence import kernels
from parallel4d.sequence.documents import Documents
from test_sequence import _inputs


def masked_attention(q, k, v, allowed):
    """Independent reference: explicit scores over the whole sequence, ``allowed [b, s, s]``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed[:, None], float("-inf"))
    return s.softmax(-1) @ v


def starts_of(lengths_per_sample, s):
    """Host ``[b, s]`` document starts from each sample's document lengths (the last runs to the end)."""
    starts = torch.zeros(len(lengths_per_sample), s, dtype=torch.bool)
    for row, lengths in enumerate(lengths_per_sample):
        at = 0
        for length in [0, *lengths]:
            at += length
            if at < s:
                starts[row, at] = True
    return starts


def _case(group, layout, causal, h, hkv, s, lengths):
    b, d = len(lengths), 4
    q, k, v, dout = _inputs(3, b, h, hkv, s, d)
    docs = Documents.from_starts(starts_of(lengths, s))
    ql, kl, vl = (split_sequence(x, group, 2, layout).requires_grad_() for x in (q, k, v))
    calls = []
    real = kernels.block_forward
    kernels.block_forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        out = ring_attention(ql, kl, vl, group, causal=causal, layout=layout, timeout_s=60, documents=docs)
    finally:
        kernels.block_forward = real
    out.backward(split_sequence(dout, group, 2, layout))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = masked_attention(qr, kr, vr, docs.mask(causal))
    ref.backward(dout)
    got = [gather_sequence(x, group, 2, layout) for x in (out.detach(), ql.grad, kl.grad, vl.grad)]
    errs = [float((a - r).abs().max()) for a, r in zip(got, (ref.detach(), qr.grad, kr.grad, vr.grad))]
    return dict(case=(dist.get_world_size(group), layout, causal, h, hkv, s, lengths), errs=errs, calls=len(calls))


def _job(n):
    group = dist.group.WORLD
    s = 8 * n
    out = []
    for layout in ("contiguous", "zigzag"):
        for causal in (True, False):
            for h, hkv in ((4, 4), (4, 2)):
                out.append(_case(group, layout, causal, h, hkv, s, [[3, 5, 1], [s], [1] * 4]))
        # work falls as documents shorten: one document vs documents of two tokens
        out.append(dict(one=_case(group, layout, True, 2, 1, s, [[s]])["calls"],
                        short=_case(group, layout, True, 2, 1, s, [[2] * (s // 2)])["calls"]))
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ring_results(request):
    return request.param, run_workers(_job, request.param, request.param, timeout_s=300, preload=())


def test_packed_documents_in_the_ring_equal_dense_attention_under_the_block_diagonal_mask(ring_results):
    """float64: output and the gradients of q, k and v within 1e-10, both layouts, causal or not, GQA,
    documents that cross shard boundaries, a sample of one document and one of one-token documents."""
    n, workers = ring_results
    for worker in workers:
        for r in worker:
            if "errs" in r:
                assert max(r["errs"]) <= 1e-10, (r["case"], r["errs"])


def test_block_pairs_of_different_documents_are_skipped(ring_results):
    """Block kernel calls of a causal forward, per layout: documents of two tokens need fewer than one
    document of the whole sequence on every rank, and on the ring as a whole strictly fewer."""
    n, workers = ring_results
    per_layout = list(zip(*([r for r in worker if "one" in r] for worker in workers)))
    for ranks in per_layout:
        assert all(r["short"] <= r["one"] for r in ranks), (n, ranks)
        assert sum(r["short"] for r in ranks) < sum(r["one"] for r in ranks), (n, ranks)


def test_one_process_ring_of_one_equals_dense_attention(single_rank):
    r = _case(dist.group.WORLD, "contiguous", True, 4, 2, 12, [[5, 7], [1, 11], [12]])
    assert max(r["errs"]) <= 1e-10, r


def test_a_block_row_that_attends_nothing_leaves_the_merge_as_it_was():
    """A document mask can leave a block row with no key (``lse = -inf``, ``out = 0``): merged into a
    row with nothing yet, or into one with a result, it changes nothing and makes no NaN."""
    out_acc = torch.tensor([[[[0.0], [2.0]]]], dtype=torch.float64)
    lse_acc = torch.tensor([[[float("-inf"), 0.5]]], dtype=torch.float64)
    kernels.merge_(out_acc, lse_acc, torch.zeros(1, 1, 2, 1, dtype=torch.float64),
                   torch.full((1, 1, 2), float("-inf"), dtype=torch.float64))
    assert out_acc.flatten().tolist() == [0.0, 2.0] and lse_acc.flatten().tolist() == [float("-inf"), 0.5]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_emulated_ring_over_documents_equals_masked_attention_and_runs_fewer_blocks(layout):
    """``sequence.emulate.ring_forward`` with documents (the benchmark's replay of every rank's calls, the
    ring's own ``StepMasks``) equals dense attention under the block-diagonal causal mask (float64), and
    the query×key elements of the calls that run fall as the documents shorten."""
    from parallel4d.sequence.emulate import ring_forward, ring_work, shard, unshard

    n, s = 4, 64
    q, k, v, _ = _inputs(5, 2, 4, 2, s, 4)
    work = []
    for length in (64, 16, 4):
        docs = Documents.from_starts(starts_of([[length] * (s // length)] * 2, s))
        got = unshard(ring_forward(*(shard(x, n, layout) for x in (q, k, v)), layout, True, documents=docs)[0], layout)
        torch.testing.assert_close(got, masked_attention(q, k, v, docs.mask(True)), rtol=0, atol=1e-12)
        work.append(ring_work(n, layout, True, s // n, docs))
    assert work[0] == ring_work(n, layout, True, s // n) > work[1] >= work[2], work  # the diagonal blocks always run
