"""The ``deepspeed:`` section is checked before any process starts (#14.6): keys DeepSpeed would
ignore, DeepSpeed's own sub-section errors, the batch triple against parallel4d's fields, and the
combinations parallel4d cannot run refuse with exit 2 and a message naming the key and the fix;
a valid section resolves to the ds_config parallel4d hands DeepSpeed.

The rules on values alone run in ``load_config`` / ``make_config`` (``config.rules.deepspeed``);
those that need DeepSpeed or the device in ``integrations.deepspeed.ds_config.resolve``. Most
checks call them in this process; a few run the CLI to see the exit status and that ``launch``
refused before creating anything."""

import subprocess
import sys

import pytest
import yaml

deepspeed = pytest.importorskip("deepspeed")  # the `deepspeed` extra; `make test` installs it

from parallel4d.tools.cli import main  # noqa: E402
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import load_config, make_config
from parallel4d.integrations.deepspeed.ds_config import resolve  # noqa: E402

MODEL = {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2}


def job(section: dict, **sections) -> dict:
    """A small job dict with ``deepspeed: section``; ``sections`` replace or add whole sections."""
    data = {"model": dict(MODEL), "data": {"source": "synthetic", "batch_size": 8}, "train": {"device": "cpu"}}
    data.update(sections)
    data["deepspeed"] = section
    return data


def refused(data: dict, device_type: str = "cpu") -> str:
    """The ConfigError message for ``data``, from validation or from resolve; fails if it passes."""
    with pytest.raises(ConfigError) as err:
        resolve(make_config(data), device_type)
    return str(err.value)


