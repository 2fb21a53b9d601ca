"""eval_table_size / eval_max_new_tokens (issue 24 item 6): greedy generations for the same
validation prompts at each evaluation, in metrics.jsonl, TensorBoard and eval_generations.md;
the fixed right-padded window decodes exactly as plain greedy decoding does (built-in model and a
transformers model); bad values are one-line errors."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from lowprec.train.config import parse_config
from lowprec.train.generations import EvalTable, choose_prompts, greedy_generate
from lowprec.train.metrics import read_metrics
from lowprec.train.model import LlamaConfig, LlamaForCausalLM
from lowprec.train.tokenizer import ByteTokenizer
from lowprec.train.trainer import train

RUN = {
    "sequence_len": 32,
    "micro_batch_size": 2,
    "dataset_max_bytes": 100_000,
    "eval_batches": 1,
    "max_steps": 4,
    "eval_steps": 2,
    "logging_steps": 2,
    "warmup_steps": 0,
    "progress_bar": False,
    "fp8": True,
    "eval_table_size": 3,
    "eval_max_new_tokens": 6,
}


def test_a_short_run_writes_generations_at_each_evaluation(tmp_path, caplog):
    """Built-in byte model, FP8 layers, CPU: a generations record per evaluation (steps 2, 4),
    the same evenly spaced prompts each time, a Markdown section per step, a TensorBoard text;
    and an inert Axolotl key in the same config is one note, logged once."""
    cfg = parse_config({**RUN, "output_dir": str(tmp_path), "use_tensorboard": True, "hub_strategy": "end"})
    with caplog.at_level(logging.INFO, logger="lowprec"):
        train(cfg)
    notes = [r.getMessage() for r in caplog.records if "hub_strategy" in r.getMessage()]
    assert notes == [
        "lowprec: note: hub_strategy: end is ignored: it only matters with hub_model_id, as in Axolotl; "
        "set that or drop hub_strategy"
    ], notes

    records = read_metrics(str(tmp_path), "generations")
    assert [r["step"] for r in records] == [2, 4]
    assert [r["step"] for r in read_metrics(str(tmp_path), "eval")] == [2, 4]
    first, last = records
    assert [s["index"] for s in first["samples"]] == [s["index"] for s in last["samples"]]
    assert [s["prompt"] for s in first["samples"]] == [s["prompt"] for s in last["samples"]]
    n_blocks = 3001 // 32  # the validation stream of this corpus size (the run logs 3001 tokens)
    assert [s["index"] for s in first["samples"]] == [0, n_blocks // 3, 2 * n_blocks // 3]
    for s in last["samples"]:  # plain text: the first half of a block is the prompt, the rest the reference
        assert set(s) == {"index", "prompt", "reference", "generated", "new_tokens"}
        assert len(s["prompt"].encode()) <= 16 and 0 <= s["new_tokens"] <= 6 and len(s["reference"].encode()) <= 6
    assert last["max_new_tokens"] == 6

    table = (tmp_path / "eval_generations.md").read_text()
    assert (
        table.index("## step 2") < table.index("## step 4")
        and table.count("| # | prompt | reference | generated |") == 2
    )
    assert not (tmp_path / "eval_generations.md.tmp").exists()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("generations/text_summary")
    assert [e.step for e in texts] == [2, 4]
    assert b"| # | prompt | reference | generated |" in texts[-1].tensor_proto.string_val[0]

    import yaml

    resolved = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())["_resolved"]
    assert resolved["eval_max_new_tokens"] == {"value": 6, "reason": "eval_max_new_tokens"}


def _plain_greedy(model, prompt: torch.Tensor, n: int, eos: int) -> list[int]:
    ids, out = prompt.clone(), []
    for _ in range(n):
        tok = int(model(input_ids=ids[None]).logits[0, -1].argmax())
        if tok == eos:
            break
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([tok])])
    return out


def test_the_padded_window_decodes_as_plain_greedy_decoding():
    """Right padding after the current position changes no logit a causal model reads, so the
    fixed (rows, width) buffer gives plain greedy decoding's tokens, for prompts of several
    lengths in one batch; generating leaves the model in training mode and no gradient behind."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_name("llama-tiny").replace(n_layers=2))
    tok = ByteTokenizer()
    prompts = [torch.randint(0, 256, (n,)) for n in (3, 11, 7)]
    model.eval()
    want = [_plain_greedy(model, p, 9, tok.eos_id) for p in prompts]
    model.train()
    got = greedy_generate(
        model, prompts, 9, width=32, rows=2, eos_id=tok.eos_id, pad_id=tok.pad_id, device=torch.device("cpu")
    )
    assert got == want and all(len(g) == 9 for g in got)

    table = EvalTable([(i, p, p[:0]) for i, p in enumerate(prompts)], 9, 32, 2, tok, "unused", "t")
    record = table.generate(model, 5, torch.device("cpu"))
    assert model.training and all(p.grad is None for p in model.parameters())
    assert [s["generated"] for s in record["samples"]] == [tok.decode(w) for w in want]


