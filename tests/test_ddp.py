"""Data-parallel gradients overlap the backward (issue #13.7): parallel4d.ddp.GradBuckets.

Each job trains 2 steps twice on the same mesh, in float64: with the buckets (small,
so there are several) and with the single all-reduce after the backward that they
replaced (``engine.average_gradients``). Parameters and losses must be equal bit for
bit; the buckets must be on the mesh's device (tests/device_audit.py); the bytes
counted under ``dp_grad`` per step must be the gradient bytes, as before; and in
every step the first bucket must be posted before the backward reaches the first
layer (the embedding's gradient hooks, the last of the backward).
"""

from __future__ import annotations

import torch

from conftest import run_workers

BUCKET_MB = 0.02  # 20 KiB: a tiny layer per bucket, several buckets


def job(**over):
    cfg = {
        "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
        "data": {"source": "synthetic", "batch_size": 8},
        "train": {"steps": 2, "dtype": "float64", "timeout_s": 60, "dp_bucket_mb": BUCKET_MB},
        "checkpoint": {"enabled": False},
    }
    for section, values in over.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


class SingleAllReduce:
    """Today's path before the buckets: one all-reduce of every grad after the backward."""

    def __init__(self, engine):
        self.engine = engine

    def start(self):
        pass

    def finish(self):
        from parallel4d.engine.grads import average_gradients

        average_gradients(self.engine.params, self.engine.mesh, self.engine.cfg.train.timeout_s,
                          getattr(self.engine.store, "experts", None))


class Events:
    """Order of the package's all-reduces (``comm.all_reduce``, which hands them to
    ``dist.all_reduce``) and of the embedding's gradient hooks, one list per step."""

    def __init__(self, engine):
        from parallel4d.distributed import comm

        self.steps: list[list[str]] = []
        self.loss_tensors: list[torch.Tensor] = []  # what the loss all-reduces were given
        self._real = comm.all_reduce
        for p in engine.model.embed.parameters():
            p.register_post_accumulate_grad_hook(lambda _: self.steps[-1].append("embed grad"))

        def recorded(*args, **kwargs):
            self.steps[-1].append(f"all_reduce {kwargs.get('label')}")
            if kwargs.get("label") == "loss":
                self.loss_tensors.append(args[0])
            return self._real(*args, **kwargs)

        comm.all_reduce = recorded

    def close(self):
        from parallel4d.distributed import comm

        comm.all_reduce = self._real


def _train(cfg_dict, buckets: bool):
    from parallel4d.config.schema import Config
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    cfg = Config.model_validate(cfg_dict)
    p = cfg.parallel
    mesh = init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=cfg.train.timeout_s)
    engine = compose(cfg, mesh)
    out = {"buckets": len(engine.store.grad_sync.buckets), "posted_in_backward": []}
    if not buckets:
        engine.store.grad_sync.remove()
        engine.store.grad_sync = SingleAllReduce(engine)
    events = Events(engine) if buckets and "embed" in dict(engine.model.named_children()) else None
    data, losses, sent = build_dataset(cfg), [], []
    for step in range(cfg.train.steps):
        before = mesh.comm_stats.sent["dp_grad"]
        if events is not None:
            events.steps.append([])
        losses.append(engine.train_step(*data.batch(step)))
        sent.append(mesh.comm_stats.sent["dp_grad"] - before)
        if buckets:
            out["posted_in_backward"].append(engine.store.grad_sync.posted_in_backward)
    if events is not None:
        events.close()
        out["events"] = events.steps
        out["returns_the_reduced_tensor"] = [any(t is loss for t in events.loss_tensors) for loss in losses]
        out["still_held_by_comm_thread"] = _losses_still_held(engine, 200)
    experts = {id(q) for q in engine.store.experts.params} if getattr(engine.store, "experts", None) else set()
    grad_bytes = sum(q.numel() * q.element_size() for q in engine.params if id(q) not in experts)  # under dp_grad
    out.update(losses=losses, sent=sent, grad_bytes=grad_bytes,
               params={n: q.detach().clone() for n, q in engine.model.named_parameters()})
    return out


