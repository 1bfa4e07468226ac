"""Packed documents in parallel4d's own training (#31, ``data.packing: documents``): a packed batch
trains exactly as each of its documents trained on its own.

The reference (:func:`documents_run`, this process, float64) cuts every row of every batch at its
end-of-document tokens and runs the dense model on each document alone — positions from 0, attention
over the document only — summing the token losses over the whole batch (the end-of-document token's
target, the next document's first token, is not one) and dividing by their number. Every layout must
give its losses within 1e-10 and every parameter after 3 AdamW steps within 1e-9:

* one process (sp = 1), gpt2 and a grouped-query llama, 2 micro-batches, evaluation too;
* the 4-worker job: the ring at sp = 4 in both layouts, Ulysses × ring, 2D tp = 4 (grouped-query heads,
  more than one key/value head per grid column; GPT-2's learned positions on the grid), 1F1B pp = 2 ×
  ring, dp = 2 × ring with activation checkpointing, hetero's ZeRO;
* the suite's 16-worker job (tests/conftest.py): Hanayo pp = 2 × ring sp = 2 × 2D tp = 4.

Synthetic rows step through a 16-token vocabulary with their own stride (1 to 7), so the
end-of-document token recurs every 4, 8 or 16 tokens (or never, for an even stride from the other
parity): mostly 3 to 5 documents a row of 32, crossing the shard boundaries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import run_workers
from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.data.batches import build_dataset
from parallel4d.data.packing import IGNORE, boundary_targets, document_starts
from parallel4d.engine.model import model_shape
from parallel4d.models.build import build_dense
from test_llama import check_pieces, dense_run, train_layouts

EOD = 5
GPT2 = {"arch": "gpt2", "vocab_size": 16, "seq_len": 32, "hidden": 32, "heads": 4, "layers": 2}
LLAMA = {"arch": "llama", "vocab_size": 16, "seq_len": 32, "hidden": 32, "heads": 8, "kv_heads": 4, "layers": 2,
         "intermediate_size": 48}


def _job(model: dict, parallel: dict | None = None, pipeline: dict | None = None, **sections) -> dict:
    train = {"steps": 3, "dtype": "float64", "grad_clip": None, "timeout_s": 60, "seed": 7, **sections.pop("train", {})}
    return {"model": model, "data": {"source": "synthetic", "batch_size": 8, "packing": "documents", "eod_token": EOD},
            "parallel": parallel or {}, "pipeline": pipeline or {"microbatches": 2},
            "optimizer": {"lr": 0.01, "warmup_steps": 1}, "train": train, **sections}


def documents_run(job: dict):
    """Each document of each batch alone through the dense model in this process: the losses and the
    parameters after ``train.steps`` AdamW steps (no clipping: the jobs here set none)."""
    assert make_config(job).train.grad_clip is None
    return dense_run(job, loss_of=lambda model, tokens, targets, step: documents_loss(model, tokens, targets))


def documents_loss(model, tokens, targets):
    """The batch's mean token loss with every document run on its own (a ``[1, length]`` sequence)."""
    targets = boundary_targets(tokens, targets, EOD)
    total = 0.0
    for row, starts in enumerate(document_starts(tokens, EOD)):
        cuts = starts.nonzero().flatten().tolist() + [tokens.shape[1]]
        for lo, hi in zip(cuts, cuts[1:]):
            logits = model(tokens[row:row + 1, lo:hi])
            total = total + F.cross_entropy(logits[0], targets[row, lo:hi], ignore_index=IGNORE, reduction="sum")
    return total / int((targets != IGNORE).sum())


def _check(results, jobs):
    for name, job in jobs.items():
        check_pieces(results, name, *documents_run(job))


def test_the_synthetic_rows_hold_several_documents():
    data = build_dataset(make_config(_job(GPT2)))
    per_row = torch.cat([document_starts(data.batch(step)[0], EOD).sum(1) for step in range(3)])
    assert (per_row >= 3).double().mean() > 0.5 and per_row.max() >= 5, per_row


# --- one process -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_one_process_packed_training_equals_each_document_alone(model, single_rank):
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    job = _job(model)
    cfg = make_config(job)
    engine, data = compose(cfg, init_mesh(timeout_s=60)), build_dataset(cfg)
    reference = build_dense(model_shape(cfg), seed=cfg.train.seed).double()
    torch.testing.assert_close(float(engine.evaluate(*data.batch(0))), float(documents_loss(reference, *data.batch(0)).detach()),
                               rtol=1e-12, atol=0)
    losses = [float(engine.train_step(*data.batch(step))) for step in range(cfg.train.steps)]
    want_losses, want = documents_run(job)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-10, atol=0)
    for name, p in engine.model.dense_named_parameters():
        torch.testing.assert_close(p.detach(), want[name], rtol=1e-9, atol=1e-12, msg=name)


