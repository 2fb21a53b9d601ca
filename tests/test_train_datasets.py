"""Axolotl dataset types, prompt masking, file formats, the prepared-data cache and sample packing
(issue 13 part 2), on data and models the tests create."""

import json

import pytest
import torch

from lowprec.train.chat_templates import TEMPLATES, render_segments
from lowprec.train.examples import DataSource, ExampleBatches, build_examples
from lowprec.train.packing import pack, packed_causal_mask
from lowprec.train.prompts import IGNORE, PromptOptions, tokenize_row
from lowprec.train.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
ALPACA = [
    {"instruction": f"Add {i} and {i}.", "input": "" if i % 2 else f"{i}+{i}", "output": str(2 * i)} for i in range(40)
]


def _trained_text(ids, labels):
    return bytes(t for t, y in zip(ids, labels) if y != IGNORE and t < 256).decode()


def test_alpaca_masks_the_prompt_and_trains_the_response_and_eos():
    ids, labels = tokenize_row(ALPACA[3], PromptOptions("alpaca"), TOK, "row")
    assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id and labels[-1] == TOK.eos_id
    assert _trained_text(ids, labels) == "6"  # the response only (+ EOS, not a byte)
    assert TOK.decode(ids).startswith("Below is an instruction") and "### Response:\n6" in TOK.decode(ids)
    with_input = tokenize_row(ALPACA[2], PromptOptions("alpaca"), TOK, "row")[0]
    assert "### Input:\n2+2" in TOK.decode(with_input)
    ids, labels = tokenize_row(ALPACA[3], PromptOptions("alpaca", train_on_inputs=True), TOK, "row")
    assert labels == ids  # train_on_inputs: true learns the prompt too


def test_input_output_segments_follow_their_labels():
    row = {
        "segments": [
            {"text": "Q: hi\n", "label": False},
            {"text": "A: hello", "label": True},
            {"text": "!", "label": False},
        ]
    }
    ids, labels = tokenize_row(row, PromptOptions("input_output"), TOK, "row")
    assert TOK.decode(ids) == "Q: hi\nA: hello!" and _trained_text(ids, labels) == "A: hello"


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_chat_template_trains_assistant_content_and_end_of_turn(name):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    segs = render_segments(TEMPLATES[name], messages, ["assistant"])
    eot = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}[name]
    assert [t for t, trained in segs if trained] == ["4", eot, "6", eot]
    assert "".join(t for t, _ in segs).count("<|") >= 10  # headers present, untrained
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    opt = PromptOptions(
        "chat_template",
        chat_template=TEMPLATES[name],
        field_messages="conversations",
        role_key="from",
        content_key="value",
    )
    ids, labels = tokenize_row(row, opt, TOK, "row")
    assert _trained_text(ids, labels) == "hello" + eot  # ShareGPT roles map to user / assistant
    opt_all = PromptOptions(
        "chat_template",
        chat_template=TEMPLATES[name],
        field_messages="conversations",
        role_key="from",
        content_key="value",
        roles_to_train=("user", "assistant"),
    )
    assert "hi" in _trained_text(*tokenize_row(row, opt_all, TOK, "row"))


def _write(tmp_path, rows, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def _build(paths, kind, seq_len=256, **kw):
    src = DataSource(tuple(paths), None, PromptOptions(kind))
    return build_examples([src], TOK, seq_len, kw.pop("val", 0.0), 0, **kw)


def test_file_formats_give_the_same_examples(tmp_path):
    pa = pytest.importorskip("pyarrow")  # declared in the [data] extra, installed by [dev]
    import pyarrow.parquet as pq

    rows = ALPACA[:10]
    ref, _ = _build([_write(tmp_path, rows)], "alpaca")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        import csv

        w = csv.DictWriter(f, fieldnames=["instruction", "input", "output"])
        w.writeheader()
        w.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    for path in ("d.json", "d.csv", "d.parquet", "saved"):
        got, _ = _build([str(tmp_path / path)], "alpaca")
        assert torch.equal(got.ids, ref.ids) and torch.equal(got.labels, ref.labels), path
    with pytest.raises(ValueError, match="has splits \\['train'\\], not 'test'"):
        build_examples([DataSource((str(tmp_path / "saved"),), "test", PromptOptions("alpaca"))], TOK, 256, 0.0, 0)


def test_pretokenized_rows_and_over_long_examples(tmp_path):
    rows = [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}, {"input_ids": [i % 200 for i in range(300)]}]
    train, _ = _build([_write(tmp_path, rows)], "pretokenized", seq_len=64)
    assert len(train) == 1  # the 300-token example is dropped (and logged), not cut
    assert train.example(0)[1].tolist() == [-100, -100, 3, 4]