def write_job(tmp_path, data: dict):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cli(*args, cwd, timeout=120):
    """``python -m parallel4d ARGS`` in a fresh process (the real exit status and stderr)."""
    return subprocess.run([sys.executable, "-m", "parallel4d", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def assert_names(msg: str, *texts: str) -> None:
    for text in texts:
        assert text in msg, (text, msg)


def test_build_model_and_as_mpu_import_no_deepspeed_and_print_nothing(tmp_path):
    """#45: ``import parallel4d; parallel4d.build_model`` printed DeepSpeed's accelerator warning to a
    user who never asked for DeepSpeed: its package imported every module, DeepSpeed's too."""
    code = ("import sys, parallel4d; parallel4d.build_model; parallel4d.integrations.deepspeed.as_mpu; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (0, "[]\n", ""), run


# --- keys DeepSpeed would silently ignore ------------------------------------------------------------


@pytest.mark.parametrize("section, key, suggestion", [
    ({"gradient_cliping": 1.0}, "gradient_cliping", "gradient_clipping"),
    ({"zero_optimisation": {"stage": 1}}, "zero_optimisation", "zero_optimization"),
    ({"train_batch_sise": 8}, "train_batch_sise", "train_batch_size"),
    ({"steps_per_prnt": 10, "bf16": {"enabled": True}}, "steps_per_prnt", "steps_per_print"),
])
def test_misspelt_top_level_key_names_the_key_and_the_valid_one(section, key, suggestion):
    msg = refused(job(section))
    assert_names(msg, f"deepspeed.{key}:", "would ignore it", f"did you mean 'deepspeed.{suggestion}'?")
    assert msg.count("\n  - ") == 1, msg  # only the misspelt key; the valid ones beside it are not reported


def test_every_misspelt_key_is_reported_at_once():
    msg = refused(job({"gradient_cliping": 1.0, "zero_optimisation": {"stage": 1}, "zero_optimization": {"stage": 1}}))
    assert_names(msg, "deepspeed.gradient_cliping", "deepspeed.zero_optimisation")
    assert "deepspeed.zero_optimization:" not in msg, msg


def test_misspelt_key_exits_2_from_validate_and_from_launch_before_anything_starts(tmp_path):
    out_dir = tmp_path / "run"
    path = write_job(tmp_path, job({"gradient_cliping": 1.0}, train={"device": "cpu", "steps": 1,
                                                                   "out_dir": str(out_dir)}))
    for command in ("validate", "launch"):
        proc = cli(command, str(path), cwd=tmp_path)
        assert proc.returncode == 2, (command, proc.returncode, proc.stderr[-3000:])
        assert_names(proc.stderr, "deepspeed.gradient_cliping", "did you mean 'deepspeed.gradient_clipping'?")
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # launch refused in its preflight: no run directory, no checkpoints, no lock, nothing in the working directory
    assert not out_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


# --- DeepSpeed's own models of the sub-sections --------------------------------------------------------


@pytest.mark.parametrize("zero, where, valid", [
    ({"stage": 1, "overlap_com": True}, "deepspeed.zero_optimization.overlap_com", "overlap_comm"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memroy": True}},
     "deepspeed.zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
])
def test_unknown_key_inside_zero_optimization(tmp_path, capsys, zero, where, valid):
    """DeepSpeed's own model refuses it; the message names it by its path in the job file and the
    model's nearest field."""
    msg = refused(job({"zero_optimization": zero}))
    assert_names(msg, f"{where}: DeepSpeed has no such key", f"did you mean '{valid}'?")
    assert main(["validate", str(write_job(tmp_path, job({"zero_optimization": zero})))]) == 2
    assert where in capsys.readouterr().err


@pytest.mark.parametrize("section, where, valid", [
    ({"flops_profiler": {"enabled": True, "profile_stepp": 2}}, "deepspeed.flops_profiler.profile_stepp",
     "deepspeed.flops_profiler.profile_step"),
    ({"activation_checkpointing": {"partition_activation": True}},
     "deepspeed.activation_checkpointing.partition_activation", "deepspeed.activation_checkpointing.partition_activations"),
    ({"optimizer": {"type": "AdamW", "parms": {"lr": 1e-3}}}, "deepspeed.optimizer.parms", "deepspeed.optimizer.params"),
])
def test_unknown_key_in_a_section_deepspeed_reads_key_by_key(section, where, valid):
    """Sections DeepSpeed reads with .get (no model of its own checks them) are recorded too."""
    assert_names(refused(job(section)), f"{where}: DeepSpeed 0.19.8 does not read this key", f"did you mean '{valid}'?")


@pytest.mark.parametrize("section", [
    {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False,
                                  "contiguous_memory_optimization": False, "number_checkpoints": None,
                                  "synchronize_checkpoint_boundary": False, "profile": False}},
    {"flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True,
                        "output_file": None}},
    {"checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
                    "parallel_write": {"pipeline_stage": False}}},
    {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0}}},
    {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}}},
    {"comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False}},
    {"tensorboard": {"enabled": False, "output_path": "x", "job_name": "y"}},
    {"fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
              "hysteresis": 2, "min_loss_scale": 1}},
])
def test_real_sub_section_keys_are_accepted(section):
    """No false alarm inside sub-sections: every key of these documented examples is read."""
    resolve(make_config(job(section)), "cpu")


@pytest.mark.parametrize("section, expect", [
    ({"amp": {"enabled": True}}, ["DeepSpeed refuses the section", "AMP"]),  # a removed feature
    ({"zero_optimization": {"stage": 1, "mics_shard_size": 2}}, ["DeepSpeed refuses the section", "mics_shard_size"]),
    ({"optimizer": "adam"}, ["deepspeed.optimizer='adam': DeepSpeed reads this as a section", "optimizer: {...}"]),
    ({"checkpoint": 3}, ["deepspeed.checkpoint=3: DeepSpeed reads this as a section"]),
    ({"zero_optimization": {"stage": 4}}, ["deepspeed.zero_optimization.stage:", "got 4"]),
    ({"communication_data_type": "fp64"}, ["communication_data_type", "fp64"]),
])
def test_what_deepspeed_itself_refuses_is_a_config_error(section, expect):
    """Never a traceback from a worker (or from ``validate``): each is a ConfigError, so exit 2."""
    assert_names(refused(job(section)), *expect)


