"""parallel4d inside DeepSpeed (issue #14, first part): the mesh as DeepSpeed's mpu, parameters
tagged so that DeepSpeed's own gradient norm and clipping count every dense element once, and
no JIT-compiled DeepSpeed op (the workers run with no C++ compiler reachable)."""

import difflib
import os
import signal
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")  # the `deepspeed` extra; `make test` installs it

from parallel4d.config.load import make_config
from parallel4d.config.schema import Config
from parallel4d.data.batches import build_dataset  # noqa: E402
from deepspeed.runtime.utils import clip_grad_norm_ as ds_clip_grad_norm_  # noqa: E402

import parallel4d  # noqa: E402
from parallel4d.engine.batch import local_batch  # noqa: E402
from parallel4d.integrations.deepspeed.mpu import as_mpu  # noqa: E402
from parallel4d.engine.state import dense_layouts  # noqa: E402
from parallel4d.engine.model import model_shape  # noqa: E402
from parallel4d.optim.optimizer import build_optimizer, lr_at, lr_lambda  # noqa: E402
from parallel4d.integrations.deepspeed import avoid_compiled_ops  # noqa: E402
from parallel4d.distributed.mesh import init_mesh  # noqa: E402
from parallel4d.models.build import build_dense  # noqa: E402
from parallel4d.models.gpt2.model import build_gpt  # noqa: E402
from parallel4d.launcher.spawn import TRAINING_IMPORTS, spawn  # noqa: E402

