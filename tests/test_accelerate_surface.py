"""The Accelerate API surface added for Accelerate's own scripts and tests (issue 12): trackers,
automatic checkpoint naming, split_batches, scheduler stepping, process helpers, utils."""

from __future__ import annotations

import glob
import os
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lowprec import Accelerator, DataLoaderConfiguration, DistributedType, PartialState, ProjectConfiguration
from lowprec.utils import LoggerType, find_executable_batch_size, init_empty_weights, skip_first_batches


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("ACCELERATE_", "LOWPREC_")) or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(k)


def test_tensorboard_tracker_writes_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(cpu=True, log_with=LoggerType.TENSORBOARD, project_dir=str(tmp_path))
    acc.init_trackers("run", config={"lr": 0.1, "name": "x"})
    for step in range(3):
        acc.log({"loss": 1.0 / (step + 1)}, step=step)
    assert acc.get_tracker("tensorboard").name == "tensorboard"
    acc.end_training()
    files = glob.glob(str(tmp_path / "run" / "events.out.tfevents.*"))
    assert files
    ev = EventAccumulator(str(tmp_path / "run"))
    ev.Reload()
    assert [round(e.value, 4) for e in ev.Scalars("loss")] == [1.0, 0.5, 0.3333]


def test_unknown_or_dirless_tracker_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not a tracker"):
        Accelerator(cpu=True, log_with="tensorbored", project_dir=str(tmp_path))
    with pytest.raises(ValueError, match="requires a `logging_dir`"):
        Accelerator(cpu=True, log_with="tensorboard")


def test_automatic_checkpoint_naming_rotates(tmp_path):
    cfg = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=cfg)
    model = acc.prepare(torch.nn.Linear(2, 2))
    weights = []
    for _ in range(4):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights.append(model.weight.detach().clone())
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]
    assert acc.save_iteration == 4
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state()  # the newest
    torch.testing.assert_close(model.weight, weights[-1])


def test_a_resumed_run_keeps_saving_after_the_checkpoint_it_loaded(tmp_path):
    """A new Accelerator (a restarted script) that load_state()s the newest automatically named
    checkpoint saves the next one after it, and total_limit removes the oldest. Was: the next
    save_state refused ('checkpoint_0 already exists') unless the script set iteration itself."""
    cfg = dict(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    first = Accelerator(cpu=True, project_config=ProjectConfiguration(**cfg))
    model = first.prepare(torch.nn.Linear(2, 2))
    for _ in range(2):
        first.save_state()
    again = Accelerator(cpu=True, project_config=ProjectConfiguration(**cfg))
    again.prepare(torch.nn.Linear(2, 2))
    again.load_state()
    assert again.save_iteration == 2
    again.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    again.load_state(str(tmp_path / "checkpoints" / "checkpoint_1"))  # an older one: the counter stays
    assert again.save_iteration == 3 and model is first._models[0]


def test_save_iteration_counts_every_save_state(tmp_path):
    """Accelerate's ``save_iteration`` counts every ``save_state``, with or without automatic naming."""
    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(2, 2))
    for _ in range(2):
        acc.save_state(str(tmp_path / f"ckpt_{acc.save_iteration}"))
    assert acc.save_iteration == 2 and sorted(os.listdir(tmp_path)) == ["ckpt_0", "ckpt_1"]


def test_save_and_load_hooks_see_the_checkpoint_folder(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    seen = {}
    acc.register_save_state_pre_hook(lambda models, weights, d: open(os.path.join(d, "extra.txt"), "w").write("hi"))
    acc.register_load_state_pre_hook(lambda models, d: seen.update(text=open(os.path.join(d, "extra.txt")).read()))
    acc.save_state(str(tmp_path / "ck"))
    acc.load_state(str(tmp_path / "ck"))
    assert seen == {"text": "hi"} and model is acc._models[0]


def test_register_for_checkpointing_names_bad_items():
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="Item at index 1"):
        acc.register_for_checkpointing(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), torch.zeros(1))


def _split_worker(rank: int, world: int, port: int, out: str) -> None:
    import json

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=4))
    batches = [b[0].tolist() for b in dl]
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 - n / 10)
    acc2 = Accelerator(cpu=True)  # default: the scheduler steps once per process
    _, opt2, sched2 = acc2.prepare(model, opt, sched)
    opt2.step()
    sched2.step()
    with acc.split_between_processes(list(range(5))) as mine:
        part = mine
    json.dump(
        {
            "batches": batches,
            "len": len(dl),
            "lr": sched2.get_last_lr()[0],
            "part": part,
            "dtype": str(acc.distributed_type),
            "last": acc.is_last_process,
        },
        open(f"{out}/r{rank}.json", "w"),
    )
    torch.distributed.destroy_process_group()


