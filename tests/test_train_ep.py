"""``ep_size`` (alias ``expert_parallel_degree``) in the trainer: `lowprec train
examples/moe_tiny.yaml --num_processes 2 --ep_size 2` shards each layer's 8 FP8 experts over the
two processes (4 each, tokens dispatched in FP8: lowprec.distributed.expert_parallel), the other
weights under DDP, and follows the same config without expert parallelism on one process,
reading the same sequences a step (gradient accumulation: one micro-batch per process of the
parallel run; rowwise: the same FP8 values in the expert GEMMs, the sums in another order). That
reference runs in the test's own process, once per sequences-a-step, shared by the tests (a
launch costs seconds of start-up; the parallel runs are the ones launched). Measured (2-core
Intel Xeon, 5 steps at lr 3e-3, rowwise): max |loss diff| 1.6e-3 at loss ~4.5; tolerance 2e-2
(test_train_tp.py's). The exported model holds every expert. With
``--fsdp_version 2`` the other weights shard under FSDP2 (against the same one-process run);
``--save_steps`` checkpoints resume bit for bit, and on another process count (2 -> 1, 4 -> 2)
follow the uninterrupted run of the same sequences. Bad inputs: one line each, exit 2 from the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from lowprec.train.config import load_config, parse_config
from lowprec.train.metrics import read_metrics
from lowprec.train.trainer import train
from tests.torchrun_util import run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = os.path.join(ROOT, "examples", "moe_tiny.yaml")
# OMP_NUM_THREADS left to the launcher, as in a user's shell (it sets 1, torchrun's default)
ENV = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "PYTHONPATH": os.path.join(ROOT, "src")}


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"ep_size": 3}, "ep_size: 3 does not divide builtin:moe-tiny's 8 experts; set ep_size to a divisor of 8"),
        ({"ep_size": 2, "base_model": "builtin:llama-tiny"}, "builtin:llama-tiny, which has no experts"),
        ({"ep_size": 2, "fp8": False}, "ep_size: 2 shards lowprec's FP8 experts: set fp8: true"),
        (
            {"ep_size": 2, "fp8_backend": "torchao", "fp8_recipe": "tensorwise"},
            "ep_size: 2 with fp8_backend: torchao: .* use fp8_backend: native",
        ),
        (
            {"ep_size": 2, "deepspeed": {"zero_optimization": {"stage": 2}}},
            "ep_size: 2 with deepspeed: .* drop deepspeed",
        ),
        (
            {
                "ep_size": 2,
                "save_steps": 5,
                "fsdp_version": 2,
                "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"},
            },
            "ep_size: 2 with save_steps and fsdp_config.state_dict_type: SHARDED_STATE_DICT: .* FULL_STATE_DICT",
        ),
        ({"ep_size": 2, "expert_parallel_degree": 4}, "ep_size: 2 and expert_parallel_degree: 4 .* keep one"),
        ({"ep_combine": "fp8"}, "ep_combine: fp8 is the expert outputs' wire format .* set ep_size > 1"),
    ],
)
def test_bad_ep_settings_are_one_error_each(keys, message):
    with pytest.raises(ValueError, match=message):
        parse_config({"base_model": "builtin:moe-tiny", "fp8": True, **keys})


def test_expert_parallel_degree_is_ep_size():
    cfg = parse_config({"base_model": "builtin:moe-tiny", "fp8": True, "expert_parallel_degree": 4})
    assert cfg.ep_size == 4


def _error_lines(*flags):
    """``lowprec train examples/moe_tiny.yaml FLAGS``, which must exit 2: its error lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "lowprec.cli.main", "train", MOE, *flags],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    return [x for x in proc.stderr.splitlines() if x.startswith("lowprec: error")]


def test_cli_exit_2_with_one_line_when_the_processes_do_not_match(tmp_path):
    assert _error_lines("--ep_size", "2", "--output_dir", str(tmp_path)) == [
        "lowprec: error: ep_size: 2 does not divide --num_processes 1: every 2 processes share the experts "
        "(more are replicas); launch a multiple of 2 processes or change ep_size"
    ]