JOB = {"parallel": {"tp": 4}, "sequence": {"layout": "zigzag"}, "model": {"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 2, "layers": 2},
       "data": {"source": "synthetic", "batch_size": 8}, "train": {"steps": 1}}
CLIP = 0.05  # below the norm (≈1.07), so clipping acts
LR = 1.0


DEEPSPEED_JOB = (*TRAINING_IMPORTS, "deepspeed")  # what these jobs' workers import: once, in the zygote


def _one_step(job: dict, stage: int, tag: bool):
    """One clipped SGD step through DeepSpeed on ``parallel4d.build_model``. Returns DeepSpeed's
    global norm (ZeRO ≥ 1 reports it; at stage 0 its clip_grad_norm_ computes it), the mean loss
    over the global batch, and this rank's pieces of every dense parameter after the step
    ``{dense name: [(offsets, tensor)]}``."""
    cfg = Config.model_validate(job)
    p = cfg.parallel
    mesh = init_mesh(dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=60)
    model = parallel4d.build_model(cfg, mesh)
    if not tag:
        for param in model.parameters():
            del param.tensor_model_parallel
    avoid_compiled_ops()
    mpu = as_mpu(mesh)
    assert not hasattr(mpu, "initialize_sequence_parallel")  # else DeepSpeed takes it for its Ulysses mpu
    assert (mpu.get_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size(),
            mpu.get_sequence_data_parallel_world_size()) == (p.tp, p.tp, p.dp * p.sp)
    params = list(model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(params, lr=LR), mpu=mpu,
        config={"train_micro_batch_size_per_gpu": cfg.data.batch_size // p.dp, "gradient_accumulation_steps": 1,
                "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
                "zero_allow_untested_optimizer": True})
    tokens, targets = build_dataset(cfg).batch(0)
    layout = cfg.sequence.layout
    loss = engine(local_batch(mesh, tokens, layout), local_batch(mesh, targets, layout))
    engine.backward(loss)
    norm = ds_clip_grad_norm_(params, max_norm=1e30, mpu=engine.mpu) if stage == 0 else None
    engine.step()
    norm = float(norm if stage == 0 else engine.get_global_grad_norm())
    return norm, float(loss), _dense_pieces(model, cfg)


def _dense_pieces(model, cfg) -> dict:
    """This rank's pieces of every dense parameter ``{dense name: [(offsets, float32 tensor)]}``."""
    local = model.local
    layouts = dense_layouts(local.stages(), tied=cfg.model.tie_embeddings)
    pieces = {}
    for name, param in local.named_parameters(remove_duplicate=False):
        dense, _, cut = layouts[name]
        pieces[dense] = [(off, view.detach().float().clone()) for off, view in cut(param)]
    return pieces


def assert_pieces_close(pieces: dict, dense: dict, rtol: float, atol: float, what: str) -> None:
    assert pieces.keys() == dense.keys(), what
    for name, boxes in pieces.items():
        for off, t in boxes:
            want = dense[name][tuple(slice(o, o + n) for o, n in zip(off, t.shape))]
            torch.testing.assert_close(t, want.float(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")


def _no_compiler(tmp_path) -> dict:
    """Worker environment with no C++ compiler reachable and an empty extension cache."""
    return {"PATH": os.path.dirname(sys.executable), "CXX": "c++-not-installed", "CC": "cc-not-installed",
            "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}


def _all_steps(job, cases):
    return [_one_step(job, stage, tag) for stage, tag in cases]


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


COUNT_CASES = [(0, True), (1, True), (2, True), (1, False)]  # (ZeRO stage, parameters tagged)
RING_JOB = {**JOB, "parallel": {"dp": 2, "sp": 2}}


def _four_worker_jobs(pipeline_jobs, saves):
    """Every 4-worker check of this file in one job (one start-up, DeepSpeed imported once per
    worker): the norm counts, the ring under ZeRO-2, the layouts through initialize(), and the
    ZeRO-3 refusal (its message)."""
    from parallel4d.config.errors import ConfigError

    counts = _all_steps(JOB, COUNT_CASES)
    ring = _all_steps(RING_JOB, [(2, True)])
    layouts = _train_batches(pipeline_jobs, saves)
    try:
        _all_steps(JOB, [(3, True)])
        refusal = None
    except ConfigError as e:
        refusal = str(e)
    return counts, ring, layouts, refusal


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory, llama_checkpoint, saved):
    """The results of :func:`_four_worker_jobs` per rank, from workers whose PATH holds no C++
    compiler and whose extension cache is empty (a JIT build of a DeepSpeed op would fail them).
    The layouts are :data:`PIPELINE_CASES`' jobs, then :func:`_llama_cases`'; the bf16 one is saved
    into ``saved``."""
    import yaml

    tmp = tmp_path_factory.mktemp("deepspeed4")
    (tmp / "tp4.yaml").write_text(yaml.safe_dump(PIPELINE_CASES[2][1]))
    given = [str(tmp / "tp4.yaml") if index == 2 else job for index, (_, job, _) in enumerate(PIPELINE_CASES)]
    given += [job for _, job, _ in _llama_cases(llama_checkpoint)]
    saves = {5: saved["bf16"]}
    assert PIPELINE_CASES[5][0] == "1F1B pp=2 × dp=2 in bf16"
    results = spawn(_four_worker_jobs, 4, (given, saves), backend="gloo", timeout_s=600, env=_no_compiler(tmp),
                    preload=DEEPSPEED_JOB)
    assert not any((tmp / "torch_extensions").glob("**/*.so"))
    return results


def test_deepspeed_counts_every_dense_element_once_without_a_compiler(dense, four_workers):
    """ZeRO 0, 1 and 2 over a 2×2 grid, gradient clipping active: DeepSpeed's global norm equals
    the dense model's (1e-5) and every parameter after the step the dense one's; untagged, the 2D
    biases and norms are miscounted (the check can fail). No C++ compiler was reachable."""
    loss, norm, after = dense
    assert norm > CLIP  # clipping acts
    for counts, _, _, _ in four_workers:
        for (stage, tag), (got_norm, got_loss, pieces) in zip(COUNT_CASES, counts):
            assert abs(got_loss - loss) <= 1e-5 * loss, (stage, got_loss, loss)
            if not tag:
                assert abs(got_norm - norm) > 1e-3 * norm, (got_norm, norm)
                continue
            assert abs(got_norm - norm) <= 1e-5 * norm, (stage, got_norm, norm)
            assert_pieces_close(pieces, after, 1e-5, 1e-6, f"ZeRO {stage}")


def test_ring_attention_under_deepspeed_zero(dense, four_workers):
    """sp = 2 × dp = 2 (4 workers, ZeRO-2 over the dp·sp replicas): the loss DeepSpeed reduces is
    each rank's share (mean / sp), so its sum over sp and average over dp are the dense gradient:
    norm and every parameter after the clipped step equal the dense model's."""
    loss, norm, after = dense
    for _, ((got_norm, got_loss, pieces),), _, _ in four_workers:
        assert abs(got_loss - loss) <= 1e-5 * loss, (got_loss, loss)  # the printed value: the global mean
        assert abs(got_norm - norm) <= 1e-5 * norm, (got_norm, norm)
        assert_pieces_close(pieces, after, 1e-5, 1e-6, "sp=2 × dp=2")


TRAIN = {**JOB, "parallel": {"tp": 4, "dp": 2},
         # eps 1e-4: the attention key bias has a zero gradient in exact arithmetic, and with a tiny eps
         # Adam turns each layout's float32 round-off there into lr-sized steps (parameters would differ
         # by ~1e-4 there for reasons that are not the layouts')
         "optimizer": {"lr": 0.01, "warmup_steps": 3, "weight_decay": 0.1, "eps": 1e-4},
         "train": {"steps": 5, "grad_clip": 0.5, "timeout_s": 60, "job_timeout_s": 240},
         "checkpoint": {"enabled": False}}


def _train_under_zero(job: dict, runs: list[tuple[int, bool]]):
    """``train.steps`` AdamW steps through DeepSpeed for each ``(ZeRO stage, bf16)`` (the optimizer,
    warm-up and clipping of the job's config); the mean losses over the replicas, step by step."""
    cfg = Config.model_validate(job)
    p = cfg.parallel
    mesh = init_mesh(dp=p.dp, sp=p.sp, tp=p.tp, timeout_s=60)
    avoid_compiled_ops()
    data, layout = build_dataset(cfg), cfg.sequence.layout
    out = {}
    for stage, bf16 in runs:
        model = parallel4d.build_model(cfg, mesh)
        optimizer = build_optimizer(model.dense_named_parameters(), cfg.optimizer)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, mpu=as_mpu(mesh),
            config={"train_micro_batch_size_per_gpu": cfg.data.batch_size // p.dp, "gradient_accumulation_steps": 1,
                    "gradient_clipping": cfg.train.grad_clip, "zero_optimization": {"stage": stage},
                    "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True})
        losses = []
        for step in range(cfg.train.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg.optimizer, cfg.train.steps)
            tokens, targets = data.batch(step)
            loss = engine(local_batch(mesh, tokens, layout), local_batch(mesh, targets, layout))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))  # build_model's loss has the global mean as its value
        out[stage, bf16] = losses, _dense_pieces(model, cfg)
    return out


def test_zero_stages_equal_parallel4d_data_parallelism(tmp_path, eight_workers):
    """tp=4 × dp=2 (8 workers), 5 AdamW steps (3 of them warm-up), weight decay and clipping active:
    DeepSpeed ZeRO 0, 1 and 2 give parallel4d's own run's losses (launch, same config) and its
    parameters after the last step (its layout-free checkpoint, read by DCP), rel 1e-5; with
    ``bf16`` (ZeRO 1) the losses are finite, within 2e-2 and learning."""
    from parallel4d import launch
    from test_checkpoint import read_state

    ours = launch({**TRAIN, "train": {**TRAIN["train"], "out_dir": str(tmp_path / "p4d")}, "checkpoint": {}})
    state = read_state(tmp_path / "p4d" / "checkpoints" / "step_00000005")
    params = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    want = torch.tensor(ours["losses"], dtype=torch.float64)
    assert want[-1] < want[0]
    for rank_results, _ in eight_workers:
        for (stage, bf16), (losses, pieces) in rank_results.items():
            got = torch.tensor(losses, dtype=torch.float64)
            if bf16:
                assert torch.isfinite(got).all() and got[-1] < got[0] and not torch.equal(got, want)
                torch.testing.assert_close(got, want, rtol=2e-2, atol=0, msg=lambda m: f"bf16: {m}")
                continue
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m, s=stage: f"ZeRO {s}: {m}")
            assert_pieces_close(pieces, params, 1e-5, 1e-6, f"ZeRO {stage} after 5 steps")


ZERO_RUNS = [(0, False), (1, False), (2, False), (1, True)]  # (ZeRO stage, bf16)


def _eight_worker_jobs(hanayo_job: dict, root: str):
    return _train_under_zero(TRAIN, ZERO_RUNS), _train_batches([hanayo_job], {0: root})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Where the spawned jobs save their DeepSpeed checkpoints: ``{what: checkpoint root}``."""
    tmp = tmp_path_factory.mktemp("deepspeed_saved")
    return {what: str(tmp / what) for what in ("hanayo", "bf16")}


@pytest.fixture(scope="module")
def eight_workers(tmp_path_factory, saved):
    """Per rank: the ZeRO runs of tp=4 × dp=2 and the Hanayo pp=2 × tp=4 job through initialize()
    (then saved as parallel4d launch saves it, into ``saved["hanayo"]``), in one spawned job whose
    workers reach no C++ compiler."""
    tmp = tmp_path_factory.mktemp("deepspeed8")
    return spawn(_eight_worker_jobs, 8, (HANAYO_JOB, saved["hanayo"]), backend="gloo", timeout_s=600,
                 env=_no_compiler(tmp), preload=DEEPSPEED_JOB)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "deepspeed"


def _torchrun_losses(scripts: dict[str, int], job: Path) -> list[list[float]]:
    """Each of ``scripts`` (``{script: processes}``) under torchrun on ``job``, side by side (a job of one
    process leaves a core idle); the losses each printed, once all exited 0."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    procs = {}
    try:
        for script, nproc in scripts.items():
            out, err = (job.parent / f"{script}.{name}" for name in ("out", "err"))
            with out.open("w") as stdout, err.open("w") as stderr:
                procs[script] = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", str(nproc),
                                                  str(EXAMPLES / script), str(job)], stdout=stdout, stderr=stderr)
        for script, proc in procs.items():
            assert proc.wait(timeout=300) == 0, (job.parent / f"{script}.err").read_text()[-3000:]
    finally:  # a failed job must not leave the other running: torchrun passes SIGTERM on to its workers
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return [[float(m) for m in re.findall(r"^step \d+ loss (\S+)$", (job.parent / f"{script}.out").read_text(), re.M)]
            for script in scripts]


