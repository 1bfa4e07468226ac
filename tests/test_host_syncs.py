"""No host sync in the step (#28.4): what makes the host wait for the GPU, counted per training step.

:class:`host_syncs.HostSyncs` counts, on CPU, every operation that would make a GPU's host wait
(value reads, blocking copies, synchronizations, object collectives), naming where each happened.
Through the training loop and the engine's own ``train_step``, per step:

* a step that neither logs, evaluates nor saves: none (the host runs ahead of the device);
* a log step (``train.log_every``), and the last: one — the losses since the last read, the gradient
  norm, float16's loss scale, every rank's peak memory and the stop signal, read back together;
* an evaluation step: one more (the validation loss); a checkpoint step: what the save needs
  (``parallel4d/checkpoint/``); a process's first step on several ranks: the gather of what each
  rank holds (summary.json's ``memory``);
* float16 with an optimizer that cannot skip a step on the device (``train.fused=off``/``apex``,
  hetero): one read of the overflow flag per step; with torch's fused AdamW, none;
* mixture of experts: the loop over experts (float32/64) reads its counts, expert parallelism its split
  sizes, once per MoE layer and forward each; under hetero one read per MoE layer and forward in every dtype
  (the experts that run, with the split sizes under ep);
* hetero: its gradient norm reads the gradient chunks that are off the device (under a budget, and
  most ZeRO shards) on the host (known, reported in #28); rows its optimizer updates on the host read
  the clipping coefficient once per step.

Each technique alone and all four together; single-process where the layout allows, else in the
suite's 16-worker job (tests/conftest.py ``sixteen_workers``). Where a GPU is, torch's own detector
(``torch.cuda.set_sync_debug_mode``) checks the engine's steps as well. docs/operations.md says the same.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from parallel4d.distributed.startup import visible_gpus

from host_syncs import HostSyncs, Sync

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 4},
        "data": {"source": "synthetic", "batch_size": 16}, "train": {"steps": 7, "log_every": 3, "timeout_s": 120},
        "optimizer": {"warmup_steps": 2}, "checkpoint": {"enabled": False}}

READ = ("tolist", "parallel4d/training/metrics.py")  # read_together: a read step's one read
VALIDATION = ("__float__", "parallel4d/training/loop.py")  # _validate: the validation loss
MEMORY = ("dist.all_gather_object", "parallel4d/training/metrics.py")  # first step: what each rank holds
OVERFLOW = ("__bool__", "parallel4d/engine/store.py")  # float16's flag, where the optimizer cannot skip
# mixture of experts: the loop over experts reads its row counts (float32 and float64, or where the grouped
# product is not there), and expert parallelism its all-to-all's split sizes, once per MoE layer and forward
LOOPED_COUNTS = ("tolist", "parallel4d/models/moe/routing.py")
EP_SPLITS = ("tolist", "parallel4d/experts/dispatch.py")
# under hetero the experts that run are decided on the host: the counts and their max over the data replicas,
# read by the dispatcher (with the split sizes under ep), once per MoE layer and forward, in every dtype
AGREED_COUNTS = EP_SPLITS
MOE = {"arch": "llama", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
       "output_router_logits": True}  # TINY's 4 layers all MoE layers
# hetero under a budget: grad_sq_norm drains the copy streams once and norms the gradients off the device
# on the host, one number then crossing to the device
HETERO_OFF_DEVICE_NORM = {("hetero Transfers.sync (copy streams)", "parallel4d/hetero/step.py"),
                          (".to(device) of a host tensor", "parallel4d/hetero/step.py")}


def job(**sections) -> dict:
    """TINY with ``sections``' fields (``{"train": {...}}``) over it."""
    cfg = {k: dict(v) for k, v in TINY.items()}
    for name, fields in sections.items():
        cfg.setdefault(name, {}).update(fields)
    return cfg


def unexpected(syncs: list[Sync], cfg, world: int, every_step=(), known=frozenset()) -> list[str]:
    """The syncs of ``cfg``'s steps beyond the documented minimum (module docstring), as text naming
    each; ``every_step``: (what, file) each step makes once more; ``known``: those allowed any number
    of times at every step."""
    t, ckpt = cfg.train, cfg.checkpoint
    wrong = []
    for n in range(1, t.steps + 1):
        got = [s for s in syncs if s.label == f"step {n}"]
        last = n == t.steps
        saving = ckpt.enabled and (last or bool(ckpt.every) and n % ckpt.every == 0)
        evaluated = t.eval_every is not None and (n % t.eval_every == 0 or last)
        want = list(every_step)
        want += [READ] if n % t.log_every == 0 or evaluated or saving or last else []
        want += [VALIDATION] if evaluated else []
        want += [MEMORY] if n == 1 and world > 1 else []
        for s in got:
            key = (s.what, s.site)
            if key in want:
                want.remove(key)
            elif not (key in known or (saving and s.site.startswith("parallel4d/checkpoint/"))):
                wrong.append(f"unexpected {s}")
        wrong += [f"step {n}: missing {w}" for w in want]
    return wrong