def test_split_batches_and_scheduler_steps_on_two_processes(tmp_path):
    import json

    from torchrun_util import free_port, spawn_ranks

    def done():
        return all((tmp_path / f"r{i}.json").is_file() and (tmp_path / f"r{i}.json").stat().st_size for i in range(2))

    spawn_ranks(_split_worker, (2, free_port(), str(tmp_path)), 2, done, port_arg=1)
    r = [json.load(open(tmp_path / f"r{i}.json")) for i in range(2)]
    assert r[0]["batches"] == [[0, 1], [4, 5]] and r[1]["batches"] == [[2, 3], [6, 7]]
    assert r[0]["len"] == 2
    assert r[0]["lr"] == pytest.approx(0.8)  # one step per process, as Accelerate
    assert r[0]["part"] == [0, 1, 2] and r[1]["part"] == [3, 4]
    assert r[0]["dtype"] == "MULTI_CPU" and [x["last"] for x in r] == [False, True]


def test_split_batches_needs_divisible_batch():
    from lowprec.utils.data_loader import DataLoaderShard, GradientState

    with pytest.raises(ValueError, match="does not divide"):
        DataLoaderShard.wrap(
            DataLoader(TensorDataset(torch.arange(6)), batch_size=3),
            rank=0,
            world_size=2,
            device=None,
            seed=0,
            gradient_state=GradientState(),
            split_batches=True,
        )


def test_skip_first_batches_on_plain_loader_and_pickling():
    acc = Accelerator(cpu=True)
    dl = DataLoader(TensorDataset(torch.arange(6)), batch_size=2)
    prepared, skipped = acc.prepare(dl, skip_first_batches(dl, 1))
    assert isinstance(prepared, DataLoader) and prepared._is_accelerate_prepared
    assert [b[0].tolist() for b in skipped] == [[2, 3], [4, 5]] and len(skipped) == 2
    again = pickle.loads(pickle.dumps(acc))
    assert [b[0].tolist() for b in again._dataloaders[1]] == [[2, 3], [4, 5]]


def test_process_helpers_single_process(capsys):
    acc = Accelerator(cpu=True)
    calls = []

    @acc.on_main_process
    def main_only():
        calls.append("main")

    @acc.on_last_process
    def last_only():
        calls.append("last")

    main_only(), last_only()
    with acc.main_process_first(), acc.local_main_process_first():
        calls.append("block")
    assert calls == ["main", "last", "block"]
    assert not acc.check_trigger()
    acc.set_trigger()
    assert acc.check_trigger() and not acc.check_trigger()
    assert PartialState().distributed_type == DistributedType.NO == "NO"
    acc.gradient_accumulation_steps = 3
    from lowprec.state import GradientState

    assert GradientState().num_steps == 3


def test_accelerator_state_has_accelerates_process_control(capsys):
    """Accelerate's AcceleratorState has the process helpers too (its test_script.py calls
    ``state.wait_for_everyone()``); they were missing from lowprec's."""
    state = Accelerator(cpu=True).state
    state.wait_for_everyone()
    with state.main_process_first(), state.local_main_process_first():
        state.print("printed")
    with state.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    assert capsys.readouterr().out == "printed\n"


def test_split_between_processes_keeps_a_dataset_and_pads_with_the_inputs_last():
    from datasets import Dataset

    from lowprec.state.partial import split_between

    data = Dataset.from_list([{"k": v} for v in range(5)])
    with PartialState().split_between_processes(data) as part:  # one process: the input itself
        assert part is data
    shares = [split_between(data, i, 4, apply_padding=True) for i in range(4)]
    assert all(isinstance(p, Dataset) for p in shares)
    # Accelerate pads every short share with the input's last element
    assert [list(p["k"]) for p in shares] == [[0, 1], [2, 4], [3, 4], [4, 4]]
    assert [split_between(list(range(5)), i, 4, apply_padding=True) for i in range(4)] == [
        [0, 1],
        [2, 4],
        [3, 4],
        [4, 4],
    ]
    assert split_between(torch.arange(5), 1, 4, apply_padding=True).tolist() == [2, 4]
    assert list(split_between(data, 3, 4)["k"]) == [4]


def test_partial_state_reset_message():
    state = PartialState()
    assert state.num_processes == 1
    PartialState._reset_state()
    with pytest.raises(AttributeError, match="_reset_state"):
        state.num_processes  # noqa: B018 - the access itself must raise
    assert PartialState().num_processes == 1  # a new instance resolves again


