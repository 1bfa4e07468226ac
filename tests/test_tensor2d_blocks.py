"""``benchmarks/tensor2d.py --blocks`` (#47.3) on the CPU at a tiny block: the GPU figure's code path —
every rank of a q×q grid built in one process (``tensor2d.emulate.LocalRank``) running its own 2D Llama
block forward and backward, against the dense block.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tensor2d as bench  # noqa: E402  benchmarks/tensor2d.py

from parallel4d.tensor2d.emulate import LocalRank, grid_ranks  # noqa: E402


def test_every_ranks_block_on_one_device_does_the_dense_blocks_work(tmp_path):
    """The q² ranks' FLOPs (counted by torch over one step) sum to the dense block's at q = 2 and 4: every
    rank ran every product; the efficiency per FLOP is the dense time over the grid's; the JSON says so."""
    out = tmp_path / "blocks.json"
    res = bench.main(["--blocks", "--quick", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(res["results"]))
    dense = res["results"]["dense"]
    assert dense["flops"] > 0
    for q in (2, 4):
        r = res["results"][f"q{q}"]
        assert r["ranks"] == q * q and r["flops"] == dense["flops"], (q, r["flops"], dense["flops"])
        assert r["efficiency_per_flop"] == pytest.approx(dense["rounds_s"][0] / r["rounds_s"][0])  # one round
    assert res["target_efficiency_q2"] == 0.85 and res["block"] == vars(bench.TINY_BLOCK)


def test_an_emulated_grid_at_q1_is_the_dense_block():
    """With one rank the emulation has no stand-ins: its block is the dense block, bit for bit."""
    dense = bench.llama_block(bench.TINY_BLOCK, "cpu", torch.float32)
    x = torch.randn(2, bench.TINY_BLOCK.seq, bench.TINY_BLOCK.hidden)
    (rank,) = grid_ranks(1)
    block = bench.LlamaBlock2D.from_dense(dense, rank, name="block")
    torch.testing.assert_close(block(x), dense(x), rtol=0, atol=0)


def test_an_emulated_fp8_grid_at_q1_is_the_dense_fp8_block():
    """train.fp8 on one rank: the 2D block's Linear2D layers in FP8 (SUMMA's panels) compute the dense block's
    RowwiseLinear products: the forward bit for bit, the input's gradient to float32's reordering (the 2D
    block sums its branches' gradients in another order)."""
    from parallel4d.models.fp8 import use_fp8

    dense = bench.llama_block(bench.TINY_BLOCK, "cpu", torch.float32)
    (rank,) = grid_ranks(1)
    block = bench.LlamaBlock2D.from_dense(dense, rank, name="block")
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([block])
    changed = use_fp8(holder)
    dense_holder = torch.nn.Module()
    dense_holder.blocks = torch.nn.ModuleList([dense])
    assert len(use_fp8(dense_holder)) == len(changed) == 7
    x = torch.randn(2, bench.TINY_BLOCK.seq, bench.TINY_BLOCK.hidden)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [block(xs[0]), dense(xs[1])]
    torch.testing.assert_close(ys[0], ys[1], rtol=0, atol=0)
    g = torch.randn_like(ys[0])
    for y in ys:
        y.backward(g)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)


def test_an_emulated_rank_counts_the_bytes_a_grid_rank_sends():
    """Its stand-in collectives count as comm does: rank (0, 1) of a 2×2 grid, one 2D layer forward."""
    from parallel4d.tensor2d import Linear2D
    mesh = LocalRank(2, 0, 1)
    lin = Linear2D(8, 6, mesh, bias=False, name="lin")
    x = torch.randn(3, 4)  # [tokens/q, in/q]
    lin(x)
    st, e = mesh.comm_stats, 4
    # summa_ab: my A block is sent once (step j = 1), received once (step 0); B likewise along the column (i = 0)
    assert (st.sent["lin:summa_ab/bcast_a"], st.received["lin:summa_ab/bcast_a"]) == (x.numel() * e, x.numel() * e)
    assert (st.sent["lin:summa_ab/bcast_b"], st.received["lin:summa_ab/bcast_b"]) == (12 * e, 12 * e)


def test_a_rank_outside_its_grid_is_refused():
    with pytest.raises(ValueError, match=r"grid rank \(2, 0\) is outside a 2x2 grid"):
        LocalRank(2, 2, 0)