def _launch(out, *flags, procs=2, steps=5, config=MOE):
    proc = run_torchrun(
        [
            sys.executable,
            "-m",
            "lowprec.cli.main",
            "train",
            config,
            "--num_processes",
            str(procs),
            "--max_steps",
            str(steps),
            "--val_set_size",
            "0",
            "--output_dir",
            str(out),
            "--quiet",
            *flags,
        ],
        lambda p: (out / "summary.json").exists(),
        env=ENV,
        timeout=300,
    )
    # none of what every launched run printed before: torchrun's four-line OMP_NUM_THREADS banner
    # and a FutureWarning about torch.distributed.reduce_op from every rank's exit (other
    # libraries' own warnings, peft's and torchao's with the LoRA config, are theirs to print)
    assert "OMP_NUM_THREADS" not in proc.stderr and "reduce_op" not in proc.stderr, proc.stderr
    return [r["loss"] for r in read_metrics(str(out), "train")]


def _one_process(out, steps, accumulate, config=MOE, **keys):
    """The same sequences on one process, in this one (no launch: the reference's own process
    count is not what these tests check): ``accumulate`` micro-batches a step, each the one a
    process of an ``accumulate``-process run reads. Its (step, loss) pairs."""
    keys = {"max_steps": steps, "val_set_size": 0, "gradient_accumulation_steps": accumulate, **keys}
    return train(load_config(config, {**keys, "progress_bar": False, "output_dir": str(out)})).train_losses


@pytest.fixture(scope="module")
def one_of_8(tmp_path_factory):
    """moe_tiny.yaml without expert parallelism, 8 sequences a step (2 processes' worth), 5 steps."""
    losses = _one_process(tmp_path_factory.mktemp("one_of_8"), 5, 2)
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5]
    return [loss for _, loss in losses]


@pytest.fixture(scope="module")
def one_of_16(tmp_path_factory):
    """The same with 16 sequences a step (4 processes' worth), 4 steps."""
    losses = _one_process(tmp_path_factory.mktemp("one_of_16"), 4, 4)
    assert [s for s, _ in losses] == [1, 2, 3, 4]
    return [loss for _, loss in losses]


