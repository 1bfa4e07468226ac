"""Gradient norm and clipping equal the dense ones (issue #13, point 5).

One 4-worker job (one start-up: the suite runs on 2 cores) builds four layouts in turn and
takes one clipped training step in each (float64, ``train.grad_clip`` small enough that
clipping really scales):

* ``tp``: 2D tensor parallel q=2 (tp=4): a parameter replicated over the grid rows counts
  once, shards on different grid ranks are summed;
* ``sp``: ring attention sp=2 × dp=2: parameters replicated over sp, gradients averaged
  over dp·sp, nothing summed over the replicas;
* ``pp``: 1F1B pp=2 × dp=2 with the embedding and the tied LM head on two pp ranks: each
  copy of the table counts half;
* ``hetero``: hetero's chunked ZeRO (``hetero.enabled``: its gradients live in chunks and the
  clip coefficient is applied inside ``HeteroOptimizer.step``) over dp=2 with sp=2 (ZeRO shards over
  the dp·sp replicas), under 2D tp=4, and under Hanayo pp=2 × dp=2: hetero's squared norm, weighted
  as the dense path weighs it, summed over tp and pp.

Each is compared with the single-process dense GPT built from the same seed on the same
batch: the norm ``Engine.train_step`` measured (``last_grad_norm``) against
``torch.nn.utils.clip_grad_norm_``, the clipped gradients the optimizer
sees (not under hetero: its gradients live in chunks and are scaled inside ``step``), and
every parameter after the AdamW step, each to 1e-12 relative. Adam's first step is nearly
blind to a gradient's scale (≈ lr·sign(g) when eps ≪ |g|); eps=1e-6 keeps the parameters
sensitive to the clip coefficient, the only place hetero's applied clipping shows.
"""

import torch

from conftest import run_workers

CLIP = 0.05
RTOL = 1e-12

BASE = {
    "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2, "tie_embeddings": True},
    "data": {"batch_size": 8, "seed": 3},
    "train": {"seed": 5, "dtype": "float64", "grad_clip": CLIP, "timeout_s": 60.0},
    "optimizer": {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1},
    "checkpoint": {"enabled": False},
}
CASES = {
    "tp": {"parallel": {"tp": 4}},
    "sp": {"parallel": {"dp": 2, "sp": 2}},
    "pp": {"parallel": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    "hetero": {"parallel": {"dp": 2, "sp": 2}, "hetero": {"enabled": True}},
    "hetero-tp": {"parallel": {"tp": 4}, "hetero": {"enabled": True}},
    "hetero-pp": {"parallel": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "hanayo", "microbatches": 2},
                  "hetero": {"enabled": True}},
}


def config(case):
    from parallel4d.config.load import make_config

    return make_config({**BASE, **CASES[case]})


def _dense_view(model, grads: bool) -> dict:
    """This rank's parameters (or gradients) as dense tensors under dense names: 2D stages
    gathered over the grid (collective), others as they are."""
    from parallel4d.engine.model import PositionedEmbedding

    stages = [(n, m) for n, m in model.named_children() if n != "blocks"]
    stages += [(f"blocks.{k}", m) for k, m in model.blocks.items()]
    out = {}
    for prefix, stage in stages:
        if isinstance(stage, PositionedEmbedding):
            stage = stage.embed
        if hasattr(stage, "dense_grads"):
            tensors = stage.dense_grads() if grads else stage.dense_state_dict()
        else:
            tensors = {n: p.grad if grads else p.detach() for n, p in stage.named_parameters(remove_duplicate=False)}
        out.update({f"{prefix}.{n}": t.detach().clone().cpu() for n, t in tensors.items() if t is not None})
    return out