def counted_run(cfg: dict) -> tuple:
    """``cfg`` trained by the loop in a one-rank group in this process, its host syncs counted."""
    from conftest import run_in_this_process
    from parallel4d.config.load import make_config
    from parallel4d.engine.step import Engine

    with HostSyncs().watch_steps(Engine) as syncs:
        summary = run_in_this_process(cfg, [])
    assert summary["steps"] == cfg["train"]["steps"] and len(summary["losses"]) == cfg["train"]["steps"]
    return syncs.syncs, make_config(cfg)


# --- the counter can fail -------------------------------------------------------------------------

def test_the_counter_sees_each_kind_of_wait_and_where():
    """Reads of a device tensor, blocking copies either way, the patched synchronizations and a timed
    wait on a work are counted at their line here; host tensors, dtype changes and a non-blocking copy from
    page-locked memory are not."""
    from device_audit import MESH_DEVICE

    with HostSyncs() as counted:
        d, h = torch.ones(3, device=MESH_DEVICE), torch.ones(3)
        d.sum().item(), float(d[0]), int(d[0]), bool(d[0]), f"{d.sum():.3f}", d.tolist(), d.numpy()
        d.cpu(), d.to("cpu"), h.to(MESH_DEVICE), torch.tensor([1.0], device=MESH_DEVICE), d[d > 0]
        if not visible_gpus():  # patched: here they only record
            torch.cuda.synchronize(), torch.cuda.Event.synchronize(object()), torch.cuda.Stream.synchronize(object())
        line = 1 + __import__("inspect").currentframe().f_lineno
        if d[0]:
            pass
        h.sum().item(), float(h[0]), h.tolist(), d.to(torch.float64), d.double()
        h.pin_memory().to(MESH_DEVICE, non_blocking=True), torch.full((1,), 1.0, device=MESH_DEVICE)
        try:  # a work that never finishes, waited with a limit (on NCCL the host would poll it)
            torch.distributed.Work().wait(timeout=timedelta(milliseconds=1))
        except RuntimeError:
            pass
    whats = [s.what for s in counted.syncs]
    waits = [] if visible_gpus() else ["torch.cuda.synchronize", "Event.synchronize", "Stream.synchronize"]
    assert whats == ["item", "__float__", "__int__", "__bool__", "__format__", "tolist", "numpy", ".cpu(host)",
                     ".to(host)", ".to(device) of a host tensor", "torch.tensor(data, device=...)",
                     "boolean-mask index", *waits, "__bool__", "Work.wait(timeout)"], whats
    assert counted.syncs[-2].where == f"tests/test_host_syncs.py:{line}"


def test_a_planted_item_in_the_step_is_caught(single_rank, monkeypatch):
    """A ``.item()`` planted in the engine's gradient norm shows up once per step, at its line; without it
    the same steps have none."""
    from device_audit import MESH_DEVICE
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose
    from parallel4d.engine.step import Engine

    cfg = make_config(job(train={"grad_clip": 1.0}))
    real = Engine.grad_norm

    def planted(engine):
        norm = real(engine)
        norm.item()  # the planted host sync
        return norm

    counts = {}
    for name in ("clean", "planted"):
        if name == "planted":
            monkeypatch.setattr(Engine, "grad_norm", planted)
        with HostSyncs().watch_steps(Engine) as counted:
            engine = compose(cfg, init_mesh())
            assert engine.device == MESH_DEVICE
            data = build_dataset(cfg)
            losses = [engine.train_step(*data.batch(step)) for step in range(3)]
        assert all(isinstance(x, torch.Tensor) and x.shape == () for x in losses)
        counts[name] = [s for s in counted.syncs if s.label != "start"]
    assert counts["clean"] == []
    assert [(s.label, s.what, s.site) for s in counts["planted"]] == [
        (f"step {n}", "item", "tests/test_host_syncs.py") for n in (1, 2, 3)]


# --- each technique through the loop, one process ---------------------------------------------------