@pytest.mark.parametrize("flags", [[], ["--fsdp_version", "2"]], ids=["ddp", "fsdp2"])
def test_expert_parallel_follows_the_plain_run_and_resumes_as_uninterrupted(tmp_path, flags, one_of_8):
    """``--ep_size 2`` (the rest under DDP, or under FSDP2 with the experts as its ignored
    parameters) against the same config without expert parallelism on one process, the same 8
    sequences a step: losses within 2e-2 (measured, 2-core Intel Xeon, 5 steps: 1.6e-3 DDP,
    4.4e-3 FSDP2), it learns, the saved model holds every expert.
    ``--save_steps 3``: checkpoint-3 holds every expert (the model file, gathered) and every
    expert's AdamW moments (the optimizer file, all-gathered along the expert dim; each process
    loads its slice back). A run resumed from it on 2 processes logs steps 4-5 with the
    uninterrupted run's losses bit for bit (CPU). Without the gather step 5 differs (DDP: process 1
    resumed with process 0's moments, 3.8837 vs 3.8846, checked)."""
    full = _launch(tmp_path / "a", "--ep_size", "2", "--save_steps", "3", *flags)
    assert len(full) == len(one_of_8) == 5
    assert full == pytest.approx(one_of_8, abs=2e-2)
    assert full[-1] < full[0] - 0.5  # it learns
    saved = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert tuple(saved["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 384, 128)  # every expert
    assert tuple(saved["model.layers.3.mlp.experts.down_proj"].shape) == (8, 128, 192)
    ckpt = tmp_path / "a" / "checkpoint-3"
    model = load_file(str(ckpt / "model_0.safetensors"))
    assert tuple(model["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 384, 128)
    moments = load_file(str(ckpt / "optimizer_0.safetensors"))
    assert (8, 384, 128) in {tuple(v.shape) for k, v in moments.items() if k.endswith("/exp_avg")}
    resumed = _launch(tmp_path / "b", "--ep_size", "2", "--resume_from_checkpoint", str(ckpt), *flags)
    assert [r["step"] for r in read_metrics(str(tmp_path / "b"), "train")] == [4, 5]
    assert resumed == full[3:]
    if not flags:  # the same checkpoint on other process counts (DDP only: the path is the same)
        _on_one_process_and_on_four(tmp_path, ckpt, full, one_of_8)


def _on_one_process_and_on_four(tmp_path, ckpt, full, one_of_8):
    """checkpoint-3 of ``--num_processes 2 --ep_size 2`` resumed on one process without expert
    parallelism, ``gradient_accumulation_steps: 2`` keeping 8 sequences a step: the data continues
    at sequence 24, and steps 4-5 follow both the uninterrupted one-process run of that layout
    (the same sequences from the start) and the 2-process run, within 2e-2 (measured, 2-core
    Intel Xeon: 2.1e-3 and 5.3e-4). That the state loaded is the saved one, every
    expert's slice in its place: test_expert_parallel.py. On 4 processes the saved position (24
    sequences) falls inside a batch of 16: one line, exit 2, before any worker starts."""
    resumed = _one_process(tmp_path / "one", 5, 2, resume_from_checkpoint=str(ckpt))
    assert [s for s, _ in resumed] == [4, 5]
    after = [loss for _, loss in resumed]
    assert after == pytest.approx(one_of_8[3:], abs=2e-2)
    assert after == pytest.approx(full[3:], abs=2e-2)
    four = ["--num_processes", "4", "--ep_size", "4", "--output_dir", str(tmp_path / "four")]
    assert _error_lines(*four, "--resume_from_checkpoint", str(ckpt)) == [
        f"lowprec: error: resume_from_checkpoint: {ckpt}: the data position was saved by 2 processes, 24 "
        "sequences into epoch 0 (3 batches of 4 each); 4 processes read 16 per batch, which does not divide 24: "
        "resume with --num_processes 1 / 2 / 3 / 6, or from a checkpoint where it divides"
    ]
    assert not (tmp_path / "four").exists()  # nothing started


def test_expert_replicas_follow_the_plain_run_and_resume_bit_for_bit_and_on_two(tmp_path, one_of_16):
    """``--num_processes 4 --ep_size 2``: two expert-parallel groups of 2 processes, each a replica
    of the other (expert gradients averaged over ranks 0 and 2, 1 and 3), against the same 16
    sequences a step without expert parallelism (one process): losses within 2e-2 (measured,
    2-core Intel Xeon: 6.7e-4), it learns, the saved model holds every expert;
    checkpoint-2 resumed on the same layout logs steps 3-4 with the uninterrupted run's losses
    bit for bit (CPU). Resumed with ``--num_processes 2 --ep_size 2 --gradient_accumulation_steps 2``
    (still 16 a step, from sequence 32): every process loads its 4 experts and their moments from
    the whole saved ones, and steps 3-4 follow the uninterrupted run of the same sequences (one
    process) and the 4-process run within 2e-2. (ep_size 4, each of 4 processes holding 2 experts:
    test_expert_parallel.py and test_expert_parallel_checkpoints.py, through the Accelerator.)"""
    full = _launch(tmp_path / "a", "--ep_size", "2", "--save_steps", "2", procs=4, steps=4)
    assert len(full) == len(one_of_16) == 4
    assert full == pytest.approx(one_of_16, abs=2e-2)
    assert full[-1] < full[0] - 0.3  # it learns
    saved = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert tuple(saved["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 384, 128)  # every expert
    ckpt = tmp_path / "a" / "checkpoint-2"
    resumed = _launch(tmp_path / "b", "--ep_size", "2", "--resume_from_checkpoint", str(ckpt), procs=4, steps=4)
    assert [r["step"] for r in read_metrics(str(tmp_path / "b"), "train")] == [3, 4]
    assert resumed == full[2:]
    report = (tmp_path / "a" / "fp8_conversion.txt").read_text()
    assert "ep_size 2 of 4 processes" in report and "2 replicas of the experts" in report, report
    two = ["--ep_size", "2", "--gradient_accumulation_steps", "2", "--resume_from_checkpoint", str(ckpt)]
    on_two = _launch(tmp_path / "c", *two, steps=4)
    assert [r["step"] for r in read_metrics(str(tmp_path / "c"), "train")] == [3, 4]
    assert on_two == pytest.approx(one_of_16[2:], abs=2e-2)
    assert on_two == pytest.approx(full[2:], abs=2e-2)


def test_a_data_position_on_another_process_count(tmp_path):
    """position_on: the same sequences consumed on another process count, or one line naming the
    counts that continue; check_process_count: the line the run logs, DeepSpeed's files refused."""
    import json

    from lowprec.train.data import position_on
    from lowprec.train.resume_check import check_process_count

    saved = {"epoch": 0, "position": 3, "batch_size": 4, "world_size": 2}
    assert [position_on(saved, w) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ValueError, match=r"4 processes read 16 per batch, .* --num_processes 1 / 2 / 3 / 6,"):
        position_on(saved, 4)
    meta = {"mixed_precision": "fp8", "fp8_backend": "native", "num_processes": 2}
    (tmp_path / "lowprec_state.json").write_text(json.dumps(meta))
    cfg = parse_config({"base_model": "builtin:moe-tiny", "micro_batch_size": 4})
    assert check_process_count(str(tmp_path), 2, cfg) is None
    assert check_process_count(str(tmp_path), 1, cfg).endswith(
        "takes 4 sequences (it took 8): gradient_accumulation_steps 2 keeps 8"
    )
    (tmp_path / "deepspeed_0").mkdir()
    ds = parse_config({"base_model": "builtin:moe-tiny", "micro_batch_size": 4, "deepspeed": {"zero_optimization": {}}})
    with pytest.raises(ValueError, match="under DeepSpeed, .* resume with --num_processes 2$"):
        check_process_count(str(tmp_path), 1, ds)
    with pytest.raises(ValueError, match=r"saved under DeepSpeed .*: resume it with the deepspeed settings that saved"):
        check_process_count(str(tmp_path), 1, cfg)  # and without deepspeed
    # ZeRO-3's files and stage 1/2's do not load each other (DeepSpeed stops with a bare AssertionError)
    (tmp_path / "deepspeed_0" / "state").mkdir()
    (tmp_path / "deepspeed_0" / "state" / "zero_pp_rank_0_mp_rank_00_model_states.pt").touch()
    with pytest.raises(ValueError, match=r"saved under DeepSpeed ZeRO stage 3, whose files DeepSpeed ZeRO stage 2 "):
        check_process_count(str(tmp_path), 2, ds)  # no stage set: the plugin's 2
    three = parse_config({"base_model": "builtin:moe-tiny", "deepspeed": {"zero_optimization": {"stage": 3}}})
    assert check_process_count(str(tmp_path), 2, three) is None
    with pytest.raises(ValueError, match=r"settings that saved it \(ZeRO stage 3\), on 2 processes"):
        check_process_count(str(tmp_path), 2, cfg)
    (tmp_path / "lowprec_state.json").write_text(json.dumps({**meta, "deepspeed_zero_stages": [1]}))  # the record wins
    assert check_process_count(str(tmp_path), 2, ds) is None
    with pytest.raises(ValueError, match=r"ZeRO stage 1, whose files DeepSpeed ZeRO stage 3 cannot load: resume it"):
        check_process_count(str(tmp_path), 2, three)


def _hf_moe(tmp_path):
    """A tiny transformers Mixtral (tests/tiny_moe.py, 8 experts) with the byte-level tokenizer, saved."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.test_train_hf_moe import _tokenizer
    from tests.tiny_moe import build

    tok = _tokenizer()
    model = build("mixtral")
    model.resize_token_embeddings(-(-len(tok) // 16) * 16)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, k, getattr(tok, k))
    model.config._experts_implementation = None
    out = tmp_path / "mixtral"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return transformers, str(out)


def test_lora_on_attention_with_expert_parallel_experts(tmp_path):
    """LoRA on attention (the experts frozen in FP8) with ``--ep_size 2``: each process holds 4 of
    Mixtral's 8 frozen experts, dispatches in FP8, and only the adapters train (DDP); losses follow
    the same sequences without expert parallelism (one process) within 2e-2 (measured, 2-core
    Intel Xeon: 8.5e-3); the adapter is saved, and the
    merged model (adapter onto the whole base on disk: each process holds only some experts) reloads
    in transformers and gives base + adapter's logits. LoRA on the expert weights themselves
    (``lora_target_parameters``) with ``ep_size``: one error."""
    import peft
    import torch

    transformers, base = _hf_moe(tmp_path)
    on_experts = {"base_model": base, "fp8": True, "ep_size": 2, "adapter": "lora", "lora_r": 8}
    with pytest.raises(ValueError, match="ep_size: 2 with lora_target_parameters: adapters on the expert weights"):
        parse_config({**on_experts, "lora_target_parameters": ["mlp.experts.down_proj"]})
    config = tmp_path / "lora.yaml"
    notes = os.path.join(ROOT, "examples", "data", "notes.jsonl")
    config.write_text(
        f"base_model: {base}\ndatasets: [{notes}]\nfp8: true\nfp8_recipe: tensorwise\nsequence_len: 32\n"
        "micro_batch_size: 2\nlearning_rate: 3.0e-3\nadapter: lora\nlora_r: 8\nlora_alpha: 32\n"
        "lora_target_modules: [q_proj, k_proj, v_proj, o_proj]\nmerge_lora: true\nprogress_bar: false\n"
        "use_tensorboard: false\nlogging_steps: 1\n"
    )
    ep = _launch(tmp_path / "ep", "--ep_size", "2", steps=6, config=str(config))
    # the same 4 sequences a step on one process (2 micro-batches of 2), in this process; its merge is not checked
    plain = [loss for _, loss in _one_process(tmp_path / "plain", 6, 2, config=str(config), merge_lora=False)]
    report = (tmp_path / "ep" / "fp8_conversion.txt").read_text()
    assert "expert parallelism: ep_size 2 of 2 processes" in report, report  # the experts were sharded
    assert "expert parallelism" not in (tmp_path / "plain" / "fp8_conversion.txt").read_text()
    assert len(ep) == len(plain) == 6 and ep == pytest.approx(plain, abs=2e-2)
    assert ep[-1] < ep[0]  # the adapters learn
    ids = torch.tensor([[5, 80, 81, 90, 100, 33, 47, 60]])
    with torch.no_grad():
        adapted = (
            peft.PeftModel.from_pretrained(
                transformers.AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "ep")
            )
            .eval()(ids)
            .logits
        )
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ep" / "merged").eval()(ids).logits
        plain_base = transformers.AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
    assert (adapted - merged).abs().mean() < 0.05 * adapted.abs().mean()  # merged == base + adapter
    assert (adapted - plain_base).abs().mean() > 10 * (adapted - merged).abs().mean()  # ... which learned


def test_a_deepspeed_checkpoint_resumed_without_deepspeed_is_one_line_before_any_worker(tmp_path):
    """A ZeRO-3 checkpoint (deepspeed_0/, no model_0.safetensors) resumed without deepspeed on the
    same process count failed in every rank with 'checkpoint file .../model_0.safetensors is
    missing; the checkpoint is incomplete'; now one line before any worker starts, exit 2."""
    import json

    ckpt = tmp_path / "run" / "checkpoint-2"
    (ckpt / "deepspeed_0").mkdir(parents=True)
    meta = {"mixed_precision": "fp8", "fp8_backend": "native", "num_processes": 2}
    (ckpt / "lowprec_state.json").write_text(json.dumps(meta))
    tiny = os.path.join(ROOT, "examples", "tiny.yaml")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "lowprec.cli.main", "train", tiny, "--num_processes", "2"]
        + ["--output_dir", str(out), "--resume_from_checkpoint", str(ckpt)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"lowprec: error: resume_from_checkpoint: {ckpt} was saved under DeepSpeed (its model and optimizer are "
        "DeepSpeed's files in deepspeed_0/, not model_0.safetensors): resume it with the deepspeed settings that "
        "saved it (ZeRO stage 1 or 2), on 2 processes (--num_processes 2)"
    ]
    assert not out.exists()  # nothing started
