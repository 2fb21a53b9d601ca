"""``transformers.Trainer`` on ``lowprec.Accelerator`` (``LowprecAcceleratorMixin``, issue 24):
FP8 asked for with a recipe (lowprec's or Accelerate's own ``TERecipeKwargs`` /
``MSAMPRecipeKwargs``) or by the launcher, never dropped by ``bf16=True``; 2 gloo processes with
DDP and FSDP2 (from ``TrainingArguments(fsdp=...)`` and from ``lowprec launch --use_fsdp``),
launched by torchrun and by ``lowprec launch``: each rank runs its Linear layers in FP8, the
losses follow the 1-process run's, and a run resumed from Trainer's checkpoint repeats the
uninterrupted run's losses exactly."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from unittest import mock

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
au = pytest.importorskip("accelerate.utils", reason="needs accelerate (dev extra)")

import lowprec  # noqa: E402
from lowprec.errors import UsageError  # noqa: E402
from lowprec.integrations.trainer_accelerator import LowprecAcceleratorMixin  # noqa: E402
from lowprec.integrations.transformers import FP8Callback, fp8_counts  # noqa: E402
from lowprec.utils import NativeRecipeKwargs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf", "trainer_accelerator_fp8.py")


class FP8Trainer(LowprecAcceleratorMixin, transformers.Trainer):
    pass


def _example():
    spec = importlib.util.spec_from_file_location("trainer_accelerator_fp8", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trainer(tmp_path, handlers=None, **kw):
    ex = _example()._trainer_fp8()
    args = transformers.TrainingArguments(
        str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        **kw,
    )
    return FP8Trainer(model=ex.tiny_llama(), args=args, train_dataset=ex.ByteWindows(), kwargs_handlers=handlers)


@pytest.fixture
def no_launch_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("ACCELERATE_", "LOWPREC_FP8", "FSDP_")):
            monkeypatch.delenv(k)
    return monkeypatch


def test_a_recipe_or_the_launcher_asks_fp8_and_bf16_true_does_not_drop_it(tmp_path, no_launch_env, caplog):
    """Trainer passes mixed_precision='bf16' when bf16=True, which would replace the FP8 asked for
    (with Accelerate's Accelerator too): the mixin keeps FP8 and says so once."""
    with caplog.at_level("INFO", logger="lowprec"):
        t = _trainer(tmp_path, [NativeRecipeKwargs(recipe="tensorwise")], bf16=True)
    assert t.accelerator.mixed_precision == "fp8"
    assert [
        r
        for r in caplog.records
        if "TrainingArguments(bf16=True) and a recipe in kwargs_handlers: FP8 runs" in r.getMessage()
    ]
    assert isinstance(t.callback_handler.callbacks[0], FP8Callback)  # added first, once
    assert sum(isinstance(c, FP8Callback) for c in t.callback_handler.callbacks) == 1
    no_launch_env.setenv("ACCELERATE_MIXED_PRECISION", "fp8")  # `lowprec launch --mixed_precision fp8`
    assert _trainer(tmp_path, bf16=True).accelerator.mixed_precision == "fp8"
    with pytest.raises(UsageError, match=r"^FP8 was asked for .*\(fp16=True\).*set bf16=True"):
        _trainer(tmp_path, fp16=True)
    no_launch_env.delenv("ACCELERATE_MIXED_PRECISION")
    plain = _trainer(tmp_path, bf16=True)  # nothing asked: Trainer's bf16, no FP8 callback
    assert plain.accelerator.mixed_precision == "bf16"
    assert not any(isinstance(c, FP8Callback) for c in plain.callback_handler.callbacks)


def _te(cls_name="TERecipeKwargs", **fields):
    """Accelerate's own TERecipeKwargs (or FP8RecipeKwargs): its class refuses to exist without
    TransformerEngine, which this machine lacks, so its availability check answers yes while it is built."""
    import accelerate.utils.dataclasses as ad

    with mock.patch.object(ad, "is_transformer_engine_available", lambda: True):
        return getattr(au, cls_name)(**fields)


@pytest.mark.parametrize(
    "make, expected",
    [
        (
            lambda: _te(
                fp8_format="E4M3",
                margin=2,
                interval=3,
                amax_history_len=16,
                amax_compute_algo="max",
                override_linear_precision=(False, False, True),
                use_autocast_during_eval=True,
            ),
            {
                "name": "delayed",
                "fp8_format": "E4M3",
                "margin": 2,
                "interval": 3,
                "amax_history_len": 16,
                "amax_compute_algo": "max",
                "override_linear_precision": [False, False, True],
                "use_during_eval": True,
            },
        ),
        (lambda: _te(use_mxfp8_block_scaling=True), {"name": "mxfp8"}),
        (lambda: au.MSAMPRecipeKwargs(opt_level="O1"), {"name": "delayed", "opt_level": "O1"}),
        (
            lambda: _te("FP8RecipeKwargs", backend="te", margin=1, amax_history_len=8),
            {"name": "delayed", "margin": 1, "amax_history_len": 8},
        ),
    ],
    ids=["te_every_field", "te_mxfp8_block_scaling", "msamp_o1", "deprecated_fp8_recipe_kwargs"],
)
def test_accelerates_te_and_msamp_recipe_kwargs_become_lowprec_recipes(make, expected, tmp_path, no_launch_env):
    """Accelerate's handler objects as they are, to lowprec's Accelerator and to Trainer through
    the mixin (``accelerator_config`` takes no handlers): every field reaches the recipe that runs
    (the native engine's, TransformerEngine and MS-AMP being absent: logged by the Accelerator)."""
    handler = make()
    direct = lowprec.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[handler]).fp8_backend_info
    trainer = _trainer(tmp_path, [handler], bf16=True)
    info = trainer.accelerator.fp8_backend_info
    got = {**info["recipe"], **({"opt_level": info["opt_level"]} if "opt_level" in info else {})}
    assert {k: got[k] for k in expected} == expected
    assert info["recipe"] == direct["recipe"] and info["backend"] == direct["backend"]


