"""Every command and program in README.md and docs/*.md runs as printed (#27.8).

The conventions are docs/contributing.md's "Writing docs": ```bash blocks run with ``bash -e``;
```console blocks run their ``$ `` lines and find the lines printed under them in the output, in
order (``...`` skips); ```python / ```yaml blocks whose first line names a file (``# train_api.py``)
are written there for a later block to run (or, naming a file of the repository, must equal it);
```text, ```diff and blocks without a language are shown only; ``<!-- not run: REASON -->`` right before a block skips it. The
pages run in one copy of configs/, docs/, examples/ and benchmarks/, README first, with
``.venv/bin/{parallel4d,python,torchrun}`` standing for this interpreter, and every config any of
their processes loads gets :data:`OVERRIDES` appended (a ``sitecustomize`` on ``PYTHONPATH``), so
each printed job trains two steps. The README runs alone (the quickstart's pace is checked); the
other pages then run three at a time (most of their blocks are one process, which leaves a core idle).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
COPIED = ("configs", "docs", "examples", "benchmarks")
OVERRIDES = ("train.steps=2", "optimizer.warmup_steps=0")
RUN, SHOWN = ("bash", "console", "python", "yaml"), ("text", "diff", "")  # "": a block without a language
NOT_RUN = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")
NAMES_FILE = re.compile(r"^#\s*([\w./-]+\.(?:py|yaml))\s*(?::.*)?$")
A_COMMAND = re.compile(r"^\s*(\$ |\.venv/bin/|parallel4d |python |torchrun |make )")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MODULE_PATH = re.compile(r"\b(?:parallel4d|tests|configs|examples|benchmarks)/[\w/.-]*[\w/]")
BLOCK_TIMEOUT_S = 600
SIDE_BY_SIDE = 3  # pages run at once after the README
# What the former tests/test_quickstart.py checked (#27: folded in here, one start-up less): the README's
# launch_quickstart.py trains the shipped configs/quickstart.yaml (what `make demo` trains: real text,
# dp=2, ~3.2M parameters) for its first 40 steps (the whole 200 would take a minute of the suite's 2
# cores): the loss falls ≥ 40 %, and at the measured pace the whole run takes < 3 minutes.
QUICKSTART = {"program": "launch_quickstart.py", "out_dir": "runs/from_python", "steps": 40}

HOOK = '''"""tests/test_docs.py: the configs this process loads get the docs test's overrides appended."""
import os

_EXTRA = [o for o in os.environ.get("PARALLEL4D_DOCS_OVERRIDES", "").splitlines() if o]
if _EXTRA:
    import parallel4d.config as _package
    import parallel4d.config.load as _load

    _original = _load.load_config

    def load_config(path, overrides=None):
        return _original(path, [*(overrides or []), *_EXTRA])

    _load.load_config = _package.load_config = load_config