def test_the_deepspeed_example_with_parallel4d_equals_the_plain_one(tmp_path):
    """examples/deepspeed: the plain DeepSpeed script (1 process, dense GPT) and the same script with
    four lines changed (8 torchrun processes: tp=4 × sp=2) print the same losses (rel 1e-4), over 3
    of the example job's 20 steps (each step of the 8 processes takes ~0.8 s on the CI's 2 cores)."""
    import yaml

    job = yaml.safe_load((EXAMPLES / "job.yaml").read_text())
    assert job["train"]["steps"] == 20
    job["train"]["steps"] = 3
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    def main_of(name):  # the training code: from `def main` on
        lines = (EXAMPLES / name).read_text().splitlines()
        return lines[next(i for i, line in enumerate(lines) if line.startswith("def main")):]

    changed = [line for line in difflib.unified_diff(main_of("train.py"), main_of("train_parallel4d.py"),
                                                     lineterm="", n=0)
               if line.startswith("+") and not line.startswith("+++")]
    assert len(changed) <= 5, changed  # the mesh, the model, mpu=, the batch shards (one call on two lines)
    want, got = _torchrun_losses({"train.py": 1, "train_parallel4d.py": 8}, tmp_path / "job.yaml")
    assert len(want) == len(got) == 3 and want[-1] < want[0]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-4, atol=0)