def _losses_still_held(engine, n: int) -> int:
    """Of ``n`` loss all-reduces, how many return while gloo's worker thread still holds the tensor
    (its C++ use count above the Python object's one)."""
    held = 0
    for _ in range(n):
        loss = engine.mean_over_replicas(torch.ones(1, device=engine.mesh.device), "loss")
        held += loss._use_count() > 1
    return held


def _run_both(cfg_dicts):
    """Per config: the bucketed run under the device audit (no collective gets a host tensor),
    then the reference run."""
    from device_audit import DeviceAudit

    out = []
    for c in cfg_dicts:
        audit = DeviceAudit()
        with audit:
            new = _train(c, True)
        new["host_tensors"] = sorted(set(audit.violations))
        out.append((new, _train(c, False)))
    return out


def _check_same(pairs):
    for rank, (new, old) in enumerate(pairs):
        assert new["losses"] == old["losses"], rank
        for name, a in old["params"].items():
            assert torch.equal(new["params"][name], a), (rank, name)
        assert not new["host_tensors"], new["host_tensors"]
        assert new["sent"] == old["sent"] == [new["grad_bytes"]] * 2, (rank, new["sent"], old["sent"])


# experts split over ep = dp = 2: their gradients summed over their replicas (ep_grad), the rest under dp_grad
EXPERTS = job(parallel={"dp": 2, "ep": 2}, model={"arch": "llama", "num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 16, "output_router_logits": True})


def test_buckets_overlap_backward_and_match_single_all_reduce():
    """dp = 2, pp = 1, without and with gradient accumulation over 2 micro-batches; and an MoE model with its
    experts split over ep = 2 (the single all-reduce then sums them over their replicas)."""
    jobs = [job(parallel={"dp": 2}, pipeline={"microbatches": m}) for m in (1, 2)]
    per_rank = run_workers(_run_both, 2, [*jobs, EXPERTS], timeout_s=120)
    _check_same([pair for rank in per_rank for pair in rank])
    pairs = [pair for rank in per_rank for pair in rank[:len(jobs)]]
    for new, _ in pairs:
        assert new["buckets"] >= 4
        # Every bucket but the embedding's own is posted from a hook, during the backward.
        assert new["posted_in_backward"][0] >= new["buckets"] - 2, new
        for log in new["events"]:
            first_reduce = log.index("all_reduce dp_grad")
            last_embed = len(log) - 1 - log[::-1].index("embed grad")
            assert first_reduce < last_embed, log
        # The step returns the very tensor the loss all-reduce was given, and only once gloo's worker
        # thread has let go of it: were the thread's drop the last but the Python object's, it would
        # need the GIL, and a script exiting right after its last step aborted.
        assert new["returns_the_reduced_tensor"] == [True, True], new["returns_the_reduced_tensor"]
        assert new["still_held_by_comm_thread"] == 0, new["still_held_by_comm_thread"]


def test_buckets_under_the_pipeline_with_tied_weights():
    """pp = 2 × dp = 2, 2 micro-batches. 1F1B: the embedding and the LM head are tied copies on
    two pp ranks, summed over pp after the backward, so their bucket waits for that. Hanayo
    (1 wave): both sit on pp rank 0 as one parameter, whose bucket waits for both chunks'
    backwards of every micro-batch."""
    jobs = [job(parallel={"pp": 2, "dp": 2}, pipeline={"microbatches": 2, "schedule": schedule, "waves": 1})
            for schedule in ("1f1b", "hanayo")]
    per_rank = run_workers(_run_both, 4, jobs, timeout_s=120)
    pairs = [pair for rank in per_rank for pair in rank]
    _check_same(pairs)
    for new, _ in pairs:
        assert new["posted_in_backward"][0] >= 1, new


def test_bucket_size_is_a_positive_finite_number():
    from parallel4d.config.errors import ConfigError
    from parallel4d.config.schema import Config

    assert Config().train.dp_bucket_mb == 25
    for bad in (0, -1.0, float("inf"), float("nan"), "25", True):
        try:
            Config.model_validate({"train": {"dp_bucket_mb": bad}})
        except (ValueError, ConfigError):
            continue
        raise AssertionError(f"train.dp_bucket_mb={bad!r} was accepted")


class _FakeWork:
    def wait(self, timeout=None):
        return True


def test_grads_are_views_of_the_buckets_no_copy_in_or_out(monkeypatch):
    """#28: each bucket copied every gradient in before its all-reduce and out after it. Now every
    ``.grad`` is a view of its bucket, which the all-reduce sums in place: the step's backward and
    reduction launch no copy_ (nor cat), and the averaged grads are the plain backward's. One
    process: two replicas faked by an all-reduce that doubles the buffer in place."""
    import types

    from op_count import CountOps
    from parallel4d.distributed import comm
    from parallel4d.distributed.ddp import GradBuckets

    reduced = []

    def all_reduce(t, group=None, **kwargs):
        reduced.append(t)
        t.mul_(2)  # two replicas holding the same gradient
        return _FakeWork()

    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, dtype=torch.float64) for _ in range(4)])
    params = list(model.parameters())
    mesh = types.SimpleNamespace(size=lambda axis: 2 if axis == "dp" else 1, device=torch.device("cpu"),
                                 group_over=lambda *axes: None, comm_stats=None, deadlines=None)
    sync = GradBuckets(params, mesh, bucket_bytes=2 * 16 * 16 * 8, timeout_s=10.0, expected={id(p): 2 for p in params})
    assert len(sync.buckets) >= 2
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    ref = torch.autograd.grad(sum(model(xm).sum() for xm in x), params)
    for step in range(2):  # the second after zero_grad(set_to_none): the views come back
        reduced.clear()
        sync.start()
        with CountOps() as ops:
            for xm in x:  # two micro-batches accumulate into the views
                model(xm).sum().backward()
            sync.finish()
        assert ops.ops["aten.copy_.default"] == 0 and ops.ops["aten.cat.default"] == 0, ops.ops
        assert sync.posted_in_backward == len(sync.buckets)
        assert [t.data_ptr() for t in reduced] == [b.flat.data_ptr() for b in sync.buckets]  # whole buffers
        for b in sync.buckets:
            for p in b.params:
                assert p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
        for p, g in zip(params, ref):
            assert torch.equal(p.grad, g)
        for p in params:
            p.grad = None
    sync.remove()


