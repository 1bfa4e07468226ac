"""Chat and instruction data (#49.3): ``parallel4d tokenize`` of ``.jsonl`` conversations renders them
with the model's chat template as transformers does and writes a loss mask covering exactly the
assistant turns; training takes loss on those tokens only, equal to transformers with labels −100 on
the prompts (float64, one process); malformed lines are refused naming the file and the line."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from parallel4d.config.load import make_config  # noqa: E402
from parallel4d.data.batches import build_dataset  # noqa: E402
from parallel4d.data.packing import IGNORE  # noqa: E402
from parallel4d.tools.cli import main  # noqa: E402

# ChatML, the answers marked with {% generation %} so that transformers' own assistant mask is the reference
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
            "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add 2 and 3"},
                  {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4 more?"},
                  {"role": "assistant", "content": "That makes 9."}]},
    {"prompt": "Name a colour.", "completion": "Blue, like the sea."},
    {"messages": [{"role": "user", "content": "Say hello twice"}, {"role": "assistant", "content": "hello hello"}]},
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (float64-ready) with a byte-level BPE tokenizer and the ChatML template above."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    directory = tmp_path_factory.mktemp("chat_model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.dumps(c) for c in CONVERSATIONS] * 5
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def chat_file(model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat_data")
    path = directory / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS * 4))
    assert main(["tokenize", "--tokenizer", str(model_dir), str(path), "-o", str(directory / "train.bin")]) == 0
    return directory / "train.bin"


def _as_messages(record: dict) -> list[dict]:
    return record.get("messages") or [{"role": "user", "content": record["prompt"]},
                                      {"role": "assistant", "content": record["completion"]}]


def test_chat_tokens_are_transformers_chat_template_ids_and_the_mask_its_assistant_tokens(model_dir, chat_file):
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    want_ids, want_mask = [], []
    for record in CONVERSATIONS * 4:
        out = tok.apply_chat_template(_as_messages(record), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        want_ids += list(out["input_ids"]) + [eos]
        want_mask += list(out["assistant_masks"]) + [0]
    meta = json.loads(chat_file.with_suffix(".json").read_text())
    got = torch.from_file(str(chat_file), size=meta["tokens"], dtype=torch.uint16).tolist()
    mask = torch.from_file(str(chat_file.with_suffix(".mask")), size=meta["tokens"], dtype=torch.uint8).tolist()
    assert got == want_ids and mask == want_mask
    assert 0 < meta["loss_mask"]["tokens_with_loss"] == sum(want_mask) < len(want_mask) // 2
    answers = tok.decode([i for i, m in zip(got, mask) if m])
    assert "That makes 9.<|im_end|>" in answers and "add 2" not in answers and "assistant" not in answers


def test_targets_of_prompt_tokens_are_ignored(chat_file):
    cfg = make_config({"data": {"source": "tokens", "path": str(chat_file), "batch_size": 4},
                       "model": {"vocab_size": 320, "seq_len": 32}})
    meta = json.loads(chat_file.with_suffix(".json").read_text())
    every = torch.from_file(str(chat_file), size=meta["tokens"], dtype=torch.uint16).to(torch.int64)
    mask = torch.from_file(str(chat_file.with_suffix(".mask")), size=meta["tokens"], dtype=torch.uint8)
    data = build_dataset(cfg)
    x, y = data.batch(2)
    for row, target in zip(x, y):
        start = next(s for s in range(len(every) - 32) if torch.equal(every[s:s + 32], row))
        want = every[start + 1:start + 33].masked_fill(mask[start + 1:start + 33] == 0, IGNORE)
        assert torch.equal(target, want)
    _, partial = data.batch(2, rows=[1])  # a rank's rows: the others are neither read nor counted
    assert torch.equal(partial[1], y[1]) and bool((partial[0] == IGNORE).all())


@pytest.mark.parametrize("microbatches", [1, 2])
def test_one_process_float64_chat_loss_equals_transformers_with_prompt_labels_ignored(model_dir, chat_file,
                                                                                     monkeypatch, microbatches):
    """The step's loss is the whole batch's mean over its answer tokens (transformers' −100 rule on the
    whole batch), also in 2 micro-batches that hold different numbers of answers (as the Trainer's
    gradient accumulation counts them: over the whole batch)."""
    from test_hf import float64_transformers

    from parallel4d import launch

    job = {"model": {"pretrained": str(model_dir), "seq_len": 32},
           "data": {"source": "tokens", "path": str(chat_file), "batch_size": 4},
           "pipeline": {"microbatches": microbatches},
           "optimizer": {"lr": 1e-3}, "train": {"steps": 1, "dtype": "float64", "grad_clip": None,
                                                 "out_dir": str(chat_file.parent / f"run{microbatches}"),
                                                 "log_every": 100}}
    loss = launch(job)["losses"][0]
    data = build_dataset(make_config(job))
    x, y = data.batch(0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").double()
    float64_transformers(monkeypatch, ref)
    ref.set_attn_implementation("sdpa")  # eager takes the softmax in float32
    # transformers shifts the labels itself: the window is x and the last target, the labels its masked copy
    window = torch.cat([x, torch.where(y[:, -1:] == IGNORE, x[:, -1:], y[:, -1:])], dim=1)
    labels = torch.cat([torch.full_like(x[:, :1], IGNORE), y], dim=1)
    with torch.no_grad():  # transformers' loss casts the logits to float32: its shift and -100 rule, in float64
        logits = ref(input_ids=window).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=-100).item()
    assert int((y != IGNORE).sum()) < y.numel() // 2
    halves = [int((h != IGNORE).sum()) for h in y.chunk(2)]
    assert halves[0] != halves[1]  # the micro-batches' counts differ: a mean of their means would not be this
    assert abs(loss - want) < 1e-10, (loss, want)


@pytest.mark.parametrize("line,said", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"', "not JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"content": "yo"}]}', "message 1 lacks role or content"),
    ('{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
     "role 'robot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"prompt": "hi"}', "completion is missing"),
])
def test_a_malformed_chat_line_is_refused_naming_file_and_line_before_anything_is_written(
        model_dir, tmp_path, capsys, line, said):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CONVERSATIONS[1]) + "\n\n" + line + "\n")
    out = tmp_path / "out" / "train.bin"
    assert main(["tokenize", "--tokenizer", str(model_dir), str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:3: " in err and said in err, err
    assert not out.parent.exists()


def test_chat_data_is_refused_only_where_deepspeeds_engine_would_average_the_parts_means(chat_file):
    """parallel4d's own engine weighs every answer token by the whole batch's count in every layout
    (tests/test_expert_parallel.py's chat layouts); DeepSpeed's engine averages each part's mean."""
    from parallel4d.config.errors import ConfigError

    job = {"data": {"source": "tokens", "path": str(chat_file), "batch_size": 4},
           "model": {"vocab_size": 320, "seq_len": 32}, "parallel": {"dp": 2}}
    make_config(job)
    make_config({**job, "pipeline": {"microbatches": 2}, "parallel": {"sp": 2}})
    with pytest.raises(ConfigError, match="loss mask.*parallel.dp=2.*deepspeed: section.*remove the deepspeed"):
        make_config({**job, "deepspeed": {}})


@pytest.mark.parametrize("packing, microbatches", [("none", 1), ("documents", 2)])
def test_a_step_without_an_answer_token_takes_loss_zero_and_no_gradient(chat_file, single_rank, packing, microbatches):
    """A window of prompts only (short windows of long prompts hold one): no NaN (0/0), no refusal
    mid-run — loss 0, every gradient 0; the next step trains as usual."""
    from parallel4d.distributed.mesh import init_mesh
    from parallel4d.engine.compose import compose

    cfg = make_config({"data": {"source": "tokens", "path": str(chat_file), "batch_size": 4, "packing": packing},
                       "model": {"vocab_size": 320, "seq_len": 32, "hidden": 32, "heads": 4, "layers": 1},
                       "pipeline": {"microbatches": microbatches}, "train": {"dtype": "float64"}})
    engine = compose(cfg, init_mesh(timeout_s=60))
    x, y = build_dataset(cfg).batch(0)
    loss = engine.compute_gradients(x, torch.full_like(y, IGNORE))
    assert float(loss) == 0.0
    grads = [p.grad for p in engine.model.parameters() if p.grad is not None]
    assert grads and all(bool((g == 0).all()) for g in grads)
    engine.optimizer.zero_grad()
    assert 0 < float(engine.train_step(x, y)) < 100
    engine.close()


def test_one_process_float64_packed_chat_loss_equals_transformers_on_each_conversation(model_dir, chat_file,
                                                                                       monkeypatch):
    """Packed (``data.packing: documents``): each window cut at the end-of-document tokens, every piece run by
    transformers alone with labels −100 on its prompts; the summed answer losses over their count."""
    from test_hf import float64_transformers

    from parallel4d import launch

    job = {"model": {"pretrained": str(model_dir), "seq_len": 32},
           "data": {"source": "tokens", "path": str(chat_file), "batch_size": 4, "packing": "documents"},
           "optimizer": {"lr": 1e-3}, "train": {"steps": 1, "dtype": "float64", "grad_clip": None,
                                                 "out_dir": str(chat_file.parent / "packed"), "log_every": 100}}
    loss = launch(job)["losses"][0]
    x, y = build_dataset(make_config(job)).batch(0)
    eod = json.loads(chat_file.with_suffix(".json").read_text())["eos_token_id"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").double()
    float64_transformers(monkeypatch, ref)
    ref.set_attn_implementation("sdpa")
    total, count = 0.0, 0
    for row, target in zip(x, y):
        ends = [int(i) + 1 for i in (row == eod).nonzero()] + [len(row)]
        start = 0
        for end in ends:
            if end > start:  # the piece's tokens and their targets (the end-of-document token's is ignored)
                labels = target[start:end].masked_fill(row[start:end] == eod, IGNORE)
                with torch.no_grad():
                    logits = ref(input_ids=row[start:end][None]).logits[0]
                total += torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum").item()
                count += int((labels != IGNORE).sum())
            start = end
    assert 0 < count < y.numel() // 2 and (x == eod).any()
    assert abs(loss - total / count) < 1e-10, (loss, total / count)


def test_a_changed_loss_mask_is_refused_at_launch_before_any_worker_starts(chat_file, tmp_path, monkeypatch):
    """The mask is checked against its sidecar's ``loss_mask.sha256`` like the token file against ``sha256``
    (hashed once, then stamped): a flipped answer byte is named before any worker starts."""
    import shutil

    from parallel4d.config.errors import ConfigError
    from parallel4d.launcher import launch as launch_module

    for suffix in (".bin", ".json", ".mask"):
        shutil.copy(chat_file.with_suffix(suffix), tmp_path / f"train{suffix}")
    path = tmp_path / "train.bin"
    job = {"data": {"source": "tokens", "path": str(path), "batch_size": 4},
           "model": {"vocab_size": 320, "seq_len": 32, "hidden": 32, "heads": 4, "layers": 1},
           "train": {"steps": 1, "out_dir": str(tmp_path / "run")}}
    mask = bytearray(path.with_suffix(".mask").read_bytes())
    mask[mask.index(0)] = 1  # a prompt token turned answer: the size and every other check still hold
    path.with_suffix(".mask").write_bytes(bytes(mask))
    monkeypatch.setattr(launch_module, "spawn", lambda *a, **k: pytest.fail("a worker started"))
    with pytest.raises(ConfigError, match=f"its loss mask {tmp_path / 'train.mask'} changed since `parallel4d "
                                          "tokenize` wrote it"):
        launch_module.launch(job)


def test_a_dataset_saved_to_disk_tokenizes_as_the_same_conversations_in_jsonl(model_dir, chat_file, tmp_path):
    """``parallel4d tokenize DIR``, DIR written by ``datasets``' own ``save_to_disk`` (arrow files, state.json,
    dataset_info.json; rows of messages and of prompt/completion in one table): the token file and loss mask
    of the same conversations as a .jsonl file."""
    datasets = pytest.importorskip("datasets")

    saved = tmp_path / "chat_dataset"
    columns = ("messages", "prompt", "completion")  # a table's: None where a row has no such key
    datasets.Dataset.from_list([{k: c.get(k) for k in columns} for c in CONVERSATIONS * 4]).save_to_disk(str(saved))
    assert {"state.json", "dataset_info.json"} <= {p.name for p in saved.iterdir()}
    out = tmp_path / "train.bin"
    assert main(["tokenize", "--tokenizer", str(model_dir), str(saved), "-o", str(out)]) == 0
    for suffix in (".bin", ".mask"):
        assert out.with_suffix(suffix).read_bytes() == chat_file.with_suffix(suffix).read_bytes()
    ours, theirs = (json.loads(p.with_suffix(".json").read_text()) for p in (out, chat_file))
    assert ours["loss_mask"] == theirs["loss_mask"] and ours["sha256"] == theirs["sha256"]


def test_a_malformed_dataset_row_is_refused_naming_the_directory_and_row(model_dir, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")

    saved = tmp_path / "bad_dataset"
    datasets.Dataset.from_list([CONVERSATIONS[1], {"prompt": "hi", "completion": None}]).save_to_disk(str(saved))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(CONVERSATIONS)}).save_to_disk(str(tmp_path / "dd"))
    capsys.readouterr()  # datasets' own progress bars
    out = tmp_path / "out" / "train.bin"
    assert main(["tokenize", "--tokenizer", str(model_dir), str(saved), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{saved} row 1: completion is missing or not a string; each row is one conversation" in err, err
    assert len(err.splitlines()) == 1 and not out.parent.exists()
    assert main(["tokenize", "--tokenizer", str(model_dir), str(tmp_path / "dd"), "-o", str(out)]) == 2
    assert f"is a DatasetDict (splits train); give one split's directory, e.g. {tmp_path / 'dd' / 'train'}" in \
        capsys.readouterr().err