def test_keys_parallel4d_decides_are_refused():
    msg = refused(job({"tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": 2}}))
    assert_names(msg, "deepspeed.tensor_parallel: set by parallel.tp", "deepspeed.pipeline: set by parallel.pp",
                 "remove it")
    # read by deepspeed.initialize, not by DeepSpeedConfig: not "ignored", and no look-alike key suggested
    msg = refused(job({"sequence_parallel_size": 2, "data_parallel_size": 2}))
    assert_names(msg, "deepspeed.sequence_parallel_size: set by parallel.sp",
                 "deepspeed.data_parallel_size: set by parallel.dp")
    assert "would ignore" not in msg and "did you mean" not in msg, msg


# --- the recorded-keys approach flags no key DeepSpeed reads ---------------------------------------------


def test_recording_notes_every_way_of_looking_a_key_up():
    from parallel4d.integrations.deepspeed.ds_keys import _Recording

    seen = _Recording({"a": 1, "b": 2, "c": 3, "d": 4, "e": 5})
    assert seen.get("a") == 1 and seen["b"] == 2 and "c" in seen and "d" in seen.keys()
    assert seen.get("missing") is None and "nowhere" not in seen
    assert sorted(seen) == ["a", "b", "c", "d", "e"] and len(seen.keys()) == 5  # iterating reads no key
    assert seen.read == {"a", "b", "c", "d", "missing", "nowhere"}

REAL_KEYS = {
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
    "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False},
    "flops_profiler": {"enabled": False, "profile_step": 1},
    "tensorboard": {"enabled": False, "output_path": "tb", "job_name": "x"},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "communication_data_type": "fp32",
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 1, "overlap_comm": False, "reduce_bucket_size": 5e8},
    "bf16": {"enabled": True},
    "memory_breakdown": False,
    "dump_state": False,
    "dataloader_drop_last": False,
    "checkpoint": {"load_universal": False},
    "comms_logger": {"enabled": False},
    "wandb": {"enabled": False},
    "csv_monitor": {"enabled": False},
}


@pytest.mark.parametrize("key", sorted(REAL_KEYS))
def test_keys_deepspeed_reads_are_accepted(key):
    ds = resolve(make_config(job({key: REAL_KEYS[key]})), "cpu")
    assert key in ds


def test_all_real_keys_together_are_accepted():
    ds = resolve(make_config(job(dict(REAL_KEYS))), "cpu")
    assert set(REAL_KEYS) <= set(ds)


@pytest.mark.parametrize("section, where, said", [
    ({"steps_per_print": "x"}, "deepspeed.steps_per_print='x'", "write a whole number ≥ 1"),  # #45: a worker's TypeError
    ({"steps_per_print": 0}, "deepspeed.steps_per_print=0", "write a whole number ≥ 1"),  # ZeroDivisionError there
    ({"wall_clock_breakdown": "no"}, "deepspeed.wall_clock_breakdown='no'", "reads true or false"),
    ({"dump_state": 1}, "deepspeed.dump_state=1", "reads true or false"),
    ({"gradient_predivide_factor": True}, "deepspeed.gradient_predivide_factor=True", "reads a number"),
    ({"flops_profiler": {"enabled": True, "profile_step": 1.5}}, "deepspeed.flops_profiler.profile_step=1.5",
     "reads a whole number"),
    ({"log_level": "loud"}, "deepspeed.log_level='loud'", "use one of debug, info"),
])
def test_values_of_another_type_than_deepspeed_reads_are_refused_naming_the_key_and_the_type(section, where, said):
    """Taken as given by DeepSpeed's parser, then a failure in every worker or a wrong reading ("no"
    is true): the types are those of the defaults DeepSpeed reads each key with."""
    assert_names(refused(job(section)), where, said)


