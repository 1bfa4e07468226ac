"""Heterogeneous memory's rules (``hetero:``): what its chunks cannot run with (a tied embedding on
two pipeline ends, a split backward), a chunk size and a device budget that hold the largest
parameter, and the dtypes of its chunks (:func:`compute_dtype`) and of its gradients' reduction."""

from __future__ import annotations

from typing import TYPE_CHECKING

from parallel4d.config.rules.common import fixed_fields
from parallel4d.config.rules.pipeline import splits_backward

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config, HeteroConfig


def tied_head_problems(cfg: Config) -> list[str]:
    """A tied embedding and LM head on two pp ranks: hetero cannot keep their chunks in step."""
    p, pl = cfg.parallel, cfg.pipeline
    if cfg.hetero.enabled and p.pp > 1 and cfg.model.tie_embeddings and pl.schedule not in ("hanayo", "zbv"):
        untie = "" if "model.tie_embeddings" in fixed_fields(cfg.model) else " or model.tie_embeddings=false"
        return [f"hetero.enabled=true with pipeline.schedule={pl.schedule} cannot keep a tied embedding and "
                f"LM head on two pp ranks in step; use pipeline.schedule=hanayo or zbv (both ends on rank 0){untie}"]
    return []


def split_backward_problems(cfg: Config) -> list[str]:
    """A split backward (B and W apart): hetero fetches and releases a chunk for one backward pass."""
    p, pl = cfg.parallel, cfg.pipeline
    if cfg.hetero.enabled and p.pp > 1 and splits_backward(pl.schedule, pl.split_backward):
        fix = "pipeline.split_backward=false" if pl.schedule == "hanayo" else "pipeline.schedule=hanayo or 1f1b"
        return [f"hetero.enabled=true cannot run a split backward yet (pipeline.schedule={pl.schedule}"
                f"{', pipeline.split_backward=true' if pl.schedule == 'hanayo' else ''}): its chunks are fetched "
                f"and released for one backward pass per module, and W runs a second; use {fix}, or "
                "hetero.enabled=false"]
    return []


CHUNK_ALIGN = 64  # elements: 256 B for fp32, the alignment cuBLAS likes; a shard of a chunk keeps it
SHARD_SLOTS = 4  # the optimizer step of one row under ZeRO: PS, GS, M, V (hetero/budget.py's shard pool)


def chunk_step(replicas: int) -> int:
    """What ``hetero.chunk_elems`` must be a multiple of: every one of ``replicas`` (dp·sp) shards aligned."""
    return CHUNK_ALIGN * replicas


def budget_problems(h: HeteroConfig, largest: int, item: int, replicas: int = 1, mixed: bool = False,
                    on_cpu: str = "") -> list[str]:
    """``hetero.chunk_elems`` against ZeRO's shards over ``replicas`` data replicas (a multiple of
    :func:`chunk_step`), and it and ``hetero.device_budget_bytes`` against the largest parameter a rank
    holds (``largest`` elements of ``item`` bytes): a chunk holds at least that, the budget the chunks
    hetero pins at once at the least (:func:`least_budget`; ``mixed``: 16-bit chunks over wider parameters).
    ``on_cpu``: the field that puts the chunks on the CPU (``"train.device=cpu"``), where a dynamic budget
    has no device memory to measure; empty when the device is not known to be the CPU."""
    out = []
    step = chunk_step(replicas)
    if h.enabled and h.chunk_elems is not None and h.chunk_elems % step:
        out.append(f"hetero.chunk_elems={h.chunk_elems} must be a multiple of {CHUNK_ALIGN}·{replicas} = {step} "
                   f"({CHUNK_ALIGN} elements per shard of its {replicas} data replicas, dp·sp); use "
                   f"hetero.chunk_elems={-(-h.chunk_elems // step) * step} or leave it unset to search")
    if h.enabled and h.dynamic_budget and replicas > 1:
        out.append(f"hetero.dynamic_budget=true with {replicas} data replicas (dp·sp): every replica must make "
                   "the same eviction decisions, and a budget measured per device can differ; use "
                   "hetero.dynamic_budget=false and a hetero.device_budget_bytes")
    if h.enabled and h.chunk_elems is not None and h.chunk_elems < largest:
        out.append(f"hetero.chunk_elems={h.chunk_elems} is smaller than the largest parameter a rank holds "
                   f"({largest} elements); use hetero.chunk_elems≥{largest} or leave it unset to search")
    if h.enabled and h.device_budget_bytes is not None:
        least, why = least_budget(max(largest, h.chunk_elems or 0), item, replicas, mixed)
        if h.device_budget_bytes < least:
            out.append(f"hetero.device_budget_bytes={h.device_budget_bytes} is below what hetero pins on the device "
                       f"at once: {why}; use hetero.device_budget_bytes≥{least} (`parallel4d plan` shows the "
                       "chunks a rank keeps on the device at once), or leave it unset")
    return out + dynamic_budget_problems(h, on_cpu)


