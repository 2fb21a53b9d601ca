"""lowprec.Accelerator takes Hugging Face Accelerate's own objects (the real accelerate 1.15
classes, installed by the dev extra): each kwargs handler and plugin becomes lowprec's, or is
refused with one line naming the field; ``GradientState`` has the attributes Trainer reads; and
``transformers.Trainer`` runs on lowprec's Accelerator through ``LowprecAcceleratorMixin``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch

au = pytest.importorskip("accelerate.utils", reason="needs accelerate (dev extra)")

import lowprec  # noqa: E402
from lowprec import kwargs as K  # noqa: E402
from lowprec.accelerate_objects import from_accelerate  # noqa: E402
from lowprec.errors import UsageError  # noqa: E402
from lowprec.parallelism_config import ParallelismConfig  # noqa: E402
from lowprec.utils import dataclasses as D  # noqa: E402


def fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def test_trainers_objects_configure_the_accelerator():
    """What transformers.Trainer passes (non-default values, so a dropped field would show)."""
    acc = lowprec.Accelerator(
        cpu=True,
        kwargs_handlers=[
            au.DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=7),
            au.GradScalerKwargs(init_scale=1024.0),
            au.AutocastKwargs(cache_enabled=False),
            au.InitProcessGroupKwargs(),
            au.ProfileKwargs(record_shapes=True),
        ],
        gradient_accumulation_plugin=au.GradientAccumulationPlugin(num_steps=3, sync_each_batch=True),
        dataloader_config=au.DataLoaderConfiguration(even_batches=False, data_seed=7),
        project_config=au.ProjectConfiguration(project_dir="proj", total_limit=2),
        dynamo_plugin=au.TorchDynamoPlugin(backend="no", mode="max-autotune"),
    )
    h = acc.handlers
    assert fields(h[K.DistributedDataParallelKwargs])["find_unused_parameters"] is True
    assert h[K.DistributedDataParallelKwargs].bucket_cap_mb == 7
    assert h[K.GradScalerKwargs].init_scale == 1024.0
    assert h[K.AutocastKwargs].cache_enabled is False
    # Accelerate's declared default backend ("nccl") means "the default", as its to_kwargs() says
    assert h[K.InitProcessGroupKwargs].backend is None
    assert h[D.ProfileKwargs].record_shapes is True
    assert acc.gradient_accumulation_steps == 3 and acc.accumulation.sync_each_batch is True
    # Trainer reads GradientState.plugin_kwargs (Accelerate's: the plugin's non-default fields)
    assert acc.gradient_state.plugin_kwargs == {"num_steps": 3, "sync_each_batch": True}
    assert isinstance(acc.dataloader_config, D.DataLoaderConfiguration)
    assert (acc.dataloader_config.even_batches, acc.dataloader_config.data_seed) == (False, 7)
    assert acc.project_configuration.total_limit == 2
    assert isinstance(acc.dynamo_plugin, D.TorchDynamoPlugin) and acc.dynamo_plugin.mode == "max-autotune"
    assert not acc.dynamo_plugin.enabled


def test_plugins_and_recipes_convert_field_by_field():
    fsdp = from_accelerate(
        au.FullyShardedDataParallelPlugin(
            fsdp_version=2,
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            reshard_after_forward=False,
            cpu_offload=True,
            state_dict_type="FULL_STATE_DICT",
        ),
        "fsdp_plugin",
    )
    assert isinstance(fsdp, K.FullyShardedDataParallelPlugin)
    assert (fsdp.transformer_cls_names_to_wrap, fsdp.auto_wrap_policy) == (
        ("LlamaDecoderLayer",),
        "TRANSFORMER_BASED_WRAP",
    )
    assert (fsdp.reshard_after_forward, fsdp.offload_params, fsdp.state_dict_type) == (False, True, "FULL_STATE_DICT")
    # transformers' Trainer names a policy, which Accelerate's plugin turns into torch's function
    trainers = from_accelerate(
        au.FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap="LlamaDecoderLayer"
        ),
        "fsdp_plugin",
    )
    assert (trainers.auto_wrap_policy, trainers.transformer_cls_names_to_wrap) == (
        "TRANSFORMER_BASED_WRAP",
        ("LlamaDecoderLayer",),
    )
    sized = from_accelerate(
        au.FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=7),
        "fsdp_plugin",
    )
    assert (sized.auto_wrap_policy, sized.min_num_params) == ("SIZE_BASED_WRAP", 7)
    ds = from_accelerate(au.DeepSpeedPlugin(zero_stage=3, gradient_clipping=0.5, offload_optimizer_device="cpu"), "ds")
    assert isinstance(ds, K.DeepSpeedPlugin)
    assert (ds.zero_stage, ds.gradient_clipping, ds.offload_optimizer_device) == (3, 0.5, "cpu")
    assert ds.hf_ds_config["zero_optimization"]["stage"] == 3  # HfDeepSpeedConfig -> its dict
    ao = from_accelerate(au.AORecipeKwargs(pad_inner_dim=False), "kwargs_handlers")
    assert isinstance(ao, K.AORecipeKwargs) and ao.pad_inner_dim is False and ao.config is not None
    from accelerate import ParallelismConfig as AccParallelismConfig

    pc = from_accelerate(AccParallelismConfig(tp_size=2), "parallelism_config")
    assert isinstance(pc, ParallelismConfig) and pc.tp_size == 2
    # an Accelerate recipe selects the backend as lowprec's own would
    acc = lowprec.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[au.AORecipeKwargs()])
    assert acc.fp8_backend_info["backend"] in ("torchao", "native")
    assert isinstance(acc.handlers["recipe"], K.AORecipeKwargs)
    with mock.patch.object(lowprec.accelerator, "autocast_context", wraps=lowprec.accelerator.autocast_context) as ctx:
        with acc.autocast(au.AutocastKwargs(enabled=False)):
            pass
    assert isinstance(ctx.call_args.args[2], K.AutocastKwargs) and ctx.call_args.args[2].enabled is False


@pytest.mark.parametrize(
    "make, where, names",
    [
        (lambda: au.TorchDynamoPlugin(use_regional_compilation=True), "dynamo_plugin", "use_regional_compilation=True"),
        (
            lambda: au.FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True),
            "fsdp_plugin",
            "activation_checkpointing=True",
        ),
        (
            lambda: au.DeepSpeedPlugin(zero_stage=3, transformer_moe_cls_names="MixtralSparseMoeBlock"),
            "deepspeed_plugin",
            "transformer_moe_cls_names='MixtralSparseMoeBlock'",
        ),
        (lambda: au.MegatronLMPlugin(), "megatron_lm_plugin", "MegatronLMPlugin has no lowprec equivalent"),
        (
            lambda: au.FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=lambda *a, **k: True),
            "fsdp_plugin",
            "auto_wrap_policy=<function",
        ),
    ],
)
def test_what_has_no_equivalent_is_refused_in_one_line(make, where, names):
    with pytest.raises(UsageError) as err:
        from_accelerate(make(), where)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{where}: Accelerate's ") and names in msg


def test_accelerates_ddp_communication_hook_becomes_lowprecs():
    theirs = au.DistributedDataParallelKwargs(
        comm_hook=au.DDPCommunicationHookType.POWER_SGD,
        comm_wrapper=au.DDPCommunicationHookType.FP16,
        comm_state_option={"matrix_approximation_rank": 2},
    )
    ours = from_accelerate(theirs, "kwargs_handlers")
    assert isinstance(ours, K.DistributedDataParallelKwargs)
    assert (ours.comm_hook, ours.comm_wrapper) == (
        K.DDPCommunicationHookType.POWER_SGD,
        K.DDPCommunicationHookType.FP16,
    )
    assert ours.comm_state_option == {"matrix_approximation_rank": 2}


def test_the_accelerator_refuses_rather_than_drops():
    with pytest.raises(UsageError, match=r"^dynamo_plugin: .*use_regional_compilation=True"):
        lowprec.Accelerator(cpu=True, dynamo_plugin=au.TorchDynamoPlugin(use_regional_compilation=True))


def test_accelerates_objects_convert_under_the_kwarg_handlers_spelling_too():
    """Accelerate's FP8 guide spells the argument ``kwarg_handlers``; its objects convert there as
    under ``kwargs_handlers`` (before: a TypeError saying lowprec's classes are needed)."""
    acc = lowprec.Accelerator(cpu=True, mixed_precision="fp8", kwarg_handlers=[au.AutocastKwargs(cache_enabled=False)])
    assert acc.handlers[K.AutocastKwargs].cache_enabled is False
    acc = lowprec.Accelerator(cpu=True, kwarg_handlers=[au.DistributedDataParallelKwargs(comm_hook="fp16")])
    assert acc.handlers[K.DistributedDataParallelKwargs].comm_hook == K.DDPCommunicationHookType.FP16


def _tiny_llama(transformers):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_transformers_trainer_runs_on_lowprecs_accelerator_in_fp8(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
    from torch.utils.data import Dataset

    import lowprec.fp8.modules.linear_fn as fp8_linear
    from lowprec.integrations.trainer_accelerator import LowprecAcceleratorMixin

    class FP8Trainer(LowprecAcceleratorMixin, transformers.Trainer):
        pass

    class Data(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")  # Trainer's own way to ask for a precision
    model = _tiny_llama(transformers)
    args = transformers.TrainingArguments(
        str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = FP8Trainer(model=model, args=args, train_dataset=Data())
    assert isinstance(trainer.accelerator, lowprec.Accelerator) and trainer.accelerator.mixed_precision == "fp8"
    import transformers.trainer as hf_trainer

    assert hf_trainer.Accelerator is not lowprec.Accelerator  # the switch lasts one method call
    real = fp8_linear.scaled_mm
    calls = []
    with mock.patch.object(fp8_linear, "scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k)):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert len(calls) > 0  # FP8 GEMMs ran inside Trainer's loop


def test_trainer_on_lowprecs_accelerator_resumes_mid_epoch_as_the_uninterrupted_run(tmp_path, monkeypatch):
    """Trainer resumes mid-epoch through Accelerate's skip_first_batches; on lowprec's loader the
    mixin routes it to lowprec's, so the resumed run sees the same batches and losses (FP8). The
    control: Accelerate's function on lowprec's loader gave another order (losses off by 0.02-0.15)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
    from torch.utils.data import Dataset

    from lowprec.integrations.trainer_accelerator import LowprecAcceleratorMixin

    seen: list = []

    class FP8Trainer(LowprecAcceleratorMixin, transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append(inputs["input_ids"][:, 0].tolist())
            return super().compute_loss(model, inputs, *args, **kwargs)

    class Data(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = (torch.arange(16) + i) % 256
            return {"input_ids": ids, "labels": ids}

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")

    def run(resume=None):
        args = transformers.TrainingArguments(
            str(tmp_path),
            max_steps=6,
            per_device_train_batch_size=4,
            logging_steps=1,
            save_strategy="steps",
            save_steps=3,
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            learning_rate=1e-2,
        )
        trainer = FP8Trainer(model=_tiny_llama(transformers), args=args, train_dataset=Data())
        seen.clear()
        trainer.train(resume_from_checkpoint=resume)
        return list(seen), {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    batches, losses = run()
    resumed_batches, resumed = run(str(tmp_path / "checkpoint-3"))
    assert resumed_batches == batches[3:]
    assert [resumed[k] for k in (4, 5, 6)] == [losses[k] for k in (4, 5, 6)]
    import transformers.trainer as hf_trainer
    from accelerate import skip_first_batches

    assert hf_trainer.skip_first_batches is skip_first_batches  # the switch lasts one train() call


@pytest.mark.parametrize("autocast", [False, True])
def test_unwrap_undoes_accelerates_forward_wrappers_so_the_model_pickles(autocast):
    """Accelerate's convention: ``_original_forward`` kept, ``forward`` wrapped by
    ``convert_outputs_to_fp32`` (over ``torch.autocast``); keep_fp32_wrapper=False undoes it."""
    import pickle

    from accelerate.utils import convert_outputs_to_fp32

    from lowprec.utils import extract_model_from_parallel

    model = torch.nn.Linear(4, 4)
    model._original_forward = model.forward
    forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward) if autocast else model.forward
    model.forward = convert_outputs_to_fp32(forward)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(model)
    model = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in vars(model) and "_original_forward" not in vars(model)
    assert pickle.loads(pickle.dumps(model))(torch.ones(1, 4)).dtype == torch.float32


def _shuffled_loader(generator: bool):
    from torch.utils.data import DataLoader

    return DataLoader(
        list(range(20)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3) if generator else None
    )


def _epochs(loader, n: int = 2) -> list:
    return [[b.tolist() for b in loader] for _ in range(n)]


def test_prepared_loader_with_a_generator_shuffles_as_accelerate_and_resumes_the_same_order():
    import accelerate

    torch.manual_seed(0)
    theirs = _epochs(accelerate.Accelerator(cpu=True).prepare(_shuffled_loader(True)))
    torch.manual_seed(0)
    acc = lowprec.Accelerator(cpu=True)
    ours = acc.prepare(_shuffled_loader(True))
    assert _epochs(ours) == theirs and theirs[0] != theirs[1]
    # mid-epoch state: a fresh loader (its generator elsewhere) replays the rest of the same epoch
    it = iter(ours)
    seen = [next(it).tolist() for _ in range(2)]
    state = ours.state_dict()
    rest = [b.tolist() for b in it]
    fresh = acc.prepare(_shuffled_loader(True))
    next(iter(fresh))  # moves its generator on
    fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == rest and seen + rest != theirs[0]


def test_save_state_mid_epoch_with_a_generator_resumes_the_same_order(tmp_path):
    acc = lowprec.Accelerator(cpu=True)
    loader = acc.prepare(_shuffled_loader(True))
    it = iter(loader)
    next(it)
    acc.save_state(str(tmp_path / "ckpt"))  # the loader's position is written as JSON
    rest = [b.tolist() for b in it]
    acc2 = lowprec.Accelerator(cpu=True)
    again = acc2.prepare(_shuffled_loader(True))
    acc2.load_state(str(tmp_path / "ckpt"))
    assert [b.tolist() for b in again] == rest


def test_save_state_between_epochs_with_a_generator_resumes_the_next_epochs_order(tmp_path):
    acc = lowprec.Accelerator(cpu=True)
    loader = acc.prepare(_shuffled_loader(True))
    first = [b.tolist() for b in loader]
    acc.save_state(str(tmp_path / "ckpt"))  # the most common checkpoint: at the end of an epoch
    later = _epochs(loader)
    acc2 = lowprec.Accelerator(cpu=True)
    again = acc2.prepare(_shuffled_loader(True))  # freshly seeded: would replay the first epoch
    acc2.load_state(str(tmp_path / "ckpt"))
    assert _epochs(again) == later and later[0] != first


def test_prepared_loader_without_a_generator_says_once_how_it_shuffles(caplog, monkeypatch):
    from lowprec import logs

    monkeypatch.setattr(logs, "_LOGGED", set())
    with caplog.at_level("INFO", logger="lowprec"):
        torch.manual_seed(0)
        first = _epochs(lowprec.Accelerator(cpu=True).prepare(_shuffled_loader(False)))
        torch.manual_seed(0)
        again = _epochs(lowprec.Accelerator(cpu=True).prepare(_shuffled_loader(False)))
    lines = [r.getMessage() for r in caplog.records if "without generator=" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert again == first and first[0] != first[1]  # seed + epoch: reproducible, new order each epoch


WORKER = """
import json, os, sys, torch
from torch.utils.data import DataLoader
import lowprec
rank = int(os.environ["RANK"])
acc = lowprec.Accelerator(cpu=True)
# each process seeds its generator differently: process 0's order must win on both (Accelerate's rule)
dl = DataLoader(list(range(20)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3 if rank == 0 else 99))
out = [[b.tolist() for b in acc.prepare(dl)] for _ in range(2)]
json.dump(out, open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
"""


def test_two_processes_shard_process_zeros_generator_order(tmp_path):
    import json
    import os

    from torchrun_util import run_ranks

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(Path(lowprec.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    run_ranks(str(script), [str(tmp_path)], 2, env, lambda: (tmp_path / "rank1.json").exists())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    single = _epochs(lowprec.Accelerator(cpu=True).prepare(_shuffled_loader(True)))  # Accelerate's order (above)
    for epoch in range(2):
        assert ranks[0][epoch] == single[epoch][0::2]
        assert ranks[1][epoch][:2] == single[epoch][1::2]