def _worker(cases):
    import parallel4d.engine.grads as grads_mod
    from parallel4d.engine.compose import compose
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh

    out = {}
    real_norm = grads_mod.global_grad_norm
    for case in cases:
        cfg = config(case)
        p = cfg.parallel
        mesh = init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=cfg.train.timeout_s)
        engine = compose(cfg, mesh)
        got = {"coords": mesh.coords, "norms": []}

        if not cfg.hetero.enabled:
            real_step = engine.optimizer.step

            def step(*args, real_step=real_step, engine=engine, got=got, **kwargs):
                got["clipped_grads"] = _dense_view(engine.model, grads=True)  # what the optimizer is given
                return real_step(*args, **kwargs)

            engine.optimizer.step = step
        norm_calls = []

        def norm(*args, **kwargs):
            n = real_norm(*args, **kwargs)
            norm_calls.append(float(n))
            return n

        grads_mod.global_grad_norm = norm
        try:
            tokens, targets = build_dataset(cfg).batch(0)
            got["loss"] = engine.train_step(tokens, targets)
        finally:
            grads_mod.global_grad_norm = real_norm
        got["norms"] = [engine.last_grad_norm]
        got["norm_calls"] = norm_calls  # the dense path's function: once, never under hetero
        if cfg.hetero.enabled:  # this rank's pieces of the dense parameters, from the checkpoint view
            got["pieces"] = {k[len("model."):]: [(off, view.clone()) for off, view in v.pieces]
                             for k, v in engine.state_dict().items() if k.startswith("model.")}
        else:
            got["params"] = _dense_view(engine.model, grads=False)
        out[case] = got
    return out


