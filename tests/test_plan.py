"""``parallel4d plan`` against what runs measure.

The plan is a dry run on fake tensors (parallel4d/plan.py); a run measures the same quantities on
real tensors at its first step (``summary.json``'s ``memory``). For the example configs as the
end-to-end tests run them (their runs are shared with tests/test_e2e.py, not repeated), each
rank's parameter, gradient, optimizer, activation and hetero bytes and the bytes it sends along
each axis are within 10 % of the plan; tests/test_e2e.py checks it too for GPipe, interleaved and 1F1B
with activation checkpointing.
That the measured activations are what the process holds is checked against glibc's heap in
tests/test_validation.py.
"""

import time

import pytest

from conftest import assert_plan_matches
from parallel4d.tools.cli import main
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.tools.plan import dry_run, parse_bytes, plan
from test_e2e import FOUR_D, FOUR_D_STEPS, PIPELINE_STEPS, ROOT, shared_run

SHIPPED = {  # config → the overrides its shared end-to-end run uses (test_e2e)
    "tensor2d": [],
    "sequence": [],
    "pipeline": PIPELINE_STEPS,
    "pipeline_zb": PIPELINE_STEPS,
    "llama": ["train.steps=8"],
    "hetero": [],
}


def config_path(name):
    return ROOT / "configs" / f"{name}.yaml"


@pytest.mark.parametrize("name", list(SHIPPED))
def test_plan_is_within_10_percent_of_the_run(name, tmp_path_factory):
    got, _ = shared_run(name, tmp_path_factory, SHIPPED[name])
    worst = assert_plan_matches(config_path(name), SHIPPED[name], got)
    assert got["memory"]["step"] == 1 and set(worst) >= {"activations", "parameters"}


@pytest.mark.parametrize("case", list(FOUR_D))
def test_plan_of_all_four_techniques(case, sixteen_workers):
    """configs/4d.yaml (16 ranks: Hanayo × ring × 2D × hetero), float32 and bfloat16 autocast."""
    got, out = sixteen_workers[0]["test_e2e"][case]
    worst = assert_plan_matches(config_path("4d"), [*FOUR_D[case], *FOUR_D_STEPS], got)
    assert {"hetero_device", "hetero_host", "sent pp", "sent sp", "sent tp_row", "sent dp+sp"} <= set(worst)


def test_a_7b_model_is_planned_without_its_memory():
    """A Llama-2-7B-shaped model on one rank: fake tensors, so the plan holds no weights, and the
    parameter bytes are the model's 6 738 415 616 float32 parameters exactly."""
    cfg = make_config({"model": {"arch": "llama", "vocab_size": 32000, "seq_len": 512, "hidden": 4096, "heads": 32,
                                 "kv_heads": 32, "layers": 32, "intermediate_size": 11008},
                       "data": {"batch_size": 1}, "checkpoint": {"enabled": False}})
    (rank,) = plan(cfg)
    n = 6_738_415_616
    assert rank.parameters == rank.gradients == 4 * n
    assert rank.optimizer_state == 8 * n + 4 * (32 * 9 + 3)  # two moments; a 4-byte step per tensor
    assert rank.activations > 0 and rank.sent_by_axis == {}


def test_plan_says_whether_it_fits_and_what_to_turn(capsys):
    """--gpus-memory: quickstart's ranks need ~117 MiB (67 of them activations): it fits in 80 GiB; in
    100 MiB it does not, and activation checkpointing is named as a knob that makes it fit."""
    assert main(["plan", str(config_path("quickstart")), "--gpus-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "fits: the largest rank needs" in out and "dp+sp" in out
    assert main(["plan", str(config_path("quickstart")), "--gpus-memory", "100MiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("does not fit") for line in lines)
    knob = next(line for line in lines if line.split()[:1] == ["train.activation_checkpointing=blocks"]
                and "hetero.enabled" not in line)
    assert knob.rstrip().endswith("— fits"), knob
    assert main(["plan", str(config_path("quickstart")), "--gpus-memory", "lots"]) == 2
    assert "--gpus-memory 'lots'" in capsys.readouterr().err


def test_sizes():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("81920MiB") == 80 * 2**30 and parse_bytes("1e9B") == 10**9
    with pytest.raises(ConfigError, match="'80' has no unit; write e.g. 80GiB"):  # not 80 bytes
        parse_bytes("80")


@pytest.mark.parametrize("extra", [
    {"parallel": {"dp": 2, "sp": 2, "tp": 4}, "model": {"seq_len": 32}},
    {"train": {"activation_checkpointing": "blocks"}, "pipeline": {"microbatches": 2}},
    {"model": {"arch": "llama", "kv_heads": 2}, "train": {"dtype": "bfloat16"}},
])
def test_a_deep_model_is_planned_from_two_shallow_dry_runs_exactly(extra):
    """#26.4: without a pipeline every planned quantity is affine in the depth, so a 9-layer plan made
    from 1- and 2-layer dry runs equals the 9-layer dry run field for field (and a 512-layer plan
    takes the time of three blocks)."""
    data = {"model": {"layers": 9, "hidden": 64, "heads": 4}, "data": {"batch_size": 8}}
    for section, fields in extra.items():
        data[section] = {**data.get(section, {}), **fields}
    cfg = make_config(data)
    assert plan(cfg) == [dry_run(cfg)]


def test_plan_refuses_at_once_what_it_cannot_dry_run_in_seconds(capsys):
    args = ["--set", "model.layers=256", "--set", "parallel.pp=4", "--set", "pipeline.microbatches=8"]
    start = time.perf_counter()
    assert main(["plan", str(config_path("quickstart")), *args]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert "model.layers=256 × pipeline.microbatches=8" in err and "--set model.layers=" in err, err


def test_the_plan_cuts_the_pipeline_by_compute(tmp_path, capsys):
    """pp=2 with a wide vocabulary: the embedding's lookup costs nothing and the LM head's V·h products
    are the heaviest stage, so the second rank holds the head alone (its untied copy of the table and
    ln_f), the first the embedding and every block (by parameter count it would be two blocks each);
    the plan says so."""
    import yaml

    job = {"model": {"vocab_size": 4096, "seq_len": 16, "hidden": 64, "heads": 4, "layers": 4},
           "parallel": {"pp": 2}, "pipeline": {"microbatches": 2}, "data": {"batch_size": 4}}
    assert dry_run(make_config(job), 1).parameters == 4 * (4096 * 64 + 2 * 64)
    (tmp_path / "wide.yaml").write_text(yaml.safe_dump(job))
    assert main(["plan", str(tmp_path / "wide.yaml")]) == 0
    assert "chunks          embed–blocks.3 | head  (cut by training FLOPs per token)" in capsys.readouterr().out