def test_values_of_the_type_deepspeed_reads_are_accepted():
    ds = resolve(make_config(job({"steps_per_print": 5, "gradient_predivide_factor": 2, "log_level": "INFO",
                                  "flops_profiler": {"enabled": False, "profile_step": 3}})), "cpu")
    assert (ds["steps_per_print"], ds["gradient_predivide_factor"]) == (5, 2)


# --- the batch triple --------------------------------------------------------------------------------

BATCH = {"parallel": {"dp": 2}, "pipeline": {"microbatches": 2}}  # with data.batch_size 8: 8 = 2 · 2 · 2
WANT = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}


@pytest.mark.parametrize("key, wrong", [("train_batch_size", 16), ("train_micro_batch_size_per_gpu", 4),
                                        ("gradient_accumulation_steps", 1), ("train_batch_size", 4)])
def test_batch_key_disagreeing_with_parallel4d_names_both_sides_and_the_value(key, wrong):
    with pytest.raises(ConfigError) as err:
        make_config(job({key: wrong}, **BATCH))
    assert_names(str(err.value), f"deepspeed.{key}={wrong}", "data.batch_size=8", "parallel.dp=2",
                 "pipeline.microbatches=2", f"set deepspeed.{key}={WANT[key]}", '"auto"')


def test_deepspeed_accumulation_steps_refusal_names_pipeline_microbatches():
    """#45: a user asking DeepSpeed for 4 accumulation steps is told parallel4d's field for them."""
    with pytest.raises(ConfigError) as err:
        make_config(job({"gradient_accumulation_steps": 4}, **BATCH))
    assert_names(str(err.value), "set deepspeed.gradient_accumulation_steps=2",
                 "for 4, set pipeline.microbatches=4: parallel4d's field for it")
    make_config(job({"gradient_accumulation_steps": 4}, parallel={"dp": 2}, pipeline={"microbatches": 4},
                    data={"source": "synthetic", "batch_size": 16}))  # the fix, with its batch


def test_batch_key_that_is_a_boolean_is_refused():
    # true == 1 in Python; gradient_accumulation_steps: true is still not a count
    with pytest.raises(ConfigError, match="deepspeed.gradient_accumulation_steps=True"):
        make_config(job({"gradient_accumulation_steps": True}))


def test_batch_key_in_a_job_file_exits_2(tmp_path, capsys):
    path = write_job(tmp_path, job({"train_micro_batch_size_per_gpu": 8}, **BATCH))
    assert main(["validate", str(path)]) == 2
    assert_names(capsys.readouterr().err, "job.yaml", "deepspeed.train_micro_batch_size_per_gpu=8",
                 "set deepspeed.train_micro_batch_size_per_gpu=2")


@pytest.mark.parametrize("given", [{}, {k: "auto" for k in WANT}, dict(WANT),
                                   {"train_batch_size": 8, "gradient_accumulation_steps": "auto"}])
def test_batch_keys_auto_absent_or_equal_are_filled(given):
    ds = resolve(make_config(job(given, **BATCH)), "cpu")
    assert {k: ds[k] for k in WANT} == WANT
    assert all(type(ds[k]) is int for k in WANT)


def test_batch_keys_filled_for_a_pipeline():
    # pp=2 · dp=2, 4 micro-batches of 16 sequences: a replica's micro-batch is 16 / (2 · 4) = 2
    cfg = make_config(job({"zero_optimization": {"stage": 1}}, parallel={"pp": 2, "dp": 2},
                          pipeline={"microbatches": 4}, data={"source": "synthetic", "batch_size": 16}))
    ds = resolve(cfg, "cpu")
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
        (16, 2, 4)
    assert ds["managed_gradient_accumulation"] is False  # parallel4d's executor accumulates


# --- what resolve fills in ---------------------------------------------------------------------------