def dense_reference():
    """One clipped AdamW step of the dense single-process GPT on the same batch (the cases
    change only the layout sections, so this one serves them all)."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.model import model_shape, parameter_dtype
    from parallel4d.optim.optimizer import build_optimizer, lr_at
    from parallel4d.models.gpt2.model import build_gpt

    cfg = make_config(BASE)
    model = build_gpt(model_shape(cfg), seed=cfg.train.seed).to(parameter_dtype(cfg))
    tokens, targets = build_dataset(cfg).batch(0)
    loss = model(tokens, targets)
    loss.backward()
    params = list(model.parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip))
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    opt = build_optimizer(model.named_parameters(), cfg.optimizer)
    for group in opt.param_groups:
        group["lr"] = lr_at(0, cfg.optimizer, cfg.train.steps)
    opt.step()
    return {"loss": loss.item(), "norm": norm, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
            "names": {n for n, _ in model.named_parameters()}}


def _assert_tensors(got: dict, ref: dict, what: str) -> set:
    """Each tensor to RTOL relative (‖Δ‖ / ‖ref‖); returns the names compared."""
    for name, t in got.items():
        r = ref[name]
        assert t.shape == r.shape, (what, name, t.shape, r.shape)
        err = float((t - r).norm())
        assert err <= RTOL * float(r.norm()), f"{what} {name}: ‖Δ‖ = {err:.3e}, ‖ref‖ = {float(r.norm()):.3e}"
    return set(got)


def _assert_pieces(pieces: dict, ref: dict, what: str) -> set:
    """Each piece (offsets in the dense tensor, values) equals the dense tensor's box there, to RTOL
    of the whole dense tensor's norm (the key-bias rows of a fused qkv bias are rounding noise alone:
    their gradient is zero in exact arithmetic)."""
    for name, boxes in pieces.items():
        for off, view in boxes:
            box = ref[name][tuple(slice(o, o + n) for o, n in zip(off, view.shape))]
            err = float((view - box).norm())
            assert err <= RTOL * float(ref[name].norm()), f"{what} {name} at {list(off)}: ‖Δ‖ = {err:.3e}"
    return set(pieces)


def _check(case, per_rank, ref):
    assert ref["norm"] > 2 * CLIP, f"{case}: the dense norm {ref['norm']} barely clips; lower CLIP"
    seen_grads, seen_params = set(), set()
    for rank, r in enumerate(per_rank):
        got = r[case]
        assert abs(got["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (case, rank, got["loss"], ref["loss"])
        assert got["norm_calls"] == ([] if "hetero" in case else got["norms"]), (case, rank, got["norm_calls"])
        norm = got["norms"][0]
        assert abs(norm - ref["norm"]) <= RTOL * ref["norm"], \
            f"{case} rank {rank}: norm {norm!r} != dense {ref['norm']!r} (rel {abs(norm / ref['norm'] - 1):.3e})"
        if "clipped_grads" in got:
            seen_grads |= _assert_tensors(got["clipped_grads"], ref["grads"], f"{case} rank {rank} clipped grad")
        if "pieces" in got:
            seen_params |= _assert_pieces(got["pieces"], ref["params"], f"{case} rank {rank} param")
        else:
            seen_params |= _assert_tensors(got["params"], ref["params"], f"{case} rank {rank} param")
    assert ref["names"] <= seen_params, (case, ref["names"] - seen_params)
    if "hetero" not in case:
        assert ref["names"] <= seen_grads, (case, ref["names"] - seen_grads)


def test_grad_norm_and_clipping_equal_dense():
    per_rank = run_workers(_worker, 4, list(CASES), timeout_s=300)
    for case in CASES:  # four distinct ranks in each layout
        assert len({tuple(r[case]["coords"].values()) for r in per_rank}) == 4, case
    assert all(set(CASES[c]) <= {"parallel", "pipeline", "hetero"} for c in CASES)  # one dense problem
    ref = dense_reference()
    for case in CASES:
        _check(case, per_rank, ref)


def _norm_with_grads(n: int, dtype) -> tuple[float, float, int]:
    """global_grad_norm over ``n`` parameters (every weight of norm_weight among them) on a one-rank
    fake mesh: (its value, the per-tensor float64 reference, aten kernels it launched)."""
    import types

    from op_count import CountOps
    from parallel4d.distributed import comm
    from parallel4d.engine.grads import global_grad_norm, norm_weight

    g = torch.Generator().manual_seed(n)
    params = []
    for i in range(n):
        p = torch.nn.Parameter(torch.empty(3 + i % 5, 4, dtype=dtype))
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
        if i % 3 == 1:
            p.tensor2d_replicated_over = ("tp_row",)
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(2, dtype=dtype)))  # no gradient: left out
    tied = {id(params[2]), id(params[5])}
    mesh = types.SimpleNamespace(size=lambda axis: 2 if axis == "tp_row" else 1, device=torch.device("cpu"),
                                 group=lambda axis: None, comm_stats=None, deadlines=None)
    real = comm.group_size
    comm.group_size = lambda group: 1  # one rank: the sums over tp/pp are no-ops
    try:
        with CountOps() as ops:
            got = float(global_grad_norm(params, mesh, tied))
    finally:
        comm.group_size = real
    ref = sum(float(p.grad.double().pow(2).sum()) * norm_weight(p, 2, tied) for p in params if p.grad is not None)
    return got, ref ** 0.5, ops.kernels


def test_norm_launches_a_constant_number_of_kernels():
    """#28: one fp64 kernel chain per tensor was O(parameters) launches; foreach norms make it O(1)
    (per dtype and weight), and float64 stays exact to rounding, float32 to float32 accumulation."""
    few, many = _norm_with_grads(8, torch.float64), _norm_with_grads(80, torch.float64)
    for got, ref, _ in (few, many):
        assert abs(got - ref) <= 1e-14 * ref, (got, ref)
    assert few[2] == many[2] <= 25, (few[2], many[2])
    got, ref, kernels = _norm_with_grads(40, torch.float32)
    assert abs(got - ref) <= 1e-6 * ref and kernels <= 25, (got, ref, kernels)
    got, ref, _ = _norm_with_grads(40, torch.bfloat16)  # accumulated in float32, not in bfloat16
    assert abs(got - ref) <= 1e-6 * ref, (got, ref)
