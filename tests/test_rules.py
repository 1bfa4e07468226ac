"""parallel4d.config.rules: each technique's pure rules (fast, no torch, no processes)."""

import ast
from pathlib import Path
from typing import get_args

import pytest

from parallel4d.config.rules import common, pipeline, tensor2d
from parallel4d.config.schema import ScheduleName


def test_common_rules_are_the_bottom_of_the_import_graph():
    tree = ast.parse(Path(common.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert imported <= {"__future__", "difflib", "math", "typing"}, imported
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]


@pytest.mark.parametrize("value,m,want", [(70, 4, [68, 72]), (3, 4, [4]), (8, 4, [8]), (0, 4, [4]), (-5, 1, [1])])
def test_nearest_multiples(value, m, want):
    assert common.nearest_multiples(value, m) == want


def test_near_multiples_text():
    assert common.near_multiples(70, 4) == "68 or 72"
    assert common.near_multiples(3, 4) == "4"


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 360, 1024])
def test_divisors_match_trial_division(n):
    assert common.divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_of_nothing():
    assert common.divisors(0) == [] and common.divisors(-4) == []


def test_closest():
    assert common.closest([1, 2, 3, 4, 6, 12], 5) == [4, 6]
    assert common.closest([1, 2, 3, 4, 6, 12], 4) == [4]
    assert common.closest([4, 8], 2) == [4]
    assert common.closest([], 3) == []


def test_nearest_divisor():
    assert common.nearest_divisor(64, 6) == 4  # 4 and 8 tie: the smaller
    assert common.nearest_divisor(64, 100) == 64
    assert common.nearest_divisor(2 ** 61 - 1, 100, reach=10) is None  # a prime: nothing near, and no long loop


def test_did_you_mean():
    assert common.did_you_mean("stepz", ["steps", "seed"]) == "did you mean 'steps'? "
    assert common.did_you_mean("polcy", ["policy"], prefix="hetero.") == "did you mean 'hetero.policy'? "
    assert common.did_you_mean("zzz", ["steps"]) == ""


def test_grid_side():
    assert tensor2d.grid_side(9) == 3
    with pytest.raises(ValueError, match=r"parallel.tp=8 is not a perfect square.*use parallel.tp=4 or 9"):
        tensor2d.grid_side(8)


def test_positive_int():
    assert common.positive_int("pp", 3.0) == 3
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"pp={bad} must be an integer ≥ 1"):
            common.positive_int("pp", bad)


def test_schedule_names_agree_with_the_config():
    assert get_args(ScheduleName) == pipeline.SCHEDULES


@pytest.mark.parametrize("name,want", [("Hanayo", "hanayo"), ("one-f-one-b", "1f1b"), ("wave", "hanayo"),
                                       ("interleaved_1f1b", "interleaved"), ("dapple", "1f1b")])
def test_schedule_aliases(name, want):
    assert pipeline.check_schedule_name(name) == want


def test_unknown_schedule_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'gpipe'\\? valid: gpipe, 1f1b, interleaved, hanayo, zb_h1, zbv"):
        pipeline.check_schedule_name("gpip")


def test_num_chunks():
    assert [pipeline.num_chunks(s, 4, waves=2, chunks_per_rank=3) for s in pipeline.SCHEDULES] == [4, 4, 12, 16, 4, 8]


def test_interleaved_microbatch_problem():
    assert pipeline.interleaved_microbatch_problem(4, 6, 2).endswith("use pipeline.microbatches=4 or 8")
    assert pipeline.interleaved_microbatch_problem(4, 3, 2) is None  # m ≤ P
    assert pipeline.interleaved_microbatch_problem(4, 8, 2) is None  # a multiple of P
    assert pipeline.interleaved_microbatch_problem(4, 6, 1) is None  # one chunk per rank: plain 1F1B


def test_pipeline_batch_problem_suggests_both_fixes():
    (msg,) = pipeline.pipeline_arg_problems(6, 2, 4, batch=20, batch_divisor=2)
    assert msg == ("data.batch_size=20 is not divisible by 2·pipeline.microbatches = 8; "
                   "use data.batch_size=16 or 24 or pipeline.microbatches=2 or 5")


def test_divisors_stay_quick_for_absurd_sizes():
    """A message for hidden=10**18 must not run 10⁹ trial divisions (it hung check_tensor2d)."""
    import time

    from parallel4d.config.rules.common import divisors

    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(1) == [1] and divisors(0) == []
    t0 = time.monotonic()
    found = divisors(10**18)
    assert time.monotonic() - t0 < 2 and all(10**18 % d == 0 for d in found) and {1, 2, 5, 10**18} <= set(found)
