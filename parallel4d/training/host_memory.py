"""This process's host memory: what its resident set grew by from a baseline, and glibc's allocator
told to give large freed blocks back to the kernel.

``summary.json``'s ``hetero.host_rss_bytes_per_param`` is :class:`HostPeak`'s growth from just before
the model is built to the end of the run, over the rank's parameters; ``parallel4d plan`` predicts it
(docs/planning.md). The two agree only if memory freed during the run leaves the resident set, which
glibc's default does not promise: :func:`return_large_blocks`, which a launched hetero job's workers call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 1 << 20  # bytes: a block this large or larger is mapped on its own


def return_large_blocks() -> bool:
    """Each block of :data:`MMAP_THRESHOLD` bytes or more mapped on its own, so that freeing it unmaps
    it (glibc's ``mallopt(M_MMAP_THRESHOLD)``), for the rest of this process; False where the C library
    is not glibc (nothing done). A launched hetero job's workers call it (``launcher/launch.py``).

    glibc starts that threshold at 128 KiB and raises it to the largest mapped block freed so far (up to
    32 MiB): once a rank's first parameters are freed into hetero's chunks, blocks of their size come
    from the heap instead, where a freed block stays resident while a block above it lives. Measured on
    ``configs/hetero.yaml`` at hidden 512 (25.4 M parameters per rank, dp = 2, float32, no checkpoint):
    the freed parameters and the first step's temporaries stayed resident, 19.2 host bytes per parameter
    where its tensors held at most 10.4 at once; with the threshold held at 128 KiB, 11.6 (the rest is
    torch's kernels paged in on first use). Held at 1 MiB, blocks below it stay in the heap: the figures
    of docs/planning.md move by 0.1 byte per parameter, and the many small temporaries of a CPU step
    are not mapped and faulted in one by one (at 128 KiB ``configs/hetero.yaml`` took 24 times the page
    faults, at 1 MiB twice). A job without hetero keeps glibc's default: its CPU steps' activations of
    a few MiB would each be mapped (``configs/quickstart.yaml``: 5 s more in the kernel per 30 steps)."""
    libc = _glibc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


class HostPeak:
    """This process's peak resident set above a baseline: what it grew by from its construction on.

    Linux: writing ``5`` to ``/proc/self/clear_refs`` sets the peak (``VmHWM``, and so ``ru_maxrss``) to
    the current resident set, the baseline (``VmRSS``) is read then, and :meth:`grown` reads ``VmHWM``:
    ``source`` ``"VmHWM"``. Where that cannot be done (no ``/proc``, a kernel that refuses the write), the
    process's lifetime peak ``ru_maxrss`` over the resident set at construction (without ``/proc``, the
    lifetime peak then): ``source`` ``"ru_maxrss"``, which a larger peak before construction (the
    imports, an earlier job in the process) hides. The reset is the process's: the host figure of
    ``metrics.jsonl``'s ``peak_memory_bytes`` counts from here on too."""

    def __init__(self):
        self.source = "VmHWM" if _reset_peak() else "ru_maxrss"
        self.baseline = _status_bytes("VmRSS") or max_rss()

    def grown(self) -> int:
        """Bytes the peak resident set reached above the baseline (0 if it never did)."""
        peak = _status_bytes("VmHWM") if self.source == "VmHWM" else max_rss()
        return max(0, (peak or 0) - self.baseline)

    def per_param(self, params: int) -> dict:
        """``summary.json``'s figures: the growth in bytes and over ``params`` parameters, and how it
        was read."""
        grown = self.grown()
        return {"host_rss_bytes": grown, "host_rss_bytes_per_param": grown / max(params, 1),
                "host_rss_source": self.source}


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


def _status_bytes(field: str) -> int | None:
    """``/proc/self/status``'s ``field`` (kB) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


def max_rss() -> int:
    """This process's peak resident set since it started (or since :class:`HostPeak` reset it), bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux counts KiB