def test_zero3_with_tensor_parallelism_is_refused_before_a_step(four_workers):
    """build_model under ZeRO-3 with tp=4 (a user's own DeepSpeed loop): refused at the first forward."""
    for *_, refusal in four_workers:
        assert re.search(r"ZeRO stage 3 is not supported with parallel.tp > 1.*stage to 1 or 2", refusal or ""), refusal


# --- initialize(config): every layout through engine.train_batch, pipelines included (#14.5, #14.6) ---

LAYOUTS = {**JOB, "model": {**JOB["model"], "layers": 4},
           "optimizer": {"lr": 0.01, "warmup_steps": 2, "weight_decay": 0.1, "eps": 1e-4},
           "train": {"steps": 5, "timeout_s": 60},
           "deepspeed": {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5, "steps_per_print": 10**6}}


def _layout(parallel: dict, pipeline: dict | None = None, stage: int = 1) -> dict:
    ds = {**LAYOUTS["deepspeed"], "zero_optimization": {"stage": stage}}
    return {**LAYOUTS, "parallel": parallel, "pipeline": pipeline or {"microbatches": 2}, "deepspeed": ds}


def dense_run(job: dict) -> tuple[list[float], list[float], dict]:
    """The dense model in this process with torch alone: AdamW, the warm-up as a LambdaLR, torch's
    clip_grad_norm_, on the whole batch. Losses, gradient norms, parameters after the last step."""
    cfg = make_config(job)  # with model.pretrained, the model fields from its config.json
    model = build_dense(model_shape(cfg), seed=cfg.train.seed)
    if cfg.model.pretrained:
        from parallel4d.models.hf import load_hf_state_dict

        model.load_state_dict(load_hf_state_dict(cfg.model.pretrained, cfg.model), strict=True)
    optimizer = build_optimizer(model.named_parameters(), cfg.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    data, losses, norms = build_dataset(cfg), [], []
    for step in range(cfg.train.steps):
        loss = model(*data.batch(step))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), job["deepspeed"]["gradient_clipping"])))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def _train_batches(jobs: list[dict], saves: dict[int, str] | None = None):
    """Each job through ``initialize`` and ``engine.train_batch``: losses, DeepSpeed's last global
    norm, this rank's parameter pieces after the last step, and what the engine is. Job ``i`` in
    ``saves`` is then saved as ``parallel4d launch`` saves it (DeepSpeedTrainer's writer) under ``saves[i]``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from parallel4d.checkpoint import dcp as checkpoint
    from parallel4d.integrations.deepspeed import DeepSpeedPipeline
    from parallel4d.integrations.deepspeed import initialize
    from parallel4d.integrations.deepspeed.trainer import checkpoint_writer

    out = []
    for index, job in enumerate(jobs):
        engine, optimizer, scheduler = initialize(job)  # a dict, or a YAML file's path
        cfg = engine.p4d_cfg
        data = build_dataset(cfg)
        losses = [engine.train_batch(*data.batch(step)) for step in range(cfg.train.steps)]
        if index in (saves or {}):
            steps = cfg.train.steps
            checkpoint.save(checkpoint_writer(engine, steps, steps * cfg.data.batch_size * cfg.model.seq_len),
                            saves[index], steps, extra_files={"config.yaml": cfg.to_yaml()})
        kind = "DeepSpeedEngine" if isinstance(engine, DeepSpeedEngine) else \
            "DeepSpeedPipeline" if isinstance(engine, DeepSpeedPipeline) else type(engine).__name__
        if kind == "DeepSpeedPipeline":
            with pytest.raises(AttributeError, match="train_batch"):
                engine.backward
        norm = engine.get_global_grad_norm()  # ZeRO ≥ 1 reports it; without ZeRO, DeepSpeed keeps None
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # whole again under ZeRO-3
            pieces = _dense_pieces_of(engine.module, cfg)
        out.append((kind, losses, None if norm is None else float(norm), pieces))
    return out


def _dense_pieces_of(module, cfg) -> dict:
    return _dense_pieces(type("M", (), {"local": getattr(module, "local", module)})(), cfg)


def _check_layout(result, job, what):
    kind, losses, norm, pieces = result
    want_losses, want_norms, want_params = dense_run(job)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(want_losses, dtype=torch.float64),
                               rtol=1e-4, atol=0, msg=lambda m: f"{what} losses: {m}")
    if job["deepspeed"]["zero_optimization"]["stage"] > 0:
        assert abs(norm - want_norms[-1]) <= 1e-4 * want_norms[-1], (what, norm, want_norms[-1])
    assert want_norms[0] > job["deepspeed"]["gradient_clipping"]  # clipping acts
    assert_pieces_close(pieces, {n: want_params[n] for n in pieces}, 1e-4, 1e-6, what)  # this rank's stages
    return kind, set(pieces), set(want_params)


def test_hanayo_pipeline_with_2d_tensor_parallelism_inside_deepspeed(eight_workers):
    """Hanayo pp=2 × tp=4 (8 workers): parallel4d's executor runs the waves, each rank's chunks
    sit in one DeepSpeedEngine (ZeRO-1, clipping, warm-up): 5 steps' losses, DeepSpeed's global
    norm and every parameter after them equal the dense model trained by torch alone (rel 1e-4).
    The workers have no C++ compiler (a JIT-built DeepSpeed op would fail them)."""
    job, results = HANAYO_JOB, [hanayo for _, hanayo in eight_workers]
    checked = [_check_layout(result, job, "Hanayo pp=2 × tp=4") for (result,) in results]
    assert {kind for kind, _, _ in checked} == {"DeepSpeedPipeline"}
    assert set().union(*(names for _, names, _ in checked)) == checked[0][2]  # every parameter somewhere


def _pipeline_cases():
    one_f_one_b = _layout({"pp": 2, "dp": 2}, {"schedule": "1f1b", "microbatches": 2})
    offload = _layout({"tp": 4}, {"microbatches": 1}, stage=2)
    offload["deepspeed"]["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return [  # (what, job, the engine it gives; None: bf16, checked on its own); the third one runs from a YAML file
        ("1F1B pp=2 × dp=2", one_f_one_b, "DeepSpeedPipeline"),
        ("Hanayo pp=2 × sp=2, split backward, ZeRO-0",
         _layout({"pp": 2, "sp": 2}, {"schedule": "hanayo", "microbatches": 2, "split_backward": True}, 0),
         "DeepSpeedPipeline"),
        ("pp=1 tp=4, ZeRO-2", _layout({"tp": 4}, {"microbatches": 2}, stage=2), "DeepSpeedEngine"),
        ("pp=1 dp=4, ZeRO-3", _layout({"dp": 4}, {"microbatches": 1}, stage=3), "DeepSpeedEngine"),
        ("pp=1 tp=4, ZeRO-2 offloading to torch's AdamW", offload, "DeepSpeedEngine"),
        ("1F1B pp=2 × dp=2 in bf16", {**one_f_one_b, "deepspeed": {**one_f_one_b["deepspeed"],
                                                                   "bf16": {"enabled": True}}}, None)]


PIPELINE_CASES = _pipeline_cases()
HANAYO_JOB = _layout({"pp": 2, "tp": 4}, {"schedule": "hanayo", "microbatches": 2})


def test_pipelines_with_data_and_sequence_parallelism_and_the_pp1_engine_inside_deepspeed(four_workers):
    """In 4 workers: 1F1B pp=2 × dp=2 (ZeRO-1 over dp, the tied table on two pp ranks); Hanayo
    pp=2 × sp=2 with its backward split into B and W, without ZeRO (ring attention: each replica's
    loss share is 1/sp); pp=1 tp=4 under
    ZeRO-2 (from a YAML file), where the engine is a genuine DeepSpeedEngine; pp=1 dp=4 under ZeRO-3;
    pp=1 tp=4 under ZeRO-2 with the optimizer states offloaded (stepped by torch's AdamW, not the
    JIT-built DeepSpeedCPUAdam). Each equals the dense model. The 1F1B job in bf16 trains within 2e-2
    of it."""
    results = [layouts for _, _, layouts, _ in four_workers]
    for index, (what, job, want) in enumerate(PIPELINE_CASES):
        if want is None:  # bf16 between the stages and in DeepSpeed's optimizer: finite, learning, close
            dense = torch.tensor(dense_run(job)[0], dtype=torch.float64)
            for rank_results in results:
                got = torch.tensor(rank_results[index][1], dtype=torch.float64)
                assert torch.isfinite(got).all() and got[-1] < got[0] and not torch.equal(got, dense)
                torch.testing.assert_close(got, dense, rtol=2e-2, atol=0, msg=lambda m: f"{what}: {m}")
            continue
        checked = [_check_layout(rank_results[index], job, what) for rank_results in results]
        assert {kind for kind, _, _ in checked} == {want}
        assert set().union(*(names for _, names, _ in checked)) == checked[0][2]


def test_launch_with_a_deepspeed_section_stops_on_ctrl_c_and_resumes_exactly(tmp_path):
    """configs/deepspeed.yaml through ``parallel4d launch`` at tp=1 (2 workers; its Hanayo pp=2 ×
    tp=4 layout is checked against the dense model in the Hanayo test above): the losses are the
    dense model's (rel 1e-4); Ctrl-C after step 3 finishes the step, saves DeepSpeed's checkpoint
    (checksummed, run.json format "deepspeed") and exits 130; the resumed run's losses equal the
    straight run's."""
    import json

    import yaml

    from parallel4d import launch
    from parallel4d.checkpoint.checksums import verify
    from parallel4d.checkpoint.resume import latest_checkpoint
    from parallel4d.checkpoint.steps import read_info
    from test_faults import finish, start_job

    shipped = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "deepspeed.yaml").read_text())

    def job(name: str, steps: int, **train) -> dict:
        return {**shipped, "parallel": {**shipped["parallel"], "tp": 1},
                "train": {**shipped["train"], "steps": steps, "log_every": 1, "timeout_s": 60,
                          "out_dir": str(tmp_path / name), **train}}

    straight = launch(job("straight", 8))
    want, _, _ = dense_run(job("straight", 8))
    torch.testing.assert_close(torch.tensor(straight["losses"], dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=0)
    proc, _ = start_job(tmp_path, job("resumed", 1000))
    proc.send_signal(signal.SIGINT)
    err = finish(proc, timeout=180)
    assert proc.returncode == 130, err[-3000:]
    saved = latest_checkpoint(tmp_path / "resumed" / "checkpoints")
    stopped = json.loads((tmp_path / "resumed" / "summary.json").read_text())["steps"]
    assert saved.name == f"step_{stopped:08d}" and 3 <= stopped < 8, (saved, stopped)
    assert read_info(saved)["format"] == "deepspeed" and verify(saved) is None
    assert sorted(saved.glob("*_optim_states.pt")), "DeepSpeed's ZeRO files"

    resumed = launch(job("resumed", 8, resume=True))
    assert resumed["resumed_from"] == stopped and len(resumed["losses"]) == 8
    torch.testing.assert_close(torch.tensor(resumed["losses"], dtype=torch.float64),
                               torch.tensor(straight["losses"], dtype=torch.float64), rtol=1e-6, atol=0)


# --- the Llama family and a transformers checkpoint inside DeepSpeed (#15.1, #15.2) ---

LLAMA_MODEL = {"arch": "llama", "vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "kv_heads": 2,
               "layers": 4, "intermediate_size": 48, "rope_theta": 5e5}


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A tiny LlamaForCausalLM (GQA) saved by transformers; its directory."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("llama")
    m = LLAMA_MODEL
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden"], intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
        max_position_embeddings=64, rope_theta=m["rope_theta"], tie_word_embeddings=False)).save_pretrained(directory)
    return str(directory)