def test_a_trainer_run_with_accelerates_te_recipe_runs_fp8_gemms(tmp_path, no_launch_env):
    import lowprec.fp8.modules.linear_fn as fp8_linear

    trainer = _trainer(tmp_path, [_te(amax_history_len=4, margin=1)], bf16=True)
    real, calls = fp8_linear.scaled_mm, []
    with mock.patch.object(fp8_linear, "scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k)):
        trainer.train()
    counts = fp8_counts(trainer)
    assert counts["fp8_linear_calls"] > 0 and counts["hp_linear_calls"] == 0
    assert len(calls) == 3 * counts["fp8_linear_calls"]  # three FP8 GEMMs per Linear call
    layer = next(m for m in trainer.model.modules() if isinstance(m, lowprec.fp8.Float8Linear))
    assert layer.recipe.amax_history_len == 4 and layer.recipe.margin == 1


def test_what_accelerates_recipe_asks_and_the_engine_cannot_do_is_one_line(tmp_path, no_launch_env):
    with pytest.raises(ValueError, match=r"fp8_format='E5M2' needs TransformerEngine") as err:
        _trainer(tmp_path, [_te(fp8_format="E5M2")])
    assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match=r"^kwargs_handlers: Accelerate's TERecipeKwargs .*margin must be"):
        _trainer(tmp_path, [_te(margin=-1)])