'''


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None  # the reason given by a "not run" marker

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def file(self) -> str | None:
        """The file a python / yaml block names on its first line."""
        first = self.text.split("\n", 1)[0]
        m = NAMES_FILE.match(first) if self.lang in ("python", "yaml") else None
        return m.group(1) if m else None


def page_blocks(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    out, k = [], 0
    while k < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[k])
        if not m:
            k += 1
            continue
        start, body = k, []
        k += 1
        while k < len(lines) and lines[k].strip() != "```":
            body.append(lines[k])
            k += 1
        assert k < len(lines), f"{page}:{start + 1}: the block is never closed"
        before = [line for line in lines[:start] if line.strip()]
        marker = NOT_RUN.match(before[-1].strip()) if before else None
        out.append(Block(page, start + 1, m.group(2), "\n".join(body) + "\n", marker.group(1).strip() if marker else None))
        k += 1
    return out


ALL = [b for page in PAGES for b in page_blocks(page)]


def test_every_block_runs_or_says_why():
    """Each block has a language this test knows, a skipped one its reason, a shown one no command,
    and each file a block writes is used by a later block."""
    assert ALL, "no blocks found"
    for k, b in enumerate(ALL):
        assert b.lang in RUN + SHOWN, f"{b.where}: a ```{b.lang} block; use one of {RUN + SHOWN}"
        assert b.skip != "", f"{b.where}: <!-- not run: --> without a reason"
        if b.lang in SHOWN or b.skip:
            continue
        if b.lang == "python":
            assert b.file, f"{b.where}: a python block starts with a comment naming its file (# example.py)"
        if b.file and not (ROOT / b.file).is_file():
            rest = "".join(x.text for x in ALL[k + 1:] if x.lang in ("bash", "console", "yaml"))
            assert b.file.split("/")[-1] in rest, f"{b.where}: {b.file} is written but no later block uses it"
    for b in ALL:
        if b.lang in SHOWN:
            commands = [line for line in b.text.splitlines() if A_COMMAND.match(line)]
            assert not commands, f"{b.where}: a ```{b.lang} block shows commands {commands}; make it bash or console"


def test_links_stay_inside_the_repository():
    for page in PAGES:
        for target in LINK.findall((ROOT / page).read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = ((ROOT / page).parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), f"{page}: the link {target} leaves the repository"
            assert path.exists(), f"{page}: the link {target} names nothing"


def test_named_files_exist():
    """A page that names a file of the repository (``parallel4d/engine/compose.py``, ``tests/test_e2e.py``)
    names one that is there: a module moved or renamed fails here until its docs follow."""
    for page in PAGES:
        for name in MODULE_PATH.findall((ROOT / page).read_text()):
            if re.search(r"[*{]|\bNAME\b|_X\b", name) or name.startswith("benchmarks/results/"):  # patterns
                continue
            assert (ROOT / name).exists(), f"{page} names {name}, which is not in the repository"


@dataclass
class Workdir:
    path: Path
    env: dict
    pool: ThreadPoolExecutor
    done: set = field(default_factory=set)
    seconds: dict = field(default_factory=dict)
    quickstart_checked: bool = False
    pages: dict[str, Future] | None = None  # the pages after the README, once started


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Workdir:
    """A directory as a user's checkout after ``make``: the copied folders, ``.venv/bin`` tools that are
    this interpreter, and the overrides hook on ``PYTHONPATH``. Leaving the module waits for every page
    started."""
    work = tmp_path_factory.mktemp("docs")
    for name in COPIED:
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = work / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool, args in (("python", ""), ("parallel4d", " -m parallel4d"), ("torchrun", " -m torch.distributed.run")):
        (bin_dir / tool).write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        (bin_dir / tool).chmod(0o755)
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join([str(hook), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "PARALLEL4D_DOCS_OVERRIDES": "\n".join(OVERRIDES),
           "PYTHONUNBUFFERED": "1"}
    with ThreadPoolExecutor(SIDE_BY_SIDE, thread_name_prefix="docs-page") as pool:
        yield Workdir(work, env, pool)


def _run(work: Workdir, command: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """``command`` run in the work directory (stdout and stderr together), and the CPU seconds it and the
    processes it waited for used: its own resource usage (pages run side by side, so this process's
    children's total would count the other page's too)."""
    proc = subprocess.Popen(command, cwd=work.path, env=env or work.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    killed = threading.Event()  # os.kill, not Popen.kill: that polls, and could reap it before wait4 reads its usage
    timer = threading.Timer(BLOCK_TIMEOUT_S, lambda: (killed.set(), os.kill(proc.pid, signal.SIGKILL)))
    timer.start()
    try:
        with proc.stdout:
            out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen has nothing left to wait for
    if killed.is_set():
        raise subprocess.TimeoutExpired(command, BLOCK_TIMEOUT_S, out)
    return subprocess.CompletedProcess(command, proc.returncode, out), usage.ru_utime + usage.ru_stime


def _check_quickstart(work: Workdir, seconds: float) -> None:
    """The former tests/test_quickstart.py's checks on the README's run of the quickstart (:data:`QUICKSTART`)."""
    steps, out = QUICKSTART["steps"], work.path / QUICKSTART["out_dir"]
    shipped = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["train"]["steps"]
    summary = json.loads((out / "summary.json").read_text())
    losses = summary["losses"]
    assert summary["world_size"] == 2 and summary["parameters"] > 2_000_000 and len(losses) == steps
    assert losses[-1] <= 0.6 * losses[0], (losses[0], losses[-1])
    val = summary["validation"]  # at the last step, on the held-out end of the corpus
    assert [v["step"] for v in val] == [steps] and val[-1]["loss"] <= 0.6 * losses[0], val
    assert summary["seconds"] / steps * shipped + (seconds - summary["seconds"]) < 180, (seconds, summary["seconds"])
    assert (out / "metrics.jsonl").is_file() and (out / "checkpoints" / "latest").is_file()


def _console(work: Workdir, b: Block) -> float:
    """Each ``$ `` command (with ``\\`` continuations) runs; the lines under it must be in its output. Returns
    their CPU seconds."""
    steps: list[tuple[str, list[str]]] = []
    for line in b.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and steps[-1][0].endswith("\\") and not steps[-1][1]:
            steps[-1] = (steps[-1][0][:-1] + line, [])
        else:
            assert steps, f"{b.where}: a console block starts with a $ command"
            steps[-1][1].append(line)
    norm = lambda s: " ".join(s.split())  # noqa: E731
    cpu = 0.0
    for command, shown in steps:
        proc, seconds = _run(work, ["bash", "-c", command])
        out, cpu = proc.stdout, cpu + seconds
        printed, at = [norm(x) for x in out.splitlines()], 0
        for want in (norm(x) for x in shown if x.strip() and x.strip() != "..."):
            assert want in printed[at:], f"{b.where}: `{command}` did not print\n  {want}\nafter line {at}; it printed:\n{out}"
            at = printed.index(want, at) + 1
    return cpu


def _file_block(work: Workdir, b: Block) -> None:
    shipped = ROOT / b.file
    if shipped.is_file():
        load = yaml.safe_load if b.lang == "yaml" else str.strip
        assert load(b.text) == load(shipped.read_text()), f"{b.where}: the block differs from {b.file}"
        return
    (work.path / b.file).parent.mkdir(parents=True, exist_ok=True)
    (work.path / b.file).write_text(b.text)


def _run_page(work: Workdir, page: str) -> None:
    for b in page_blocks(page):
        if b.skip or b.lang in SHOWN:
            continue
        start, cpu = time.monotonic(), 0.0
        if b.file:
            _file_block(work, b)
        elif b.lang == "yaml":
            yaml.safe_load(b.text)
        elif b.lang == "console":
            cpu = _console(work, b)
        else:
            quickstart = QUICKSTART["program"] in b.text
            env = {**work.env, "PARALLEL4D_DOCS_OVERRIDES": f"train.steps={QUICKSTART['steps']}"} if quickstart else None
            proc, cpu = _run(work, ["bash", "-e", "-o", "pipefail", "-c", b.text], env)
            assert proc.returncode == 0, f"{b.where}: exit {proc.returncode}\n{b.text}\n--- output:\n{proc.stdout[-6000:]}"
            if quickstart:
                _check_quickstart(work, time.monotonic() - start)
                work.quickstart_checked = True
        work.seconds[b.where] = (time.monotonic() - start, cpu)
    work.done.add(page)
    if page == "README.md":
        assert work.quickstart_checked, f"README.md no longer runs {QUICKSTART['program']}: keep the quickstart's checks"


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_printed(page, workdir, request):
    if PAGES[0] not in workdir.done:  # first and alone: later pages use its run (runs/first)
        _run_page(workdir, PAGES[0])
    if workdir.pages is None:  # the selected others, side by side
        selected = {item.callspec.params["page"] for item in request.session.items
                    if getattr(item, "module", None) is request.module and hasattr(item, "callspec")}
        workdir.pages = {p: workdir.pool.submit(_run_page, workdir, p) for p in PAGES[1:] if p in selected}
    if page != PAGES[0]:
        workdir.pages[page].result()
    slow = sorted(((s, w) for w, s in workdir.seconds.items() if w.startswith(page + ":")), reverse=True)
    print(f"\n{page}: " + ", ".join(f"line {w.split(':')[1]} {s:.1f}s ({cpu:.1f}s CPU)" for (s, cpu), w in slow))
