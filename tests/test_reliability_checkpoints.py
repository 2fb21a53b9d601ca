"""Reliability table 1: tampered checkpoints execute nothing.

Every file a checkpoint holds (both serialisations, the trainer's and a plain Accelerator's,
the file names of earlier versions too) is replaced by ``torch.save({"p": Evil()})`` whose
``__reduce__`` runs ``touch MARKER``. Loading must fail with one line naming the file, and the
marker must never appear. Rows: ``<source>-<serialisation>-<file>``.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from lowprec import Accelerator
from lowprec.errors import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
EXECUTED: list[str] = []  # rows whose marker appeared (reported in the log; must stay empty)


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tamper(path: str, marker: str) -> None:
    if os.path.exists(path):
        os.remove(path)
    torch.save({"p": Evil(marker)}, path)


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n, "history": (1, 2.5, None), "by_id": {3: torch.arange(3)}}

    def load_state_dict(self, state):
        self.n = state["n"]


def _accelerator_run(mp: str):
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision=mp)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    data = torch.utils.data.DataLoader(torch.randn(16, 16), batch_size=4)
    counter = Counter()
    model, opt, sched, data = acc.prepare(model, opt, sched, data)
    acc.register_for_checkpointing(counter)
    for x in data:
        with acc.accumulate(model):
            acc.backward(model(x).float().pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
    return acc


@pytest.fixture(scope="module")
def accelerator_checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("acc")
    out = {}
    for safe in (True, False):
        acc = _accelerator_run("fp16")  # fp16: the scaler's file is there too
        out[safe] = acc.save_state(str(base / f"safe{safe}"), safe_serialization=safe)
    return out


ACC_FILES = {
    True: [
        "model_0.safetensors",
        "optimizer_0.safetensors",
        "scheduler_0.safetensors",
        "scaler.safetensors",
        "custom_checkpoint_0.safetensors",
        "random_states_0.safetensors",
        "dataloader_0.json",
        "lowprec_state.json",
    ],
    False: ["pytorch_model_0.bin", "optimizer_0.bin"],
}
# earlier versions' names: the new file removed, an old-named pickle put beside it
LEGACY = ["scheduler_0.bin", "scaler.pt", "custom_checkpoint_0.pkl", "random_states_0.pkl"]


def test_every_file_kind_is_in_the_table(accelerator_checkpoints):
    for safe, path in accelerator_checkpoints.items():
        written = set(os.listdir(path))
        expected = set(ACC_FILES[True]) - ({"model_0.safetensors", "optimizer_0.safetensors"} if not safe else set())
        assert expected | set(ACC_FILES[False] if not safe else []) == written


@pytest.mark.parametrize(
    "safe, name",
    [(True, n) for n in ACC_FILES[True]]
    + [(False, n) for n in ACC_FILES[False]]
    + [(True, f"legacy:{n}") for n in LEGACY],
    ids=lambda v: str(v) if not isinstance(v, bool) else ("safetensors" if v else "pickle"),
)
def test_accelerator_load_state_executes_nothing(accelerator_checkpoints, tmp_path, safe, name):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(accelerator_checkpoints[safe], ckpt)
    marker = tmp_path / "MARKER"
    if name.startswith("legacy:"):
        old = name.split(":", 1)[1]
        stem = os.path.splitext(old)[0]
        os.remove(ckpt / f"{stem}.safetensors")
        target = ckpt / old
    else:
        target = ckpt / name
    _tamper(str(target), str(marker))
    acc = _accelerator_run("fp16")
    with pytest.raises(CheckpointError) as info:
        acc.load_state(str(ckpt))
    if marker.exists():
        EXECUTED.append(f"accelerator-{name}")
    assert not marker.exists(), f"{name}: the tampered file ran its code"
    message = str(info.value)
    assert "\n" not in message and os.path.basename(str(target)) in message


def test_old_pickled_checkpoints_still_load(accelerator_checkpoints, tmp_path):
    """A checkpoint of an earlier version (pickled RNG states with numpy arrays, scheduler,
    scaler and custom state) loads through the restricted unpickler, values intact."""
    from lowprec.checkpoint.serialization import load_object

    ckpt = tmp_path / "old"
    shutil.copytree(accelerator_checkpoints[True], ckpt)
    for old in LEGACY:
        stem = os.path.splitext(old)[0]
        state = load_object(str(ckpt / f"{stem}.safetensors"))
        if stem.startswith("random_states"):
            import numpy as np

            np.random.seed(3)
            state["numpy"] = np.random.get_state()
        os.remove(ckpt / f"{stem}.safetensors")
        torch.save(state, str(ckpt / old))
    acc = _accelerator_run("fp16")
    acc.load_state(str(ckpt))
    import numpy as np

    np.random.seed(3)
    expected = np.random.rand()
    acc.load_state(str(ckpt))
    assert np.random.rand() == expected
    assert acc._custom_objects[0].n == 0 and acc.scaler.get_scale() > 0


def test_a_state_that_needs_pickle_is_refused_when_saving(tmp_path):
    class Opaque:
        def state_dict(self):
            return {"f": lambda: 1}

        def load_state_dict(self, state):
            pass

    acc = Accelerator()
    acc.register_for_checkpointing(Opaque())
    with pytest.raises(CheckpointError, match=r"registered object 0 \(Opaque\).*function"):
        acc.save_state(str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory):
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train

    out = tmp_path_factory.mktemp("run")
    cfg = load_config(
        TINY,
        {
            "max_steps": 2,
            "save_steps": 2,
            "eval_steps": None,
            "val_set_size": 0.0,
            "fp8_recipe": "delayed",
            "output_dir": str(out),
            "use_tensorboard": False,
        },
    )
    train(cfg)
    return str(out / "checkpoint-2")


TRAINER_FILES = [
    "model_0.safetensors",
    "optimizer_0.safetensors",
    "scheduler_0.safetensors",
    "custom_checkpoint_0.safetensors",
    "custom_checkpoint_1.safetensors",
    "random_states_0.safetensors",
    "lowprec_state.json",
]


def test_trainer_checkpoint_files_are_all_in_the_table(trainer_checkpoint):
    assert set(os.listdir(trainer_checkpoint)) == set(TRAINER_FILES)


@pytest.mark.parametrize("name", TRAINER_FILES + [f"legacy:{n}" for n in LEGACY if "scaler" not in n])
def test_trainer_resume_auto_executes_nothing(trainer_checkpoint, tmp_path, capsys, name):
    from lowprec.cli.main import main

    out = tmp_path / "run"
    shutil.copytree(trainer_checkpoint, out / "checkpoint-2")
    marker = tmp_path / "MARKER"
    if name.startswith("legacy:"):
        old = name.split(":", 1)[1]
        os.remove(out / "checkpoint-2" / f"{os.path.splitext(old)[0]}.safetensors")
        target = out / "checkpoint-2" / old
    else:
        target = out / "checkpoint-2" / name
    _tamper(str(target), str(marker))
    rc = main(
        [
            "train",
            TINY,
            "--max_steps",
            "3",
            "--save_steps",
            "2",
            "--eval_steps",
            "null",
            "--fp8_recipe",
            "delayed",
            "--val_set_size",
            "0",
            "--output_dir",
            str(out),
            "--resume_from_checkpoint",
            "auto",
            "--use_tensorboard",
            "false",
            "--quiet",
        ]
    )
    if marker.exists():
        EXECUTED.append(f"trainer-{name}")
    assert not marker.exists(), f"{name}: the tampered file ran its code"
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("lowprec: error: ") and os.path.basename(str(target)) in err[-1], err
    assert not any("Traceback" in line for line in err)


# ----------------------------------------------------------------------------- DeepSpeed's own files
@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_deepspeed_files_are_scanned_before_deepspeed_unpickles_them(tmp_path, name):
    """DeepSpeed loads with ``weights_only=False``; the scan (opcodes only) must refuse a file
    naming any global outside torch's safe set and DeepSpeed's own data classes, and accept
    what DeepSpeed writes. (A full ZeRO-2 save, tamper and load_state was run by hand: see
    docs/LOG.md, rel entry.)"""
    from lowprec.checkpoint.serialization import check_deepspeed_dir

    state = tmp_path / "deepspeed_0" / "state"
    state.mkdir(parents=True)
    (tmp_path / "deepspeed_0" / "latest").write_text("state")
    (tmp_path / "deepspeed_0" / "zero_to_fp32.py").write_text("print('helper DeepSpeed copies; never loaded')\n")
    good = {"module": {"w": torch.zeros(2)}, "ds_version": "0.19", "lr": [1e-3], "ok": (1, None)}
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        good["zero_stage"] = ZeroStageEnum(2)
    except ImportError:
        pass
    torch.save(good, str(state / name))
    check_deepspeed_dir(str(tmp_path / "deepspeed_0"))
    marker = tmp_path / "MARKER"
    _tamper(str(state / name), str(marker))
    with pytest.raises(CheckpointError, match=rf"{name}.*posix.system"):
        check_deepspeed_dir(str(tmp_path / "deepspeed_0"))
    assert not marker.exists()


def test_a_well_formed_file_of_another_model_is_one_line(accelerator_checkpoints, tmp_path):
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(accelerator_checkpoints[True], ckpt)
    save_file({"other.weight": torch.zeros(3, 3)}, str(ckpt / "model_0.safetensors"))
    acc = _accelerator_run("fp16")
    with pytest.raises(CheckpointError, match=r"model_0.safetensors does not fit this run") as info:
        acc.load_state(str(ckpt))
    assert "\n" not in str(info.value)
