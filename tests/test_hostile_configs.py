"""Hostile input (#26.10): a few hundred generated invalid job files and ``--set`` values through the
CLI's entry point, in this process. Each one exits 2 before anything runs, with no traceback, and
every line of the refusal names the field it is about and says what to write instead.

The cases are generated from the config's own fields (wrong types, values past each bound, YAML 1.1
spellings, unencodable paths, numbers too long to parse), plus broken structure and broken rules
between fields, so a field added later is covered without editing this file.
"""

from __future__ import annotations

import importlib
import re
import typing

import pytest

from parallel4d.config import schema as config_module
from parallel4d.tools.cli import main
from parallel4d.config.schema import Config

# Words that start a fix; each refusal line must hold one.
FIX = re.compile(r"\b(use|set|write|remove|give|lower|raise|choose|keep|point|install|tokenize|delete|leave|start|"
                 r"fix|quote|pass|restore|move|unset|add)\b|did you mean")

BIG_INT = "9" * 5000
INT_VALUES = ["-1", "1" + "0" * 30, BIG_INT, "'5'", "true", "1.5", "yes", "1:30", "017", "1_000", "[1]", "{a: 1}",
              ".nan", "2001-12-14"]
FLOAT_VALUES = [".nan", ".inf", "-.inf", "1e300", "-1.0", "'abc'", "true", "1:30", "[1.0]", "1e-60"]
BOOL_VALUES = ["yes", "no", "on", "off", "1", "'true'", "[true]", "y"]
CHOICE_VALUES = ["nosuch", "5", "true", "[a]", "{a: 1}"]
PATH_VALUES = ['""', '"\\ud800"', '"a\\0b"', "5", "true", "[a]"]


