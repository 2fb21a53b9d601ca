"""Axolotl's configs as written (issue 13 part 0): every key Axolotl documents is known, null
means unset, unsupported keys name what to use instead, and the listed working keys work."""

from types import SimpleNamespace

import pytest
import torch

from lowprec.errors import NonFiniteError
from lowprec.train.axolotl_keys import OWNED_BY_MODELS, UNSUPPORTED
from lowprec.train.config import TrainConfig, load_config, parse_config

# Axolotl's examples/llama-3/fft-8b.yaml with only the model, data and sizes changed
AXOLOTL_FFT = {
    "base_model": "builtin:llama-tiny",
    "datasets": [{"path": "data.jsonl", "type": "alpaca"}],
    "dataset_prepared_path": "last_run_prepared",
    "val_set_size": 0.05,
    "output_dir": "./outputs/out",
    "sequence_len": 256,
    "sample_packing": True,
    "wandb_project": None,
    "wandb_entity": None,
    "wandb_watch": None,
    "wandb_name": None,
    "wandb_log_model": None,
    "gradient_accumulation_steps": 8,
    "micro_batch_size": 1,
    "num_epochs": 1,
    "optimizer": "adamw_torch_fused",
    "lr_scheduler": "cosine",
    "learning_rate": 2e-5,
    "bf16": "auto",
    "tf32": False,
    "gradient_checkpointing": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "resume_from_checkpoint": None,
    "logging_steps": 1,
    "warmup_ratio": 0.1,
    "evals_per_epoch": 2,
    "saves_per_epoch": 1,
    "weight_decay": 0.0,
    "loss_watchdog_threshold": 5.0,
    "loss_watchdog_patience": 3,
}


def test_every_axolotl_key_is_known_null_accepted_values_named():
    from lowprec.train.config.inert import RULES

    fields = set(TrainConfig.model_fields)
    default = {k: f.default for k, f in TrainConfig.model_fields.items()}.get  # val_set_size: 0.03
    inert_alone = {k for rule in RULES for k in rule.keys if not rule.live(default)}
    for key in sorted(set(UNSUPPORTED) - fields):
        parse_config({key: None})  # null: unset
        if key in inert_alone:  # e.g. hub_strategy without hub_model_id: Axolotl ignores it too
            assert parse_config({key: "something"}).notes[0].startswith(f"{key}: something is ignored: it only matters")
            continue
        with pytest.raises(ValueError, match=f"^config: {key}: an Axolotl key lowprec does not support \\(.+\\)$"):
            parse_config({key: "something"})
    assert "lora_r" in OWNED_BY_MODELS and "load_in_8bit" in OWNED_BY_MODELS and len(UNSUPPORTED) > 300


