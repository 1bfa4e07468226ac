"""Config: defaults, YAML round trip, overrides, and cross-field errors that name the fix."""

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

import parallel4d
from parallel4d.tools.cli import main
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config, make_config
from parallel4d.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_a_valid_small_job():
    cfg = Config.model_validate({})
    assert cfg.world_size == 1
    assert parallel4d.Config is Config
    assert set(cfg.parallel.model_dump()) == {"pp", "dp", "sp", "tp", "ep"}


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


def test_overrides_leave_the_callers_dict_as_it_was():
    job = {"train": {"steps": 3}, "model": {"layers": 2}}
    cfg = make_config(job, ["train.steps=7", "model.layers=4"])
    assert (cfg.train.steps, cfg.model.layers) == (7, 4)
    assert job == {"train": {"steps": 3}, "model": {"layers": 2}}


@pytest.mark.parametrize("data, expect", [
    ({"parallel": {"tp": 8}}, ["parallel.tp=8", "perfect square", "4 or 9"]),
    ({"parallel": {"tp": 4}, "model": {"heads": 3, "hidden": 48}}, ["model.heads=3", "q=2", "2 or 4"]),
    ({"parallel": {"tp": 9}, "model": {"hidden": 64, "heads": 3, "vocab_size": 255}},
     ["model.hidden=64", "63 or 66"]),
    ({"model": {"hidden": 64, "heads": 5}}, ["model.hidden=64", "model.heads=5", "model.heads=4"]),
    ({"parallel": {"sp": 3}, "model": {"seq_len": 64}}, ["model.seq_len=64", "2·parallel.sp=6", "60 or 66"]),
    ({"parallel": {"sp": 3}, "sequence": {"layout": "contiguous"}, "model": {"seq_len": 64}},
     ["parallel.sp=3", "63 or 66"]),
    ({"parallel": {"dp": 2, "tp": 4}, "data": {"batch_size": 6}, "pipeline": {"microbatches": 1}},
     ["data.batch_size=6", "dp·q·pipeline.microbatches", "= 4", "8"]),
    ({"parallel": {"pp": 4}, "pipeline": {"schedule": "hanayo", "waves": 2}, "model": {"layers": 4},
      "data": {"batch_size": 8}}, ["16 chunks", "model.layers≥14", "pipeline.waves"]),
    ({"pipeline": {"waves": 0}}, ["pipeline.waves"]),
    ({"parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b"}, "hetero": {"enabled": True}},
     ["pipeline.schedule=1f1b", "pipeline.schedule=hanayo", "model.tie_embeddings=false"]),
    ({"parallel": {"pp": 2}, "pipeline": {"schedule": "gpipe", "split_backward": True}},
     ["pipeline.split_backward=true", "gpipe does not", "zb_h1", "pipeline.split_backward=false"]),
    ({"parallel": {"pp": 2}, "pipeline": {"schedule": "zbv"}, "hetero": {"enabled": True}},
     ["hetero.enabled=true cannot run a split backward", "pipeline.schedule=zbv", "hetero.enabled=false"]),
    ({"parallel": {"pp": 2}, "pipeline": {"schedule": "hanayo", "split_backward": True},
      "train": {"activation_checkpointing": "blocks"}},
     ["train.activation_checkpointing=blocks", "split_backward=true", "activation_checkpointing=none"]),
    ({"parallel": {"pp": 4}, "pipeline": {"schedule": "zbv"}, "model": {"layers": 4}},
     ["zbv with parallel.pp=4 cuts the model into 8 chunks", "model.layers≥6", "parallel.pp≤3"]),
    ({"modle": {}}, ["unknown field 'modle'", "did you mean 'model'"]),
    ({"train": {"step": 3}}, ["unknown field 'train.step'", "did you mean 'steps'"]),
    ({"data": {"source": "text", "text_root": "/nonexistent/dir"}}, ["data.text_root", "not a directory"]),
])
def test_errors_name_field_and_fix(data, expect):
    with pytest.raises(ConfigError) as err:
        make_config(data)
    for text in expect:
        assert text in str(err.value), (text, str(err.value))


