"""The executor against the single-process dense GPT (float64): loss, every gradient,
peak stored activations = simulate's prediction (until W when the backward is split), tied
embeddings, and a hang → error. Every schedule, split or not, at pp=2 and pp=4."""

import time

import pytest
import torch

from conftest import run_workers
from parallel4d.models.gpt2.model import GPTShape, build_gpt
from parallel4d.models.stages import cross_entropy
from parallel4d.pipeline import make_schedule, simulate
from parallel4d.pipeline.executor import PipelineExecutor, TiedGradSync
from parallel4d.pipeline.partition import build_chunks, parameter_costs, partition
from parallel4d.launcher.supervise import WorkerError

VOCAB, SEQ, HIDDEN = 16, 4, 8


def _shape(layers, tie):
    return GPTShape(vocab_size=VOCAB, seq_len=SEQ, hidden=HIDDEN, heads=2, layers=layers, tie_embeddings=tie)


def _batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _reference(layers, tie, tokens, targets):
    model = build_gpt(_shape(layers, tie), seed=0).double()
    loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _worker(pp, dp, cases):
    from parallel4d.distributed.mesh import init_mesh

    mesh = init_mesh(pp=pp, dp=dp)
    me = mesh.rank("pp")
    out = []
    for (name, kw, layers, tie, m, batch) in cases:
        model = build_gpt(_shape(layers, tie), seed=0).double()
        stages = model.stages()
        sched = make_schedule(name, pp, m, **kw)
        ranges = partition(parameter_costs(stages), sched.num_chunks)
        chunks = build_chunks(stages, ranges, sched.placement[me])
        tokens, targets = _batch(batch)
        rows = batch // dp
        d = mesh.rank("dp")
        tokens, targets = tokens[d * rows:(d + 1) * rows], targets[d * rows:(d + 1) * rows]
        ex = PipelineExecutor(sched, mesh, chunks, cross_entropy, (rows // m, SEQ, HIDDEN), torch.float64,
                              timeout_s=120)
        res = ex.step(list(tokens.chunk(m)), list(targets.chunk(m)))
        if tie:
            sync = TiedGradSync(mesh, sched)
            owns_tied = me in (sched.owner(0), sched.owner(sched.num_chunks - 1))
            sync([model.embed.tok.weight] if owns_tied else [])
        mine = {id(p) for c in chunks.values() for p in c.parameters()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if id(p) in mine}
        out.append(dict(loss=res.loss, peak=res.peak_activations, peak_mb=res.peak_microbatches,
                        sim=simulate(sched), grads=grads, dp=d, pp=me, trace_len=len(res.trace),
                        tied_active=tie and sync.active))
    return out


def _check(results, cases, dp=1):
    for k, (name, kw, layers, tie, m, batch) in enumerate(cases):
        per_rank = [r[k] for r in results]
        rows = batch // dp
        all_names = None
        for d in range(dp):
            tokens, targets = _batch(batch)
            ref_loss, ref_grads = _reference(layers, tie, tokens[d * rows:(d + 1) * rows],
                                             targets[d * rows:(d + 1) * rows])
            all_names = set(ref_grads)
            seen = set()
            for r in per_rank:
                if r["dp"] != d:
                    continue
                assert abs(r["loss"] - ref_loss) < 1e-10, (name, kw, r["loss"], ref_loss)
                assert r["peak"] == r["sim"].peak_activations[r["pp"]], (name, kw, r["pp"])
                assert r["peak_mb"] == r["sim"].peak_microbatches[r["pp"]]
                for n, g in r["grads"].items():
                    torch.testing.assert_close(g, ref_grads[n], atol=1e-10, rtol=1e-10, msg=f"{name} {kw} {n}")
                    seen.add(n)
            assert seen == all_names, (name, kw, all_names - seen)


PP2_CASES = [
    ("gpipe", {}, 2, True, 4, 8),                           # tied embedding across ranks 0 and 1
    ("1f1b", {}, 3, False, 4, 8),
    ("interleaved", {"chunks_per_rank": 2}, 2, True, 4, 8),
    ("hanayo", {"waves": 1}, 2, True, 4, 8),                # tied, both ends on rank 0
    ("hanayo", {"waves": 2}, 6, False, 3, 6),
    # split backward: B sends the input gradient, W (later) the weight gradients
    ("zb_h1", {}, 3, True, 4, 8),                           # tied across ranks 0 and 1
    ("hanayo", {"waves": 1, "split_backward": True}, 2, True, 4, 8),
]
PP4_CASES = [
    ("hanayo", {"waves": 2}, 14, True, 8, 8),
    ("interleaved", {"chunks_per_rank": 2}, 6, True, 4, 8),
    ("zbv", {}, 6, True, 8, 8),
    ("zb_h1", {}, 3, False, 6, 6),
    ("hanayo", {"waves": 2, "split_backward": True}, 14, False, 8, 8),
]


def test_every_schedule_pp2_matches_dense():
    results = run_workers(_worker, 2, 2, 1, PP2_CASES, timeout_s=300, preload=())
    _check(results, PP2_CASES)
    # Tied weights: summed between ranks 0/1 except under Hanayo (local sharing).
    assert [results[0][k]["tied_active"] for k in range(len(PP2_CASES))] == [True, False, True, False, False, True, False]


def test_every_schedule_pp4_matches_dense():
    results = run_workers(_worker, 4, 4, 1, PP4_CASES, timeout_s=300, preload=())
    _check(results, PP4_CASES)


def test_pp2_dp2_peers_resolved_through_the_mesh():
    cases = [("hanayo", {"waves": 1}, 2, True, 2, 8), ("1f1b", {}, 2, True, 2, 8)]
    results = run_workers(_worker, 4, 2, 2, cases, timeout_s=300, preload=())
    _check(results, cases, dp=2)


def _mismatch_worker():
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.pipeline import gpipe

    mesh = init_mesh(pp=2)
    me = mesh.rank("pp")
    # Rank 1 believes there is only one micro-batch: rank 0 waits forever for mb 1's gradient.
    sched = gpipe(2, 2 if me == 0 else 1)
    model = build_gpt(_shape(2, False), seed=0).double()
    stages = model.stages()
    chunks = build_chunks(stages, partition(parameter_costs(stages), 2), sched.placement[me])
    m = sched.microbatches
    tokens, targets = _batch(2 * m)  # micro-batches of 2 rows on both ranks: same message shapes

    class Unchecked(PipelineExecutor):  # skip the up-front fingerprint comparison to reach the p2p timeout
        def _check_same_schedule(self):
            pass

    ex = Unchecked(sched, mesh, chunks, cross_entropy, (2, SEQ, HIDDEN), torch.float64, timeout_s=3.0)
    t0 = time.monotonic()
    try:
        ex.step(list(tokens.chunk(m)), list(targets.chunk(m)))
    except Exception as e:  # returned, not raised: which rank the spawner reports first is not our concern
        return type(e).__name__, str(e), time.monotonic() - t0
    return "finished", "", time.monotonic() - t0


def test_mismatched_schedule_times_out_naming_rank_and_action():
    (kind0, msg0, dt0), (kind1, msg1, dt1) = run_workers(_mismatch_worker, 2, timeout_s=120, preload=())
    # Rank 0 stalls on mb 1's gradient and says so within its 3 s limit, instead of hanging.
    assert kind0 == "CommTimeout", (kind0, msg0)
    assert "pp rank 0 (global rank 0) at action #3 B(mb=1, chunk=0)" in msg0
    assert "gradient of B(mb=1, chunk=1) [backward] from pp rank 1" in msg0
    assert dt0 < 3.0 + 1.5
    # Rank 1 finished its own actions; it fails (no hang) in the final loss broadcast.
    assert kind1 != "finished" and ("loss broadcast" in msg1 or "Connection closed" in msg1), (kind1, msg1)


def _consistency_worker():
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.pipeline import gpipe, one_f_one_b

    mesh = init_mesh(pp=2)
    me = mesh.rank("pp")
    sched = gpipe(2, 2) if me == 0 else one_f_one_b(2, 2)
    chunks = {me: torch.nn.Identity()}
    PipelineExecutor(sched, mesh, chunks, cross_entropy, (1, SEQ, HIDDEN), torch.float64, timeout_s=30)


def test_different_schedules_are_caught_up_front():
    with pytest.raises(WorkerError, match="pp ranks run different schedules"):
        run_workers(_consistency_worker, 2, timeout_s=120, preload=())

