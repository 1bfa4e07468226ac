"""``train.compile: blocks`` (#28.6): each transformer block's forward compiled on its own.

What each test proves:

* ``test_only_the_blocks_are_compiled``: compose() compiles every block's forward and nothing else
  (not the embedding, the head or the rank's whole model), and the dense names are unchanged;
  ``none`` compiles nothing. No compilation runs (nothing is called).
* ``test_compiled_blocks_with_inductor_equal_eager``: one process, torch's default backend (inductor),
  float64: three steps' losses and every parameter equal the same job with ``train.compile: none``
  (1e-10); the first step compiles graphs, shared by both blocks (a recompilation anywhere in the run
  is an error: the second block reuses the first's graphs), each block is one graph (no graph break),
  and steps 2..3 compile nothing.
* ``test_compiled_blocks_compose_with_every_technique``: one 4-worker job, two layouts — 2D tp=4, and
  1F1B pp=2 × ring sp=2 (zigzag) × hetero (ZeRO over the sp replicas) × activation checkpointing:
  float64 losses and this rank's piece of every parameter equal the eager job's (1e-10); the first
  step compiles graphs on every rank; every graph break is a call the code marked eager (a collective,
  hetero's layers and hooks), none is dynamo giving up inside a collective; nothing compiles after
  the first step, and nothing recompiles at all (the collectives' per-layer labels stay out of the
  graphs: a traced label would recompile the second block; under hetero a layer compiled alone would
  recompile for each shape). These run dynamo and AOTAutograd with the ``aot_eager`` backend (the
  same graphs, graph breaks, guards and forward/backward partition as inductor, without its code
  generation, which costs minutes on the CI's 2 cores with 4 workers compiling at once).
* ``test_compiled_fp8_blocks_trace_every_product_and_equal_eager_fp8``: ``train.fp8: rowwise`` (float32
  products on the CPU), one process: each block one graph holding every FP8 product (``_scaled_mm`` in the
  forward and both gradients in the backward: the quantization around them fuses on a GPU), no graph break,
  and losses and parameters equal eager FP8's bit for bit (``aot_eager``: the same kernels, in order).
* ``test_compiled_fp8_blocks_with_inductor_equal_eager_fp8``: the same with inductor: within a tenth of
  FP8's own error (eager FP8 against float32) of eager FP8 (inductor reorders float32 sums, and a value one
  ulp off may round to the neighbouring e4m3 value).
* in the 4-worker job, FP8 over dp=2 × 1F1B pp=2: the amax reduction of the weight gradients runs inside the
  compiled backward (a functional all-reduce: no graph break), bit-equal to eager FP8, counted the same.
* the rule: a split backward (zb_h1, zbv, hanayo's split) refuses ``train.compile: blocks`` by name,
  before anything runs (``parallel4d validate``).
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_workers
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.tools.cli import main

STEPS = 3
TINY = {"model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2},
        "data": {"source": "synthetic", "batch_size": 8},
        "optimizer": {"lr": 0.01, "warmup_steps": 1},
        "train": {"steps": STEPS, "dtype": "float64", "timeout_s": 120}, "checkpoint": {"enabled": False}}


def job(parallel=None, **sections) -> dict:
    """TINY with ``parallel`` and ``sections``' fields over it."""
    out = {k: dict(v) for k, v in TINY.items()}
    out["parallel"] = dict(parallel or {})
    for name, fields in sections.items():
        out.setdefault(name, {}).update(fields)
    return out


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _breaks() -> dict:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def train(config: dict, mode: str):
    """``(losses, {dense name: [this rank's pieces]}, graphs compiled by the end of each step, why the
    graphs broke, fp8.amax all-reduces counted)`` of ``config`` under ``train.compile=mode``. A
    recompilation is an error: every block reuses the graphs the first block compiled, and later steps
    reuse the first step's."""
    import torch._dynamo

    from parallel4d.data.batches import build_dataset
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    cfg = make_config({**config, "train": {**config["train"], "compile": mode}})
    p = cfg.parallel
    torch._dynamo.reset()  # a fresh start: graphs of an earlier job would be reused
    engine, data = compose(cfg, init_mesh(pp=p.pp, dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=120)), build_dataset(cfg)
    start, breaks, losses, graphs = _graphs(), _breaks(), [], []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(cfg.train.steps):
            losses.append(float(engine.train_step(*data.batch(step))))
            graphs.append(_graphs() - start)
    pieces = {k: [view.detach().clone() for _, view in v.pieces] for k, v in engine.state_dict().items()
              if k.startswith("model.")}
    torch._dynamo.reset()
    reasons = sorted(k for k, n in _breaks().items() if n > breaks.get(k, 0))
    return losses, pieces, graphs, reasons, engine.mesh.comm_stats.calls.get("fp8.amax", 0)