def test_resolve_fills_clipping_dtype_and_optimizer_choices():
    cfg = make_config(job({}, train={"device": "cpu", "grad_clip": 0.5, "dtype": "bfloat16"}))
    ds = resolve(cfg, "cpu")
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert ds["zero_force_ds_cpu_optimizer"] is False  # parallel4d's torch optimizer, no JIT-built CPU Adam
    assert "managed_gradient_accumulation" not in ds and "fp16" not in ds
    assert cfg.deepspeed == {}  # resolve does not write into the config

    plain = resolve(make_config(job({})), "cpu")
    assert "gradient_clipping" not in plain and "bf16" not in plain


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "adamw"])
def test_deepspeed_adam_runs_on_torch_code_on_cpu_only(kind):
    section = {"optimizer": {"type": kind, "params": {"lr": 1e-3}}}
    ds = resolve(make_config(job(section)), "cpu")
    assert ds["optimizer"]["params"] == {"lr": 1e-3, "torch_adam": True}
    assert "zero_force_ds_cpu_optimizer" not in ds  # DeepSpeed's optimizer: its own choice
    assert resolve(make_config(job(section)), "cuda")["optimizer"]["params"] == {"lr": 1e-3}
    # a user's torch_adam: false is kept
    mine = {"optimizer": {"type": kind, "params": {"lr": 1e-3, "torch_adam": False}}}
    assert resolve(make_config(job(mine)), "cpu")["optimizer"]["params"]["torch_adam"] is False