def test_the_single_all_reduce_reference_sums_expert_grads_over_their_replicas_only(monkeypatch):
    """Under expert parallelism (ep=2 of dp·sp = 4) an expert's gradient already holds its ep group's tokens:
    the reference all-reduce (``average_gradients``) sums it over the ranks holding the same experts (2),
    not over all dp·sp (which would add other experts' gradients), divided by dp·sp as the dense ones
    and as the buckets do. One process: each group's all-reduce faked as its ranks holding the same gradient."""
    import types

    from parallel4d.distributed import comm
    from parallel4d.engine.experts import ExpertShards
    from parallel4d.engine.grads import average_gradients

    ranks = {"dp·sp": 4, "expert replicas": 2, "ep": 2}
    reduced = []

    def all_reduce(t, group=None, **kwargs):
        reduced.append((group, kwargs.get("label")))
        t.mul_(ranks[group])
        return _FakeWork()

    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    monkeypatch.setattr(comm, "wait", lambda work, *args, **kwargs: work.wait())
    dense, expert = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 3))
    dense.grad, expert.grad = torch.full((3,), 2.0), torch.full((2, 3), 2.0)
    mesh = types.SimpleNamespace(size=lambda axis: {"dp": 2, "sp": 2}.get(axis, 1), group_over=lambda *axes: "dp·sp",
                                 comm_stats=None, deadlines=None)
    average_gradients([dense, expert], mesh, 10.0, ExpertShards("ep", "expert replicas", [expert]))
    assert torch.equal(dense.grad, torch.full((3,), 2.0))  # 4 equal replicas ÷ 4
    assert torch.equal(expert.grad, torch.full((2, 3), 1.0))  # 2 equal replicas ÷ 4
    assert sorted(reduced) == [("dp·sp", "dp_grad"), ("expert replicas", "ep_grad")]