def assert_equal(compiled, eager):
    """float64: losses to 1e-10 relative, every parameter piece to 1e-10 (1e-12 absolute near zero)."""
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), rtol=1e-10, atol=0)
    assert set(compiled[1]) == set(eager[1]) and compiled[1]
    for name, pieces in eager[1].items():
        for got, want in zip(compiled[1][name], pieces, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def assert_compiled_once(compiled):
    """The first step compiled graphs, the later ones nothing; the graphs broke only where the code asks
    (a call of a ``torch.compiler.disable``d function: a collective, hetero's hooks), never where dynamo
    gave up tracing (inside a collective's autograd function, say)."""
    graphs, reasons = compiled[2], compiled[3]
    assert graphs[0] > 0 and graphs == [graphs[0]] * STEPS, graphs
    assert all("torch.compiler.disable" in r for r in reasons), reasons


# --- one process ------------------------------------------------------------------------------------

def test_only_the_blocks_are_compiled(single_rank):
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    def compiled(mode, recompute="none"):
        cfg = make_config(job(train={"compile": mode, "activation_checkpointing": recompute}))
        stages = compose(cfg, init_mesh()).model.stages()
        return {name: hasattr(inner_forward(stage), "_torchdynamo_orig_callable") for name, stage in stages.items()}, \
            sorted(n for stage in stages.values() for n, _ in stage.named_parameters())

    blocks, names = compiled("blocks")
    assert blocks == {"embed": False, "blocks.0": True, "blocks.1": True, "head": False}
    none, eager_names = compiled("none")
    assert not any(none.values()) and names == eager_names
    assert compiled("blocks", "blocks")[0] == blocks  # under activation checkpointing, what it recomputes


def inner_forward(stage):
    """The stage's own ``forward``, under activation checkpointing's wrapper (:func:`recompute_in_backward`)."""
    forward = stage.__dict__.get("forward", stage.forward)
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    return cells["inner"].cell_contents if "inner" in cells else forward


def test_compiled_blocks_with_inductor_equal_eager(single_rank):
    import torch._inductor.config

    config = job()
    eager = train(config, "none")
    with torch._inductor.config.patch(compile_threads=1):  # no compile workers left in the test process
        compiled = train(config, "blocks")
    assert_equal(compiled, eager)
    assert_compiled_once(compiled)
    assert compiled[3] == []  # without collectives or hooks a block is one graph
    assert eager[2] == [0] * STEPS


FP8 = {"dtype": "float32", "fp8": "rowwise"}  # FP8 products written in float32 on the CPU


def recording(graphs: list):
    """A backend doing what ``aot_eager`` does (dynamo, then AOTAutograd's forward/backward partition,
    run as traced), appending each compiled graph's ``(kind, [aten ops called])`` to ``graphs``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind):
        def record(gm, example_inputs):
            graphs.append((kind, [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]))
            return make_boxed_func(gm.forward)
        return record

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


def fp8_products(graphs: list, kind: str) -> list[int]:
    """The FP8 products (``_scaled_mm``) of each graph of ``kind``."""
    return [sum("_scaled_mm" in op for op in ops) for k, ops in graphs if k == kind]


def fp8_linears_per_block(config: dict) -> int:
    """How many linears of one block of ``config``'s model compute in FP8 (one process)."""
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose
    from parallel4d.models.fp8 import fp8_linears

    cfg = make_config(config)
    stages = compose(cfg, init_mesh()).model.stages()
    return fp8_linears(stages["blocks.0"])


def test_compiled_fp8_blocks_trace_every_product_and_equal_eager_fp8(single_rank, monkeypatch):
    """``train.fp8: rowwise`` with ``train.compile: blocks``, one process: each block is one graph holding its
    FP8 linears whole — the forward graph every linear's product, the backward graph both gradients' —, so
    the amaxes, scales and quantization fuse around them (inductor on a GPU); losses and parameters after
    3 steps equal eager FP8's bit for bit (the traced graph runs the same kernels in the same order)."""
    import parallel4d.engine.compile as compile_module

    config = job(train=FP8)
    eager = train(config, "none")
    graphs: list = []
    monkeypatch.setattr(compile_module, "BACKEND", recording(graphs))
    compiled = train(config, "blocks")
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), rtol=0, atol=0)
    for name, pieces in eager[1].items():
        for got, want in zip(compiled[1][name], pieces, strict=True):
            assert torch.equal(got, want), name
    assert_compiled_once(compiled)
    assert compiled[3] == []  # no graph break: not a linear left to run eagerly
    linears = fp8_linears_per_block(config)
    assert fp8_products(graphs, "forward") == [linears]  # one graph, shared by both blocks
    assert fp8_products(graphs, "backward") == [2 * linears]  # dX and dW of each


