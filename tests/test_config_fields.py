"""Every field of ``parallel4d.config.Config`` does what it says (issue #13.6).

* a static walk: each field of each section is read somewhere in the package (not only
  validated): a field nothing reads is silently ignored by every job that sets it;
* ``sequence.causal: false`` is bidirectional attention in the dense model (sp = 1) and in the
  ring with 2D blocks (sp = 2 × tp = 4), checked in float64 through ``launch``;
* ``pipeline.microbatches`` at pp = 1 accumulates gradients: the same step as one big batch,
  with a lower activation peak.
"""

from __future__ import annotations

import ast
import math
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from parallel4d.config import schema as config_module
from parallel4d.config.schema import Config

PACKAGE = Path(config_module.__file__).resolve().parents[1]  # the parallel4d package

# Fields that are known to be read by nothing, each with the issue that deals with it.
ALLOWED_DEAD: set[tuple[str, str]] = set()

# Functions of the config package (config/ and its rules, config/rules/) and of the model families' specs
# (models/<family>/spec.py) that only validate: a field read there is checked, not used.
VALIDATION_ONLY = {"cross_field_problems", "_text_root_problems", "_family_problems", "_lr_schedule_problems",
                   "grid_problems", "ring_problems", "batch_split_problems", "layout_problems", "recompute_problems",
                   "compile_problems",
                   "tied_head_problems", "split_backward_problems", "tensorboard_problems", "section_problems",
                   "source_problems", "problems", "_grid_problems", "_on_the_grid", "fixed_fields",
                   "field_problems", "layout_problems", "_set_fields", "_moe_problems"}


def validates_only(path: Path, root: Path) -> bool:
    """Whether :data:`VALIDATION_ONLY` names validating functions in ``path``."""
    return "config" in path.relative_to(root).parts[:-1] or path.name == "spec.py"


def sections() -> dict[str, type]:
    """``{section name: section model}``, plus ``"": Config`` for the top-level fields."""
    out = {"": Config}
    for name, field in Config.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, config_module._Section):
            out[name] = ann
    return out


def leaf_fields() -> set[tuple[str, str]]:
    """Every ``(section, field)`` of the config; top-level non-section fields as ``("", name)``."""
    secs = sections()
    out = {(name, f) for name, model in secs.items() if name for f in model.model_fields}
    out |= {("", f) for f in Config.model_fields if f not in secs}
    return out


