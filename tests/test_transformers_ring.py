"""Ring attention inside an unmodified ``transformers`` Llama (#15.5): registered as an attention
implementation, run on each rank's sequence shard with global position ids, at sp=2 (× dp=2)
and sp=4, it gives the loss and every gradient of the same model on the whole sequence in one
process (float64, 1e-10)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from conftest import run_workers  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rope_theta=5e5, tie_word_embeddings=False)
SEQ, BATCH = 16, 2


def _model(attn_implementation: str):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG, attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(cfg).double()


def _data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _ring_runs(layouts):
    """Per (dp, sp, layout): the loss over the whole sequence and the gradients, from the shards."""
    import torch.distributed as dist

    from parallel4d.integrations.transformers import shard_sequence, use_ring_attention
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.sequence import split_sequence

    out = []
    for dp, sp, layout in layouts:
        mesh = init_mesh(dp=dp, sp=sp, timeout_s=60)
        name = use_ring_attention(mesh, layout=layout)
        model = _model(name)
        tokens, targets = _data()
        ids, position_ids = shard_sequence(mesh, tokens, layout)
        local_targets = split_sequence(targets, mesh.group("sp"), dim=1, layout=layout)
        logits = model(ids, position_ids=position_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), local_targets.flatten())  # mean over my tokens
        loss.backward()
        group = mesh.group("sp")
        for p in model.parameters():  # the shards' mean of means: the whole sequence's mean
            dist.all_reduce(p.grad, group=group)
            p.grad /= sp
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        out.append((float(total) / sp, _grads(model)))
    return out


HETERO = {"enabled": True, "chunk_elems": 2048, "device_budget_bytes": 60_000}
OPTIMIZER = {"lr": 0.01, "weight_decay": 0.1}
STEPS = 3


def _hetero_steps():
    """The ring model at sp=2 × dp=2 with hetero's chunks and ZeRO over the 4 data replicas, under a
    device budget below its model data: AdamW steps on the shards; losses and the budget stats."""
    from parallel4d.engine.store import DataReplicas
    from parallel4d.hetero import wrap
    from parallel4d.integrations.transformers import shard_sequence, use_ring_attention
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.sequence import split_sequence

    mesh = init_mesh(dp=2, sp=2, timeout_s=60)
    model, optimizer = wrap(_model(use_ring_attention(mesh)), OPTIMIZER, HETERO, mesh=DataReplicas(mesh))
    tokens, targets = _data()
    ids, position_ids = shard_sequence(mesh, tokens)
    local_targets = split_sequence(targets, mesh.group("sp"), dim=1, layout="zigzag")
    losses = []
    for _ in range(STEPS):
        logits = model(ids, position_ids=position_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), local_targets.flatten())
        loss.backward()  # hetero averages the gradients over dp·sp
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, optimizer.stats()


def _ring_and_hetero(layouts):
    return _ring_runs(layouts), _hetero_steps()


def test_ring_attention_inside_transformers_llama_equals_one_process():
    """Also, with hetero.wrap on top (sp=2 × dp=2, a budget below the model data), its AdamW steps
    on the shards follow torch's AdamW on the whole sequence in one process (1e-9)."""
    layouts = [(1, 4, "zigzag"), (2, 2, "zigzag"), (2, 2, "contiguous")]
    both = run_workers(_ring_and_hetero, 4, layouts, timeout_s=300)
    results = [ring for ring, _ in both]
    reference = _model("sdpa")
    optimizer = torch.optim.AdamW(reference.parameters(), **OPTIMIZER)
    tokens, targets = _data()
    want = []
    for _ in range(STEPS):
        loss = F.cross_entropy(reference(tokens).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(float(loss))
    assert want[-1] < want[0]
    for _, (losses, stats) in both:
        assert stats["device_budget_bytes"] < stats["model_data_bytes"]
        assert stats["peak_resident_bytes"] <= stats["device_budget_bytes"]
        assert losses[-1] < losses[0]  # this rank's shard learns too
    mean = torch.tensor([losses for _, (losses, _) in both], dtype=torch.float64).mean(0)  # over the 4 shards
    torch.testing.assert_close(mean, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=0)
    model = _model("sdpa")
    tokens, targets = _data()
    loss = F.cross_entropy(model(tokens).logits.flatten(0, 1), targets.flatten())
    loss.backward()
    want = _grads(model)
    for rank_results in results:
        for (dp, sp, layout), (got_loss, grads) in zip(layouts, rank_results):
            assert abs(got_loss - float(loss)) <= 1e-10 * float(loss), (sp, layout, got_loss, float(loss))
            assert grads.keys() == want.keys()
            for n, g in grads.items():
                torch.testing.assert_close(g, want[n], rtol=1e-10, atol=1e-13,
                                           msg=lambda m, n=n, s=sp, lay=layout: f"sp={s} {lay} {n}: {m}")


def test_ring_attention_refuses_what_it_cannot_do(single_rank):
    from parallel4d.integrations.transformers import use_ring_attention
    from parallel4d.distributed.mesh import init_mesh

    name = use_ring_attention(init_mesh(timeout_s=60))
    attention = transformers.AttentionInterface()[name]
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="dropout"):
        attention(None, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="attention mask"):
        attention(None, q, q, q, torch.zeros(1, 1, 4, 4))


