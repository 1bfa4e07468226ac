"""The trainer contract (issue #27.4): ``training/loop.py`` drives a trainer only through
:class:`parallel4d.engine.trainer.Trainer`, and both trainers — parallel4d's ``Engine`` and the
DeepSpeed integration's ``DeepSpeedTrainer`` — implement all of it. One process, no spawn.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import parallel4d.training.loop as loop
from parallel4d.config.load import make_config
from parallel4d.engine.step import Engine
from parallel4d.engine.trainer import Trainer

METHODS = set(Trainer.__abstractmethods__)
ATTRIBUTES = set(Trainer.__annotations__)
TINY = {"model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
        "data": {"source": "synthetic", "batch_size": 8}, "train": {"steps": 1}, "checkpoint": {"enabled": False}}


def missing(trainer) -> list[str]:
    """The contract's members ``trainer`` lacks: methods absent, left abstract or taking other
    parameters (a class or an instance), and data attributes (an instance only)."""
    cls = trainer if isinstance(trainer, type) else type(trainer)
    out = []
    for name in sorted(METHODS):
        impl, wanted = getattr(cls, name, None), inspect.signature(getattr(Trainer, name)).parameters.keys()
        if not callable(impl) or getattr(impl, "__isabstractmethod__", False) \
                or inspect.signature(impl).parameters.keys() != wanted:
            out.append(name)
    if not isinstance(trainer, type):
        out += [a for a in sorted(ATTRIBUTES) if not hasattr(trainer, a)]
    return out


def _without(cls: type, name: str) -> type:
    """A copy of ``cls`` (same bases, same body) that lacks method ``name``."""
    body = {k: v for k, v in vars(cls).items() if k not in (name, "__dict__", "__weakref__")}
    return type(f"{cls.__name__}Without_{name}", cls.__bases__, body)


def _deepspeed_trainer(monkeypatch):
    """A DeepSpeedTrainer through its own ``__init__``, DeepSpeed's engine replaced by a stand-in."""
    pytest.importorskip("deepspeed")
    from parallel4d.integrations.deepspeed import trainer as ds_trainer

    class StandIn:
        module, executor = torch.nn.Linear(2, 2), None

    monkeypatch.setattr(ds_trainer, "build_engine", lambda cfg, mesh: (StandIn(), None, None))
    return ds_trainer.DeepSpeedTrainer(make_config(TINY), None)


def test_the_contract_is_exactly_what_the_training_loop_uses():
    """Every member of ``engine`` / ``self.engine`` that loop.py touches is in the contract, every
    member of the contract is used there, and nothing is probed for (getattr / hasattr)."""
    tree = ast.parse(Path(loop.__file__).read_text())
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and (
        (isinstance(node.value, ast.Name) and node.value.id == "engine")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "engine"))}
    assert used == METHODS | ATTRIBUTES, (used - METHODS - ATTRIBUTES, METHODS | ATTRIBUTES - used)
    probes = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")]
    assert probes == [], probes  # no member of a trainer is looked up by name
    assert {"train_step", "evaluate", "checkpoint_state", "load_checkpoint", "held_memory"} <= METHODS


def test_the_engine_implements_the_contract(single_rank):
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    engine = compose(make_config(TINY), init_mesh())
    assert Trainer in Engine.__mro__ and isinstance(engine, Trainer)
    assert missing(Engine) == [] and missing(engine) == []
    assert list(engine.data_rows()) == list(range(8)) and engine.held_memory() is None and engine.hetero_stats() is None
    del engine.last_lr  # an attribute the contract names, gone: seen
    assert missing(engine) == ["last_lr"]


def test_the_deepspeed_trainer_implements_the_contract(monkeypatch):
    trainer = _deepspeed_trainer(monkeypatch)
    assert Trainer in type(trainer).__mro__ and isinstance(trainer, Trainer)
    assert missing(type(trainer)) == [] and missing(trainer) == []
    assert (trainer.data_rows(), trainer.held_memory(), trainer.loss_scaler(), trainer.pretrained_bytes(),
            trainer.hetero_stats(), trainer.pipeline_step_info()) == (None,) * 6
    assert trainer.parameter_count() == 6


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_trainer_without_a_method_fails_loudly(name, monkeypatch):
    """Both classes with one contract method deleted: the check names it, and the class cannot be
    instantiated (every contract method is abstract)."""
    pytest.importorskip("deepspeed")
    from parallel4d.integrations.deepspeed.trainer import DeepSpeedTrainer

    for cls in (Engine, DeepSpeedTrainer):
        broken = _without(cls, name)
        assert missing(broken) == [name]
        with pytest.raises(TypeError, match=f"abstract .*{name}"):
            broken.__new__(broken)
