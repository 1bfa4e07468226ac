"""Config: defaults, YAML round trip, overrides, and cross-field errors that name the fix."""

from pathlib import Path

import pytest
import yaml

import parallel4d
from parallel4d.cli import main
from parallel4d.config import Config, ConfigError, load_config, make_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_a_valid_small_job():
    cfg = Config.model_validate({})
    assert cfg.world_size == 1
    assert parallel4d.Config is Config
    assert set(cfg.parallel.model_dump()) == {"pp", "dp", "sp", "tp"}


def test_yaml_round_trip(tmp_path):
    cfg = make_config({"parallel": {"dp": 2}, "model": {"layers": 3}}, ["train.steps=7"])
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg and again.train.steps == 7 and again.parallel.dp == 2


def test_overrides_parse_yaml_values(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {steps: 3}\n")
    cfg = load_config(path, ["train.steps=50", "optimizer.betas=[0.8, 0.9]", "model.tie_embeddings=false",
                             "sequence.layout=contiguous"])
    assert cfg.train.steps == 50 and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.model.tie_embeddings is False and cfg.sequence.layout == "contiguous"


@pytest.mark.parametrize("data, expect", [
    ({"parallel": {"tp": 8}}, ["parallel.tp=8", "perfect square", "4 or 9"]),
    ({"parallel": {"tp": 4}, "model": {"heads": 3, "hidden": 48}}, ["model.heads=3", "q=2", "2 or 4"]),
    ({"parallel": {"tp": 9}, "model": {"hidden": 64, "heads": 3, "vocab_size": 255}},
     ["model.hidden=64", "63 or 66"]),
    ({"parallel": {"tp": 4}, "model": {"vocab_size": 255, "heads": 4}}, ["model.vocab_size=255", "254 or 256"]),
    ({"model": {"hidden": 64, "heads": 5}}, ["model.hidden=64", "model.heads=5", "model.heads=4"]),
    ({"parallel": {"sp": 3}, "model": {"seq_len": 64}}, ["model.seq_len=64", "2·parallel.sp=6", "60 or 66"]),
    ({"parallel": {"sp": 3}, "sequence": {"layout": "contiguous"}, "model": {"seq_len": 64}},
     ["parallel.sp=3", "63 or 66"]),
    ({"parallel": {"dp": 2, "tp": 4}, "data": {"batch_size": 6}, "pipeline": {"microbatches": 1}},
     ["data.batch_size=6", "dp·q·pipeline.microbatches", "= 4", "8"]),
    ({"parallel": {"pp": 4}, "pipeline": {"schedule": "hanayo", "waves": 2}, "model": {"layers": 4},
      "data": {"batch_size": 8}}, ["16 chunks", "model.layers≥14", "pipeline.waves"]),
    ({"pipeline": {"waves": 0}}, ["pipeline.waves"]),
    ({"parallel": {"tp": 4}, "hetero": {"enabled": True}, "train": {"grad_clip": 1.0}},
     ["train.grad_clip", "hetero.enabled=true", "parallel.tp=1"]),
    ({"parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b"}, "hetero": {"enabled": True}},
     ["pipeline.schedule=1f1b", "pipeline.schedule=hanayo", "model.tie_embeddings=false"]),
    ({"modle": {}}, ["unknown field 'modle'", "did you mean 'model'"]),
    ({"train": {"step": 3}}, ["unknown field 'train.step'", "did you mean 'steps'"]),
    ({"data": {"source": "text", "text_root": "/nonexistent/dir"}}, ["data.text_root", "not a directory"]),
])
def test_errors_name_field_and_fix(data, expect):
    with pytest.raises(ConfigError) as err:
        make_config(data)
    for text in expect:
        assert text in str(err.value), (text, str(err.value))


def test_short_run_of_a_long_config_is_valid():
    # `--set train.steps=5` on a job that checkpoints every 50 steps just saves at the end.
    assert make_config({"checkpoint": {"every": 50}}, ["train.steps=5"]).train.steps == 5


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        make_config({"parallel": {"tp": 4, "sp": 3}, "model": {"heads": 3, "hidden": 48, "seq_len": 64}})
    msg = str(err.value)
    assert "model.heads=3" in msg and "model.seq_len=64" in msg


def test_bad_override_and_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="section.field=value"):
        make_config({}, ["train.steps"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_shipped_configs_validate():
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert paths
    for path in paths:
        load_config(path)


def test_cli_validate(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("parallel: {dp: 2}\n")
    assert main(["validate", str(path), "--set", "train.steps=5"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert printed["train"]["steps"] == 5 and printed["parallel"]["dp"] == 2
    assert main(["validate", str(path), "--set", "parallel.tp=3"]) == 2
    assert "parallel.tp=3" in capsys.readouterr().err


def test_cli_plan(capsys):
    assert main(["plan", str(ROOT / "configs" / "quickstart.yaml")]) == 0
    assert "world size      2" in capsys.readouterr().out