def _packed_batch():
    """``(input_ids, position_ids, attention_mask, labels)`` of 3 rows of 16: three packed documents
    (position_ids restart); one document then right padding; left padding then two documents. Labels
    -100 on padding and where the next token starts another document."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, CONFIG["vocab_size"], (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, :3] = 0
    docs = [[5, 7, 4], [16], [3, 6, 7]]  # padding's positions as transformers numbers them: they do not restart
    positions = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in docs])
    positions[2, :3] = 1
    labels = torch.roll(ids, -1, dims=1)
    ends = torch.roll(positions, -1, dims=1) == 0  # the next token starts a document (or the row ends)
    labels[ends | (mask == 0) | (torch.roll(mask, -1, dims=1) == 0)] = -100
    return ids, positions, mask, labels


def _packed_runs(layouts):
    """Per (dp, sp, layout): the summed loss of the valid tokens and its gradients, from the shards."""
    import torch.distributed as dist

    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.integrations.transformers import shard_packed, use_ring_attention
    from parallel4d.sequence import split_sequence

    out = []
    for (dp, sp, layout), given in itertools.product(layouts, (True, False)):
        mesh = init_mesh(dp=dp, sp=sp, timeout_s=60)
        model = _model(use_ring_attention(mesh, layout=layout))
        ids, positions, mask, labels = _packed_batch()
        local_ids, local_positions, documents = shard_packed(mesh, ids, position_ids=positions if given else None,
                                                             attention_mask=mask, layout=layout)
        local_labels = split_sequence(labels, mesh.group("sp"), dim=1, layout=layout)
        logits = model(local_ids, position_ids=local_positions, documents=documents).logits
        loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), ignore_index=-100, reduction="sum")
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mesh.group("sp"))
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.group("sp"))
        out.append((float(total), _grads(model)))
    return out


def test_packed_and_padded_batches_in_the_ring_equal_transformers_with_a_block_diagonal_mask():
    """float64: packed documents (position_ids restarting) and padding (left and right) through ring
    attention inside transformers' Llama at sp=4 and sp=2 × dp=2, both layouts: the summed loss of the
    valid tokens and every gradient equal transformers on the whole batch in one process given the
    block-diagonal 4D mask and per-document position_ids (1e-10)."""
    from parallel4d.sequence.documents import Documents

    from parallel4d.data.packing import document_positions

    layouts = [(1, 4, "zigzag"), (2, 2, "contiguous")]
    results = run_workers(_packed_runs, 4, layouts, timeout_s=300)
    ids, positions, mask, labels = _packed_batch()
    wants = []
    for given in (True, False):  # position_ids restarting per document; none given (only the padding mask)
        starts = (positions == 0) if given else torch.zeros(ids.shape, dtype=torch.bool)
        starts[:, 0] = True
        starts[:, 1:] |= mask[:, 1:] != mask[:, :-1]
        allowed = Documents.from_starts(starts).mask(causal=True)
        model = _model("sdpa")
        logits = model(ids, position_ids=positions if given else document_positions(starts),
                       attention_mask=allowed[:, None]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss.backward()
        wants.append((float(loss), _grads(model)))
    for rank_results in results:
        cases = list(itertools.product(layouts, (True, False)))
        for ((dp, sp, layout), given), (got, grads) in zip(cases, rank_results):
            loss, want = wants[0 if given else 1]
            assert abs(got - loss) <= 1e-10 * abs(loss), (sp, layout, given, got, loss)
            for n, g in grads.items():
                torch.testing.assert_close(g, want[n], rtol=1e-10, atol=1e-13,
                                           msg=lambda m, n=n, s=sp, lay=layout: f"sp={s} {lay} {n}: {m}")
