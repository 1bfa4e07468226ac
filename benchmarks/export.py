"""``parallel4d export`` of a 1B-parameter checkpoint: its peak resident memory, time and bytes written.

A checkpoint in parallel4d's layout-free format (the same ``checkpoint.dcp.save`` and DCP planner a
training run uses, with config.yaml, run.json and checksums) of a Llama-3.2-1B-shaped model in float32
(``--model``: 1.24B parameters, a 128256 × 2048 token table of 1.05 GB; or ``gpt2-1b``) is written
once under ``--scratch`` by a child process, one tensor at a time (each tensor's values are drawn when DCP
asks for them, so not even that process holds the model), and reused while its config matches.
Then ``parallel4d export CKPT OUT`` runs in a child process of its own, which reports its own peak
resident memory (``VmHWM`` of ``/proc/self/status``: a parent's ``ru_maxrss`` of a child counts the
parent's pages it was forked from), once right after its imports and once at the end. A third child
checks the export against the values drawn (every tensor's first and last rows, the small ones whole).

Prints a table and writes ``benchmarks/results/export.json`` (device, torch version, config, peak RSS,
seconds, bytes written). This process imports no torch. DeepSpeed's ``zero_to_fp32`` is not run: it
``torch.load``s every ZeRO partition and assembles the whole float32 state dict in host memory before
writing it (at least the model's 4 bytes per parameter, ~5 GB here), and it refuses a checkpoint with
tensor or pipeline parallelism (one ``mp_rank``) — which parallel4d's own gather and export read.

    python benchmarks/export.py                 # the 1B export (~10 GB of disk under /tmp, removed after)
    python benchmarks/export.py --keep          # keep the checkpoint for the next run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {  # model: sections
    "llama-1b": {"arch": "llama", "vocab_size": 128256, "hidden": 2048, "heads": 32, "kv_heads": 8, "layers": 16,
                 "intermediate_size": 8192, "rope_theta": 5e5, "tie_embeddings": True, "seq_len": 2048},
    "gpt2-1b": {"arch": "gpt2", "vocab_size": 50304, "hidden": 2048, "heads": 16, "layers": 20, "seq_len": 1024},
}
# the export, in a child that reports its peak resident memory after its imports and at the end
RUN_AND_REPORT = """
import sys
import torch.distributed.checkpoint, parallel4d.checkpoint.export, parallel4d.models.hf
from parallel4d.checkpoint.resume import saved_config
from parallel4d.config.load import make_config
from parallel4d.tools.cli import main
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
parallel4d.models.hf.dense_shapes(make_config(saved_config(sys.argv[2])).model)  # the family's modules imported
imported = hwm()
rc = main(sys.argv[1:])
print("PEAK_RSS", imported, hwm(), file=sys.stderr)
sys.exit(rc)
"""


def _values(name: str, shape, seed: int = 0):
    """The values drawn for tensor ``name`` (float32, std 0.02; the same every time)."""
    import torch

    g = torch.Generator().manual_seed(seed + sum(ord(c) * (i + 1) for i, c in enumerate(name)))
    return torch.randn(shape, generator=g) * 0.02


def write_checkpoint(root: Path, model: dict, seed: int = 0) -> Path:
    """A parallel4d checkpoint of ``model`` (the ``model:`` section) under ``root`` with drawn values,
    through ``checkpoint.dcp.save`` (one process); each tensor is made only when DCP writes it. Returns
    its step directory."""
    import torch

    from parallel4d.checkpoint import dcp as checkpoint
    from parallel4d.checkpoint.shards import DenseShards
    from parallel4d.config.load import make_config
    from parallel4d.models.hf import dense_shapes

    class Drawn(DenseShards):
        """All of a dense tensor, drawn when DCP asks for it (a meta tensor until then)."""

        def __init__(self, name: str, shape):
            super().__init__(shape, torch.empty(shape, device="meta"))
            self.name = name

        def __get_tensor_shard__(self, index):
            return _values(self.name, self.shape, seed)

    cfg = make_config({"model": model})
    state = {"step": torch.tensor(1), "tokens_seen": torch.tensor(0)}
    for name, shape in dense_shapes(cfg.model).items():
        if not (cfg.model.tie_embeddings and name == "head.weight"):
            state[f"model.{name}"] = Drawn(name, shape)
    return checkpoint.save(state, root, 1, keep=1, extra_files={"config.yaml": cfg.to_yaml()})


def check_export(out_dir: Path, model: dict, seed: int = 0) -> int:
    """Compare the export with the values drawn: tensors of ≤ 4M elements whole, the others' first
    and last 8 rows. Returns the tensors checked; AssertionError naming the first that differs."""
    import torch
    from safetensors import safe_open

    from parallel4d.config.load import make_config
    from parallel4d.models.hf import dense_shapes, p4d_to_hf

    cfg = make_config({"model": model})
    shapes, checked = dense_shapes(cfg.model), 0
    index = out_dir / "model.safetensors.index.json"
    files = {f for f in json.loads(index.read_text())["weight_map"].values()} if index.exists() else {"model.safetensors"}
    handles = {f: safe_open(str(out_dir / f), framework="pt") for f in files}
    where = {n: h for h in handles.values() for n in h.keys()}
    for name, (hf, how) in p4d_to_hf(cfg.model).items():
        want = _values(name, shapes[name], seed)
        want = want.t() if how == "t" else want
        got = where[hf].get_slice(hf)
        rows = [slice(None)] if want.numel() <= 1 << 22 else [slice(0, 8), slice(want.shape[0] - 8, want.shape[0])]
        for r in rows:
            assert torch.equal(got[r], want[r]), f"{hf}: rows {r} differ from the checkpoint's"
        checked += 1
    return checked


def _child(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc, seconds


def measure_export(ckpt: Path, out_dir: Path) -> dict:
    """``parallel4d export ckpt out_dir`` in a child: its peak RSS after imports and at the end (bytes), seconds."""
    proc, seconds = _child("-c", RUN_AND_REPORT, "export", str(ckpt), str(out_dir))
    line = next(line for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS "))
    imported, peak = (int(x) for x in line.split()[1:])
    written = sum(p.stat().st_size for p in out_dir.iterdir())
    return {"peak_rss_bytes": peak, "rss_after_imports_bytes": imported, "seconds": round(seconds, 2),
            "bytes_written": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-1b")
    ap.add_argument("--scratch", default="/tmp/parallel4d-export-bench", help="checkpoint and export go here")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (the export is always removed)")
    ap.add_argument("--out", default=str(RESULTS / "export.json"))
    ap.add_argument("--write-checkpoint", help=argparse.SUPPRESS)  # a child's part: write it there
    ap.add_argument("--check", help=argparse.SUPPRESS)  # a child's part: check the export there
    args = ap.parse_args()
    model = MODELS[args.model]
    if args.write_checkpoint:
        from parallel4d.checkpoint.rows import CheckpointTensors

        step = write_checkpoint(Path(args.write_checkpoint), model)
        with CheckpointTensors(step) as tensors:
            parameters = sum(shape.numel() for k, (shape, _) in tensors.shapes.items() if k.startswith("model."))
        print(json.dumps({"step": str(step), "parameters": parameters, "model": model,
                          "bytes": sum(f.stat().st_size for f in step.iterdir())}))
        return
    if args.check:
        print(json.dumps({"checked": check_export(Path(args.check), model)}))
        return

    scratch = Path(args.scratch) / args.model
    marker, out_dir = scratch / "checkpoint.json", scratch / "hf"
    shutil.rmtree(out_dir, ignore_errors=True)
    made = json.loads(marker.read_text()) if marker.is_file() else None
    if made is None or made["model"] != model or not Path(made["step"]).is_dir():
        shutil.rmtree(scratch, ignore_errors=True)
        proc, seconds = _child(__file__, "--model", args.model, "--write-checkpoint", str(scratch / "checkpoints"))
        made = {**json.loads(proc.stdout.splitlines()[-1]), "written_s": round(seconds, 1)}
        marker.write_text(json.dumps(made))
    versions = json.loads(_child("-c", "import json, torch; print(json.dumps(torch.__version__))")[0].stdout)
    try:
        result = measure_export(Path(made["step"]), out_dir)
        check = _child(__file__, "--model", args.model, "--check", str(out_dir))[0]
        result["tensors_checked"] = json.loads(check.stdout.splitlines()[-1])["checked"]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    report = {"benchmark": "export", "device": f"cpu: {platform.processor() or platform.machine()}, "
                                               f"{os.cpu_count()} cores, no GPU used",
              "torch": versions, "python": platform.python_version(), "model": args.model, "config": model,
              "parameters": made["parameters"], "checkpoint_bytes": made["bytes"],
              "checkpoint_written_s": made["written_s"], "export": result, "target_peak_rss_bytes": int(1.5e9),
              "zero_to_fp32": "not run: it holds the whole float32 state dict (at least 4 bytes per parameter) in "
                              "host memory before writing it, and refuses tensor- or pipeline-parallel checkpoints"}
    _print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"-> {args.out}")


def _print(report: dict) -> None:
    e = report["export"]
    rows = [("model", f"{report['model']}: {report['parameters'] / 1e9:.2f}B parameters, float32"),
            ("checkpoint", f"{report['checkpoint_bytes'] / 1e9:.2f} GB (written in {report['checkpoint_written_s']} s)"),
            ("export written", f"{e['bytes_written'] / 1e9:.2f} GB in {e['seconds']:.1f} s "
                               f"({e['bytes_written'] / 1e9 / e['seconds']:.2f} GB/s, checksums verified first)"),
            ("peak RSS after imports", f"{e['rss_after_imports_bytes'] / 1e9:.3f} GB"),
            ("peak RSS of the export", f"{e['peak_rss_bytes'] / 1e9:.3f} GB (target < 1.5 GB)"),
            ("tensors checked", str(e["tensors_checked"]))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
