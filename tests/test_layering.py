"""The house stays as drawn (#27.6): every module's imports, parsed (module top, function bodies and
``importlib.import_module("...")``), keep the layers of docs/architecture.md.

* no import upward: a module imports only modules of its own layer or a lower one;
* no technique package (tensor2d, pipeline, sequence, hetero, experts) imports another;
* config (layer L0) is torch-free: what importing one of its modules runs (its imports, theirs, and
  the packages they sit in) imports nothing outside the standard library, pydantic and yaml;
* no import cycle between modules, function-level imports included;
* a function imports a module of the package only if it is an optional extra's (DeepSpeed, the hf
  extra) or, in tools/cli.py, a command's own module; outside the package, an optional extra, the
  standard library, or a deferral :data:`DEFERRED` gives a reason for (an import of a second or more);
* no relative import; no import of a module that is not there; every module in a layer.

:data:`LAYERS` is the one table; docs/architecture.md shows it. The checker's own tests build small
packages that break each rule once, so the suite proves it can fail.
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import parallel4d

PACKAGE = Path(parallel4d.__file__).resolve().parent

#: bottom → top; a module belongs to the layer of its longest matching pattern
LAYERS: list[tuple[str, list[str]]] = [
    ("L0 config (torch-free)", ["parallel4d.config", "parallel4d.config.*", "parallel4d.data.token_files",
                                "parallel4d.data.tokenizer_identity", "parallel4d.data.text_files",
                                "parallel4d.models.spec", "parallel4d.models.registry",
                                "parallel4d.models.*.spec"]),
    ("L1 distributed, optim, fp8", ["parallel4d.distributed", "parallel4d.distributed.*", "parallel4d.optim",
                                    "parallel4d.optim.*", "parallel4d.fp8", "parallel4d.fp8.*"]),
    ("L2 techniques", ["parallel4d.tensor2d", "parallel4d.tensor2d.*", "parallel4d.pipeline", "parallel4d.pipeline.*",
                       "parallel4d.sequence", "parallel4d.sequence.*", "parallel4d.hetero", "parallel4d.hetero.*",
                       "parallel4d.experts", "parallel4d.experts.*"]),
    ("L3 models", ["parallel4d.models", "parallel4d.models.*"]),
    ("L4 checkpoint", ["parallel4d.checkpoint", "parallel4d.checkpoint.*"]),
    ("L4 data (above checkpoint)", ["parallel4d.data", "parallel4d.data.*"]),
    ("L5 engine", ["parallel4d.engine", "parallel4d.engine.*"]),
    ("L6 integrations", ["parallel4d.integrations", "parallel4d.integrations.*"]),
    ("L7 training", ["parallel4d.training", "parallel4d.training.*"]),
    ("L8 launcher", ["parallel4d.launcher", "parallel4d.launcher.*"]),
    ("L9 planning", ["parallel4d.planning", "parallel4d.planning.*"]),
    ("L10 tools", ["parallel4d.tools", "parallel4d.tools.*"]),
    ("the package (its public names, imported on first use; python -m parallel4d)",
     ["parallel4d", "parallel4d.__main__"]),
]
#: the technique packages of L2, which never import one another
TECHNIQUES = ("parallel4d.tensor2d", "parallel4d.pipeline", "parallel4d.sequence", "parallel4d.hetero",
              "parallel4d.experts")
#: what L0 and everything importing it runs may import besides the standard library
TORCH_FREE_THIRD_PARTY = ("pydantic", "pydantic_core", "yaml")
#: optional extras, which a function may import where it needs them (with the parts of parallel4d that need them)
EXTRAS = ("deepspeed", "transformers", "tokenizers", "safetensors", "datasets", "matplotlib", "tensorboard",
          "torch.utils.tensorboard", "apex", "parallel4d.integrations.deepspeed", "parallel4d.models.hf")
#: (module pattern, import) a function there puts off on purpose, and why; the standard library may always be
DEFERRED = {
    ("parallel4d.checkpoint.*", "torch.distributed.checkpoint"): "≈1 s to import (DTensor): a job that never saves "
                                                                 "skips it",
    ("parallel4d.launcher.worker_process", "torch"): "a worker imports torch once its environment is set (threads, "
                                              "devices); the zygote once, for every worker it forks",
    ("parallel4d.planning.dry_run", "torch.testing._internal.distributed.fake_pg"): "registers the fake backend, for the "
                                                                             "plan's dry run only",
    ("parallel4d.training.loop", "tqdm"): "a progress bar, on a terminal only",
    ("parallel4d.data.tokenize", "tqdm"): "a progress bar, on a terminal only",
}
#: the module whose functions import their command's module (so that `parallel4d validate` needs no torch)
COMMANDS = "parallel4d.tools.cli"


@dataclass(frozen=True)
class Import:
    source: str
    target: str  # a module name (for ``from m import name``: m.name when that is a module, else m)
    line: int
    in_function: bool
    annotations_only: bool  # under ``if TYPE_CHECKING:``: never run


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def find_modules(root: Path) -> dict[str, Path]:
    """Module name → file, for the package in directory ``root`` (``root.name`` is its name)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else "") \
        == "TYPE_CHECKING"