def test_axolotl_example_config_validates_and_its_gpu_only_keys_are_named(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    cfg = parse_config({**AXOLOTL_FFT, "datasets": [{"path": str(tmp_path / "data.jsonl"), "type": "alpaca"}]})
    assert cfg.sample_packing and cfg.evals_per_epoch == 2 and cfg.gradient_checkpointing
    for key, value, text in [
        ("optimizer", "paged_adamw_8bit", "paged optimizers need bitsandbytes"),
        ("attn_implementation", "flash_attention_2", "attn_implementation: an Axolotl key"),
        ("load_in_8bit", True, "bitsandbytes"),
        ("flash_attention", True, "scaled_dot_product_attention"),
    ]:
        with pytest.raises(ValueError, match=text):
            parse_config({**AXOLOTL_FFT, key: value, "datasets": cfg.to_yaml_dict()["datasets"]})
    with pytest.raises(ValueError, match="evals_per_epoch and eval_steps are both set"):
        parse_config({"evals_per_epoch": 2, "eval_steps": 3})


def test_the_parallelism_keys_name_the_command_that_runs_the_trainer_on_n_processes():
    # `lowprec launch` runs a Python script, not a YAML config: the fix names `lowprec train`
    with pytest.raises(ValueError, match="fsdp: an Axolotl key") as err:
        parse_config({"fsdp": ["full_shard", "auto_wrap"]})
    assert "`lowprec train CONFIG.yaml --num_processes N`" in str(err.value)
    assert "lowprec launch" not in str(err.value)


def test_resume_keys_in_axolotls_and_transformers_shapes_name_resume_from_checkpoint_auto():
    """Axolotl's auto_resume_from_checkpoints: true and transformers' resume_from_checkpoint: true
    both mean 'continue from the latest checkpoint': the error names the key that does that here
    (it said 'drop the key', which silently starts afresh, and 'Input should be a valid string')."""
    for data in ({"auto_resume_from_checkpoints": True}, {"resume_from_checkpoint": True}):
        with pytest.raises(ValueError, match="resume_from_checkpoint: auto") as err:
            parse_config(data)
        assert "drop the key" not in str(err.value) and "valid string" not in str(err.value), err.value
    assert parse_config({"resume_from_checkpoint": False}).resume_from_checkpoint is None  # asks for nothing
    assert parse_config({"auto_resume_from_checkpoints": False}).resume_from_checkpoint is None


def test_per_epoch_intervals_and_warmup_ratio_resolve_once():
    from lowprec.train.resolve import total_steps

    cfg = parse_config(
        {
            "evals_per_epoch": 4,
            "saves_per_epoch": 1,
            "warmup_ratio": 0.1,
            "num_epochs": 2,
            "gradient_accumulation_steps": 2,
        }
    )
    decisions: dict = {}
    assert total_steps(cfg, 100, decisions, main=False) == 100  # 50 steps per epoch x 2
    assert decisions["eval_steps"].value == 12 and decisions["save_steps"].value == 50
    assert decisions["warmup_steps"].value == 10 and "warmup_ratio" in decisions["warmup_steps"].reason


def test_eval_and_save_steps_below_one_are_fractions_of_the_run():
    """Axolotl documents eval_steps / save_steps as 'integer for every N steps, float for fraction
    of total steps' (transformers resolves the fraction as ceil(fraction x steps)); they were
    refused with pydantic's 'Input should be a valid integer'."""
    from lowprec.train.resolve import total_steps

    decisions: dict = {}
    cfg = parse_config({"eval_steps": 0.25, "save_steps": 0.3, "max_steps": 7})
    assert total_steps(cfg, 100, decisions, main=False) == 7
    assert decisions["eval_steps"].value == 2 and decisions["save_steps"].value == 3  # ceil(1.75), ceil(2.1)
    assert "eval_steps: 0.25 x 7 steps" in decisions["eval_steps"].reason
    assert parse_config({"eval_steps": 5.0}).eval_steps == 5  # a whole float is a number of steps
    for key in ("eval_steps", "save_steps"):
        for bad in (1.5, 0, -0.5, 0.0):
            with pytest.raises(ValueError, match=f"{key}: .*number of steps.*fraction") as err:
                parse_config({key: bad})
            assert "valid integer" not in str(err.value)


def test_strict_limits_flags_to_keys_the_file_sets(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("strict: true\nlearning_rate: 0.001\n")
    assert load_config(path, {"learning_rate": 0.002}).learning_rate == 0.002
    with pytest.raises(ValueError, match="strict: true in .*--seed set keys the file does not have"):
        load_config(path, {"seed": 3})
    path.write_text("learning_rate: 0.001\n")
    assert load_config(path, {"seed": 3}).seed == 3  # strict: false (Axolotl's default)


def _loop(**cfg):
    from lowprec.train.loop import Loop

    run = SimpleNamespace(cfg=SimpleNamespace(**cfg), state=SimpleNamespace(step=7), main=False)
    return Loop(run=run, tokens_per_step=1, batches=None)


def test_loss_watchdog_stops_after_patience_high_steps():
    loop = _loop(loss_watchdog_threshold=5.0, loss_watchdog_patience=2)
    loop._watch(6.0)
    loop._watch(4.0)  # a good step resets the count
    loop._watch(6.0)
    with pytest.raises(
        NonFiniteError, match="loss_watchdog: training loss above loss_watchdog_threshold: 5.0 for 2 steps"
    ):
        loop._watch(7.0)


def test_early_stopping_after_patience_evaluations_without_gain():
    loop = _loop(early_stopping_patience=2)
    for loss in (3.0, 2.5, 2.6, 2.4, 2.5):
        loop._early_stopping(loss)
    assert not loop.stop_early  # 2.4 improved: the count restarted
    loop._early_stopping(2.45)
    assert loop.stop_early


@pytest.mark.parametrize("fp8", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(fp8):
    """Also with FP8 layers: the recompute runs in the FP8 region of the first forward
    (lowprec.fp8.checkpoint), so it saves the same tensors and gives the same gradients."""
    from lowprec import fp8 as engine
    from lowprec.train.model import build_model

    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 16))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model("llama-tiny", n_layers=2)
        if fp8:
            engine.convert(model, recipe=engine.Recipe.from_name("tensorwise", gemm="emulate"))
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        with engine.autocast(enabled=fp8):
            loss = model(x, labels=x).loss
        loss.backward()  # outside the FP8 region, as in a training loop
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("name", ["alpaca_fp8.yaml", "chat_fp8.yaml"])
def test_new_keys_survive_replace_as_compare_uses_it(name):
    """`lowprec compare` re-validates a dumped config per precision: the dump must load back."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "examples", name))
    other = cfg.replace(fp8=False, bf16=False)
    assert other.datasets == cfg.datasets and other.warmup_ratio == cfg.warmup_ratio
    assert other.evals_per_epoch == cfg.evals_per_epoch and other.sample_packing == cfg.sample_packing


# (config, inert key, what would make it matter): Axolotl's own behaviour (lowprec.train.config.inert.RULES)
INERT = [
    (
        {"eval_table_size": None, "eval_max_new_tokens": 128},
        "eval_max_new_tokens",
        "eval_table_size above 0",
    ),  # its llama-3 instruct example
    ({"val_set_size": 0, "evals_per_epoch": 4}, "evals_per_epoch", "val_set_size above 0"),  # 53 of its examples
    ({"val_set_size": 0.0, "eval_steps": 10}, "eval_steps", "val_set_size above 0"),
    ({"adapter": None, "lora_r": 8}, "lora_r", "adapter (lora or qlora)"),  # its archived examples
    ({"loss_watchdog_patience": 3}, "loss_watchdog_patience", "loss_watchdog_threshold"),
    (
        {"gradient_checkpointing": False, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
        "gradient_checkpointing_kwargs",
        "gradient_checkpointing: true",
    ),
    ({"torch_compile_backend": "inductor"}, "torch_compile_backend", "torch_compile"),
    ({"hub_model_id": None, "hub_strategy": "end"}, "hub_strategy", "hub_model_id"),
    ({"wandb_project": None, "wandb_entity": "team"}, "wandb_entity", "wandb_project (or use_wandb)"),
    ({"generate_samples": False, "num_generation_samples": 5}, "num_generation_samples", "generate_samples: true"),
]


@pytest.mark.parametrize("data, key, needs", INERT, ids=[k for _, k, _ in INERT])
def test_a_key_inert_given_the_rest_is_one_note_not_an_error(data, key, needs):
    from lowprec.train.config.base import yaml_text

    cfg = parse_config(data)
    assert cfg.notes == (
        f"{key}: {yaml_text(data[key])} is ignored: it only matters with {needs}, as in Axolotl; "
        f"set that or drop {key}",
    )
    if key in TrainConfig.model_fields:  # not applied either
        assert getattr(cfg, key) is None
    assert cfg.replace(seed=7).notes == cfg.notes  # `compare`'s copies keep it, once


@pytest.mark.parametrize(
    "data, check",
    [
        ({"eval_table_size": 2, "eval_max_new_tokens": 16}, lambda c: c.eval_max_new_tokens == 16),
        ({"val_set_size": 0.05, "evals_per_epoch": 4}, lambda c: c.evals_per_epoch == 4),
        ({"adapter": "lora", "lora_r": 8}, "needs a Hugging Face base_model"),  # live: the adapter's own rules apply
        ({"loss_watchdog_threshold": 5.0, "loss_watchdog_patience": 3}, lambda c: c.loss_watchdog_patience == 3),
        (
            {"torch_compile": True, "torch_compile_backend": "inductor"},
            "torch_compile_backend: an Axolotl key lowprec does not",
        ),
        ({"wandb_project": "p", "wandb_entity": "team"}, "wandb_project: an Axolotl key lowprec does not support"),
    ],
    ids=[
        "eval_max_new_tokens",
        "evals_per_epoch",
        "lora_r",
        "loss_watchdog_patience",
        "torch_compile_backend",
        "wandb_entity",
    ],
)
def test_the_same_key_matters_when_its_condition_holds(data, check):
    if isinstance(check, str):
        with pytest.raises(ValueError, match=check):
            parse_config(data)
        return
    cfg = parse_config(data)
    assert check(cfg) and cfg.notes == ()


def test_inert_keys_chain_and_defaults_ask_for_nothing():
    cfg = parse_config({"val_set_size": 0, "eval_table_size": 2, "eval_max_new_tokens": 8})
    assert [n.split(":")[0] for n in cfg.notes] == ["eval_table_size", "eval_max_new_tokens"]
    assert cfg.eval_table_size is None and cfg.eval_max_new_tokens is None
    # null, false, or Axolotl's own default: nothing asked, nothing said
    assert (
        parse_config(
            {
                "val_set_size": 0,
                "eval_table_size": 0,
                "generation_do_sample": True,
                "lora_dropout": 0.0,
                "wandb_entity": None,
                "torch_compile_mode": None,
            }
        ).notes
        == ()
    )


def test_local_files_through_the_hf_json_builder_load_as_local_files(tmp_path):
    """Axolotl's local-file form {path: json, data_files: a.jsonl} once was 'datasets.0: datasets:
    data_files: an Axolotl key lowprec does not support (datasets from the Hugging Face Hub; ...)':
    it is the local file (one entry per file; found next to the config as path is)."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (data / name).write_text('{"instruction": "Say hi.", "output": "hi"}\n')
    one = parse_config({"datasets": [{"path": "json", "data_files": str(data / "a.jsonl"), "type": "alpaca"}]})
    assert [(d.path, d.ds_type, d.type) for d in one.datasets] == [(str(data / "a.jsonl"), "json", "alpaca")]
    many = parse_config({"datasets": [{"path": "json", "data_files": str(data / "*.jsonl"), "type": "alpaca"}]})
    assert [d.path for d in many.datasets] == [str(data / "a.jsonl"), str(data / "b.jsonl")]
    split = {"path": "json", "data_files": {"train": str(data / "b.jsonl")}, "split": "train", "type": "alpaca"}
    assert parse_config({"datasets": [split]}).datasets[0].path == str(data / "b.jsonl")
    (tmp_path / "conf").mkdir()
    yaml = tmp_path / "conf" / "c.yaml"
    yaml.write_text("datasets:\n  - path: json\n    data_files: [../data/a.jsonl]\n    type: alpaca\n")
    assert load_config(str(yaml)).datasets[0].path == str(tmp_path / "conf" / "../data/a.jsonl")
    with pytest.raises(
        ValueError, match=r"datasets.0: data_files: an Axolotl key lowprec does not support \(lowprec rea"
    ):
        parse_config({"datasets": [{"path": "org/name", "data_files": "a.jsonl"}]})  # the Hub: one prefix
    with pytest.raises(ValueError, match=r"path: json with data_files \['test'\] has no 'train' split; set split"):
        parse_config({"datasets": [{"path": "json", "data_files": {"test": "a.jsonl"}}]})


def test_defaults_that_are_not_axolotls_are_named_for_a_hugging_face_model(tmp_path):
    """A Hugging Face run whose config leaves out keys where lowprec's default is not Axolotl's
    resolves one setting naming each, with Axolotl's value; a config that sets them, or a
    built-in model (lowprec's own defaults are for those), resolves none."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowprec.train.resolve import resolve

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, num_key_value_heads=1, **shape)).save_pretrained(tmp_path / "m")
    model = {"base_model": str(tmp_path / "m"), "tokenizer": "byte"}
    said = resolve(parse_config({**model, "sequence_len": 64})).decisions["defaults"].value
    for part in (
        "val_set_size 0.03 (Axolotl: 0.0)",
        "micro_batch_size 8 (Axolotl: 1)",
        "adam_beta2 0.95",
        "save_total_limit 2 (Axolotl: 4)",  # Axolotl's trainer builder: save_total_limit or 4
        "warmup_steps 0 (Axolotl: 3% of the run's steps, at most 100)",  # Axolotl's warmup without either key
        "one per epoch",
    ):
        assert part in said, said
    assert "sequence_len" not in said  # set in the config
    axolotl = {"val_set_size": 0.0, "sequence_len": 512, "micro_batch_size": 1, "adam_beta2": 0.999}
    every = {**axolotl, "save_total_limit": 4, "saves_per_epoch": 1, "warmup_ratio": 0.03}
    assert "defaults" not in resolve(parse_config({**model, **every})).decisions
    # save_total_limit: null keeps every checkpoint here; Axolotl reads its null as 4
    said = resolve(parse_config({**model, **every, "save_total_limit": None})).decisions["defaults"].value
    assert said.startswith("save_total_limit null: every checkpoint kept (Axolotl: 4)"), said
    assert "defaults" not in resolve(parse_config({"base_model": "builtin:llama-tiny"})).decisions