def _kind(annotation) -> str:
    """'int', 'float', 'bool', 'choice', 'str', 'tuple', 'list' or 'dict' for a field's annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    inner = args[0] if typing.get_origin(annotation) is typing.Union and len(args) == 1 else annotation
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        return "choice"
    if origin in (tuple, list, dict):
        return origin.__name__
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(inner, "other")


def _fields():
    """``(section, field, kind)`` of every leaf field."""
    for section, info in Config.model_fields.items():
        model = info.annotation
        if isinstance(model, type) and issubclass(model, config_module._Section):
            for name, field in model.model_fields.items():
                yield section, name, _kind(field.annotation)
        else:
            yield "", section, _kind(model)


VALUES = {"int": INT_VALUES, "float": FLOAT_VALUES, "bool": BOOL_VALUES, "choice": CHOICE_VALUES, "str": PATH_VALUES,
          "tuple": ["0.9", "[0.9]", "[0.9, 1.5]", "[.nan, 0.9]", "[a, b]"], "list": ["5", "[5]", '["\\ud800"]'],
          "dict": ["5", "[1]", "{zero_optimization: {stage: 5}}", "{scheduler: {type: NoSuch}}",
                   "{optimizer: {type: Nope}}", "{gradient_cliping: 1.0}"]}


def field_cases() -> list[tuple[str, str, str]]:
    """``(case id, YAML text, the dotted field the refusal must name)``: each field × its bad values."""
    out = []
    for section, name, kind in _fields():
        where = f"{section}.{name}" if section else name
        for value in VALUES.get(kind, ["[1]"]):
            text = f"{section}:\n  {name}: {value}\n" if section else f"{name}: {value}\n"
            out.append((f"{where}={value[:12]}", text, where))
    return out


STRUCTURE = [
    ("top-level list", "- parallel\n- model\n", "top level"),
    ("top-level scalar", "5\n", "top level"),
    ("unknown section", "modle: {layers: 2}\n", "modle"),
    ("section scalar", "parallel: 5\n", "parallel"),
    ("section list", "model: [1, 2]\n", "model"),
    ("duplicate key", "train:\n  steps: 5\n  steps: 6\n", "steps"),
    ("alias", "a: &x 5\ntrain: {steps: *x}\n", "alias"),
    ("unclosed", "train: {steps: [\n", "line"),
    ("tab", "train:\n\tsteps: 5\n", "line"),
    ("deep", "a: " + "[" * 40 + "]" * 40 + "\n", "nesting"),
    ("binary", "train: {steps: 5}\n\0\0", "binary"),
]
for section, name, _ in list(_fields())[:: 7]:
    if section:
        STRUCTURE.append((f"unknown {section}.x", f"{section}:\n  {name}x: 1\n", f"{section}.{name}x"))

# rules between fields: (id, overrides as YAML mappings, a field the refusal names)
CROSS = [
    ("tp not square", "parallel: {tp: 3}", "parallel.tp"),
    ("pp above layers", "parallel: {pp: 8}\nmodel: {layers: 2}", "model.layers"),
    ("batch split", "parallel: {dp: 3}", "data.batch_size"),
    ("sp zigzag", "parallel: {sp: 3}", "model.seq_len"),
    ("heads divide", "model: {hidden: 64, heads: 5}", "model.heads"),
    ("kv heads", "model: {arch: llama, heads: 4, kv_heads: 3}", "model.kv_heads"),
    ("odd rotary", "model: {arch: llama, hidden: 60, heads: 4}", "model.hidden"),
    ("gpt2 kv", "model: {kv_heads: 2}", "model.kv_heads"),
    ("eval without data", "data: {source: text}\ntrain: {eval_every: 5}", "train.eval_every"),
    ("val without eval", "data: {source: text, val_fraction: 0.1}", "train.eval_every"),
    ("tokens without path", "data: {source: tokens}", "data.path"),
    ("missing token file", "data: {source: tokens, path: /nonexistent/x.bin}", "data.path"),
    ("path without tokens", "data: {path: x.bin}", "data.path"),
    ("glob without text", "data: {text_glob: ['*.md']}", "data.text_glob"),
    ("text root missing", "data: {source: text, text_root: /nonexistent}", "data.text_root"),
    ("min lr", "optimizer: {schedule: cosine, lr: 0.001, min_lr: 0.01}", "optimizer.min_lr"),
    ("decay before warmup", "optimizer: {schedule: cosine, warmup_steps: 20}\ntrain: {steps: 10}", "train.steps"),
    ("constant with min", "optimizer: {min_lr: 0.0001}", "optimizer.min_lr"),
    ("precision preset", "train: {dtype: bfloat16, param_dtype: float64}", "train.param_dtype"),
    ("float64 autocast", "train: {param_dtype: float64, autocast_dtype: bfloat16}", "train.autocast_dtype"),
    ("hetero budget", "hetero: {enabled: true, device_budget_bytes: 1}", "hetero.device_budget_bytes"),
    ("hetero chunk", "hetero: {enabled: true, chunk_elems: 8}", "hetero.chunk_elems"),
    ("huge model", "model: {hidden: 131072, heads: 8, layers: 512, vocab_size: 4294967296}", "model"),
    ("world", "parallel: {pp: 1, dp: 65536, sp: 65536}\ndata: {batch_size: 65536}", "parallel"),
    ("split with recompute", "parallel: {pp: 2}\npipeline: {schedule: zb_h1, microbatches: 2}\n"
                             "model: {layers: 4}\ntrain: {activation_checkpointing: blocks}",
     "train.activation_checkpointing"),
    ("pretrained missing", "model: {pretrained: /nonexistent}", "model.pretrained"),
    ("ds hetero", "deepspeed: {}\nhetero: {enabled: true}", "hetero.enabled"),
    ("ds batch", "deepspeed: {train_batch_size: 3}", "deepspeed.train_batch_size"),
    ("ds stage", "deepspeed: {zero_optimization: {stage: '3'}}", "deepspeed.zero_optimization.stage"),
    ("ds scheduler params", "deepspeed: {scheduler: {type: WarmupLR, params: {nosuch: 1}}}", "deepspeed.scheduler"),
    # #45: DeepSpeed's keys typed as it reads them (accepted, then a TypeError in every worker, or read wrongly)
    ("ds steps_per_print", "deepspeed: {steps_per_print: x}", "deepspeed.steps_per_print"),
    ("ds steps_per_print 0", "deepspeed: {steps_per_print: 0}", "deepspeed.steps_per_print"),
    ("ds bool as a string", "deepspeed: {zero_allow_untested_optimizer: 'no'}", "deepspeed.zero_allow_untested_optimizer"),
    ("ds number as a string", "deepspeed: {gradient_predivide_factor: x}", "deepspeed.gradient_predivide_factor"),
    ("ds log level", "deepspeed: {log_level: loud}", "deepspeed.log_level"),
    ("ds sub-section key", "deepspeed: {flops_profiler: {enabled: true, profile_step: two}}",
     "deepspeed.flops_profiler.profile_step"),
    ("threads", "train: {threads_per_worker: 4096}", "train.threads_per_worker"),
    ("local workers", "parallel: {dp: 128}\ndata: {batch_size: 128}", "train.max_local_workers"),
]

SET = [("train.steps=1:30", "train.steps"), ("train.resume=yes", "train.resume"), (f"model.hidden={BIG_INT}", "model.hidden"),
       ("optimizer.lr=1e300", "optimizer.lr"), ('train.out_dir="\\ud800"', "train.out_dir"), ("train.steps", "train.steps"),
       ("=5", "override"), ("train.steps.x=5", "train.steps"), ("parallel.pp=-1", "parallel.pp"),
       ("train.threads_per_worker=1e6", "train.threads_per_worker"), ("data.seed=017", "data.seed")]


def job_file(tmp_path, n: int, text: str) -> str:
    """``text`` as job file number ``n`` (lone surrogates written as they are: a path must refuse them)."""
    path = tmp_path / f"case{n}.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    return str(path)


def refusal(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err


def assert_refused(code: int, err: str, field: str, case: str) -> None:
    assert code == 2, (case, code, err[-500:])
    assert "Traceback" not in err and err.startswith("parallel4d: "), (case, err[-500:])
    assert field in err, (case, field, err[:500])
    lines = [line for line in err.splitlines() if line.startswith("  - ")] or [err]
    for line in lines:
        assert FIX.search(line), (case, "no fix named", line)
    assert len(err) < 5000, (case, "a refusal fits a screen", len(err))


def test_hundreds_of_invalid_job_files_are_refused_with_a_field_and_a_fix(tmp_path, capsys):
    cases = field_cases() + STRUCTURE + CROSS
    assert len(cases) > 300
    for n, (case, text, field) in enumerate(cases):
        assert_refused(*refusal(capsys, ["validate", job_file(tmp_path, n, text)]), field, case)


def test_invalid_overrides_are_refused_with_a_field_and_a_fix(tmp_path, capsys):
    base = tmp_path / "job.yaml"
    base.write_text("train: {steps: 5}\n")
    for item, field in SET:
        assert_refused(*refusal(capsys, ["validate", str(base), "--set", item]), field, item)


def test_launch_refuses_the_same_before_any_worker(tmp_path, capsys, monkeypatch):
    """The launch entry point says the same as validate and starts nothing (spawn is never called)."""
    def spawn(*args, **kwargs):
        raise AssertionError("a worker was started for an invalid config")

    monkeypatch.setattr(importlib.import_module("parallel4d.launcher.launch"), "spawn", spawn)  # the CLI imports it on use
    for n, (case, text, field) in enumerate(field_cases()[::15] + CROSS):
        assert_refused(*refusal(capsys, ["launch", job_file(tmp_path, n, text)]), field, case)


def test_byte_text_under_a_bpe_model_is_refused_before_any_worker(tmp_path, capsys, monkeypatch):
    """#45: ``data.source: text`` (byte ids 0–255) under a ``model.pretrained`` whose tokenizer.json is a
    BPE was accepted and trained on ids that mean other tokens to the model; validate and launch refuse it."""
    tokenizers = pytest.importorskip("tokenizers")
    from parallel4d.config.load import make_config
    from parallel4d.models import hf
    from parallel4d.models.build import build_dense, shape_from_config

    model = tmp_path / "model"
    cfg = make_config({"model": {"vocab_size": 320, "hidden": 32, "layers": 2, "heads": 4, "seq_len": 32}})
    hf.save_hf(build_dense(shape_from_config(cfg.model), seed=0).state_dict(), cfg.model, model)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["def f(x):\n    return x\n" * 40], tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(model / "tokenizer.json"))
    text = job_file(tmp_path, 0, f"model: {{pretrained: {model}, seq_len: 16}}\ndata: {{source: text}}\n")
    assert_refused(*refusal(capsys, ["validate", text]), "data.source", "byte text under BPE")
    def spawn(*args, **kwargs):
        raise AssertionError("a worker was started for byte text under a BPE model")

    monkeypatch.setattr(importlib.import_module("parallel4d.launcher.launch"), "spawn", spawn)
    assert_refused(*refusal(capsys, ["launch", text]), "data.source", "byte text under BPE (launch)")


# --- the tools' arguments (#45) ------------------------------------------------------------------------
# Outputs onto or into what a command reads, into a checkpoint, of the wrong kind or under a file, and
# inputs that are no usable checkpoint: each was a traceback, an exit 1, or (gather onto a shard of its
# own checkpoint, which the next resume then set aside) a silent loss.

def tool_cases(run, tmp) -> list[tuple[str, list[str], str]]:
    """``(case, argv, what the refusal names)`` over ``run`` (:func:`conftest.small_run`); ``tmp`` holds a
    regular file ``blocker``, a copy of the newest checkpoint with a flipped byte under ``bad``, an empty
    directory ``empty``, a tokenizer with a text file and the run's job file ``job.yaml``."""
    ckpt, blocker = run / "checkpoints", tmp / "blocker"
    step, older = ckpt / "step_00000002", ckpt / "step_00000001"
    gather, export, plot = ["checkpoint", "gather", str(ckpt)], ["export", str(ckpt)], ["plot", str(run), "-o"]
    tokenize = ["tokenize", "--tokenizer", str(tmp / "tokenizer.json"), str(tmp / "text.txt"), "-o"]
    job, schedule = tmp / "job.yaml", ["schedule", "--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--plot"]
    return [
        ("gather onto a shard of its own checkpoint", [*gather, str(step / "__0_0.distcp")], "OUT"),
        ("gather onto latest", [*gather, str(ckpt / "latest")], "OUT"),
        ("gather onto the checkpoint directory", [*gather, str(ckpt)], "OUT"),
        ("gather into an older checkpoint", [*gather, str(older / "model.pt")], "OUT"),
        ("gather under a file", [*gather, str(blocker / "model.pt")], "OUT"),
        ("gather of no checkpoint", ["checkpoint", "gather", str(tmp / "empty"), str(tmp / "m.pt")], "neither"),
        ("export into its checkpoint", [*export, str(step / "hf")], "OUT_DIR"),
        ("export onto its checkpoint", [*export, str(step)], "OUT_DIR"),
        ("export onto a file", [*export, str(blocker)], "OUT_DIR"),
        ("export under a file", [*export, str(blocker / "hf")], "OUT_DIR"),
        ("export of a corrupted checkpoint", ["export", str(tmp / "bad"), str(tmp / "hf")], "is not usable"),
        ("plot onto its metrics", [*plot, str(run / "metrics.jsonl")], "-o"),
        ("plot onto its summary", [*plot, str(run / "summary.json")], "-o"),
        ("plot into a checkpoint", [*plot, str(step / "curves.png")], "-o"),
        ("plot under a file", [*plot, str(blocker / "curves.png")], "-o"),
        ("plot as an unknown format", [*plot, str(tmp / "curves.xyz")], "-o"),
        ("generate from no checkpoint", ["generate", str(tmp / "empty")], "neither"),
        ("tokenize into a checkpoint", [*tokenize, str(step / "t.bin")], "-o"),
        ("tokenize under a file", [*tokenize, str(blocker / "t.bin")], "-o"),
        ("plan --json onto its job file", ["plan", str(job), "--json", str(job)], "--json"),
        ("plan --write onto its job file", ["plan", str(job), "--write", str(job)], "--write"),
        ("plan --write-profile into a checkpoint", ["plan", str(job), "--calibrate", "--write-profile",
                                                    str(step / "h.yaml")], "--write-profile"),
        ("plan --json under a file", ["plan", str(job), "--json", str(blocker / "p.json")], "--json"),
        ("schedule --plot into a checkpoint", [*schedule, str(step / "t.png")], "--plot"),
        ("schedule --plot as an unknown format", [*schedule, str(tmp / "t.xyz")], "--plot"),
        ("check --keep into a checkpoint", ["check", str(job), "--keep", str(step / "kept")], "--keep"),
        ("check --keep onto a file", ["check", str(job), "--keep", str(blocker)], "--keep"),
    ]


