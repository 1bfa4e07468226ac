"""Device profiles: what the time model (:mod:`.cost`) charges for each op and each byte on a wire.

A profile is data: a YAML file (``devices/h100.yaml``, ``devices/h200.yaml``, or one written by
``parallel4d plan --calibrate``). Each op kind costs ``latency_s + work / peak`` — an affine model,
so a small op pays its launch and a large one runs at the peak rate (``peak`` per dtype for matmul
and attention, bytes/s for memory ops). A collective or a point-to-point message on a link costs
``latency_s + bytes / bytes_per_s``; a group of ranks within ``ranks_per_node`` consecutive ranks uses
the ``node`` link, any other the ``network`` one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from parallel4d.checkpoint.outputs import write_text
from parallel4d.config.errors import ConfigError
from parallel4d.planning.trace import KINDS, Op

DEVICES = Path(__file__).parent / "devices"


@dataclass(frozen=True)
class Rate:
    """One op kind's cost: ``latency_s + work / peak[dtype]``."""

    latency_s: float
    peak: dict[str, float] | float | None = None

    def seconds(self, work: float, dtype: str) -> float:
        if not work or self.peak is None:
            return self.latency_s
        peak = self.peak if isinstance(self.peak, float) else self.peak.get(dtype)
        if peak is None:
            raise ConfigError(f"the device profile gives no rate for {dtype}; add it to its peak table")
        return self.latency_s + work / peak


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float

    def seconds(self, nbytes: float, messages: int) -> float:
        return messages * self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    name: str
    memory_bytes: int | None
    rates: dict[str, Rate]  # by op kind (trace.KINDS)
    host: dict[str, Rate]  # hetero's host-side optimizer: its ``memory`` rate
    host_link_bytes_per_s: float
    ranks_per_node: int
    links: dict[str, Link]  # "node", "network"
    threads: int | None = None  # calibrated profiles: the torch threads each rank had
    op_overhead_s: float = 0.0  # the engine's own Python per op, beyond the op's dispatch (calibrated)

    def op_seconds(self, op: Op, on_host: bool = False) -> float:
        rates = self.host if on_host and op.kind in self.host else self.rates
        return rates[op.kind].seconds(op.work, op.dtype) + self.op_overhead_s

    def link(self, within_node: bool) -> Link:
        return self.links["node" if within_node else "network"]

    def as_dict(self) -> dict:
        rate = lambda r: {"latency_s": r.latency_s, **({"peak": r.peak} if r.peak is not None else {})}  # noqa: E731
        return {"name": self.name, "memory_bytes": self.memory_bytes, "threads": self.threads,
                "op_overhead_s": self.op_overhead_s,
                "rates": {k: rate(r) for k, r in self.rates.items()},
                "host": {k: rate(r) for k, r in self.host.items()},
                "host_link_bytes_per_s": self.host_link_bytes_per_s, "ranks_per_node": self.ranks_per_node,
                "links": {k: {"bytes_per_s": v.bytes_per_s, "latency_s": v.latency_s} for k, v in self.links.items()}}


def _rate(d: dict) -> Rate:
    peak = d.get("peak")
    return Rate(float(d["latency_s"]), {k: float(v) for k, v in peak.items()} if isinstance(peak, dict)
                else None if peak is None else float(peak))


def from_dict(d: dict, source: str) -> Profile:
    try:
        missing = [k for k in KINDS if k not in d["rates"]]
        if missing:
            raise KeyError(f"rates.{missing[0]}")
        return Profile(str(d["name"]), d.get("memory_bytes"), {k: _rate(v) for k, v in d["rates"].items()},
                       {k: _rate(v) for k, v in d.get("host", {}).items()}, float(d["host_link_bytes_per_s"]),
                       int(d["ranks_per_node"]),
                       {k: Link(float(v["bytes_per_s"]), float(v["latency_s"])) for k, v in d["links"].items()},
                       d.get("threads"), float(d.get("op_overhead_s", 0.0)))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"device profile {source}: missing or malformed field {e}; see "
                          f"{DEVICES / 'h100.yaml'} for the fields") from None


def known() -> list[str]:
    return sorted(p.stem for p in DEVICES.glob("*.yaml"))


def load(name_or_path: str) -> Profile:
    """A built-in profile by name (:func:`known`) or a profile YAML file."""
    path = DEVICES / f"{name_or_path}.yaml"
    if not path.exists():
        path = Path(name_or_path)
    if not path.exists():
        raise ConfigError(f"--device {name_or_path!r}: not a known device ({', '.join(known())}) nor a profile file; "
                          "write one with `parallel4d plan CONFIG --calibrate --write-profile FILE`")
    return from_dict(yaml.safe_load(path.read_text()), str(path))


def save(profile: Profile, path) -> None:
    """``--write-profile``: under a temporary name, renamed once written (:mod:`parallel4d.checkpoint.outputs`)."""
    write_text(Path(path), "--write-profile", yaml.safe_dump(profile.as_dict(), sort_keys=False))