@pytest.mark.parametrize("tp", [4, 9, 16, 25])
def test_a_pretrained_vocabulary_the_grid_does_not_split_is_accepted(tmp_path, tp):
    """Qwen's 151,936 tokens (a config.json that fixes it) at q = 2, 3, 4, 5: the 2D layers pad the
    vocabulary to the grid, so no rule refuses it (3 and 5 do not divide it)."""
    qwen = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 240, "intermediate_size": 480,
            "num_hidden_layers": 1, "num_attention_heads": 60, "num_key_value_heads": 60, "head_dim": 4,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    cfg = make_config({"model": {"pretrained": str(tmp_path), "seq_len": 60}, "parallel": {"tp": tp},
                       "data": {"source": "synthetic", "batch_size": 60}})
    assert cfg.model.vocab_size == 151936 and cfg.parallel.q ** 2 == tp


@pytest.mark.parametrize("where", ["train.gradient_accumulation_steps", "gradient_accumulation_steps",
                                   "optimizer.gradient_accumulation_steps", "train.accumulate_grad_batches"])
def test_gradient_accumulation_by_its_usual_name_points_to_pipeline_microbatches(where):
    """#45: refused as an unknown field without a hint; the fix it names is a job that loads."""
    job = {"data": {"batch_size": 16}, "pipeline": {"microbatches": 2}}
    with pytest.raises(ConfigError) as err:
        make_config(job, [f"{where}=4"])
    msg = str(err.value)
    fix = "use pipeline.microbatches=4 (and data.batch_size=32 to keep micro-batches of 8 sequences)"
    assert f"unknown field '{where}': parallel4d's gradient accumulation is pipeline.microbatches" in msg, msg
    assert fix in msg, msg
    cfg = make_config(job, ["pipeline.microbatches=4", "data.batch_size=32"])
    assert cfg.data.batch_size // cfg.pipeline.microbatches == 8


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
    from conftest import shipped_configs

    paths = shipped_configs(ROOT)
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