def test_torchao_layers_train_and_the_added_callback_says_it_counts_only_lowprecs(tmp_path, no_launch_env, caplog):
    pytest.importorskip("torchao", reason="needs torchao")
    from lowprec.utils import has_ao_layers

    trainer = _trainer(tmp_path, [au.AORecipeKwargs()], bf16=True)
    with caplog.at_level("INFO", logger="lowprec"):
        trainer.train()
    assert has_ao_layers(trainer.model) and not lowprec.fp8.has_fp8_layers(trainer.model)
    assert [r for r in caplog.records if "FP8 layers are another library's" in r.getMessage()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The example on one process (global batch 4): the losses two processes of batch 2 follow."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("ACCELERATE_", "LOWPREC_FP8", "FSDP_"))}
    try:
        return _example().main(["--output_dir", str(tmp_path_factory.mktemp("one"))])
    finally:
        os.environ.update(saved)


# launcher, its flags, the example's flags
# (DDP under `lowprec launch`: the Trainer example's 2-process run in test_integrations_transformers.py;
# this example under `lowprec launch`: its FSDP row)
LAUNCHES = {
    # (FSDP from TrainingArguments with plain AdamW: the O2 row's path with its optimizer, and
    # the launcher's FSDP row's optimizer on its path)
    # MS-AMP's O2 (Accelerate's MSAMPRecipeKwargs, lowprec.optim without MS-AMP): FP8AdamW on the shards
    "fsdp_o2_from_training_args-torchrun": ("torchrun", [], ["--fsdp", "--opt_level", "O2"]),
    # Accelerate's own launcher: --multi_gpu is its torchrun path (on CPU its --cpu needs mpirun)
    "ddp-accelerate_launch": ("accelerate", ["--multi_gpu"], []),
    "fsdp_from_launcher-lowprec_launch": (
        "lowprec",
        ["--use_fsdp", "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"],
        [],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_two_processes_run_fp8_follow_one_process_and_resume_exactly(launch, one_process, tmp_path):
    from tests.torchrun_util import run_torchrun

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        LOWPREC_CONFIG_HOME=str(tmp_path / "no-config"),
        HF_HUB_OFFLINE="1",
    )
    launcher, launch_flags, script_flags = LAUNCHES[launch]
    script = [EXAMPLE, "--batch", "2", "--output_dir", str(tmp_path / "out"), *script_flags]
    if launcher == "torchrun":  # --master_port: run_torchrun puts a free one
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0"]
    elif launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_flags, "--num_processes", "2"]
        cmd += ["--main_process_port", "0"]
    else:
        cmd = [sys.executable, "-m", "lowprec.cli.main", "launch", "--cpu", "--num_processes", "2"]
        cmd += ["--main_process_port", "0", *launch_flags]
    cmd += script
    proc = run_torchrun(cmd, lambda p: '"world_size": 2' in p.stdout, env=env, timeout=300, cwd=ROOT)
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"recipe"')][-1])
    fsdp = launch.startswith("fsdp")
    assert r["sharded"] == fsdp and r["distributed_type"] == ("FSDP" if fsdp else "MULTI_CPU")
    # 6 steps x 13 converted Linears, each rank (MS-AMP's levels convert every Linear: 15, as msamp.initialize)
    layers = 15 if "--opt_level" in script_flags else 13
    assert r["fp8_linear_calls_per_rank"] == [6 * layers, 6 * layers]
    assert r["hp_linear_calls_per_rank"] == [0, 0]
    assert r["optimizer"] == ("FP8AdamW" if "--opt_level" in script_flags else "AdamW")
    # Trainer's own checkpoint (FSDP2: each rank's shards through lowprec's DCP functions)
    assert r["resume_steps"] == [4, 5, 6] and r["resume_max_abs_diff"] == 0.0
    assert r["unexpected_keys"] == [] and r["missing_keys"] == [] and r["weights_equal"]
    # same global batch and data order as one process; FP8 scales from half the batch per rank
    ref = {int(k): v for k, v in one_process["losses"].items()}
    got = {int(k): v for k, v in r["losses"].items()}
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    assert max(abs(got[s] - ref[s]) / ref[s] for s in ref) < 0.005  # measured: 0.013% DDP, 0.13% FSDP2
    assert got != ref  # two processes did run: their FP8 scales are their own