def test_compiled_fp8_blocks_with_inductor_equal_eager_fp8(single_rank):
    """The same FP8 job compiled by inductor (its CPU code: the amaxes, scales and quantization fused into
    C++ kernels around ``_scaled_mm``; those kernels alone give eager's scales and e4m3 values exactly).
    Inductor reorders float32 sums elsewhere (norms, softmax): an operand one float32 ulp off can round to
    the neighbouring e4m3 value (2⁻⁴ apart), so compiled FP8 is not bit-equal to eager FP8 — but its
    losses over 3 steps stay within a tenth of FP8's own error (eager FP8 against eager float32) and within
    1e-4 relative of eager FP8."""
    import torch._inductor.config

    config = job(train=FP8)
    eager = torch.tensor(train(config, "none")[0])
    exact = torch.tensor(train(job(train={"dtype": "float32"}), "none")[0])
    with torch._inductor.config.patch(compile_threads=1):
        compiled = train(config, "blocks")
    drift, fp8_error = (torch.tensor(compiled[0]) - eager).abs(), (eager - exact).abs()
    print("compiled - eager FP8:", drift.tolist(), "eager FP8 - float32:", fp8_error.tolist())
    assert (drift <= 0.1 * fp8_error).all() and (drift <= 1e-4 * eager.abs()).all(), (drift, fp8_error)
    assert_compiled_once(compiled)
    assert compiled[3] == []


# --- every technique, one 4-worker job ----------------------------------------------------------------

LAYOUTS = {
    "2D tp=4": job({"tp": 4}),
    "1F1B pp=2 × ring sp=2 × hetero × activation checkpointing": job(
        {"pp": 2, "sp": 2}, pipeline={"schedule": "1f1b", "microbatches": 2}, sequence={"layout": "zigzag"},
        model={"tie_embeddings": False}, hetero={"enabled": True, "chunk_elems": 4096},
        train={"activation_checkpointing": "blocks"}),
}


