"""A device profile corrected from what ``make gpu-check`` measured, so that the time model predicts it.

Reads a gpu-check JSON (``benchmarks/results/gpu_check.json``): its measured one-GPU steps (each with its job)
and the rates it measured directly (the host link). Refits the profile (``--profile``, default the GPU's
shipped one) with :func:`parallel4d.planning.refit.refit` — the host link and the host optimizer's rate set
from their direct measures, the device's matmul, attention and memory rates scaled to fit the steps — and
prints every step predicted before and after beside the measure (ratio measured / predicted, ``*`` past
15 %). ``--write FILE`` saves the refitted profile (a YAML for ``parallel4d plan --device FILE``).

The shipped profiles (``parallel4d/planning/devices/``) change only from a real GPU run's JSON: this script
never invents a number, and writes only where ``--write`` says.

Usage: ``python benchmarks/calibrate.py benchmarks/results/gpu_check.json [--profile h100] [--write FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.planning import profiles  # noqa: E402
from parallel4d.planning.refit import TOLERANCE, MeasuredStep, Refit, refit, side_by_side  # noqa: E402

USABLE = ("ok", "timed_out")  # a step stopped at its cap keeps the one-GPU steps it had measured


def profile_for(gpu: str | None) -> str | None:
    """The shipped profile of a GPU by its name (None: none for it)."""
    name = (gpu or "").lower()
    return "h200" if "h200" in name else "h100" if "h100" in name else None


def measured_steps(report: dict) -> list[MeasuredStep]:
    """The one-GPU steps every step of a gpu-check report measured (configs rebuilt from their jobs; the same
    job measured twice — the engine and the plain loop — shares one dry run)."""
    steps, seen = [], {}
    for step in report["steps"]:
        if step["status"] not in USABLE:
            continue
        for s in step.get("one_gpu_steps", []):
            m = MeasuredStep(s["name"], make_config(s["job"]), s["step_s"], s.get("peak_bytes"), s.get("host_update_s"))
            key = json.dumps(s["job"], sort_keys=True)
            if key in seen:
                m.plans = seen[key].timed_plans()
            seen.setdefault(key, m)
            steps.append(m)
    return steps


def measured_rates(report: dict) -> dict[str, float]:
    """The machine rates the report's steps measured directly (the last of each)."""
    out = {}
    for step in report["steps"]:
        out.update(step.get("measured_rates") or {})
    return out


def calibrate(report: dict, base: profiles.Profile) -> tuple[Refit, list[dict], list[dict]]:
    """``(the refit, the steps on base, the steps on the refitted profile)``."""
    steps = measured_steps(report)
    if not steps:
        raise SystemExit("calibrate: the report holds no measured one-GPU step (a dry run's or a GPU run's "
                         "default part has them)")
    if report.get("dry_run"):
        print("calibrate: a dry run's report (CPU steps): the profile below describes that CPU, not a GPU")
    fit = refit(base, steps, measured_rates(report).get("host_link_bytes_per_s"),
                name=f"{base.name} refitted to {report['machine'].get('gpu') or 'the CPU'} ({report.get('started')})")
    return fit, [side_by_side(s, base) for s in steps], [side_by_side(s, fit.profile) for s in steps]


def _row(r: dict) -> str:
    star = "*" if "step" in r["flagged"] else " "
    return f"{r['predicted_step_s']:>11.4f}{r['step_ratio']:>7.2f}{star}"


def table(fit: Refit, before: list[dict], after: list[dict]) -> list[str]:
    lines = [f"measured one-GPU steps: predicted on {before[0]['profile']} and refitted "
             f"(ratio measured / predicted, * off by more than {TOLERANCE:.0%})",
             f"  {'step':<44}{'measured s':>11}{'before s':>11}{'ratio':>8}{'after s':>11}{'ratio':>8}"]
    for b, a in zip(before, after):
        lines.append(f"  {b['name'][:43]:<44}{b['measured_step_s']:>11.4f}{_row(b)}{_row(a)}")
    lines.append("device rates' time × " + ", ".join(f"{k} {v:.3f}" for k, v in fit.factors.items()))
    if fit.direct:
        lines.append("set from direct measures: " + ", ".join(f"{k} {v:.3g}" for k, v in fit.direct.items()))
    off = [a["name"] for a in after if "step" in a["flagged"]]
    lines.append("the refitted profile predicts every step within "
                 f"{TOLERANCE:.0%}" if not off else f"still off after the refit: {', '.join(off)}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a gpu-check JSON")
    ap.add_argument("--profile", default=None,
                    help="the profile to correct (default: the GPU's shipped one, else h100)")
    ap.add_argument("--write", default=None, metavar="FILE", help="save the refitted profile (YAML)")
    args = ap.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    base = profiles.load(args.profile or profile_for(report["machine"].get("gpu")) or "h100")
    fit, before, after = calibrate(report, base)
    print("\n".join(table(fit, before, after)))
    if args.write:
        profiles.save(fit.profile, args.write)
        print(f"wrote {args.write}")
    return 0 if all("step" not in a["flagged"] for a in after) else 1


if __name__ == "__main__":
    sys.exit(main())