@pytest.mark.parametrize("name, sections, every_step", [
    ("plain with clipping, evaluation and checkpoints",
     {"train": {"grad_clip": 1.0, "eval_every": 4, "eval_batches": 2}, "checkpoint": {"enabled": True, "every": 5}}, ()),
    ("gradient accumulation", {"pipeline": {"microbatches": 2}}, ()),
    ("float16, fused AdamW: the skip decided on the device",
     {"train": {"dtype": "float16", "fused": "torch", "grad_clip": 1.0, "loss_scale_init": 2.0 ** 40}}, ()),
    ("float16, plain AdamW: the overflow flag read each step", {"train": {"dtype": "float16"}}, (OVERFLOW,)),
    ("dropout at every site: masks hashed on the device",
     {"model": {"dropout": 0.1, "attention_dropout": 0.1, "embedding_dropout": 0.1}}, ()),
    ("Qwen3-style llama: yarn rotary, q/k norms, head_dim, attention dropout",
     {"model": {"arch": "llama", "kv_heads": 2, "qk_norm": True, "head_dim": 16, "max_positions": 32,
                "attention_dropout": 0.1, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 8}}}, ()),
    ("packed documents, evaluated: counted on the host, copied from page-locked memory",
     {"data": {"packing": "documents", "eod_token": 5}, "pipeline": {"microbatches": 2},
      "train": {"eval_every": 4, "eval_batches": 1}}, ()),
    ("packed documents in a grouped-query llama",
     {"model": {"arch": "llama", "kv_heads": 2}, "data": {"packing": "documents", "eod_token": 5}}, ()),
    ("mixture of experts, grouped experts (bf16): the counts stay on the device",
     {"model": MOE, "train": {"dtype": "bfloat16"}}, ()),
    ("mixture of experts in float32: the loop over experts reads its counts, each layer", {"model": MOE},
     (LOOPED_COUNTS,) * 4),
    # (the same path in every dtype: under hetero the experts are modules run one by one, never grouped)
    ("mixture of experts under hetero: the experts that run read with their counts, the loop nothing more",
     {"model": MOE, "hetero": {"enabled": True, "chunk_elems": 4096}}, (AGREED_COUNTS,) * 4),
    ("llama with dynamic rotary past its positions",
     {"model": {"arch": "llama", "kv_heads": 2, "max_positions": 8,
                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}}, ()),
])
def test_each_step_makes_the_documented_host_syncs(name, sections, every_step, tmp_path):
    cfg = job(**sections)
    cfg["train"]["out_dir"] = str(tmp_path / "run")
    syncs, config = counted_run(cfg)
    assert unexpected(syncs, config, 1, every_step) == [], name


def test_hetero_under_a_budget_reads_only_its_off_device_gradient_chunks(tmp_path):
    """hetero with a device budget below its model data: its chunk copies run on the copy stream and
    wait for nothing; what remains per step is its gradient norm reading the gradient chunks that are
    off the device (on the host, after draining the copy stream): the known limit, reported in #28."""
    cfg = job(hetero={"enabled": True, "chunk_elems": 4096, "device_budget_bytes": 100000, "policy": "belady"},
              train={"grad_clip": 1.0, "out_dir": str(tmp_path / "run")})
    syncs, config = counted_run(cfg)
    assert unexpected(syncs, config, 1, known=HETERO_OFF_DEVICE_NORM) == []
    assert {(s.what, s.site) for s in syncs if s.label != "start"} >= HETERO_OFF_DEVICE_NORM  # the limit is seen