def test_prepared_path_is_reused_and_keyed_by_config(tmp_path, caplog):
    path = _write(tmp_path, ALPACA)
    cache = tmp_path / "prepared"
    first, val = _build([path], "alpaca", val=0.2, prepared_path=str(cache))
    assert val is not None and len(first) + len(val) == len(ALPACA)
    with caplog.at_level("INFO", logger="lowprec"):
        again, _ = _build([path], "alpaca", val=0.2, prepared_path=str(cache))
    assert "reusing tokenized data" in caplog.text and torch.equal(again.ids, first.ids)
    _build([path], "alpaca", seq_len=384, val=0.2, prepared_path=str(cache))  # another sequence_len
    assert len(list(cache.iterdir())) == 2


def test_pack_fits_rows_and_keeps_every_example():
    lengths = [5, 3, 8, 2, 7, 1, 9, 4]
    rows = pack(lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert len(rows) == -(-sum(lengths) // 10)  # these lengths pack without waste


def test_packed_batches_position_ids_and_masks(tmp_path):
    train, _ = _build([_write(tmp_path, ALPACA)], "alpaca", seq_len=512)
    loader = ExampleBatches(train, batch_size=2, seq_len=512, pad_id=TOK.pad_id, pack=True, seed=0)
    assert loader.n_rows < len(train)
    batch = next(iter(loader))
    pos, labels = batch["position_ids"], batch["labels"]
    starts = (pos == 0).nonzero().tolist()
    assert all(labels[b, t] == IGNORE for b, t in starts)  # no example predicted from its neighbour
    assert (labels != IGNORE).sum() > 0 and batch["input_ids"].shape == (2, 512)
    unpacked = next(iter(ExampleBatches(train, batch_size=4, seq_len=512, pad_id=TOK.pad_id)))
    assert "position_ids" not in unpacked and unpacked["input_ids"].shape[1] % 16 == 0


def test_packing_has_no_cross_example_attention_builtin_model():
    from lowprec.train.model import build_model

    torch.manual_seed(0)
    model = build_model("llama-tiny").eval()
    a, b = torch.randint(0, 256, (1, 11)), torch.randint(0, 256, (1, 5))
    pos = torch.cat([torch.arange(11), torch.arange(5)])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), position_ids=pos).logits
        alone_a, alone_b = model(a).logits, model(b).logits
        leaky = model(torch.cat([a, b], 1)).logits  # without position ids: b sees a
    assert torch.allclose(packed[:, :11], alone_a, atol=1e-5) and torch.allclose(packed[:, 11:], alone_b, atol=1e-5)
    assert not torch.allclose(leaky[:, 11:], alone_b, atol=1e-3)
    mask = packed_causal_mask(pos)[0, 0]
    assert mask[11:, :11].sum() == 0 and mask[:11, :11].equal(torch.ones(11, 11, dtype=torch.bool).tril())


def test_packing_has_no_cross_example_attention_hf_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=272,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    from lowprec.train.trainer import _HFLoss

    model = _HFLoss(transformers.LlamaForCausalLM(cfg)).eval()  # what the trainer runs
    a, b = torch.randint(0, 256, (1, 9)), torch.randint(0, 256, (1, 7))
    pos = torch.cat([torch.arange(9), torch.arange(7)])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), position_ids=pos).logits
        alone_a, alone_b = model(a).logits, model(b).logits
    assert torch.allclose(packed[:, :9], alone_a, atol=1e-5) and torch.allclose(packed[:, 9:], alone_b, atol=1e-5)


def test_yaml_dataset_types_and_axolotl_keys(tmp_path):
    from lowprec.train.config import parse_config

    path = _write(tmp_path, ALPACA)
    cfg = parse_config(
        {
            "datasets": [{"path": path, "type": "alpaca", "name": None}],
            "sample_packing": True,
            "wandb_project": None,
            "load_in_8bit": False,
            "lora_fan_in_fan_out": None,
        }
    )
    assert cfg.datasets[0].type == "alpaca" and cfg.sample_packing
    with pytest.raises(ValueError, match="datasets.0.type: dataset type 'sharegpt' is not supported; ShareGPT data"):
        parse_config({"datasets": [{"path": path, "type": "sharegpt"}]})
    # Axolotl's user-defined prompt format (type: a mapping) was 'Input should be a valid string'
    custom = {"field_instruction": "instruction", "format": "[INST] {instruction} [/INST]"}
    with pytest.raises(ValueError, match="datasets.0.type: a custom prompt format .* use type: alpaca") as err:
        parse_config({"datasets": [{"path": path, "type": custom}]})
    assert "valid string" not in str(err.value)
    with pytest.raises(ValueError, match="wandb_project: an Axolotl key lowprec does not support .*use_tensorboard"):
        parse_config({"wandb_project": "mine"})
    with pytest.raises(ValueError, match="unknown key 'sample_pakcing' \\(did you mean 'sample_packing'"):
        parse_config({"sample_pakcing": None})  # a typo stays an error even when null


