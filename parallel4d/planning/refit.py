"""Measured one-GPU steps beside the time model's, and a device profile refitted to them.

``make gpu-check`` (``benchmarks/gpu_check.py``) measures whole training steps on one GPU: the engine and
the plain loop at the Llama-3.2-1B shape, hetero's GPT beside plain PyTorch. For each, :func:`side_by_side`
puts the step :func:`.cost.predict` gives on a profile (what ``parallel4d plan --device`` prints) beside the
measured one, and the device memory :func:`.dry_run.plan` gives beside the measured peak; a ratio
``measured / predicted`` off 1 by more than :data:`TOLERANCE` is flagged.

:func:`refit` corrects a profile so that it predicts those steps:

* what a run measured directly is taken as it is: the host link (pinned copies, the slower direction) and
  the host optimizer's rate (hetero's host update seconds per step against the work the plan puts on the
  host, less its ops' latencies);
* the device's rates — each op kind and dtype that carries work in the measured steps (matmul and attention
  per dtype, memory) — are scaled by factors fitted to the measured steps: Gauss–Newton on ``log(predicted
  / measured)`` through :func:`.cost.predict` itself (so every rule of the model holds, the host step the
  worker hides included), each factor's log held towards 0 by a weak prior (:data:`PRIOR`): a kind the
  steps barely use keeps its profile's rate, and two steps cannot move five rates apart.

Nothing here measures: the numbers come from a run's JSON. The profiles shipped in ``devices/`` change only
from a real GPU run's refit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from parallel4d.config.schema import Config
from parallel4d.planning.cost import host_step_share, predict
from parallel4d.planning.dry_run import RankPlan, plan
from parallel4d.planning.profiles import Profile, Rate

TOLERANCE = 0.15  # a prediction within 15 % of the measure holds
PRIOR = 0.05  # the weight of a factor's log² beside each step's log²(predicted / measured)
DEVICE_KINDS = ("matmul", "attention", "memory")  # the device rates a refit scales


@dataclass
class MeasuredStep:
    """One step a GPU run measured: its job, median seconds and peak device bytes (``None``: not measured
    for this job alone); under hetero the host optimizer's seconds per step."""

    name: str
    cfg: Config
    step_s: float
    peak_bytes: float | None = None
    host_update_s: float | None = None
    plans: list[RankPlan] | None = field(default=None, repr=False)  # its timed dry run, made once

    def timed_plans(self) -> list[RankPlan]:
        if self.plans is None:
            self.plans = plan(self.cfg, timed=True)
        return self.plans


def ratio_row(measured: float | None, predicted: float | None) -> tuple[float | None, bool]:
    """``(measured / predicted, off by more than TOLERANCE)``; ``(None, False)`` where either is missing."""
    if not measured or not predicted:
        return None, False
    r = measured / predicted
    return r, abs(r - 1) > TOLERANCE


def side_by_side(step: MeasuredStep, profile: Profile) -> dict:
    """The measured step and peak memory beside the predicted ones on ``profile``, their ratios and which of
    them are off (``flagged``: "step", "memory")."""
    plans = step.timed_plans()
    pred = predict(step.cfg, plans, profile)
    memory = max(r.device_bytes for r in plans)
    step_ratio, step_off = ratio_row(step.step_s, pred.step_s)
    mem_ratio, mem_off = ratio_row(step.peak_bytes, memory)
    return {"name": step.name, "profile": profile.name, "measured_step_s": step.step_s,
            "predicted_step_s": pred.step_s, "step_ratio": step_ratio, "measured_peak_bytes": step.peak_bytes,
            "predicted_peak_bytes": memory, "memory_ratio": mem_ratio, "predicted_parts_s": pred.parts,
            "predicted_mfu": pred.mfu, "flagged": [k for k, off in (("step", step_off), ("memory", mem_off)) if off]}


# --- the refit ------------------------------------------------------------------------------------
def _host_work(cfg: Config, plans: list[RankPlan], profile: Profile) -> tuple[float, float]:
    """``(bytes, fixed seconds)`` of the optimizer step's host share on ``profile``: its ops' work and their
    latency plus the per-op overhead (:func:`.cost.compute_seconds`'s host term)."""
    p = plans[0]
    share = host_step_share(cfg, p)
    work = fixed = 0.0
    for op, n in p.ops.items():
        if op.phase == "step" and op.kind in profile.host:
            work += n * share * op.work
            fixed += n * share * (profile.host[op.kind].latency_s + profile.op_overhead_s)
    return work, fixed