def _llama_cases(directory: str):
    """(what, job, the engine it gives): a Llama built by build_model at tp=4 under ZeRO-2, and the
    transformers checkpoint loaded slice by slice into Hanayo pp=2 × ring sp=2 under ZeRO-1."""
    tp4 = {**_layout({"tp": 4}, {"microbatches": 2}, stage=2), "model": LLAMA_MODEL}
    hanayo = {**_layout({"pp": 2, "sp": 2}, {"schedule": "hanayo", "microbatches": 2}, stage=1),
              "model": {"pretrained": directory, "seq_len": 16}}
    return [("Llama pp=1 tp=4, ZeRO-2", tp4, "DeepSpeedEngine"),
            ("a transformers Llama, Hanayo pp=2 × sp=2, ZeRO-1", hanayo, "DeepSpeedPipeline")]


def test_llama_and_a_pretrained_checkpoint_inside_deepspeed(four_workers, llama_checkpoint):
    """The Llama family through initialize(): at tp=4 (build_model's 2D Llama in a DeepSpeedEngine,
    ZeRO-2) and from a transformers checkpoint under Hanayo pp=2 × ring sp=2 (ZeRO-1). 5 steps each:
    losses, DeepSpeed's global norm and every parameter equal the dense Llama trained by torch alone
    (from the same checkpoint), rel 1e-4."""
    results = [layouts[len(PIPELINE_CASES):] for _, _, layouts, _ in four_workers]
    for index, (what, job, want) in enumerate(_llama_cases(llama_checkpoint)):
        checked = [_check_layout(rank_results[index], job, what) for rank_results in results]
        assert {kind for kind, _, _ in checked} == {want}
        assert set().union(*(names for _, names, _ in checked)) == checked[0][2]


