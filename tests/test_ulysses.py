"""Ulysses and hybrid (Ulysses × ring) attention equal dense attention, and move the bytes they say."""

import pytest
import torch
import torch.distributed as dist

from conftest import run_workers
from parallel4d.distributed import comm
from parallel4d.models.dropout import AttentionMask
from parallel4d.sequence.ulysses import hybrid_positions, ulysses_attention, ulysses_bytes
from parallel4d.sequence.documents import Documents
from test_documents import masked_attention
from test_sequence import _inputs, dense_attention

WORLD = 4
SPLITS = [(1, 4), (2, 2), (4, 1)]  # (ring R, Ulysses U): pure Ulysses, hybrid, ring alone


def _groups(u: int):
    """This rank's Ulysses and ring groups over the world (every rank creates every group, in order)."""
    me, mine = dist.get_rank(), {}
    for i in range(WORLD // u):
        g = dist.new_group(list(range(i * u, (i + 1) * u)))
        if me // u == i:
            mine["ulysses"] = g
    for j in range(u):
        g = dist.new_group(list(range(j, WORLD, u)))
        if me % u == j:
            mine["ring"] = g
    return mine["ulysses"], mine["ring"]


def _case(u, layout, causal, h, hkv, s, dropout_p=0.0, documents=False):
    """One hybrid forward+backward against dense attention on the whole sequence: max errors and bytes."""
    b, d = 2, 4
    ug, rg = _groups(u)
    q, k, v, dout = _inputs(7, b, h, hkv, s, d)
    pos = [torch.tensor(hybrid_positions(s, r, WORLD, u, layout)) for r in range(WORLD)]
    mine = pos[dist.get_rank()]
    ql, kl, vl = (x.index_select(2, mine).requires_grad_() for x in (q, k, v))
    mask = (AttentionMask(dropout_p, 12345, torch.arange(b), torch.arange(h), None) if dropout_p else None)
    starts = torch.zeros(b, s, dtype=torch.bool)
    starts[:, 0], starts[0, s // 3], starts[1, 1] = True, True, True  # documents crossing the shards
    docs = Documents.from_starts(starts) if documents else None
    stats = comm.CommStats()
    out = ulysses_attention(ql, kl, vl, ug, rg, causal=causal, layout=layout, stats=stats, timeout_s=60,
                            backend="math", dropout=mask, documents=docs)
    out.backward(dout.index_select(2, mine))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    if docs is not None:
        ref = masked_attention(qr, kr, vr, docs.mask(causal))
    else:
        ref = mask.attend(qr, kr, vr, causal) if mask else dense_attention(qr, kr, vr, causal)
    ref.backward(dout)
    errs = []
    for local, full in zip((out.detach(), ql.grad, kl.grad, vl.grad), (ref.detach(), qr.grad, kr.grad, vr.grad)):
        whole = torch.empty_like(full)
        for r, piece in enumerate(comm.all_gather(local.contiguous(), dim=0).chunk(WORLD, dim=0)):
            whole.index_copy_(2, pos[r], piece)
        errs.append(float((whole - full).abs().max()))
    want = ulysses_bytes(WORLD, u, b, h, hkv, s, d, q.dtype)
    return dict(case=(u, layout, causal, h, hkv, s, dropout_p), errs=errs, sent=dict(stats.sent),
                received=dict(stats.received), want=want)


def _job():
    results = []
    for ring_n, u in SPLITS:
        for layout in ("contiguous", "zigzag"):
            for causal in (False, True):
                results.append(_case(u, layout, causal, 8, 4, 8 * ring_n * u))
            results.append(_case(u, layout, True, 8, 4, 8 * WORLD, dropout_p=0.3))
        results.append(_case(u, "zigzag", True, 4, 4, 6 * WORLD))  # a ring shard slice across both pieces
        results.append(_case(u, "zigzag", True, 8, 4, 8 * WORLD, documents=True))  # packed documents
    return results


@pytest.fixture(scope="module")
def hybrid_results():
    return run_workers(_job, WORLD, timeout_s=300, preload=())


def test_ulysses_hybrid_and_ring_attention_equal_dense_attention(hybrid_results):
    """Forward and every input gradient in float64, for pure Ulysses (U=4), hybrid (R=2 × U=2) and the ring
    alone, both layouts, causal or not, grouped-query heads, with attention dropout drawn by dense position."""
    for worker in hybrid_results:
        for r in worker:
            assert max(r["errs"]) <= 1e-10, (r["case"], r["errs"])


def test_ulysses_moves_the_bytes_its_formula_says(hybrid_results):
    for worker in hybrid_results:
        for r in worker:
            assert r["sent"] == r["want"] and r["received"] == r["want"], (r["case"], r["sent"], r["want"])


@pytest.mark.parametrize("rank, ulysses, layout, want", [
    (0, 2, "contiguous", [0, 1, 2]), (1, 2, "contiguous", [3, 4, 5]), (3, 2, "contiguous", [9, 10, 11]),
    (0, 2, "zigzag", [0, 1, 2]), (1, 2, "zigzag", [9, 10, 11]), (2, 2, "zigzag", [3, 4, 5]),
    (1, 4, "zigzag", [3, 4, 5]), (2, 1, "contiguous", [6, 7, 8]),
])
def test_hybrid_positions_cut_each_ring_shard_in_ulysses_order(rank, ulysses, layout, want):
    assert hybrid_positions(12, rank, 4, ulysses, layout) == want


def _job_file(tmp_path, name, arch="gpt2", **sections):
    model = {"arch": arch, "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2,
             **({"heads": 8, "kv_heads": 4, "intermediate_size": 48} if arch == "llama" else {})}
    cfg = {"model": model, "data": {"source": "synthetic", "batch_size": 4},
           "train": {"steps": 3, "dtype": "float64", "out_dir": str(tmp_path / name), "timeout_s": 60,
                     "job_timeout_s": 240},
           "checkpoint": {"enabled": False}}
    for key, fields in sections.items():
        cfg.setdefault(key, {}).update(fields)
    return cfg


@pytest.mark.parametrize("arch, parallel, sequence", [
    ("gpt2", {"sp": 4}, {"ulysses": 2, "layout": "zigzag"}),
    ("gpt2", {"sp": 2}, {"ulysses": 2, "layout": "contiguous"}),
    ("llama", {"sp": 2, "tp": 4}, {"ulysses": 2, "layout": "zigzag"}),
    ("gpt2", {"sp": 2, "pp": 2}, {"ulysses": 2, "layout": "zigzag", "pipeline": {"schedule": "1f1b", "microbatches": 2},
                                  "model": {"dropout": 0.1, "attention_dropout": 0.1}}),
    ("gpt2", {"sp": 2, "dp": 2}, {"ulysses": 2, "layout": "zigzag",
                                  "hetero": {"enabled": True, "chunk_elems": 4096, "device_budget_bytes": 200000}}),
], ids=["gpt2-hybrid-2x2-zigzag", "gpt2-pure-ulysses", "llama-gqa-ulysses-2d-tp4", "gpt2-1f1b-ulysses-dropout",
        "gpt2-hetero-zero-ulysses"])
def test_training_under_ulysses_equals_one_process(tmp_path, arch, parallel, sequence):
    """float64, 3 AdamW steps: every loss within 1e-10 of the same job at sp = 1."""
    from parallel4d import launch

    sequence = dict(sequence)
    others = {k: sequence.pop(k) for k in ("pipeline", "model", "hetero") if k in sequence}
    one = launch(_job_file(tmp_path, "one", arch, **others))
    many = launch(_job_file(tmp_path, "many", arch, parallel=parallel, sequence=sequence, **others))
    assert len(many["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(one["losses"], many["losses"])) <= 1e-10, (one["losses"], many["losses"])