def test_a_transformers_model_decodes_as_its_own_generate():
    """The same window through the trainer's wrapper of a transformers model agrees with
    transformers' greedy ``generate`` (KV cache, no padding)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
    from lowprec.train.trainer import _HFLoss

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=272,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            eos_token_id=257,
            pad_token_id=258,
            bos_token_id=256,
        )
    ).eval()
    prompts = [torch.randint(0, 256, (n,)) for n in (4, 9)]
    want = []
    for p in prompts:
        seq = hf.generate(
            p[None],
            attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=257,
            pad_token_id=258,
        )[0, p.numel() :].tolist()
        want.append(seq[: seq.index(257)] if 257 in seq else seq)
    got = greedy_generate(_HFLoss(hf), prompts, 8, width=32, rows=2, eos_id=257, pad_id=258, device=torch.device("cpu"))
    assert got == want


def test_prompts_of_instruction_examples_stop_at_the_first_trained_token():
    from lowprec.train.examples import ExampleBatches, ExampleSet

    examples = ExampleSet.from_lists(
        [([1, 2, 3, 4, 5], [-100, -100, -100, 4, 5]), ([6, 7, 8, 9], [6, 7, 8, 9]), ([10, 11, 12], [-100, 11, 12])],
        "x",
        "f",
    )
    loader = ExampleBatches(examples, 1, seq_len=8, pad_id=0, shuffle=False, drop_last=False)
    got = [(i, p.tolist(), r.tolist()) for i, p, r in choose_prompts(loader, 3)]
    # the instruction, then (every token trained) the first half
    assert got == [(0, [1, 2, 3], [4, 5]), (1, [6, 7], [8, 9]), (2, [10], [11, 12])]
    assert [i for i, _, _ in choose_prompts(loader, 2)] == [0, 1]  # evenly spaced: 0, 3 // 2
    assert len(choose_prompts(loader, 50)) == 3  # no more than there are


@pytest.mark.parametrize(
    "bad, expected",
    [
        ({"eval_table_size": -1}, "config: eval_table_size: Input should be greater than or equal to 0 (got -1)"),
        ({"eval_table_size": 5000}, "config: eval_table_size: Input should be less than or equal to 1024 (got 5000)"),
        ({"eval_table_size": "all"}, "config: eval_table_size: Input should be a valid integer (got all)"),
        (
            {"eval_table_size": 2, "eval_max_new_tokens": 0},
            "config: eval_max_new_tokens: Input should be greater than or equal to 1 (got 0)",
        ),
        (
            {"eval_table_size": 2, "eval_max_new_tokens": 128},
            "config: eval_max_new_tokens: 128 leaves no room for a prompt in sequence_len: 128 (prompt and generation share "
            "it); lower it below 128",
        ),
        # inert (eval_table_size unset) but still typed
        ({"eval_max_new_tokens": 2.5}, "config: eval_max_new_tokens: Input should be a valid integer (got 2.5)"),
    ],
)
def test_bad_values_are_one_line_errors(bad, expected):
    with pytest.raises(ValueError) as err:
        parse_config(bad)
    assert str(err.value) == expected


def test_default_max_new_tokens_fits_the_sequence(tmp_path):
    """Unset, eval_max_new_tokens is Axolotl's 128, capped at half of sequence_len (a decision
    with its reason); the prompt keeps its last sequence_len - that tokens."""
    from lowprec.train.data import TokenBatches

    loader = TokenBatches(torch.arange(200, dtype=torch.int32) % 250, 2, 40, shuffle=False)
    cfg = parse_config({"sequence_len": 40, "eval_table_size": 2, "val_set_size": 0.1})
    decisions: dict = {}
    table = EvalTable.build(cfg, loader, ByteTokenizer(), str(tmp_path), "t", decisions, logging.getLogger("x"))
    assert table.max_new_tokens == 20 and decisions["eval_max_new_tokens"].value == 20
    assert "capped at half of sequence_len: 40" in decisions["eval_max_new_tokens"].reason
    assert table.width == 40 and [p.numel() for _, p, _ in table.samples] == [20, 20]
    assert os.path.basename(table.path) == "eval_generations.md"


def test_the_table_file_is_rewritten_whole_with_one_section_per_step(tmp_path):
    """A resumed run reads its sections back from metrics.jsonl (cut at the checkpoint's step)
    and an evaluation at a step already there replaces that section, so the file never holds
    two sections of one step."""

    def record(step, text):
        return {
            "kind": "generations",
            "step": step,
            "max_new_tokens": 4,
            "samples": [{"index": 0, "prompt": "a|b\n  c", "reference": "<r>", "generated": text, "new_tokens": 1}],
        }

    table = EvalTable([], 4, 16, 1, ByteTokenizer(), str(tmp_path / "eval_generations.md"), "run")
    table.records = [record(2, "x"), record(4, "old")]
    table.write(record(4, "new"))
    text = (tmp_path / "eval_generations.md").read_text()
    assert text.count("## step") == 2 and "| 0 | a\\|b<br>&nbsp; c | &lt;r&gt; | new |" in text and "old" not in text
    assert os.listdir(tmp_path) == ["eval_generations.md"]
