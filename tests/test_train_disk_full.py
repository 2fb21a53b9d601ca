"""A full disk or a read-only directory mid-run (issue 28 item 6): one line naming the path and
the last good checkpoint, exit 74, no traceback, the earlier checkpoint intact and resumable; and
checkpoints are fsynced (files and directories before the rename, the parent after).

The failure is injected in-process (we run as root, so chmod cannot make a directory read-only,
and no small file system can be mounted here): the checkpoint writer raises what safetensors
raises on ENOSPC, or the metrics writer what Python raises."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

from lowprec.errors import EXIT_STORAGE
from lowprec.train.checkpoints import list_checkpoints
from lowprec.train.metrics import MetricsWriter, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
FLAGS = ["--save_steps", "2", "--eval_steps", "null", "--val_set_size", "0", "--use_tensorboard", "false", "--quiet"]


def _train(out, *flags: str) -> int:
    from lowprec.cli.main import main

    return main(["train", TINY, *FLAGS, *flags, "--output_dir", str(out)])


def test_a_full_disk_while_saving_a_checkpoint_keeps_the_last_good_one(tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    import lowprec.checkpoint.state as checkpoint

    out = tmp_path / "run"
    real = checkpoint.save_tensors

    def full_at_step_4(sd, path, safe):
        if "checkpoint-4.tmp-" in path:  # as safetensors' Rust writer reports ENOSPC
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(sd, path, safe)

    monkeypatch.setattr(checkpoint, "save_tensors", full_at_step_4)
    rc = _train(out, "--max_steps", "6")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_STORAGE == 74, err
    assert len(err) == 1 and not any("Traceback" in x for x in err), err
    assert err[0].startswith(
        f"lowprec: stopped: stopped at step 4: cannot write checkpoint {out}/checkpoint-4 (No space left on device); it "
        f"was not saved and the checkpoints before it are untouched; last good checkpoint: {out}/checkpoint-2; "
        "to continue: lowprec train "
    ), err[0]
    # no half-written checkpoint-4 (nor its temporary), no export, checkpoint-2 whole
    assert [p for p in os.listdir(out) if p.startswith("checkpoint")] == ["checkpoint-2"]
    assert not (out / "model.safetensors").exists()
    failed = {r["step"]: r["loss"] for r in read_metrics(str(out), "train")}

    monkeypatch.setattr(checkpoint, "save_tensors", real)  # space again: the kept checkpoint resumes
    assert _train(out, "--max_steps", "4", "--resume_from_checkpoint", "auto") == 0
    resumed = read_metrics(str(out), "train")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[2]["loss"] == failed[3]  # bit for bit: the checkpoint was whole
    assert [s for s, _ in list_checkpoints(str(out))] == [2, 4]


def test_a_failed_metrics_write_is_one_line_naming_the_directory(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real = MetricsWriter.write

    def full_at_step_3(self, record):
        if record["step"] == 3:  # Python's own write: an OSError without a file name (at flush)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, record)

    monkeypatch.setattr(MetricsWriter, "write", full_at_step_3)
    rc = _train(out, "--max_steps", "4")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 74 and len(err) == 1, err
    assert err[0].startswith(
        f"lowprec: stopped: stopped at step 3: cannot write {out} (No space left on device); free "
        f"space or make the directory writable, then resume; last good checkpoint: {out}/checkpoint-2"
    ), err[0]


def test_save_state_fsyncs_files_and_directories_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    from lowprec import Accelerator

    acc = Accelerator()
    model = acc.prepare(nn.Linear(4, 4))
    opt = acc.prepare(torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    target = tmp_path / "ckpt"
    real, seen = os.fsync, []

    def record(fd):
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), target.exists()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    acc.save_state(str(target))
    files = sorted(os.listdir(target))
    assert "model_0.safetensors" in files and "optimizer_0.safetensors" in files
    tmp = [p for p, _ in seen if ".tmp-" in p]
    tmp_dir = next(p for p in tmp if os.path.basename(p).startswith("ckpt.tmp-"))
    # every file, under its temporary name, before the target existed
    assert sorted(os.path.basename(p) for p in tmp if p != tmp_dir) == files
    assert all(not existed for p, existed in seen if ".tmp-" in p)
    # the parent after the rename (the rename is its entry), and after the checkpoint's own
    parent = [i for i, (p, existed) in enumerate(seen) if p == str(tmp_path) and existed]
    assert parent and parent[-1] > max(i for i, (p, _) in enumerate(seen) if p == tmp_dir)


@pytest.mark.parametrize(
    "exc,expected",
    [
        (OSError(errno.EROFS, "Read-only file system"), (errno.EROFS, "/x")),
        (OSError(errno.ENOSPC, "No space left on device", "/x/y"), (errno.ENOSPC, "/x/y")),
        (RuntimeError("unexpected pos 576 vs 534 (os error 28)"), None),  # not safetensors': not claimed
    ],
)
def test_os_error_of(exc, expected):
    from lowprec.durable import os_error_of

    got = os_error_of(exc, "/x")
    assert (None if got is None else (got.errno, got.filename)) == expected