# --- DeepSpeed's checkpoints gathered and exported as native ones (#30.5) ---

def _gathered(root: str, out: Path) -> dict:
    from parallel4d.checkpoint.gather import gather

    return torch.load(gather(root, out, progress=False), weights_only=True)


def _union(ranks: list[dict]) -> dict:
    """Every rank's pieces ``{dense name: [(offsets, tensor)]}`` together."""
    out: dict = {}
    for pieces in ranks:
        for name, boxes in pieces.items():
            out.setdefault(name, []).extend(boxes)
    return out


def test_deepspeed_checkpoints_gather_and_export_like_native_ones(eight_workers, four_workers, saved, tmp_path):
    """A DeepSpeed run's checkpoint, saved as ``parallel4d launch`` saves it, through ``parallel4d checkpoint
    gather`` and ``parallel4d export`` (which refused it before, pointing to zero_to_fp32.py, which fails on
    pp=2 × tp=4). Hanayo pp=2 × tp=4 under ZeRO-1 (the shipped example's layout): every dense parameter
    equals, bit for bit, what the engine holds after its 5 steps (every rank's pieces of it); the export's
    safetensors hold the same. 1F1B pp=2 × dp=2 in bf16: the float32 master, which rounds to the module's
    bf16 parameters and is not them."""
    from parallel4d.checkpoint.export import export
    from parallel4d.models.hf import load_hf_state_dict

    hanayo = _gathered(saved["hanayo"], tmp_path / "hanayo.pt")
    assert hanayo["step"] == 5 and hanayo["optimizer"] == {}
    pieces = _union([ranks[1][0][3] for ranks in eight_workers])
    assert pieces.keys() == hanayo["model"].keys()
    assert_pieces_close(pieces, hanayo["model"], 0, 0, "Hanayo pp=2 × tp=4 gathered")
    cfg = make_config(HANAYO_JOB)
    exported = load_hf_state_dict(export(saved["hanayo"], tmp_path / "hf"), cfg.model)
    assert all(torch.equal(exported[k], v) for k, v in hanayo["model"].items())

    bf16 = _gathered(saved["bf16"], tmp_path / "bf16.pt")["model"]
    module = _union([ranks[2][5][3] for ranks in four_workers])  # the module's bf16 parameters, as float32
    assert all(t.dtype == torch.float32 for t in bf16.values())
    assert_pieces_close(module, {k: v.bfloat16() for k, v in bf16.items()}, 0, 0, "bf16 master rounded")
    assert not all(torch.equal(t, bf16[n][tuple(slice(o, o + k) for o, k in zip(off, t.shape))])
                   for n, boxes in module.items() for off, t in boxes)  # the master, not the 16-bit copy