class _Reads(ast.NodeVisitor):
    """Collects ``(section, field)`` reads in one module.

    An expression is *of section S* when it is ``<anything>.S`` (``cfg.sequence``,
    ``self.cfg.pipeline``), a local name bound to one (``p, m = cfg.parallel, cfg.model``), a
    parameter annotated with S's class or passed one at a call site in the package
    (``build_optimizer(params, cfg.optimizer)``), a name bound to a call that names S's class
    (``cfg = _validate(x, HeteroConfig, ...)``), or ``self`` inside S's class. ``<S-expr>.f``
    is a read of ``(S, f)``.
    """

    def __init__(self, secs: dict[str, type], param_kinds: dict[tuple[str, str], set[str]], skip_funcs=()):
        self.by_class = {model.__name__: name for name, model in secs.items() if name}
        self.secs = set(self.by_class.values())
        self.param_kinds = param_kinds  # (function name, parameter) -> sections passed to it
        self.skip_funcs = set(skip_funcs)
        self.reads: set[tuple[str, str]] = set()
        self.calls: list[tuple[str, list, dict]] = []  # (callee name, [arg kinds], {kw: kinds})
        self.scopes: list[dict[str, set[str]]] = [{}]
        self.cls: list[str] = []

    # --- kinds of expressions ------------------------------------------------------------
    def kinds(self, node) -> set[str]:
        if isinstance(node, ast.Attribute) and node.attr in self.secs:
            return {node.attr}
        if isinstance(node, ast.Name):
            if node.id == "self" and self.cls and self.cls[-1] in self.by_class:
                return {self.by_class[self.cls[-1]]}
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
        if isinstance(node, ast.Call):
            named = {self.by_class[a.id] for a in node.args if isinstance(a, ast.Name) and a.id in self.by_class}
            return named
        return set()

    def bind(self, target, value) -> None:
        if isinstance(target, ast.Name):
            k = self.kinds(value)
            if k:
                self.scopes[-1][target.id] = k
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            for t, v in zip(target.elts, value.elts):
                self.bind(t, v)

    # --- visitors -------------------------------------------------------------------------
    def visit_ClassDef(self, node):
        self.cls.append(node.name)
        self.generic_visit(node)
        self.cls.pop()

    def visit_FunctionDef(self, node):
        if node.name in self.skip_funcs:
            return
        key = self.cls[-1] if node.name == "__init__" and self.cls else node.name  # Class(...) runs __init__
        scope: dict[str, set[str]] = {}
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        for a in args:
            k = set(self.param_kinds.get((key, a.arg), ()))
            ann = a.annotation
            if isinstance(ann, ast.Name) and ann.id in self.by_class:
                k.add(self.by_class[ann.id])
            if k:
                scope[a.arg] = k
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        self.visit(node.value)
        for t in node.targets:
            self.bind(t, node.value)
            self.visit(t)

    def visit_Attribute(self, node):
        for s in self.kinds(node.value):
            self.reads.add((s, node.attr))
        if node.attr in TOP_LEVEL:  # a top-level field, e.g. <config>.deepspeed
            self.reads.add(("", node.attr))
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name:
            self.calls.append((name, [self.kinds(a) for a in node.args],
                               {kw.arg: self.kinds(kw.value) for kw in node.keywords if kw.arg}))
        self.generic_visit(node)


TOP_LEVEL = {f for s, f in leaf_fields() if s == ""}


def _params(tree) -> dict[str, list[str]]:
    """``{function name: positional parameter names}`` (``self``/``cls`` dropped); a class's
    ``__init__`` is listed under the class name, as ``Class(...)`` calls it."""
    out: dict[str, list[str]] = {}

    def add(name, fn):
        names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        out.setdefault(name, names[1:] if names and names[0] in ("self", "cls") else names)

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    add(node.name, item)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "__init__":
            add(node.name, node)
    return out


def dead_fields(root: Path = PACKAGE) -> set[tuple[str, str]]:
    """The ``(section, field)`` pairs no module under ``root`` reads (validation excluded)."""
    secs = sections()
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))}
    params: dict[str, list[str]] = {}
    for tree in trees.values():
        params.update(_params(tree))
    param_kinds: dict[tuple[str, str], set[str]] = {}
    reads: set[tuple[str, str]] = set()
    for _ in range(4):  # kinds flow through call sites: iterate to a fixed point
        before = {k: set(v) for k, v in param_kinds.items()}
        for path, tree in trees.items():
            v = _Reads(secs, param_kinds, VALIDATION_ONLY if validates_only(path, root) else ())
            v.visit(tree)
            reads |= v.reads
            for callee, args, kws in v.calls:
                names = params.get(callee, [])
                for name, k in [*zip(names, args), *kws.items()]:
                    if k:
                        param_kinds.setdefault((callee, name), set()).update(k)
        if param_kinds == before:
            break
    return leaf_fields() - reads


def test_the_validation_only_functions_exist():
    """Each name in VALIDATION_ONLY is a function of the config package or of a family's spec (a rename
    would silently count its reads as uses)."""
    files = [*(PACKAGE / "config").rglob("*.py"), *(PACKAGE / "models").rglob("spec.py")]
    defined = {n.name for p in files for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef)}
    assert VALIDATION_ONLY <= defined, sorted(VALIDATION_ONLY - defined)


def test_every_config_field_is_read_by_the_package():
    dead = dead_fields() - ALLOWED_DEAD
    assert not dead, ("config fields that nothing in parallel4d reads (a job setting them gets silently "
                      f"ignored): {sorted('.'.join(x for x in f if x) for f in dead)}")