class _Imports:
    """The imports of one module, walking its statements (imports are statements; the bodies of
    functions are function-level, those under ``if TYPE_CHECKING:`` annotations only)."""

    def __init__(self, source: str, modules: dict[str, Path], dynamic: bool):
        self.source, self.modules, self.dynamic = source, modules, dynamic
        self.found: list[Import] = []
        self.relative: list[int] = []

    def walk(self, body: list[ast.stmt], in_function: bool = False, type_checking: bool = False) -> None:
        for st in body:
            if isinstance(st, ast.Import):
                self.found += [Import(self.source, a.name, st.lineno, in_function, type_checking) for a in st.names]
            elif isinstance(st, ast.ImportFrom):
                self._from(st, in_function, type_checking)
            elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.walk(st.body, True, type_checking)
            elif isinstance(st, ast.If):
                self.walk(st.body, in_function, type_checking or _is_type_checking(st.test))
                self.walk(st.orelse, in_function, type_checking)
            else:
                blocks = [getattr(st, f) for f in ("body", "orelse", "finalbody") if getattr(st, f, None)]
                blocks += [h.body for h in getattr(st, "handlers", ())] + [c.body for c in getattr(st, "cases", ())]
                for block in blocks:  # class bodies, loops, with, try, match
                    self.walk(block, in_function, type_checking)
                if not blocks and self.dynamic:
                    self._import_module_calls(st, in_function)

    def _from(self, st: ast.ImportFrom, in_function: bool, type_checking: bool) -> None:
        if st.level:
            self.relative.append(st.lineno)
            return
        for alias in st.names:
            sub = f"{st.module}.{alias.name}"
            target = sub if sub in self.modules else st.module
            self.found.append(Import(self.source, target, st.lineno, in_function, type_checking))

    def _import_module_calls(self, st: ast.stmt, in_function: bool) -> None:
        """``importlib.import_module("name")`` with a literal name is an import too."""
        for node in ast.walk(st):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                f = node.func
                if (f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "") \
                        == "import_module":
                    self.found.append(Import(self.source, node.args[0].value, node.lineno, in_function, False))


def find_imports(modules: dict[str, Path]) -> tuple[list[Import], list[str]]:
    """Every import of every module, and a violation for each relative import."""
    found, bad = [], []
    for name, path in modules.items():
        text = path.read_text()
        visitor = _Imports(name, modules, dynamic="import_module" in text)
        visitor.walk(ast.parse(text, str(path)).body)
        found += visitor.found
        bad += [f"{name}:{line}: a relative import (write it absolute)" for line in visitor.relative]
    return found, bad