def host_rate(steps: list[MeasuredStep], profile: Profile) -> float | None:
    """The host optimizer's bytes/s from the steps that measured their host updates (the median), or None."""
    rates = []
    for s in steps:
        if s.host_update_s is None or "memory" not in profile.host:
            continue
        work, fixed = _host_work(s.cfg, s.timed_plans(), profile)
        if work > 0 and s.host_update_s > fixed:
            rates.append(work / (s.host_update_s - fixed))
    return sorted(rates)[len(rates) // 2] if rates else None


def _keys(steps: list[MeasuredStep], profile: Profile) -> list[tuple[str, str | None]]:
    """The device rates the steps' ops put work on: ``(kind, dtype)`` for a per-dtype peak, ``(kind, None)``
    for a single one (memory's)."""
    keys = set()
    for s in steps:
        for op in s.timed_plans()[0].ops:
            if op.kind in DEVICE_KINDS and op.work:
                keys.add((op.kind, op.dtype if isinstance(profile.rates[op.kind].peak, dict) else None))
    return sorted(keys, key=lambda k: (k[0], k[1] or ""))


def _scaled(profile: Profile, keys: list[tuple[str, str | None]], logs: list[float]) -> Profile:
    """``profile`` with each key's device peak divided by ``exp(log)`` (its ops take that much longer)."""
    rates = dict(profile.rates)
    for (kind, dtype), y in zip(keys, logs):
        rate, f = rates[kind], math.exp(y)
        peak = rate.peak / f if dtype is None else {**rate.peak, dtype: rate.peak[dtype] / f}
        rates[kind] = Rate(rate.latency_s, peak)
    return replace(profile, rates=rates)


def _residuals(steps: list[MeasuredStep], profile: Profile, keys, logs: list[float]) -> list[float]:
    scaled = _scaled(profile, keys, logs)
    misfit = [math.log(predict(s.cfg, s.timed_plans(), scaled).step_s / s.step_s) for s in steps]
    return misfit + [math.sqrt(PRIOR) * y for y in logs]


def _gauss_newton(steps: list[MeasuredStep], profile: Profile, keys, iters: int = 30) -> list[float]:
    """The logs of the keys' time factors minimising the residuals (forward-difference Jacobian, halving
    steps that do not lower the sum of squares)."""
    logs, h = [0.0] * len(keys), 1e-5
    r = _residuals(steps, profile, keys, logs)
    for _ in range(iters):
        cols = []
        for i in range(len(keys)):
            moved = [y + (h if j == i else 0.0) for j, y in enumerate(logs)]
            cols.append([(a - b) / h for a, b in zip(_residuals(steps, profile, keys, moved), r)])
        jac = torch.tensor(cols, dtype=torch.float64).T
        delta = torch.linalg.lstsq(jac, -torch.tensor(r, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
        scale, before = 1.0, sum(x * x for x in r)
        while scale > 1e-3:
            trial = [y + scale * float(d) for y, d in zip(logs, delta)]
            r_trial = _residuals(steps, profile, keys, trial)
            if sum(x * x for x in r_trial) < before:
                break
            scale /= 2
        else:
            break  # no step lowers it: at the minimum
        logs, r = trial, r_trial
        if float(delta.abs().max()) * scale < 1e-7:
            break
    return logs


@dataclass
class Refit:
    """A refitted profile, the factor each device rate's time was scaled by, and what was set directly."""

    profile: Profile
    factors: dict[str, float]  # "matmul bfloat16" → its ops' time × factor (peak ÷ factor)
    direct: dict[str, float]  # "host_link_bytes_per_s", "host memory peak": measured, set as they are


def refit(profile: Profile, steps: list[MeasuredStep], host_link_bytes_per_s: float | None = None,
          name: str | None = None) -> Refit:
    """``profile`` corrected to predict ``steps`` (see the module docstring); ``host_link_bytes_per_s``: a
    measured host↔device bandwidth, set as it is."""
    if not steps:
        raise ValueError("refit needs at least one measured step (a gpu-check JSON's one_gpu_steps)")
    direct = {}
    if host_link_bytes_per_s:
        profile = replace(profile, host_link_bytes_per_s=float(host_link_bytes_per_s))
        direct["host_link_bytes_per_s"] = float(host_link_bytes_per_s)
    host = host_rate(steps, profile)
    if host is not None:
        profile = replace(profile, host={**profile.host, "memory": Rate(profile.host["memory"].latency_s, host)})
        direct["host memory peak"] = host
    keys = _keys(steps, profile)
    logs = _gauss_newton(steps, profile, keys)
    fitted = _scaled(profile, keys, logs)
    factors = {f"{k}{'' if d is None else ' ' + d}": math.exp(y) for (k, d), y in zip(keys, logs)}
    return Refit(replace(fitted, name=name or f"{profile.name} refitted"), factors, direct)