@pytest.mark.parametrize("model, absent", [
    ({"arch": "llama", "mlp_ratio": 3}, {"activation", "mlp_ratio"}),
    ({"arch": "gpt2"}, {"kv_heads", "intermediate_size", "rope_theta", "qkv_bias"}),
])
def test_cli_validate_shows_the_fields_of_the_model_family(tmp_path, capsys, model, absent):
    """validate prints the model: fields the job's family reads (a Llama shows no GPT activation), an
    unset one that stands for another value with that value; the printed job is the same job."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": model}))
    assert main(["validate", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert not absent & set(printed["model"]), printed["model"]
    cfg = load_config(path)
    if cfg.model.arch == "llama":
        assert printed["model"]["intermediate_size"] == 3 * 64 and printed["model"]["kv_heads"] == 4
    again = make_config(printed)
    assert again.model_dump(exclude={"model"}) == cfg.model_dump(exclude={"model"})
    assert again.shown_yaml() == cfg.shown_yaml()
    assert (again.model.mlp_width, again.model.kv_heads_or_heads) == (cfg.model.mlp_width, cfg.model.kv_heads_or_heads)


def test_cli_plan(capsys):
    assert main(["plan", str(ROOT / "configs" / "quickstart.yaml")]) == 0
    assert "world size      2" in capsys.readouterr().out


# --- issue #12.9: bad input stops at validation (exit 2) with a message naming the field or file ---


@contextlib.contextmanager
def _within(seconds):
    """Fail (instead of hanging the suite) if the body runs longer than ``seconds``."""
    def expire(*_):
        raise TimeoutError(f"took longer than {seconds}s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _fails(capsys, args, *expect):
    assert main(["validate", *args]) == 2
    err = capsys.readouterr().err
    for text in expect:
        assert text in err, (text, err)


def _binary(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


def _latin1(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes("train:\n  out_dir: runs/café\n".encode("latin-1"))
    return str(path)


def _nul_bytes(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00train: {}\n")  # valid UTF-8, still binary
    return str(path)


def _huge(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\n")
    return str(path)


def _directory(tmp_path):
    (tmp_path / "job.yaml").mkdir()
    return str(tmp_path / "job.yaml")


def _fifo(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(tmp_path / "job.yaml")  # nobody writes: opening it for reading would block
    return str(tmp_path / "job.yaml")


def _dev_null(tmp_path):
    if not os.path.exists(os.devnull) or os.devnull != "/dev/null":
        pytest.skip("no /dev/null")
    return os.devnull


@pytest.mark.parametrize("make, expect", [
    (_binary, ["job.yaml", "not UTF-8"]),
    (_latin1, ["job.yaml", "not UTF-8", "byte 0xe9 at offset 26"]),
    (_nul_bytes, ["job.yaml", "binary file", "not UTF-8"]),
    (_huge, ["job.yaml", "larger than 1048576 bytes"]),
    (_directory, ["job.yaml", "is a directory, not a YAML file"]),
    (_fifo, ["job.yaml", "FIFO"]),
    (_dev_null, ["/dev/null", "character device"]),
])
def test_config_path_that_is_not_a_yaml_file(tmp_path, capsys, make, expect):
    path = make(tmp_path)
    with _within(5):
        _fails(capsys, [path], *expect)


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {steps: 3}\n")
    return str(path)


@pytest.mark.parametrize("override, expect", [
    ("model.hidden=[1", ["model.hidden=[1", "not valid YAML"]),
    ('train.out_dir="runs/a', ["train.out_dir", "not valid YAML"]),
    ("deepspeed={a: &x [1, 2], b: *x}", ["alias"]),
    ("deepspeed={a: " + "[" * 100 + "]" * 100 + "}", ["deepspeed", "levels of nesting"]),
])
def test_override_value_that_is_not_yaml(job, capsys, override, expect):
    _fails(capsys, [job, "--set", override], *expect)


@pytest.mark.parametrize("override, expect", [
    ("optimizer.lr=inf", ["optimizer.lr", "finite"]),
    ("optimizer.lr=.inf", ["optimizer.lr", "finite"]),
    ("optimizer.lr=nan", ["optimizer.lr", "finite"]),
    ("optimizer.betas=[nan, 2]", ["optimizer.betas[0]", "finite", "optimizer.betas[1]", "less than 1"]),
    ("optimizer.betas=[0.9, 1.0]", ["optimizer.betas[1]", "less than 1"]),
    ("optimizer.betas=[-0.1, 0.9]", ["optimizer.betas[0]", "greater than or equal to 0"]),
    ("optimizer.eps=.inf", ["optimizer.eps", "finite"]),
    ("optimizer.weight_decay=.inf", ["optimizer.weight_decay", "finite"]),
    ("train.grad_clip=.inf", ["train.grad_clip", "finite"]),
    ("model.norm_eps=.inf", ["model.norm_eps", "finite"]),
    ("model.init_std=.inf", ["model.init_std", "finite"]),
    ("train.timeout_s=inf", ["train.timeout_s", "finite"]),
    ("train.timeout_s=.inf", ["train.timeout_s", "finite"]),
    ("train.timeout_s=1e-9", ["train.timeout_s", "greater than or equal to 1"]),
    ("train.timeout_s=0.5", ["train.timeout_s", "greater than or equal to 1"]),
    ("train.timeout_s=1e300", ["train.timeout_s", "less than or equal to"]),
    ("train.job_timeout_s=.inf", ["train.job_timeout_s", "finite"]),
    ("hetero.compute_device=banana", ["hetero.compute_device='banana'", "'cuda:N'"]),
    ("hetero.compute_device=cuda:x", ["hetero.compute_device='cuda:x'"]),
    (r'train.out_dir="runs/a\0b"', ["train.out_dir", "NUL"]),
    (r'checkpoint.dir="ck\0pt"', ["checkpoint.dir", "NUL"]),
    (r'data.text_root="src\0"', ["data.text_root", "NUL"]),
    ('data.text_root=""', ["data.text_root", "empty"]),
    ('train.out_dir=""', ["train.out_dir", "empty"]),
    ("train.seed=-1", ["train.seed", "greater than or equal to 0"]),
    ("data.seed=100000000000000000000", ["data.seed", "less than or equal to"]),
    ("train.max_local_workers=0", ["train.max_local_workers", "greater than or equal to 1"]),
])
def test_field_value_errors_name_the_field(job, capsys, override, expect):
    _fails(capsys, [job, "--set", override, "--set", "data.source=text"], *expect)


@pytest.mark.parametrize("files, expect", [
    ({"notes.txt": "x" * 4096}, ["holds 0 bytes of .py files"]),
    ({"tiny.py": "x = 1\n"}, ["holds 6 bytes of .py files", "≥ 1024"]),
])
def test_text_root_without_enough_python_sources(tmp_path, capsys, job, files, expect):
    root = tmp_path / "corpus"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    _fails(capsys, [job, "--set", "data.source=text", "--set", f"data.text_root={root}"], "data.text_root", *expect)
    (root / "big.py").write_text("y = 2\n" * 200)
    assert main(["validate", job, "--set", "data.source=text", "--set", f"data.text_root={root}"]) == 0


def test_local_world_size_limit():
    from parallel4d.config.rules.job import local_job_problems

    huge = make_config({"parallel": {"dp": 4096}, "data": {"batch_size": 4096}})
    assert huge.train.max_local_workers == 64
    (msg,) = local_job_problems(huge)
    for text in ("parallel.pp·dp·sp·tp", "4096", "train.max_local_workers=64", "torchrun"):
        assert text in msg, (text, msg)
    job = {"parallel": {"dp": 65}, "data": {"batch_size": 65}}
    assert local_job_problems(make_config(job))
    assert local_job_problems(make_config(job, ["train.max_local_workers=65"])) == []
    assert local_job_problems(make_config({"parallel": {"pp": 2, "dp": 2, "tp": 16}})) == []


@pytest.mark.parametrize("data, expect", [
    ({"model": {"hidden": 10**18, "heads": 7}}, ["model.hidden=131072 or less"]),
    ({"model": {"hidden": 64, "heads": 10**18}}, ["model.heads=131072 or less"]),
    ({"parallel": {"pp": 10**15, "dp": 10**15}, "pipeline": {"microbatches": 10**15}}, ["parallel.pp=65536 or less"]),
    # within the bounds, the divisibility rules still answer at once
    ({"model": {"hidden": 131071, "heads": 7}}, ["model.hidden=131068 or 131075", "model.heads="]),
    ({"parallel": {"pp": 65536, "dp": 65536}, "pipeline": {"microbatches": 2**20}}, ["data.batch_size=8"]),
])
def test_absurd_sizes_are_refused_without_iterating(data, expect):
    with _within(2), pytest.raises(ConfigError) as err:
        make_config(data)
    for text in expect:
        assert text in str(err.value), (text, str(err.value))


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("deepspeed:\n  " + BOMB.replace("\n", "\n  "))  # 10⁹ strings once expanded
    assert len(path.read_bytes()) < 500
    start = time.perf_counter()
    with _within(2), pytest.raises(ConfigError, match="alias"):
        load_config(path)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("text, key", [
    ("train:\n  steps: 3\n  steps: 5\n", "'steps'"),
    ("train: {steps: 3}\nmodel: {}\ntrain: {steps: 4}\n", "'train'"),
    ("deepspeed: {zero: {stage: 1, stage: 2}}\n", "'stage'"),
])
def test_duplicate_yaml_keys_are_errors(tmp_path, capsys, text, key):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    _fails(capsys, [str(path)], "job.yaml", "duplicate key " + key)


@pytest.mark.parametrize("override, field", [
    ("train.steps=true", "train.steps"),
    ("optimizer.lr=true", "optimizer.lr"),
    ("train.steps='5'", "train.steps"),
    ("train.steps=10.0", "train.steps"),
    ("optimizer.lr='0.1'", "optimizer.lr"),
    ("model.tie_embeddings=1", "model.tie_embeddings"),
    ("parallel.dp=1e400", "parallel.dp"),
])
def test_no_silent_type_coercion(job, capsys, override, field):
    _fails(capsys, [job, "--set", override], field, "got ")


def test_strict_types_keep_ordinary_yaml_working(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optimizer: {lr: 3e-4, eps: 1E-8, betas: [0.8, 0.9], weight_decay: 0}\n"
                    "train: {timeout_s: 1e3, steps: 1_000}\nhetero: {compute_device: 'cuda:1'}\n")
    cfg = load_config(path, ["train.steps=50", "optimizer.lr=2e-3"])
    assert cfg.optimizer.lr == 2e-3 and cfg.optimizer.eps == 1e-8 and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.train.timeout_s == 1000.0 and cfg.train.steps == 50 and cfg.hetero.compute_device == "cuda:1"
    assert make_config(yaml.safe_load(cfg.to_yaml())) == cfg


def test_a_home_directory_in_a_path_field_expands(tmp_path, monkeypatch):
    """`train.out_dir: ~/x` is the home directory's x, as in a shell, not a directory named `~` under the
    current one: every path field expands `~` (model.pretrained before its config.json is read)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config({"train": {"out_dir": "~/runs/x"}, "checkpoint": {"dir": "~/ckpt"}})
    assert cfg.train.out_dir == str(tmp_path / "runs" / "x") and cfg.checkpoint_dir == tmp_path / "ckpt"
    with pytest.raises(ConfigError, match=f"cannot read {tmp_path / 'model' / 'config.json'}"):
        load_config({}, ["model.pretrained=~/model"])