# --- sequence.causal ------------------------------------------------------------------------------


def explicit_attention(q, k, v, causal: bool):
    """Independent reference on ``[b, heads, s, d]``: explicit scores, optional causal mask."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def test_dense_model_follows_sequence_causal():
    """sp = 1: the dense blocks built for a job use ``sequence.causal`` (before, they were always
    causal, so ``causal: false`` did nothing without sequence parallelism). float64."""
    from parallel4d.engine.model import model_shape
    from parallel4d.models.gpt2.model import build_stage, dense_attention

    out = {}
    for causal in (True, False):
        cfg = Config.model_validate({"model": {"hidden": 16, "heads": 2, "seq_len": 8},
                                     "sequence": {"causal": causal}})
        block = build_stage(model_shape(cfg), 1, seed=0).double()
        assert block.attn.causal is causal
        x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        seen = []
        block.attn.attention_fn = lambda q, k, v, causal: seen.append((q, k, v, causal)) or \
            explicit_attention(q, k, v, causal)
        got = block(x)
        assert seen[0][3] is causal
        block.attn.attention_fn = dense_attention
        torch.testing.assert_close(block(x), got, rtol=1e-12, atol=1e-12)  # SDPA == explicit, same mask
        out[causal] = got
    # bidirectional attention changes every position but the last (which sees everything either way)
    diff = (out[True] - out[False]).abs().amax(dim=(0, 2))
    assert (diff[:-1] > 1e-6).all() and diff[-1] < 1e-12, diff


def tiny_job(out_dir, **sections):
    """A tiny float64 job (tests/test_launch.py's size), sections overriding the defaults."""
    cfg = {"model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
           "data": {"source": "synthetic", "batch_size": 8},
           "train": {"steps": 3, "dtype": "float64", "out_dir": str(out_dir), "timeout_s": 60, "job_timeout_s": 240},
           "checkpoint": {"enabled": False}}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def first_loss(cfg_dict, causal: bool) -> float:
    """Step 1's loss of the dense reference (built by models/gpt2/model.py directly, not the engine)."""
    from parallel4d.data.batches import build_dataset
    from parallel4d.models.build import shape_from_config
    from parallel4d.models.gpt2.model import build_gpt

    cfg = Config.model_validate(cfg_dict)
    shape = shape_from_config(cfg.model, causal=causal)
    tokens, targets = build_dataset(cfg).batch(0)
    return float(build_gpt(shape, seed=cfg.train.seed).double()(tokens, targets))


def test_bidirectional_ring_through_launch_equals_sp1(tmp_path, single_rank):
    """``sequence.causal: false``: sp = 2 (ring, zigzag) × tp = 4 (2D blocks), launched, equals
    sp = 1 (the same run_training in this process) to 1e-10 in float64, and both are the
    bidirectional model: step 1's loss is the non-causal reference's, not the causal one's."""
    from parallel4d import launch
    from parallel4d.training.loop import run_training

    ring = launch(tiny_job(tmp_path / "sp2", parallel={"sp": 2, "tp": 4},
                               sequence={"causal": False, "layout": "zigzag"}))
    one_job = tiny_job(tmp_path / "sp1", sequence={"causal": False})
    one = run_training(Config.model_validate(one_job))
    a, b = (torch.tensor(r["losses"], dtype=torch.float64) for r in (ring, one))
    assert len(a) == len(b) == 3 and ring["world_size"] == 8
    assert ring["bytes_communicated"]["sent"]["ring_attention.fwd.kv"] > 0
    torch.testing.assert_close(a, b, rtol=1e-10, atol=0)
    bidirectional, causal = first_loss(one_job, False), first_loss(one_job, True)
    assert abs(b[0].item() - bidirectional) <= 1e-12 * bidirectional
    assert abs(bidirectional - causal) > 1e-6  # the field makes a difference the check can see


# --- sequence.kernel --------------------------------------------------------------------------------


def test_sequence_kernel_blockwise_runs_the_rings_kernel_on_one_rank_and_equals_sdpa_in_float64(tmp_path, single_rank,
                                                                                                 monkeypatch):
    """``sequence.kernel: blockwise`` at sp = 1: every block's attention is the ring's kernel on the rank alone
    (``parallel4d check``'s reference for an FP8 job over sp: the core the layout computes) — each block calls it
    once per forward —, and in float64 the losses equal SDPA's (``auto``) to 1e-12; a sequence its zigzag pieces
    cannot cut is refused by name."""
    from parallel4d.sequence import adapter
    from parallel4d.training.loop import run_training

    calls = []
    ring = adapter.ring_attention
    monkeypatch.setattr(adapter, "ring_attention", lambda *a, **k: calls.append(a[3]) or ring(*a, **k))
    losses = {}
    for kernel in ("auto", "blockwise"):
        job = tiny_job(tmp_path / kernel, sequence={"kernel": kernel})
        losses[kernel] = run_training(Config.model_validate(job))["losses"]
        assert len(calls) == (0 if kernel == "auto" else 2 * 3), (kernel, len(calls))  # 2 blocks, 3 steps
    assert all(dist.get_world_size(group) == 1 for group in calls)
    torch.testing.assert_close(torch.tensor(losses["blockwise"]), torch.tensor(losses["auto"]), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"model.seq_len=15 .*sequence.kernel=blockwise; or sequence.layout=contiguous"):
        Config.model_validate(tiny_job(tmp_path, model={"seq_len": 15}, sequence={"kernel": "blockwise"}))
    Config.model_validate(tiny_job(tmp_path, model={"seq_len": 15}, sequence={"kernel": "blockwise",
                                                                              "layout": "contiguous"}))


# --- pipeline.microbatches at pp = 1 ---------------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors that ops allocate while the mode is on, counted while any
    tensor on their storage is alive (an output sharing an input's untracked storage, such
    as a view of a parameter, allocates nothing)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [live tensors, bytes]

    def _drop(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.refs:
                if ptr in inputs:
                    continue
                self.refs[ptr] = [0, storage.nbytes()]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self.refs[ptr][0] += 1
            weakref.finalize(t, self._drop, ptr)
        return out


def test_microbatches_accumulate_gradients_at_pp1(tmp_path, single_rank):
    """pp = 1, ``pipeline.microbatches`` = 4: one step equals the step on one batch of 8 (loss,
    parameters to 1e-12 relative, float64), and fewer bytes are alive at the step's peak (one
    micro-batch's activations at a time). Before, the field was ignored at pp = 1.

    optimizer.eps = 1e-4: the attention key bias has a zero gradient in exact arithmetic, and
    Adam's first step turns its round-off into ``lr·g/(|g|+eps)``, far below 1e-12 only for a
    large eps."""
    from parallel4d.data.batches import build_dataset
    from parallel4d.engine.compose import compose
    from parallel4d.distributed.mesh import init_mesh

    mesh = init_mesh()
    runs = {}
    for m in (1, 4):
        cfg = Config.model_validate(tiny_job(tmp_path, pipeline={"microbatches": m}, optimizer={"eps": 1e-4}))
        engine = compose(cfg, mesh)
        tokens, targets = build_dataset(cfg).batch(0)
        with LiveBytes() as mode:
            loss = engine.train_step(tokens, targets)
        runs[m] = loss, dict(engine.model.named_parameters()), mode.peak
    (loss1, p1, peak1), (loss4, p4, peak4) = runs[1], runs[4]
    assert abs(loss4 - loss1) <= 1e-12 * loss1
    for name, a in p1.items():
        rel = float((p4[name] - a).norm() / a.norm())
        assert rel <= 1e-12, (name, rel)
    assert peak4 < peak1, (peak4, peak1)