def test_packed_llama_equals_transformers_given_the_block_diagonal_mask(tmp_path, monkeypatch, single_rank):
    """transformers' own Llama (grouped-query, float64) given the batch's block-diagonal causal 4D mask and
    position_ids restarting at each document, loss summed over the valid targets and divided by their
    number: the engine's packed loss and every gradient, in one process (1e-10)."""
    transformers = pytest.importorskip("transformers")
    from parallel4d.data.packing import document_positions
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose
    from parallel4d.models import hf
    from parallel4d.sequence.documents import Documents
    from test_hf import float64_transformers

    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, rope_theta=5e5, tie_word_embeddings=False)).double()
    ref.save_pretrained(tmp_path)
    job = _job({"pretrained": str(tmp_path), "seq_len": 32})
    cfg = make_config(job)
    engine = compose(cfg, init_mesh(timeout_s=60))
    tokens, targets = build_dataset(cfg).batch(0)
    loss = float(engine.compute_gradients(tokens, targets))

    float64_transformers(monkeypatch, ref)
    ref.set_attn_implementation("sdpa")
    starts = document_starts(tokens, EOD)
    logits = ref(tokens, position_ids=document_positions(starts),
                 attention_mask=Documents.from_starts(starts).mask(causal=True)[:, None]).logits
    labels = boundary_targets(tokens, targets, EOD)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    want = want / int((labels != IGNORE).sum())
    want.backward()
    assert abs(loss - want.item()) <= 1e-10 * want.item(), (loss, want.item())
    names = hf.p4d_to_hf(cfg.model)
    for name, p in engine.model.dense_named_parameters():
        hf_name, how = names[name]
        g = ref.get_parameter(hf_name).grad
        torch.testing.assert_close(p.grad, g.t() if how == "t" else g, rtol=1e-10, atol=1e-13, msg=name)


# --- four workers ------------------------------------------------------------------------------------

FOUR = {
    "gpt2 ring sp=4 zigzag": _job(GPT2, {"sp": 4}, sequence={"layout": "zigzag"}),
    "llama GQA ring sp=4 contiguous": _job(LLAMA, {"sp": 4}, sequence={"layout": "contiguous"}),
    "llama GQA Ulysses 2 × ring 2 zigzag": _job(LLAMA, {"sp": 4}, sequence={"layout": "zigzag", "ulysses": 2}),
    "llama GQA 2D tp=4": _job(LLAMA, {"tp": 4}),
    "gpt2 2D tp=4 (learned positions on the grid)": _job(GPT2, {"tp": 4}),
    "gpt2 1F1B pp=2 × ring sp=2 contiguous": _job(GPT2, {"pp": 2, "sp": 2}, {"schedule": "1f1b", "microbatches": 2},
                                                  sequence={"layout": "contiguous"}),
    "gpt2 dp=2 × ring sp=2 zigzag, recomputed": _job(GPT2, {"dp": 2, "sp": 2},
                                                     train={"activation_checkpointing": "blocks"}),
    "llama hetero ZeRO over dp=2 × sp=2": _job(LLAMA, {"dp": 2, "sp": 2}, hetero={
        "enabled": True, "chunk_elems": 2048, "device_budget_bytes": 60000}),
}


def test_packed_training_in_every_layout_equals_each_document_alone():
    _check(run_workers(train_layouts, 4, FOUR, timeout_s=300), FOUR)


# --- the suite's sixteen workers -----------------------------------------------------------------------

SIXTEEN = {"llama GQA Hanayo pp=2 × ring sp=2 zigzag × 2D tp=4": _job(
    LLAMA, {"pp": 2, "sp": 2, "tp": 4}, {"schedule": "hanayo", "waves": 1, "microbatches": 2})}


def sixteen_worker_job(tmp):
    """This file's share of the suite's 16-worker job (tests/conftest.py)."""
    return train_layouts(SIXTEEN)


def test_packed_training_with_all_of_pipeline_ring_and_2d_equals_each_document_alone(sixteen_workers):
    _check([r["test_packed_training"] for r in sixteen_workers], SIXTEEN)


# --- the rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    ({"data": {"eod_token": None}}, r"data.packing=documents needs the end-of-document token: set data.eod_token"),
    ({"data": {"eod_token": 16}}, r"data.eod_token=16 is not below model.vocab_size=16"),
    ({"data": {"packing": "none"}}, r"data.eod_token=5 is read with data.packing=documents"),
    ({"train": {"compile": "blocks"}}, r"train.compile=blocks: the documents change every micro-batch"),
    ({"model": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}}, r"rope_type=dynamic"),
    ({"deepspeed": {"zero_optimization": {"stage": 1}}}, r"data.packing=documents with a deepspeed: section"),
])
def test_packing_rules_name_the_field_and_the_fix(change, message):
    job = _job(LLAMA)
    for section, fields in change.items():
        job[section] = {**job.get(section, {}), **fields}
    with pytest.raises(ConfigError, match=message):
        make_config(job)


def test_a_packed_job_is_planned_on_one_document_rows():
    """``parallel4d plan`` dry-runs a packed job (its documents computed for real inside the fake-tensor
    step) on rows of one document each, the most work: every ring block pair runs, so the bytes sent equal
    the unpacked job's, and the dense core's document mask is counted in the activations."""
    from parallel4d.planning.dry_run import plan

    for parallel in ({"sp": 4}, {"dp": 2}):
        packed = plan(make_config(_job(GPT2, parallel)))[0]
        plain_job = _job(GPT2, parallel)
        plain_job["data"] = {"source": "synthetic", "batch_size": 8}
        plain = plan(make_config(plain_job))[0]
        assert packed.sent_by_axis == plain.sent_by_axis and packed.parameters == plain.parameters, parallel
        assert packed.activations > plain.activations if "dp" in parallel else packed.activations >= plain.activations