@functools.lru_cache(maxsize=None)
def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s longest matching pattern."""
    best = max(((len(p), i) for i, (_, patterns) in enumerate(LAYERS) for p in patterns if fnmatchcase(module, p)),
               default=None)
    return None if best is None else best[1]


def _technique(module: str) -> str | None:
    return next((t for t in TECHNIQUES if _within(module, [t])), None)


def _parents(module: str) -> list[str]:
    """The packages importing ``module`` runs first: ``a``, ``a.b`` for ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name == "__future__"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan; the graph is a few hundred edges, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def violations(root: Path) -> list[str]:
    """Every broken layering rule in the package in directory ``root``, one line each."""
    modules = find_modules(root)
    imports, out = find_imports(modules)
    internal = [i for i in imports if _within(i.target, [root.name])]
    out += [f"{m}: in no layer of LAYERS (add it there and to docs/architecture.md)"
            for m in modules if layer_of(m) is None]
    for i in internal:
        where = f"{i.source}:{i.line}"
        if i.target not in modules:
            out.append(f"{where}: imports {i.target}, which is not a module of the package")
            continue
        src, dst = layer_of(i.source), layer_of(i.target)
        if src is not None and dst is not None and dst > src:
            out.append(f"{where}: imports {i.target} upward ({LAYERS[src][0]} → {LAYERS[dst][0]})")
        techniques = _technique(i.source), _technique(i.target)
        if None not in techniques and techniques[0] != techniques[1]:
            out.append(f"{where}: technique {techniques[0]} imports technique {techniques[1]} ({i.target})")
    out += [f"{i.source}:{i.line}: imports {i.target} inside a function; only an optional extra may be "
            f"({', '.join(EXTRAS)}), in {COMMANDS} a command's module, or what DEFERRED lists"
            for i in imports if i.in_function and not _may_defer(i, root.name)]
    out += _torch_free_problems(modules, imports)
    edges: dict[str, set[str]] = {}
    for i in internal:
        if not i.annotations_only and i.target in modules:
            edges.setdefault(i.source, set()).add(i.target)
    out += [f"import cycle: {' ↔ '.join(c)}" for c in _cycles(edges)]
    return out


def _may_defer(i: Import, package: str) -> bool:
    """Whether a function may import ``i.target``: an optional extra, a command's module in the CLI, a
    deferral :data:`DEFERRED` gives a reason for, or (outside L0) the standard library."""
    if _within(i.target, EXTRAS) or (i.source == COMMANDS and _within(i.target, [package])):
        return True
    if _within(i.target, [package]):
        return False
    return _is_stdlib(i.target) or any(
        fnmatchcase(i.source, where) and _within(i.target, [what]) for where, what in DEFERRED)


def _torch_free_problems(modules: dict[str, Path], imports: list[Import]) -> list[str]:
    """What importing an L0 module runs (its module-top imports, theirs, and their packages'
    ``__init__``) may import only the standard library, pydantic and yaml."""
    runs: dict[str, list[Import]] = {}
    for i in imports:
        if not i.in_function and not i.annotations_only:
            runs.setdefault(i.source, []).append(i)
    out = []
    for start in sorted(m for m in modules if layer_of(m) == 0):
        seen, todo = {start}, [start]
        while todo:
            module = todo.pop()
            for i in runs.get(module, ()):
                if i.target in modules:
                    reached = [i.target, *_parents(i.target)]
                    todo += [m for m in reached if m in modules and m not in seen]
                    seen.update(reached)
                elif not _within(i.target, TORCH_FREE_THIRD_PARTY) and not _is_stdlib(i.target):
                    via = "" if module == start else f" through {module}"
                    out.append(f"{start}: importing it imports {i.target}{via} ({module}:{i.line}); L0 imports "
                               "only the standard library, pydantic and yaml")
            todo += [p for p in _parents(module) if p in modules and p not in seen]
            seen.update(_parents(module))
    return sorted(set(out))


# --- the package ---------------------------------------------------------------------------------------


def test_the_package_keeps_its_layers():
    found = violations(PACKAGE)
    assert not found, "the import rules of docs/architecture.md are broken:\n" + "\n".join(found)


def test_the_table_names_every_top_level_part():
    """Each subpackage and root module is in a layer (a new one is placed on purpose)."""
    tops = {".".join(m.split(".")[:2]) for m in find_modules(PACKAGE)}
    assert all(layer_of(t) is not None for t in tops), sorted(t for t in tops if layer_of(t) is None)