def test_fp8_report_picks_the_worst_layers():
    from lowprec.train.plots import worst_layers

    def rec(step, bad):
        layers = {f"l{i}": {"input": {"saturated": 0.0, "underflow": 0.0}} for i in range(8)}
        for name, frac in bad.items():
            layers[name]["input"]["underflow"] = frac
        return {"kind": "fp8", "step": step, "layers": layers}

    records = [rec(1, {"l5": 0.01}), rec(2, {"l2": 0.3, "l5": 0.02})]
    assert worst_layers(records, top=3) == ["l2", "l5", "l0"]  # worst first, ties in layer order


def test_other_ranks_log_errors_only(monkeypatch, caplog):
    import logging

    from lowprec.train import trainer

    log = logging.getLogger("lowprec")
    monkeypatch.setenv("RANK", "1")
    trainer._quiet_other_ranks()
    try:
        with caplog.at_level("INFO", logger="lowprec"):
            log.warning("lowprec: a warning every rank would repeat")
            log.error("lowprec: an error")
        assert [r.getMessage() for r in caplog.records] == ["lowprec: an error"]
    finally:
        log.filters[:] = [f for f in log.filters if not isinstance(f, trainer._RankZeroOnly)]


def test_chat_template_tokenizer_default_with_a_hf_tokenizer(tmp_path):
    """tokenizer_default renders with the tokenizer's own template; its special tokens stay
    single ids; special_tokens sets the pad token (Axolotl's special_tokens: pad_token)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lowprec.train.chat_templates import template_text
    from lowprec.train.tokenizer import load_tokenizer

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>", "user", "assistant", "hi", "hello", "there"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # the newline after the role is dropped
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", unk_token="<unk>", additional_special_tokens=["<|im_start|>"]
    )
    fast.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}{% endfor %}"
    )
    fast.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"), {"pad_token": "<pad>"})
    assert tok.pad_id == 3 and tok.eos_id == 2
    opt = PromptOptions("chat_template", chat_template=template_text("tokenizer_default", tok._tok.chat_template, None))
    row = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]}
    ids, labels = tokenize_row(row, opt, tok, "row")
    assert ids == [
        1,
        4,
        6,
        8,
        2,
        1,
        5,
        7,
        2,
    ]  # <|im_start|> user hi there <|im_end|> <|im_start|> assistant hello <|im_end|>
    assert [i for i, y in zip(ids, labels) if y != IGNORE] == [7, 2]  # "hello" and its <|im_end|>


_CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "Instruction Response Reverse the word amber rebma hello there how are you user assistant",
] * 5


def _hf_tokenizer(tmp_path, kind):
    """A local fast tokenizer: ``metaspace`` is SentencePiece-style (Llama-2 / Mistral: a BPE with
    the Metaspace pre-tokenizer, prepend_scheme first), ``bytelevel`` is Llama-3 / Qwen-style."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lowprec.train.tokenizer import load_tokenizer

    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "metaspace":
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = sorted(set("".join(_CORPUS) + "#:.?!+0123456789\n"))
    else:
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet)
    core.train_from_iterator(_CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (  # Llama-2 style: the answer follows "[/INST] "
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    fast.save_pretrained(tmp_path / kind)
    return load_tokenizer(str(tmp_path / kind))


def _text_of(tok, ids):
    return "".join(tok._tok.convert_ids_to_tokens(ids)).replace("▁", " ").replace("Ġ", " ").replace("Ċ", "\n")


@pytest.mark.parametrize("kind", ["metaspace", "bytelevel"])
def test_alpaca_and_chat_ids_are_the_whole_text_encoding(tmp_path, kind):
    """No stray '▁' token where prompt and response (or two turns) meet: the ids are the
    tokenizer's encoding of the whole text; the mask covers exactly the response / assistant turns."""
    from lowprec.train.chat_templates import template_text
    from lowprec.train.prompts import ALPACA_PROMPT_NO_INPUT

    tok = _hf_tokenizer(tmp_path, kind)
    row = {"instruction": "Reverse the word amber.", "output": "rebma"}
    ids, labels = tokenize_row(row, PromptOptions("alpaca"), tok, "row")
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=row["instruction"])
    assert ids == [tok.bos_id] + tok._tok.encode(prompt + "rebma", add_special_tokens=False) + [tok.eos_id]
    trained = [i for i, y in zip(ids, labels) if y != IGNORE]
    assert trained[-1] == tok.eos_id and _text_of(tok, trained[:-1]).strip() == "rebma"
    assert _text_of(tok, [i for i, y in zip(ids[1:], labels[1:]) if y == IGNORE]).rstrip().endswith("### Response:")

    chat = [("user", "hello there"), ("assistant", "how are you"), ("user", "hello"), ("assistant", "there")]
    messages = [{"role": r, "content": c} for r, c in chat]
    opt = PromptOptions("chat_template", chat_template=template_text("tokenizer_default", tok._tok.chat_template, None))
    ids, labels = tokenize_row({"messages": messages}, opt, tok, "row")
    assert ids == tok._tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    spans, run = [], []
    for i, y in zip(ids, labels):
        if y != IGNORE:
            run.append(i)
        elif run:
            spans, run = spans + [run], []
    assert [_text_of(tok, s).strip() for s in spans + [run]] == ["how are you</s>", "there</s>"]


def test_a_tokenizer_without_offsets_tokenizes_per_segment_and_says_so_once(caplog):
    class NoOffsets(ByteTokenizer):
        name = "slow-test-tokenizer"

        def encode_with_offsets(self, text):
            return None  # a slow Hugging Face tokenizer

    with caplog.at_level("INFO", logger="lowprec"):
        for row in ALPACA[:3]:
            assert tokenize_row(row, PromptOptions("alpaca"), NoOffsets(), "row") == tokenize_row(
                row, PromptOptions("alpaca"), TOK, "row"
            )
    assert sum("not a fast tokenizer" in r.getMessage() for r in caplog.records) == 1


def test_completion_rows_without_text_name_the_real_key(tmp_path):
    """type: completion on rows without 'text' names datasets[].field (a key that exists), on the
    token-stream path and the examples path alike, and says when the rows look like alpaca."""
    from lowprec.train.config import parse_config
    from lowprec.train.data import build_datasets
    from lowprec.train.data_setup import DATA_KEYS

    path = _write(tmp_path, ALPACA)
    fix = r"set datasets\[\]\.field to the field that holds the text \(these look like alpaca rows: type: alpaca\)"
    with pytest.raises(
        ValueError, match=r"line 1: no 'text' field \(keys: \['input', 'instruction', 'output'\]\); " + fix
    ):
        build_datasets([path], seq_len=8, val_fraction=0.0, names=DATA_KEYS)
    with pytest.raises(ValueError, match=r"jsonl:1: no 'text' field .*; " + fix):
        tokenize_row(ALPACA[0], PromptOptions("completion"), TOK, f"{path}:1")
    cfg = parse_config({"datasets": [{"path": path, "type": "completion", "field": "output"}]})
    assert cfg.text_field == "output"  # the key the message names is a real one
    train, _ = build_datasets([path], seq_len=8, val_fraction=0.0, text_field=cfg.text_field, names=DATA_KEYS)
    assert TOK.decode(train.tokens).startswith("0")


def test_roles_to_train_typos_are_named_not_an_empty_dataset(tmp_path):
    """A misspelt role once gave 'no training example fits sequence_len'; now it is one line naming
    the key, the value and the role meant, at config time (near misses) or once the data's roles
    are known (a role no row has after the roles mapping)."""
    from lowprec.train.config import parse_config

    chat = [
        {"messages": [{"role": "user", "content": f"{i}+{i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(4)
    ]
    path = _write(tmp_path, chat)
    bad = {
        "roles_to_train": (
            ["asistant"],
            r"datasets.0.roles_to_train: 'asistant' is not a role .*did you mean 'assistant'",
        ),
        "roles": ({"asistant": ["gpt"]}, r"datasets.0.roles: 'asistant' is not a chat role \(did you mean 'assistant'"),
        "train_on_eos": ("turns", r"datasets.0.train_on_eos: 'turns' is not one of turn, .*did you mean 'turn'"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_config({"datasets": [{"path": path, "type": "chat_template", key: value}]})
    custom = {"path": path, "type": "chat_template", "roles": {"function": ["fn"]}, "roles_to_train": ["function"]}
    assert parse_config({"datasets": [custom]}).datasets[0].roles_to_train == ["function"]  # own roles pass

    def build(**kw):
        opt = PromptOptions("chat_template", chat_template=TEMPLATES["chatml"], **kw)
        return build_examples([DataSource((path,), None, opt, "datasets.0")], TOK, 256, 0.0, 0)

    assert build()[0].n_trained > 0
    with pytest.raises(ValueError, match=r"^datasets.0.roles_to_train: \['bot'\] names no role of the data \(its "):
        build(roles_to_train=("bot",))
    with pytest.raises(ValueError, match=r"roles mapping: helper, user\) \(did you mean 'helper'"):
        build(roles={"helper": ["assistant"], "user": ["user"]}, roles_to_train=("helpr",))