def test_env_torch_device(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:3")
    assert str(Accelerator().device) == "cpu:3"


def test_find_executable_batch_size_shrinks_on_oom():
    tried = []

    @find_executable_batch_size(starting_batch_size=100)
    def run(batch_size):
        tried.append(batch_size)
        if batch_size > 80:
            raise RuntimeError("CUDA out of memory. Tried to allocate")
        return batch_size

    assert run() == 72 and tried == [100, 90, 81, 72]


def test_init_empty_weights_puts_params_on_meta():
    with init_empty_weights():
        m = torch.nn.Linear(4, 4)
    assert m.weight.is_meta and m.bias.is_meta


def test_init_empty_weights_buffers_take_torchs_keywords():
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", tensor=torch.ones(2), persistent=False)

    with init_empty_weights(include_buffers=True):
        m = WithBuffer()
    assert m.scale.is_meta and "scale" in m._non_persistent_buffers_set


def test_unwrap_keep_torch_compile():
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(torch.nn.DataParallel(model))
    assert acc.unwrap_model(compiled) is model
    assert acc.unwrap_model(compiled, keep_torch_compile=True)._orig_mod is model


def test_save_model_shards_with_format_metadata(tmp_path):
    from safetensors import safe_open

    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    acc.save_model(model, str(tmp_path), max_shard_size=300)
    assert (tmp_path / "model.safetensors.index.json").exists()
    shards = sorted(glob.glob(str(tmp_path / "model-*.safetensors")))
    assert len(shards) > 1
    with safe_open(shards[0], framework="pt") as f:
        assert f.metadata()["format"] == "pt"


class Conv1D(torch.nn.Module):
    """transformers.pytorch_utils.Conv1D's shape: weight stored (in, out), ``nf`` output features."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class LoraLinear(torch.nn.Module):
    """peft's lora.Linear layout: base_layer plus lora_A / lora_B ModuleDicts keyed by adapter name."""

    def __init__(self, d: int, r: int) -> None:
        super().__init__()
        self.base_layer = torch.nn.Linear(d, d)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(d, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, d, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def test_conversion_converts_conv1d_and_skips_lora_adapters():
    from lowprec.fp8 import Float8Conv1D, convert

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), Conv1D(64, 64), LoraLinear(64, 16), torch.nn.Linear(64, 64))
    report = convert(model)
    skipped = dict(report.skipped)
    assert "peft adapter" in skipped["2.lora_A.default"] and "peft adapter" in skipped["2.lora_B.default"]
    assert [name for name, _, _ in report.converted] == ["1", "2.base_layer"]
    assert isinstance(model[1], Float8Conv1D) and model[1].weight.shape == (64, 64)
    kept = report.to_dict()["kept_in_high_precision_by_type"]
    assert kept["peft adapter Linear"]["count"] == 2 and kept["Linear"]["count"] == 2  # first and last


def test_gpt2_conv1d_layers_convert():
    transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
    from lowprec.fp8 import convert

    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=16)
    report = convert(transformers.GPT2LMHeadModel(cfg))
    assert sorted(n for n, _, _ in report.converted) == [
        "transformer.h.0.attn.c_proj",
        "transformer.h.0.mlp.c_fc",
        "transformer.h.0.mlp.c_proj",
    ]
    assert dict(report.skipped)["transformer.h.0.attn.c_attn"] == "first Linear"  # the first GEMM, a Conv1D
    assert "Embedding x2 (lookups, not GEMMs)" in str(report)


def test_profile_writes_a_trace(tmp_path):
    from lowprec.utils import ProfileKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[ProfileKwargs(output_trace_dir=str(tmp_path), record_shapes=True)])
    with acc.profile() as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert any("mm" in e.key for e in prof.key_averages())
    assert (tmp_path / "trace_rank0.json").exists()


def test_a_scripts_own_kwargs_handler_gets_accelerates_to_kwargs_contract():
    import dataclasses

    from lowprec.utils import GradScalerKwargs, KwargsHandler

    @dataclasses.dataclass  # not frozen: the base is not a dataclass, as in Accelerate
    class Mock(KwargsHandler):
        a: int = 0
        c: float = 3.0

    assert Mock().to_kwargs() == {} and Mock(a=2).to_kwargs() == {"a": 2}
    # handlers that configure a library forward every field (defaults included) on purpose
    assert GradScalerKwargs(init_scale=1024.0).to_kwargs()["growth_interval"] == 2000