def test_float16_skips_an_overflowed_step_on_the_device(single_rank):
    """torch's fused AdamW gets the agreed overflow flag on the device: a step whose gradient holds an
    inf changes no parameter, moment or step count and halves the scale, without a host read."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    cfg = make_config(job(train={"dtype": "float16", "fused": "torch", "loss_scale_init": 1024.0}))
    engine = compose(cfg, init_mesh())
    data = build_dataset(cfg)
    real = engine.compute_gradients

    def overflowing(tokens, targets):
        loss = real(tokens, targets)
        if engine.step == 1:
            next(p for p in engine.params if p.grad is not None).grad.view(-1)[0] = float("inf")
        return loss

    engine.compute_gradients = overflowing
    seen = []
    for step in range(3):
        before = [p.detach().clone() for p in engine.params]
        moments = [{k: v.clone() for k, v in engine.optimizer.state[p].items()} for p in engine.params
                   if p in engine.optimizer.state]
        engine.train_step(*data.batch(step))
        changed = any(not torch.equal(a, p) for a, p in zip(before, engine.params))
        kept = all(torch.equal(v, engine.optimizer.state[p][k]) for p, m in zip(engine.params, moments)
                   for k, v in m.items())
        seen.append((bool(engine.last_step_skipped), changed, kept and step > 0, float(engine.loss_scale.scale)))
    assert seen == [(False, True, False, 1024.0), (True, False, True, 512.0), (False, True, False, 512.0)]
    assert int(engine.loss_scale.skipped) == 1
    assert {float(s["step"]) for s in engine.optimizer.state.values()} == {2.0}  # the skipped step not counted


def test_the_loss_scale_rule_on_the_device():
    """Halve on an overflow (never below 1), double after ``window`` good steps in a row: the rule of
    the plain-number version, as device ops."""
    from parallel4d.optim.loss_scale import LossScale

    scale = LossScale(4.0, window=2)
    seen = []
    for overflow in (0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0):
        scale.update(torch.tensor(float(overflow)))
        seen.append(float(scale.scale))
    assert seen == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0]
    assert int(scale.skipped) == 5 and scale.scale.dtype == torch.float64


# --- each technique alone and all four together: the suite's 16-worker job ---------------------------

SIXTEEN_STEPS = {"steps": 4}  # 1: the memory gather, 2: nothing, 3: a log step, 4: the last
SIXTEEN = {  # each alone fills the 16 ranks with data parallelism
    "2D tp": {"parallel": {"tp": 4, "dp": 4}, "train": {"grad_clip": 1.0}},
    "pipeline 1f1b": {"parallel": {"pp": 2, "dp": 8}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    "pipeline interleaved": {"parallel": {"pp": 4, "dp": 4}, "model": {"layers": 6},
                             "pipeline": {"schedule": "interleaved", "chunks_per_rank": 2, "microbatches": 4}},
    # packed documents: the ring's block skipping is decided on the host, from the documents' host copy
    "ring sp, packed documents": {"parallel": {"sp": 2, "dp": 8}, "data": {"packing": "documents", "eod_token": 5}},
    "hetero ZeRO": {"parallel": {"dp": 16}, "hetero": {"enabled": True, "chunk_elems": 4096}},
    "experts ep=4 over dp=8 × sp=2 (bf16: grouped experts)": {"parallel": {"dp": 8, "sp": 2, "ep": 4}, "model": MOE,
                                                             "train": {"dtype": "bfloat16"}},
}


def sixteen_job(name: str) -> dict:
    sections = SIXTEEN[name]
    return job(**{**sections, "train": {**sections.get("train", {}), **SIXTEEN_STEPS}})


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job (tests/conftest.py): each case of SIXTEEN trained
    by the loop, its host syncs counted on each rank: ``{case: [(what, where, label)]}``. configs/4d.yaml's
    are counted in test_e2e's share, while its float32 run trains (test_e2e.FOUR_D_SYNCS)."""
    from conftest import train_in_job
    from parallel4d.engine.step import Engine

    out = {}
    for i, name in enumerate(SIXTEEN):
        with HostSyncs().watch_steps(Engine) as counted:
            train_in_job(sixteen_job(name), [f"train.out_dir={tmp / f'case{i}'}"])
        out[name] = [(s.what, s.where, s.label) for s in counted.syncs if s.label != "start"]
    return out


@pytest.fixture(scope="module")
def sixteen(sixteen_workers):
    return [rank["test_host_syncs"] for rank in sixteen_workers]


@pytest.mark.parametrize("name", sorted(SIXTEEN))
def test_each_technique_alone_on_16_ranks(sixteen, name):
    from parallel4d.config.load import make_config

    cfg = make_config(sixteen_job(name))
    known = HETERO_OFF_DEVICE_NORM if cfg.hetero.enabled else frozenset()  # its ZeRO shards are mostly off the device
    every_step = (EP_SPLITS,) * cfg.model.layers if cfg.parallel.ep > 1 else ()  # one read per MoE layer
    for rank, per_case in enumerate(sixteen):
        assert unexpected([Sync(*s) for s in per_case[name]], cfg, 16, every_step, known) == [], (name, rank)


def test_all_four_techniques_together(sixteen_workers):
    """configs/4d.yaml (Hanayo pp=2 × ring sp=2 × 2D tp=4 × hetero ZeRO under a device budget), its
    float32 run of test_e2e (4 steps, a log step at 3): the documented minimum, plus hetero's known norm
    reads of off-device gradient chunks."""
    from parallel4d.config.load import load_config
    from test_e2e import FOUR_D, FOUR_D_STEPS, FOUR_D_SYNCS

    cfg = load_config(ROOT / "configs" / "4d.yaml", [*FOUR_D["float32"], *FOUR_D_STEPS])
    assert (cfg.train.steps, cfg.train.log_every, cfg.checkpoint.enabled) == (4, 3, False)
    for rank, results in enumerate(sixteen_workers):
        syncs = [Sync(*s) for s in results["test_e2e"][FOUR_D_SYNCS]]
        assert unexpected(syncs, cfg, 16, known=HETERO_OFF_DEVICE_NORM) == [], rank