# --- the checker, on small packages that break one rule each ----------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package named parallel4d under ``tmp_path`` (parsed, never imported): ``files`` maps a path
    inside it to its source; every directory gets an empty ``__init__.py`` unless given one."""
    root = tmp_path / "parallel4d"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for directory in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        (directory / "__init__.py").touch()
    return root


CLEAN = {
    "config/schema.py": "import math\nimport yaml\nfrom parallel4d.config.rules import common\n",
    "config/rules/common.py": "import difflib\n",
    "data/token_files.py": "import json\n",
    "distributed/comm.py": "import torch\nfrom parallel4d.config.schema import math\n",
    "tensor2d/layers.py": "import torch\nfrom parallel4d.distributed import comm\n",
    "pipeline/executor.py": "from parallel4d.config.rules.common import difflib\n",
    "engine/compose.py": "import importlib\nfrom parallel4d.tensor2d import layers\n\n\n"
                         "def load():\n    return importlib.import_module('parallel4d.models.hf')\n",
    "models/hf.py": "import torch\nimport safetensors\n",
    "tools/cli.py": "from parallel4d.config import schema\n\n\ndef run():\n    from parallel4d.engine import compose\n",
    "tools/plot.py": "def draw():\n    import matplotlib\n",
    "checkpoint/dcp.py": "def _dcp():\n    import resource\n    import torch.distributed.checkpoint as dcp\n",
}


def test_a_clean_package_passes(tmp_path):
    assert violations(_package(tmp_path, CLEAN)) == []


def test_an_upward_import_fails(tmp_path):
    """config (L0) importing the engine (L5): upward, and it drags torch into config."""
    root = _package(tmp_path, {**CLEAN, "config/schema.py": "from parallel4d.engine import compose\n"})
    found = violations(root)
    assert any("parallel4d.config.schema:1: imports parallel4d.engine.compose upward (L0" in v for v in found), found
    assert any(v.startswith("parallel4d.config.schema: importing it imports torch through parallel4d.") for v in found)


def test_a_technique_importing_another_fails(tmp_path):
    root = _package(tmp_path, {**CLEAN, "pipeline/executor.py": "from parallel4d.tensor2d.layers import torch\n"})
    assert violations(root) == ["parallel4d.pipeline.executor:1: technique parallel4d.pipeline imports technique "
                                "parallel4d.tensor2d (parallel4d.tensor2d.layers)"]


def test_torch_reached_through_a_package_init_fails(tmp_path):
    """Importing data.token_files runs data/__init__.py first: a torch import there reaches config."""
    root = _package(tmp_path, {**CLEAN, "data/__init__.py": "import torch\n",
                               "config/schema.py": "from parallel4d.data import token_files\n"})
    found = violations(root)
    assert "parallel4d.config.schema: importing it imports torch through parallel4d.data (parallel4d.data:1); " \
           "L0 imports only the standard library, pydantic and yaml" in found, found
    assert all("torch" in v or "parallel4d.data.token_files" in v for v in found), found


def test_a_direct_numpy_import_in_config_fails(tmp_path):
    root = _package(tmp_path, {**CLEAN, "config/rules/common.py": "import numpy\n"})
    assert any(v.startswith("parallel4d.config.rules.common: importing it imports numpy (") for v in violations(root))


def test_a_cycle_through_a_function_level_import_fails(tmp_path):
    """tools/cli.py may import a command's module inside a function, but not one that imports cli back."""
    root = _package(tmp_path, {**CLEAN, "tools/plot.py": "from parallel4d.tools import cli\n"
                                                         "def draw():\n    import matplotlib\n",
                               "tools/cli.py": "def run():\n    from parallel4d.tools import plot\n"})
    assert violations(root) == ["import cycle: parallel4d.tools.cli ↔ parallel4d.tools.plot"]


def test_a_function_level_import_of_a_non_extra_fails(tmp_path):
    root = _package(tmp_path, {**CLEAN, "engine/compose.py": "def build():\n    import torch\n"
                                                             "    from parallel4d.distributed import comm\n"})
    found = violations(root)
    assert [v.split(" inside")[0] for v in found] == ["parallel4d.engine.compose:2: imports torch",
                                                      "parallel4d.engine.compose:3: imports parallel4d.distributed.comm"]


def test_torch_imported_inside_a_config_function_fails(tmp_path):
    root = _package(tmp_path, {**CLEAN, "config/rules/common.py": "def f():\n    import torch.nn\n"})
    assert [v.split(" inside")[0] for v in violations(root)] == ["parallel4d.config.rules.common:2: imports torch.nn"]


def test_relative_missing_and_unplaced_modules_fail(tmp_path):
    root = _package(tmp_path, {**CLEAN, "engine/compose.py": "from . import memory\nimport parallel4d.engine.gone\n",
                               "extras/thing.py": ""})
    assert sorted(violations(root)) == [
        "parallel4d.engine.compose:1: a relative import (write it absolute)",
        "parallel4d.engine.compose:2: imports parallel4d.engine.gone, which is not a module of the package",
        "parallel4d.extras.thing: in no layer of LAYERS (add it there and to docs/architecture.md)",
        "parallel4d.extras: in no layer of LAYERS (add it there and to docs/architecture.md)",
    ]