def test_optimizer_that_needs_a_compiled_op_is_refused_on_cpu():
    section = {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    assert_names(refused(job(section), "cpu"), "deepspeed.optimizer.type='Lamb'", "Adam or AdamW",
                 "remove deepspeed.optimizer")
    assert resolve(make_config(job(section)), "cuda")["optimizer"]["type"] == "Lamb"


# --- hetero, precision, ZeRO stages ------------------------------------------------------------------


def test_hetero_with_deepspeed_offload_is_refused():
    section = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError) as err:
        make_config(job(section, hetero={"enabled": True}))
    assert_names(str(err.value), "hetero.enabled=true", "DeepSpeed's zero_optimization.offload_optimizer would",
                 "one memory manager", "set hetero.enabled=false")
    with pytest.raises(ConfigError) as err:
        make_config(job({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                        hetero={"enabled": True}))
    assert_names(str(err.value), "hetero.enabled=true", "DeepSpeed's zero_optimization.offload_param would")
    with pytest.raises(ConfigError) as err:  # any deepspeed: section, offload or not
        make_config(job({"zero_optimization": {"stage": 1}}, hetero={"enabled": True}))
    assert "hetero.enabled=true" in str(err.value) and "offload_optimizer would" not in str(err.value)
    make_config(job(section))  # DeepSpeed's offload alone is fine


def test_fp16_is_refused_on_cpu_only(tmp_path, capsys):
    section = {"fp16": {"enabled": True}}
    assert_names(refused(job(section), "cpu"), "deepspeed.fp16.enabled", "no fp16 on CPU",
                 "deepspeed.bf16.enabled=true")
    ds = resolve(make_config(job(section)), "cuda")  # pp=1 on a GPU: DeepSpeed's fp16 with its loss scaling
    assert ds["fp16"] == {"enabled": True} and "bf16" not in ds
    resolve(make_config(job({"fp16": {"enabled": False}})), "cpu")  # a disabled section is fine
    assert main(["validate", str(write_job(tmp_path, job(section)))]) == 2  # train.device: cpu
    assert "deepspeed.fp16.enabled" in capsys.readouterr().err


@pytest.mark.parametrize("data, expect", [
    (job({"fp16": {"enabled": True}}, parallel={"pp": 2}, pipeline={"microbatches": 2}),
     ["deepspeed.fp16.enabled with parallel.pp > 1", "bf16"]),
    (job({"fp16": {"enabled": True}}, train={"dtype": "bfloat16"}),
     ["train.dtype=bfloat16", "deepspeed.fp16.enabled is true", "train.dtype=float32"]),
    (job({"bf16": {"enabled": False}}, train={"dtype": "bfloat16"}),
     ["train.dtype=bfloat16", "deepspeed.bf16.enabled is false", "deepspeed.bf16.enabled=true"]),
    (job({}, train={"dtype": "float64"}), ["train.dtype=float64", "train.dtype=float32"]),
    (job({"gradient_clipping": 1.0}, train={"grad_clip": 0.5}),
     ["train.grad_clip=0.5", "deepspeed.gradient_clipping=1.0", "disagree"]),
    (job({"scheduler": {"type": "WarmupLR", "params": {}}}, optimizer={"warmup_steps": 3}),
     ["deepspeed.scheduler", "optimizer.warmup_steps=3", "optimizer.warmup_steps=0"]),
    (job({"managed_gradient_accumulation": True}, parallel={"pp": 2}, pipeline={"microbatches": 2}),
     ["deepspeed.managed_gradient_accumulation with parallel.pp > 1", "remove the key"]),
])
def test_combinations_parallel4d_cannot_run_are_refused(data, expect):
    with pytest.raises(ConfigError) as err:
        make_config(data)
    assert_names(str(err.value), *expect)


def test_agreeing_precision_and_clipping_pass():
    make_config(job({"gradient_clipping": 0.5}, train={"grad_clip": 0.5}))
    make_config(job({"bf16": {"enabled": True}}, train={"dtype": "bfloat16"}))
    make_config(job({"scheduler": {"type": "WarmupLR", "params": {}}}, optimizer={"warmup_steps": 0}))


@pytest.mark.parametrize("parallel, stage, expect", [
    ({"tp": 4}, 3, ["deepspeed.zero_optimization.stage=3", "parallel.tp=4", "use stage 1 or 2"]),
    ({"sp": 2}, 3, ["deepspeed.zero_optimization.stage=3", "parallel.sp=2", "use stage 1 or 2"]),
    ({"pp": 2}, 2, ["deepspeed.zero_optimization.stage=2", "parallel.pp=2", "use stage 0 or 1"]),
    ({"pp": 2}, 3, ["deepspeed.zero_optimization.stage=3", "parallel.pp=2", "use stage 0 or 1"]),
    ({"tp": 4}, "3", ["deepspeed.zero_optimization.stage='3'", "whole number"]),  # DeepSpeed reads "3" as 3
])
def test_zero_stage_parallel4d_cannot_run_is_refused(parallel, stage, expect):
    data = job({"zero_optimization": {"stage": stage}}, parallel=parallel, pipeline={"microbatches": 2})
    with pytest.raises(ConfigError) as err:
        make_config(data)
    assert_names(str(err.value), *expect)


@pytest.mark.parametrize("parallel, stage", [({"tp": 4}, 2), ({"tp": 4, "dp": 2}, 1), ({"sp": 2}, 2),
                                             ({"pp": 2}, 1), ({"pp": 2}, 0), ({"dp": 2}, 3)])
def test_zero_stage_parallel4d_can_run_is_accepted(parallel, stage):
    cfg = make_config(job({"zero_optimization": {"stage": stage}}, parallel=parallel, pipeline={"microbatches": 2}))
    assert resolve(cfg, "cpu")["zero_optimization"]["stage"] == stage


# --- a valid section -------------------------------------------------------------------------------


def test_valid_section_passes_validate(tmp_path, capsys):
    section = {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "bf16": {"enabled": True}}
    path = write_job(tmp_path, job(section))
    assert load_config(path).deepspeed == section
    assert main(["validate", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["deepspeed"] == section


@pytest.mark.parametrize("clip", ["abc", -1.0, True, float("inf")])
def test_gradient_clipping_that_deepspeed_would_not_apply_is_refused(clip):
    assert_names(refused(job({"gradient_clipping": clip})), "deepspeed.gradient_clipping=", "finite number ≥ 0")
