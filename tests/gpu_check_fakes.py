"""Steps for tests/test_gpu_check.py's orchestration tests: standard library only (a child starts in a blink)."""

from __future__ import annotations

import subprocess
import time


def records_then_hangs(ctx) -> None:
    """Records a figure and the pid of a process it started, then hangs past any cap."""
    child = subprocess.Popen(["sleep", "600"])
    ctx.record.figure("before_the_hang", 1)
    ctx.record.figure("grandchild_pid", child.pid)
    time.sleep(600)


def quick(ctx, value: str = "1") -> None:
    ctx.record.figure("value", int(value))
    ctx.record.headline(f"value {value}")


def raises(ctx) -> None:
    ctx.record.figure("before_the_error", 1)
    raise RuntimeError("a step's own error")


def not_there(ctx) -> None:
    ctx.record.status("not_available", "what it measures does not exist yet")