def test_a_diverged_loss_read_at_the_log_step_names_its_own_step(tmp_path):
    """Losses are read back at log steps only: a loss that diverged at step 2 is caught at step 3 (the log
    step, before any checkpoint of it could be saved) and named as step 2's."""
    from conftest import run_in_this_process

    cfg = job(optimizer={"lr": 1e30}, train={"dtype": "float64", "steps": 5, "out_dir": str(tmp_path / "run")},
              checkpoint={"enabled": True, "every": 3})
    with pytest.raises(FloatingPointError, match="loss became .* at step 2; lower optimizer.lr"):
        run_in_this_process(cfg, [])
    assert not (tmp_path / "run" / "checkpoints" / "step_00000003").exists()


def test_a_signal_stops_the_run_at_the_next_log_step_and_saves(tmp_path, monkeypatch):
    """SIGTERM during step 4 of a run that logs every 3 steps: the ranks agree on it with the read of step
    6 (the next step that reads back), save step 6 and stop: the latency docs/operations.md states."""
    import os
    import signal

    from conftest import run_in_this_process
    from parallel4d.engine.step import Engine

    real = Engine.train_step

    def train_step(engine, *args, **kwargs):
        if engine.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler records it
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(Engine, "train_step", train_step)
    cfg = job(train={"steps": 20, "log_every": 3, "out_dir": str(tmp_path / "run")}, checkpoint={"enabled": True})
    summary = run_in_this_process(cfg, [])
    assert (summary["stop_signal"], summary["steps"], len(summary["losses"])) == ("SIGTERM", 6, 6)
    assert Path(summary["checkpoint"]).name == "step_00000006"


def test_hetero_rows_updated_on_the_host_read_the_clip_coefficient_once_per_step(single_rank):
    """hetero's optimizer on the host (the default on CUDA) for rows off the device: the clipping
    coefficient, a device tensor, is read back once per step (host arithmetic takes a host number) and
    the steps equal those of the rows updated on the device, bit for bit ("exact")."""
    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose
    from parallel4d.engine.step import Engine

    cfg = make_config(job(hetero={"enabled": True, "chunk_elems": 4096, "device_budget_bytes": 100000},
                          train={"grad_clip": 0.05}))
    losses, counted = {}, None
    for mode in ("off", "exact"):
        with HostSyncs().watch_steps(Engine) as syncs:
            engine = compose(cfg, init_mesh())
            engine.optimizer.rt.host_optimizer = mode
            data = build_dataset(cfg)
            losses[mode] = [engine.train_step(*data.batch(step)) for step in range(3)]
        counted = syncs
    assert engine.hetero_stats()["host_optimizer_rows"] > 0
    assert [float(x) for x in losses["exact"]] == [float(x) for x in losses["off"]]
    reads = [(s.label, s.site) for s in counted.syncs if s.what == ".cpu(host)"]
    assert reads == [(f"step {n}", "parallel4d/hetero/step.py") for n in (1, 2, 3)]


@pytest.mark.gpu
def test_steps_on_a_gpu_make_no_synchronizing_cuda_call(tmp_path):
    """Where a GPU is: torch's own detector of synchronizing CUDA calls (``set_sync_debug_mode("error")``:
    ``.item()``, blocking copies, stream synchronizations) around the engine's steps after the first (one
    rank, NCCL): plain with clipping, gradient accumulation, float16 with fused AdamW and clipping, packed
    documents in a grouped-query llama (their documents and positions copied from page-locked memory)."""
    import math

    import torch.distributed as dist

    from parallel4d.config.load import make_config
    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        for sections in ({"train": {"grad_clip": 1.0}}, {"pipeline": {"microbatches": 2}},
                         {"train": {"dtype": "float16", "fused": "torch", "grad_clip": 1.0}},
                         {"data": {"packing": "documents", "eod_token": 5}, "pipeline": {"microbatches": 2},
                          "model": {"arch": "llama", "kv_heads": 2}}):
            cfg = make_config(job(**sections))
            engine = compose(cfg, init_mesh())
            assert engine.device.type == "cuda"
            data = build_dataset(cfg)
            losses = [engine.train_step(*data.batch(0))]  # the first step allocates and builds the state
            torch.cuda.set_sync_debug_mode("error")
            try:
                losses += [engine.train_step(*data.batch(step)) for step in (1, 2, 3)]
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert all(math.isfinite(float(x)) for x in losses), sections
    finally:
        dist.destroy_process_group()