def _tool_inputs(tmp) -> None:
    """What :func:`tool_cases` reads besides the run (a word-level tokenizer: the hf extra's tokenizers)."""
    import shutil

    tokenizers = pytest.importorskip("tokenizers")
    (tmp / "blocker").write_text("a file, not a directory")
    (tmp / "empty").mkdir()
    bad = tmp / "bad" / "step_00000002"
    shutil.copytree(tmp / "run" / "checkpoints" / "step_00000002", bad)
    shard = bad / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<|endoftext|>": 1, "a": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "text.txt").write_text("a a a\n")
    shutil.copy(tmp / "run" / "checkpoints" / "step_00000002" / "config.yaml", tmp / "job.yaml")


def test_tool_arguments_that_would_lose_data_or_fail_are_refused_with_a_fix(tmp_path, capsys):
    """Each :func:`tool_cases` case through the CLI's entry point: exit 2, one line naming the path's
    flag (or the input's problem) and a fix, no traceback; the run's files and every input as they were."""
    from conftest import small_run, snapshot

    run = small_run(tmp_path / "run")
    _tool_inputs(tmp_path)
    capsys.readouterr()
    before = snapshot(tmp_path)
    for case, argv, field in tool_cases(run, tmp_path):
        code, err = refusal(capsys, argv)
        assert_refused(code, err, field, case)
        assert err.count("\n") == 1, (case, err)  # one line
        assert snapshot(tmp_path) == before, case