@pytest.mark.parametrize("fused", [True, False], ids=["FP16_Optimizer", "FP16_UnfusedOptimizer"])
def test_fp16_without_zero_exposes_its_float32_masters_to_the_layout_free_copy(single_rank, fused, monkeypatch):
    """DeepSpeed's fp16 optimizers without ZeRO (the real classes, which also construct on CPU) keep the
    float32 masters in their own groups: ``_float32_parameters`` reads each parameter's — float32, the
    parameter's shape, rounding to exactly the 16-bit parameter DeepSpeed copied back after its steps
    (a wrong offset into the fused flat group would not), and finer than it (not an upcast copy);
    the tied alias shares its master."""
    from types import SimpleNamespace

    import deepspeed.comm
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from parallel4d.integrations.deepspeed.trainer import _float32_parameters

    # The unfused optimizer asks deepspeed.comm for the rank (to log); init_distributed would JIT-build
    # DeepSpeed's shared-memory op on CPU (~25 s on a fresh machine) to answer 0.
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 11)).half()
    model[2].weight = model[0].weight  # tied, as a tied head
    cls = FP16_Optimizer if fused else FP16_UnfusedOptimizer
    opt = cls(torch.optim.Adam(model.parameters(), lr=3e-3), static_loss_scale=1.0, verbose=False)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(model(torch.randint(0, 11, (4, 3))).float().square().mean())
        opt.step()
    got = _float32_parameters(SimpleNamespace(zero_optimization_stage=lambda: 0, optimizer=opt), model)
    assert sorted(got) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert got["2.weight"] is got["0.weight"]
    for name, p in model.named_parameters(remove_duplicate=False):
        master = got[name]
        assert master.dtype == torch.float32 and master.shape == p.shape, name
        assert torch.equal(master.half(), p.detach()), name
    assert any(not torch.equal(m, m.half().float()) for m in got.values())