def test_dynamo_plugin_reads_accelerates_variables_and_prepare_compiles(monkeypatch):
    from lowprec.utils import TorchDynamoPlugin, clear_environment

    with clear_environment():
        os.environ["ACCELERATE_DYNAMO_BACKEND"] = "EAGER"
        os.environ["ACCELERATE_DYNAMO_MODE"] = "reduce-overhead"
        assert TorchDynamoPlugin().to_kwargs() == {"backend": "eager", "mode": "reduce-overhead"}
        # the names accelerate launch --dynamo_use_fullgraph / --dynamo_use_dynamic export
        os.environ["ACCELERATE_DYNAMO_USE_FULLGRAPH"] = "True"
        os.environ["ACCELERATE_DYNAMO_USE_DYNAMIC"] = "False"
        plugin = TorchDynamoPlugin()
        assert plugin.fullgraph is True and plugin.dynamic is False
    assert os.environ.get("ACCELERATE_DYNAMO_BACKEND") is None  # the environment came back
    model = torch.nn.Linear(4, 4)
    acc = Accelerator(cpu=True, dynamo_backend="eager")
    compiled = acc.prepare(model)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert acc.unwrap_model(compiled) is model
    assert compiled(torch.randn(2, 4)).shape == (2, 4)
    assert not isinstance(
        Accelerator(cpu=True).prepare(torch.nn.Linear(4, 4)), torch._dynamo.eval_frame.OptimizedModule
    )


def test_accelerate_115_settings_members_on_one_process():
    """Accelerate 1.15 members a script calls were AttributeErrors: the dataloader settings, the
    distributed read-outs, ``clear``, ``verify_device_map`` and ``join_uneven_inputs``."""
    cfg = DataLoaderConfiguration(even_batches=False, non_blocking=True, dispatch_batches=False)
    acc = Accelerator(cpu=True, dataloader_config=cfg)
    assert (acc.even_batches, acc.non_blocking, acc.dispatch_batches) == (False, True, False)
    assert not acc.use_seedable_sampler and not acc.use_stateful_dataloader
    assert not acc.is_fsdp2 and not acc.multi_device and acc.deepspeed_plugin is None and acc.should_save_model
    acc.even_batches = True
    assert cfg.even_batches
    model = torch.nn.Linear(2, 2)
    assert not acc.verify_device_map(model)
    model.hf_device_map = {"a": 0, "b": "cpu"}
    assert acc.verify_device_map(model)
    prepared = acc.prepare(model)
    with acc.join_uneven_inputs([prepared], even_batches=False):  # one process: nothing to join
        prepared(torch.ones(1, 2))
    assert acc.clear(prepared) == [None] and acc._models == []


def test_state_repr_is_accelerates_summary():
    """Accelerate's examples log ``accelerator.state``: a summary, not an object address."""
    acc = Accelerator(cpu=True, mixed_precision="fp8")
    text = repr(acc.state)
    assert text.startswith("Distributed environment: NO\nNum processes: 1\nProcess index: 0\n")
    assert "Device: cpu\n" in text and "Mixed precision type: fp8\n" in text and "FP8 backend: " in text
    assert repr(PartialState()).startswith("Distributed environment: NO\nNum processes: 1\n")


def test_get_logger_takes_accelerates_keywords(caplog, monkeypatch):
    """``from accelerate.logging import get_logger`` becomes ``from lowprec.logging import get_logger``."""
    import logging

    from lowprec.logging import get_logger

    monkeypatch.delenv("ACCELERATE_LOG_LEVEL", raising=False)
    PartialState._reset_state()
    logger = get_logger("lowprec_test_logger", log_level="INFO")
    with pytest.raises(RuntimeError, match="create the Accelerator"):
        logger.info("too early")
    Accelerator(cpu=True)
    with caplog.at_level(logging.INFO, logger="lowprec_test_logger"):
        logger.info("a %s", "b", main_process_only=False)
        logger.info("in order", in_order=True)
        logger.warning_once("once")
        logger.warning_once("once")
        logger.debug("hidden")
    records = [r for r in caplog.records if r.name == "lowprec_test_logger"]
    assert [r.getMessage() for r in records] == ["[RANK 0] a b", "[RANK 0] in order", "[RANK 0] once"]
    assert {r.filename for r in records[:2]} == {"test_accelerate_surface.py"}  # the caller's line


def test_accelerates_top_level_names_and_submodules():
    """``from accelerate import Accelerator, DistributedDataParallelKwargs`` (Accelerate's docs)
    and ``import accelerate; accelerate.utils.set_seed(0)`` work with the import switched."""
    import subprocess
    import sys

    code = (
        "import lowprec\n"
        "lowprec.utils.set_seed(0)\n"
        "assert lowprec.state.AcceleratorState and lowprec.logging.get_logger\n"
        "from lowprec import (AutocastKwargs, DeepSpeedPlugin, DistributedDataParallelKwargs,\n"
        "    FullyShardedDataParallelPlugin, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)\n"
        "from lowprec import utils\n"
        "assert DistributedDataParallelKwargs is utils.DistributedDataParallelKwargs\n"
        "assert ProfileKwargs is utils.ProfileKwargs and DeepSpeedPlugin is utils.DeepSpeedPlugin\n"
    )
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)  # a fresh interpreter: nothing imported yet
