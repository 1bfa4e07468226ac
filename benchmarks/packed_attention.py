"""Ring attention over packed documents: the block work falls as documents shorten.

For a ring of N ranks (zigzag and contiguous layouts, causal) over one sequence of s tokens packed with
documents of equal length ℓ (s, s/4, s/16, s/64), the script runs on one device every rank's block calls
and merges of a ring forward (``parallel4d.sequence.emulate.ring_forward`` with the documents: exactly
the calls the ranks run, the same host-side skipping of block pairs that share no document) and reports:

* ``work``: the query×key elements of the calls that run, as a fraction of the ring without documents
  (the packed ring's cost of a block pair is its whole block: it skips whole pairs, masks inside);
* ``needed``: the pairs a query may attend (same document, key ≤ query), the floor a varlen kernel
  reaches, as the same fraction;
* ``time``: the forward's wall time relative to the one-document sequence, math kernel both ways (the
  kernel every packed ring runs);
* ``error``: the max difference from attention over the whole sequence under the block-diagonal mask.

CPU by default (float32; the figures are the block arithmetic's, not a GPU's); ``--quick``: s = 1024.
Prints a table; writes JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.nn.functional as F

from parallel4d.sequence.documents import Documents
from parallel4d.sequence.emulate import ring_forward, ring_work, shard, unshard
from report import RESULTS, save
from sequence import timed


def packed(batch: int, seq: int, length: int, device) -> Documents:
    """Documents of ``length`` tokens end to end in every row."""
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[:, ::length] = True
    return Documents.from_starts(starts, device)


def case(n: int, layout: str, length: int, q, k, v, one_doc_ms: dict, args) -> dict:
    b, s = q.shape[0], q.shape[2]
    docs, whole = packed(b, s, length, q.device), packed(b, s, s, q.device)
    qs, ks, vs = (shard(x, n, layout) for x in (q, k, v))
    L = s // n
    plain = ring_work(n, layout, True, L)

    def run(d):
        return ring_forward(qs, ks, vs, layout, True, documents=d)

    key = (n, layout)
    if key not in one_doc_ms:
        one_doc_ms[key] = timed(lambda: run(whole), q.device, args.iters, 1, min_time_s=args.min_time)
    ms = one_doc_ms[key] if length == s else timed(lambda: run(docs), q.device, args.iters, 1, min_time_s=args.min_time)
    out = unshard(run(docs)[0], layout)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask(True)[:, None])
    needed = int(docs.mask(True)[0].sum())
    return {"ranks": n, "layout": layout, "document_length": length, "work": ring_work(n, layout, True, L, docs) / plain,
            "needed": needed / plain, "time_ms": ms,
            "time_vs_one_document": ms / one_doc_ms[key], "error": float((out - ref).abs().max())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="s = 1024")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds each figure is timed for at least")
    ap.add_argument("--out", default=os.path.join(RESULTS, "packed_attention.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.seq = 1024
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim, generator=g) for _ in range(3))
    one_doc: dict = {}
    rows = [case(n, layout, args.seq // div, q, k, v, one_doc, args)
            for n in (4, 8) for layout in ("zigzag", "contiguous") for div in (1, 4, 16, 64)]
    print(f"ring forward over packed documents, causal, s={args.seq}, {args.heads} heads × {args.head_dim}, "
          f"float32 on {platform.machine()} CPU (all ranks' block calls in one process, math kernel)")
    print(f"{'N':>2} {'layout':>10} {'doc len':>7} | {'work':>6} {'needed':>6} | {'time':>6} {'max err':>8}")
    for r in rows:
        print(f"{r['ranks']:>2} {r['layout']:>10} {r['document_length']:>7} | {r['work']:>6.3f} {r['needed']:>6.3f} | "
              f"{r['time_vs_one_document']:>6.3f} {r['error']:>8.1e}")
    return save(args.out, "packed_attention", f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
                vars(args), rows=rows)


if __name__ == "__main__":
    main()
