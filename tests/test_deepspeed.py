"""parallel4d inside DeepSpeed (issue #14, first part): the mesh as DeepSpeed's mpu, parameters
tagged so that DeepSpeed's own gradient norm and clipping count every dense element once, and
no JIT-compiled DeepSpeed op (the workers run with no C++ compiler reachable)."""

import os
import sys

import pytest
import torch
import torch.nn as nn

deepspeed = pytest.importorskip("deepspeed")  # the `deepspeed` extra; `make test` installs it

from parallel4d.config import Config  # noqa: E402
from parallel4d.data import build_dataset, local_slice  # noqa: E402
from deepspeed.runtime.utils import clip_grad_norm_ as ds_clip_grad_norm_  # noqa: E402

from parallel4d.engine import LocalModel, build_stages, dense_layouts, model_shape  # noqa: E402
from parallel4d.integrations.deepspeed import avoid_compiled_ops, tag_parameters  # noqa: E402
from parallel4d.mesh import init_mesh  # noqa: E402
from parallel4d.models.gpt import build_gpt, stage_names  # noqa: E402
from parallel4d.workers import spawn  # noqa: E402

JOB = {"parallel": {"tp": 4}, "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
       "data": {"source": "synthetic", "batch_size": 8}, "train": {"steps": 1}}
CLIP = 0.05  # below the norm (≈1.07), so clipping acts
LR = 1.0


class Stages(nn.Module):
    """This rank's 2D stages (under the engine's LocalModel names) and the 2D loss:
    ``forward(tokens, targets)`` on ``[b/q, s]`` shards → the grid batch's mean loss."""

    def __init__(self, stages: dict, loss_fn, names: list[str]):
        super().__init__()
        self.local = LocalModel({names[i]: stages[i] for i in sorted(stages)})
        self.order = [stages[i] for i in sorted(stages)]
        self.loss_fn = loss_fn

    def forward(self, tokens, targets):
        h = tokens
        for stage in self.order:
            h = stage(h)
        return self.loss_fn(h, targets)


def _one_step(stage: int, tag: bool):
    """One clipped SGD step through DeepSpeed at tp=4 (2×2 grid). Returns DeepSpeed's global norm
    (ZeRO ≥ 1 reports it; at stage 0 its clip_grad_norm_ computes it), the loss, and this rank's
    pieces of every dense parameter after the step ``{dense name: [(offsets, tensor)]}``."""
    cfg = Config.model_validate(JOB)
    mesh = init_mesh(tp=4, timeout_s=60)
    stages, loss_fn = build_stages(cfg, mesh)
    names = stage_names(model_shape(cfg))
    model = Stages(stages, loss_fn, names)
    if tag:
        tag_parameters(model, mesh)
    avoid_compiled_ops()
    mpu = mesh.as_mpu()
    assert not hasattr(mpu, "initialize_sequence_parallel")  # else DeepSpeed takes it for its Ulysses mpu
    assert (mpu.get_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size(),
            mpu.get_sequence_data_parallel_world_size()) == (4, 4, 1)
    params = list(model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(params, lr=LR), mpu=mpu,
        config={"train_micro_batch_size_per_gpu": cfg.data.batch_size, "gradient_accumulation_steps": 1,
                "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
                "zero_allow_untested_optimizer": True})
    tokens, targets = build_dataset(cfg).batch(0)
    i, q = mesh.rank("tp_row"), mesh.q
    loss = engine(local_slice(tokens, i, q), local_slice(targets, i, q))
    engine.backward(loss)
    norm = ds_clip_grad_norm_(params, max_norm=1e30, mpu=engine.mpu) if stage == 0 else None
    engine.step()
    norm = float(norm if stage == 0 else engine.get_global_grad_norm())
    layouts = dense_layouts({names[k]: stages[k] for k in stages}, tied=cfg.model.tie_embeddings)
    pieces = {}
    for name, p in model.local.named_parameters(remove_duplicate=False):
        dense, _, cut = layouts[name]
        pieces[dense] = [(off, view.detach().clone()) for off, view in cut(p)]
    return norm, float(loss), pieces


def _all_steps(cases):
    return [_one_step(stage, tag) for stage, tag in cases]


@pytest.fixture(scope="module")
def dense():
    """The dense model on the same batch: loss, gradient norm (torch's clip_grad_norm_) and the
    parameters after the same clipped SGD step."""
    cfg = Config.model_validate(JOB)
    model = build_gpt(model_shape(cfg), seed=cfg.train.seed)
    tokens, targets = build_dataset(cfg).batch(0)
    loss = model(tokens, targets)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return float(loss), norm, {n: p.detach() for n, p in model.named_parameters()}


def test_deepspeed_counts_every_dense_element_once_without_a_compiler(dense, tmp_path):
    """ZeRO 0, 1 and 2 over a 2×2 grid, gradient clipping active: DeepSpeed's global norm equals
    the dense model's (1e-5) and every parameter after the step the dense one's; untagged, the 2D
    biases and norms are miscounted (the check can fail). The workers' PATH holds no C++ compiler
    and the extension cache is empty, so a JIT build of a DeepSpeed op would fail the job."""
    env = {"PATH": os.path.dirname(sys.executable), "CXX": "c++-not-installed", "CC": "cc-not-installed",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    cases = [(0, True), (1, True), (2, True), (1, False)]
    results = spawn(_all_steps, 4, (cases,), backend="gloo", timeout_s=300, env=env)
    loss, norm, after = dense
    assert norm > CLIP  # clipping acts
    for rank_results in results:
        for (stage, tag), (got_norm, got_loss, pieces) in zip(cases, rank_results):
            assert abs(got_loss - loss) <= 1e-5 * loss, (stage, got_loss, loss)
            if not tag:
                assert abs(got_norm - norm) > 1e-3 * norm, (got_norm, norm)
                continue
            assert abs(got_norm - norm) <= 1e-5 * norm, (stage, got_norm, norm)
            assert pieces.keys() == after.keys()
            for name, boxes in pieces.items():
                for off, t in boxes:
                    want = after[name][tuple(slice(o, o + n) for o, n in zip(off, t.shape))]
                    torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{stage} {n}: {m}")
    assert not any((tmp_path / "torch_extensions").glob("**/*.so"))