#: FP8 where the tokens of a micro-batch are split over data replicas: each linear's weight-gradient amaxes
#: MAX-reduced over them inside the compiled backward (a functional all-reduce, counted by the block)
FP8_LAYOUTS = {"FP8 dp=2 × 1F1B pp=2": job({"dp": 2, "pp": 2}, pipeline={"schedule": "1f1b", "microbatches": 2},
                                          model={"tie_embeddings": False}, train=FP8),
               "FP8 dp=4 × hetero × activation checkpointing": job(
                   {"dp": 4}, hetero={"enabled": True, "chunk_elems": 4096},
                   train={**FP8, "activation_checkpointing": "blocks"})}


def _layouts(layouts: dict, fp8_layouts: dict) -> dict:
    """Each layout eager, then compiled with dynamo and AOTAutograd (``aot_eager``: see the docstring); each
    FP8 layout likewise, with the graphs recorded (:func:`recording`: ``aot_eager``'s partition)."""
    import parallel4d.engine.compile as compile_module

    compile_module.BACKEND = "aot_eager"  # this worker process only
    out = {name: (train(config, "none"), train(config, "blocks")) for name, config in layouts.items()}
    for name, config in fp8_layouts.items():
        graphs: list = []
        eager = train(config, "none")
        compile_module.BACKEND = recording(graphs)
        out[name] = (eager, train(config, "blocks"), graphs)
    return out


def test_compiled_blocks_compose_with_every_technique():
    """(The module doc.) And FP8 over data replicas: compiled equals eager FP8 bit for bit on every rank, and
    the ``fp8.amax`` count is eager's (one per linear per micro-batch per step, none more for a
    recomputation); without hetero no graph break, each backward graph holding one amax all-reduce per FP8
    linear; under hetero the FP8 linears (swapped in after the block is compiled) run eagerly like every
    layer holding parameters, never recompiled per shape."""
    results = run_workers(_layouts, 4, LAYOUTS, FP8_LAYOUTS, timeout_s=600)
    for rank, by_layout in enumerate(results):
        for name, (eager, compiled, *graphs) in by_layout.items():
            assert_compiled_once(compiled)
            assert eager[2] == [0] * STEPS, (rank, name)
            if name in FP8_LAYOUTS:
                assert compiled[0] == eager[0] and all(
                    torch.equal(g, w) for n in eager[1] for g, w in zip(compiled[1][n], eager[1][n], strict=True))
                assert compiled[4] == eager[4] > 0, (rank, name, compiled[4], eager[4])
                if "hetero" in name:
                    continue
                assert compiled[3] == [], (rank, name)  # the linears and their reductions inside the graphs
                reductions = [sum("all_reduce" in op for op in ops) for k, ops in graphs[0] if k == "backward"]
                assert reductions == [n // 2 for n in fp8_products(graphs[0], "backward")] != [0], (rank, graphs[0])
            else:
                assert_equal(compiled, eager)
                assert compiled[3], (rank, name)  # the collectives (and hetero's hooks) break the graphs


# --- the rule -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pipeline", [{"schedule": "zb_h1"}, {"schedule": "zbv"},
                                      {"schedule": "hanayo", "split_backward": True}])
def test_a_split_backward_refuses_compiled_blocks(pipeline, tmp_path, capsys):
    config = job({"pp": 2}, pipeline={**pipeline, "microbatches": 4}, model={"layers": 4},
                 train={"compile": "blocks"})
    with pytest.raises(ConfigError) as err:
        make_config(config)
    words = ["train.compile=blocks", f"pipeline.schedule={pipeline['schedule']}", "use train.compile=none"]
    assert all(w in str(err.value) for w in words), err.value
    path = tmp_path / "job.yaml"
    path.write_text(make_config({**config, "train": {**config["train"], "compile": "none"}}).to_yaml())
    assert main(["validate", str(path)]) == 0
    assert main(["validate", str(path), "--set", "train.compile=blocks"]) == 2
    assert "train.compile=blocks with a split backward" in capsys.readouterr().err