def dynamic_budget_problems(h: HeteroConfig, on_cpu: str) -> list[str]:
    """A dynamic budget whose chunks compute on the CPU (``on_cpu`` says why: a field, or the machine
    for ``auto``; empty when not known to be the CPU) and no fixed budget to fall back on."""
    if h.enabled and h.dynamic_budget and h.device_budget_bytes is None and on_cpu:
        return [f"hetero.dynamic_budget=true on the CPU ({on_cpu}) needs hetero.device_budget_bytes: a CPU has no "
                "device memory to measure the budget from; set hetero.device_budget_bytes or "
                "hetero.dynamic_budget=false"]
    return []


def least_budget(largest: int, item: int, replicas: int = 1, mixed: bool = False) -> tuple[int, str]:
    """``(bytes, why)``: a lower bound of the smallest ``hetero.device_budget_bytes`` that runs, as
    ``hetero/budget.py`` counts it on the rank holding the largest parameter (``largest`` elements of
    ``item`` bytes): its chunk is at least that, rounded up to :func:`chunk_step`; the main pool pins the
    P, G, M, V chunks of one row for the optimizer without data replicas and 16-bit chunks (else at
    least a module's parameter chunk and a gradient chunk); ZeRO adds its shard slots of a chunk/replicas
    each (one under 16-bit chunks, else ``SHARD_SLOTS``). The exact value depends on how the parameters
    pack into chunks: ``parallel4d plan`` reports it."""
    step = chunk_step(replicas)
    chunk = -(-max(largest, 1) // step) * step
    slots = 4 if replicas == 1 and not mixed else 2
    shards = 0 if replicas == 1 else 1 if mixed else SHARD_SLOTS
    least = (slots * chunk + shards * (chunk // replicas)) * item
    why = (f"{slots} chunks of at least {chunk} elements (the largest parameter a rank holds, {largest} elements, "
           f"in chunks of multiples of {step}) × {item} bytes"
           + (f" plus {shards} ZeRO shard slot{'s' if shards > 1 else ''} of {chunk // replicas} elements" if shards
              else "") + f" = {least} bytes")
    return least, why


def compute_dtype(cfg: Config) -> str:
    """The dtype name of hetero's device chunks (parameters and gradients): ``hetero.compute_dtype``, or
    the autocast dtype under autocast (16-bit chunks, the master copy in the parameters' dtype on the
    host), else the parameters' dtype (one copy)."""
    t = cfg.train
    return cfg.hetero.compute_dtype or (t.autocast if t.autocast != "none" else t.parameters)


def reduce_dtype_problems(cfg: Config) -> list[str]:
    """``train.grad_reduce_dtype`` other than the chunks' dtype: hetero reduces in its chunks' dtype."""
    t = cfg.train
    if t.grad_reduce_dtype and cfg.hetero.enabled and t.grad_reduce != compute_dtype(cfg):
        return [f"train.grad_reduce_dtype={t.grad_reduce_dtype}: hetero reduces gradients in its chunks' dtype "
                f"({compute_dtype(cfg)}); unset it or hetero"]
    return []


def compute_dtype_problems(cfg: Config) -> list[str]:
    """``hetero.compute_dtype`` that autocast would not compute in, or wider than the parameters."""
    t, want = cfg.train, cfg.hetero.compute_dtype
    if not (cfg.hetero.enabled and want):
        return []
    if t.autocast != "none" and want != t.autocast:
        return [f"hetero.compute_dtype={want} but train's autocast computes in {t.autocast}; "
                f"use hetero.compute_dtype={t.autocast} or leave it unset"]
    if t.autocast == "none" and want != t.parameters and not (want == "float32" and t.parameters == "float64"):
        return [f"hetero.compute_dtype={want} with {t.parameters} parameters and no autocast: the chunks would "
                f"compute in another precision than train.dtype asks; leave hetero.compute_dtype unset, or set "
                f"train.dtype=bfloat16/float16 (16-bit chunks), or float32 chunks under train.dtype=float64"]
    return []
