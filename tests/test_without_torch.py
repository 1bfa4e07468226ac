"""``import parallel4d.config`` and ``parallel4d validate`` work where torch cannot be imported (#27.2).

A child interpreter whose ``sys.meta_path`` refuses ``torch`` and ``numpy`` (and their submodules)
imports the config package and runs the CLI's ``validate`` on every shipped config without a
``deepspeed:`` section (DeepSpeed needs torch); each prints what it prints where torch is installed.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import shipped_configs
from parallel4d.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [p for p in shipped_configs(ROOT) if "deepspeed" not in yaml.safe_load(p.read_text())]

# Runs first in the child: every later `import torch` (or numpy) fails as on a machine without it.
BLOCK = '''
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} is blocked by this test", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
'''

CHILD = BLOCK + '''
import contextlib, io, json
try:
    import torch
    sys.exit("the blocker let torch through")
except ImportError:
    pass
import parallel4d.config
from parallel4d.tools.cli import main
out = {}
for path in sys.argv[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out[path] = [main(["validate", path]), buf.getvalue()]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
print(json.dumps({"validated": out, "heavy": heavy}))
'''


def _validate_here(path: str) -> list:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["validate", path])
    return [rc, buf.getvalue()]


def test_config_and_validate_need_no_torch():
    assert len(CONFIGS) >= 5, CONFIGS  # quickstart and the technique configs
    paths = [str(p) for p in CONFIGS]
    child = subprocess.run([sys.executable, "-c", CHILD, *paths], capture_output=True, text=True, cwd=ROOT,
                           timeout=120)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert result["heavy"] == []
    for path in paths:
        assert result["validated"][path] == _validate_here(path), path
        assert result["validated"][path][0] == 0, path
