"""Resume: a run killed with SIGKILL and resumed reproduces the uninterrupted run's losses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lowprec.train.checkpoints import latest_checkpoint, list_checkpoints, resolve_resume, rotate
from lowprec.train.config import load_config
from lowprec.train.metrics import read_metrics
from lowprec.train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
# delayed scaling: the FP8 amax history is state that must survive the restart too
RUN = {
    "max_steps": 10,
    "save_steps": 3,
    "save_total_limit": 2,
    "logging_steps": 1,
    "eval_steps": 5,
    "fp8_recipe": {"name": "delayed", "amax_history_len": 4},
    "use_tensorboard": False,
    "progress_bar": False,
}
# fp8_recipe with fp8: false is an error (issue 10 item 8): the fp32 runs leave it out
NO_FP8_RUN = {k: v for k, v in RUN.items() if k != "fp8_recipe"}


def _flags(d: dict) -> list[str]:
    import yaml

    out = []
    for k, v in d.items():
        out += [f"--{k}", yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()]
    return out


def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(tmp_path):
    ref = train(load_config(TINY, {**RUN, "output_dir": str(tmp_path / "ref")}))
    ref_losses = dict(ref.train_losses)
    assert len(ref_losses) == 10

    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lowprec.cli.main", "train", TINY, *_flags({**RUN, "output_dir": str(out)})]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 240
    try:
        while time.time() < deadline:  # kill as soon as step 7 is logged (checkpoint-6 exists)
            steps = [r["step"] for r in read_metrics(str(out), "train")]
            if steps and max(steps) >= 7:
                break
            if proc.poll() is not None:
                pytest.fail(f"the run ended (code {proc.returncode}) before it could be killed")
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    done = max(r["step"] for r in read_metrics(str(out), "train"))
    assert 7 <= done < 10, "killed too late to test anything"
    assert [s for s, _ in list_checkpoints(str(out))] == [3, 6]
    assert not (out / "model.safetensors").exists()

    resumed = train(load_config(TINY, {**RUN, "output_dir": str(out), "resume_from_checkpoint": "auto"}))
    assert resumed.steps == 10
    recs = read_metrics(str(out), "train")
    assert [r["step"] for r in recs] == list(range(1, 11))  # steps after the checkpoint logged once
    for r in recs:  # bit-for-bit on CPU: weights, Adam state, schedule, data position, FP8 history
        assert r["loss"] == ref_losses[r["step"]], r["step"]
    assert [r["step"] for r in read_metrics(str(out), "eval")] == [5, 10]
    assert resumed.final_eval_loss == ref.final_eval_loss


def test_resume_from_an_explicit_checkpoint_path(tmp_path):
    cfg = {**NO_FP8_RUN, "max_steps": 6, "eval_steps": None, "fp8": False, "output_dir": str(tmp_path / "a")}
    full = train(load_config(TINY, cfg))
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert ckpt.is_dir()
    again = train(load_config(TINY, {**cfg, "output_dir": str(tmp_path / "b"), "resume_from_checkpoint": str(ckpt)}))
    # the new run starts at step 3 (its own metrics cover steps 4..6) and ends where the first did
    assert [s for s, _ in again.train_losses] == [4, 5, 6]
    assert dict(again.train_losses) == {s: loss for s, loss in full.train_losses if s > 3}


def test_resuming_a_finished_run_reports_its_final_losses(tmp_path):
    """A run whose last checkpoint is its final step (killed while exporting, then run again with
    resume_from_checkpoint: auto) trains nothing more; its result and summary.json still give the
    final validation loss metrics.jsonl holds, not None ("validation loss n/a")."""
    import json

    cfg = {**NO_FP8_RUN, "fp8": False, "max_steps": 4, "save_steps": 2, "eval_steps": 2, "output_dir": str(tmp_path)}
    ref = train(load_config(TINY, cfg))
    assert ref.final_eval_loss is not None and [s for s, _ in list_checkpoints(str(tmp_path))] == [2, 4]
    again = train(load_config(TINY, {**cfg, "resume_from_checkpoint": "auto"}))
    assert again.steps == 4
    assert again.final_eval_loss == ref.final_eval_loss
    assert again.final_train_loss == ref.final_train_loss
    assert json.loads((tmp_path / "summary.json").read_text())["final_eval_loss"] == ref.final_eval_loss


def test_a_save_killed_mid_write_leaves_nothing_behind_for_the_next_run(tmp_path, caplog):
    """SIGKILL during save_state leaves checkpoint-N.tmp-<host>-<pid> (a partial copy, as large as
    a checkpoint), or checkpoint-N.old-... (the last complete one, moved aside) with no
    checkpoint-N. They were cleaned only by a later save of that same step: a fresh run, or a
    resumed one that never saved it again, kept them for good, and resume_from_checkpoint: auto
    did not see the moved-aside checkpoint. The next run restores and removes them first."""
    import logging
    import shutil

    from lowprec.durable import temp_suffix

    cfg = {**NO_FP8_RUN, "fp8": False, "max_steps": 6, "save_steps": 3, "eval_steps": None, "output_dir": str(tmp_path)}
    train(load_config(TINY, cfg))
    dead = temp_suffix()  # this process's own name: never the owner of a save in progress
    os.replace(tmp_path / "checkpoint-6", tmp_path / f"checkpoint-6.old-{dead}")  # killed between the renames
    shutil.copytree(tmp_path / "checkpoint-3", tmp_path / f"checkpoint-9.tmp-{dead}")  # killed mid-write
    with caplog.at_level(logging.INFO, logger="lowprec"):
        train(load_config(TINY, {**cfg, "resume_from_checkpoint": "auto"}))
    assert any(
        "resume = " in r.getMessage() and r.getMessage().split("(")[0].endswith("checkpoint-6 ") for r in caplog.records
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-3",
        "checkpoint-6",
    ]
    shutil.copytree(tmp_path / "checkpoint-3", tmp_path / f"checkpoint-12.tmp-{dead}")
    train(load_config(TINY, {**cfg, "max_steps": 2, "save_steps": None}))  # a fresh run that saves nothing
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")]


def test_resume_rules(tmp_path):
    assert resolve_resume(None, str(tmp_path))[0] is None
    path, why = resolve_resume("auto", str(tmp_path))
    assert path is None and "fresh run" in why
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        resolve_resume(str(tmp_path / "nope"), str(tmp_path))
    for step in (2, 10, 4):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "lowprec_state.json").write_text("{}")
    (tmp_path / "checkpoint-12.tmp-99").mkdir()  # an interrupted save is never picked
    (tmp_path / "checkpoint-11").mkdir()  # nor a directory without the state file
    assert latest_checkpoint(str(tmp_path)).endswith("checkpoint-10")
    assert resolve_resume("auto", str(tmp_path))[0].endswith("checkpoint-10")
    removed = rotate(str(tmp_path), 2)
    assert [os.path.basename(p) for p in removed] == ["checkpoint-2"]
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [4, 10]


def test_a_fresh_run_removes_an_earlier_runs_checkpoints(tmp_path):
    cfg = {**NO_FP8_RUN, "fp8": False, "eval_steps": None, "output_dir": str(tmp_path)}
    train(load_config(TINY, {**cfg, "max_steps": 7}))
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [6, 7]  # the final step is checkpointed too
    train(load_config(TINY, {**cfg, "max_steps": 5}))  # fresh: its own checkpoints 3 and 5 only
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [3, 5]
    assert [r["step"] for r in read_metrics(str(tmp_path), "train")] == [1, 2, 3, 4, 5]


def test_tensorboard_shows_one_value_per_step_after_a_fresh_run_and_a_resume(tmp_path):
    """runs/ keeps every events file: an earlier run's (a fresh run over it) and the steps an
    interrupted run logged past its checkpoint (resumed) would be drawn beside this run's."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = {**NO_FP8_RUN, "fp8": False, "eval_steps": None, "output_dir": str(tmp_path), "use_tensorboard": True}
    train(load_config(TINY, {**cfg, "max_steps": 4}))

    def ctrl_c_at_4(record):
        if record["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # fresh (another seed), interrupted after step 4: checkpoint-3
        train(load_config(TINY, {**cfg, "max_steps": 5, "seed": 3}), on_log=ctrl_c_at_4)
    train(load_config(TINY, {**cfg, "max_steps": 5, "seed": 3, "resume_from_checkpoint": "auto"}))
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    drawn = [(e.step, round(e.value, 5)) for e in events.Scalars("train/loss")]
    assert drawn == [(r["step"], round(r["loss"], 5)) for r in read_metrics(str(tmp_path), "train")]
    assert [step for step, _ in drawn] == [1, 2, 3, 4, 5]


# the CLI, killed by a real SIGKILL right after writing checkpoint-<KILL_AFTER> when that is set
_CLI = """
import os, signal, sys
from lowprec.train import loop
real = loop.Loop.eval_and_save
def eval_and_save(self):
    real(self)
    if str(self.run.state.step) == os.environ.get("KILL_AFTER"):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally
loop.Loop.eval_and_save = eval_and_save
from lowprec.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
_TIMING = ("tokens_per_s", "peak_mem_mb")  # wall-clock and allocator figures: not reproducible


def _cli(cfg: dict, kill_after: str = "") -> int:
    # every run of the comparison in a fresh process started the same way (an in-process run
    # can round differently from a CLI process; here only the resume is under test)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "KILL_AFTER": kill_after}
    cmd = [sys.executable, "-c", _CLI, "train", TINY, *_flags(cfg), "--quiet"]
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=300).returncode


def _rows(out) -> list[dict]:
    import json

    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k not in _TIMING} for r in recs if r["kind"] in ("train", "eval", "fp8", "skip")
    ]


def test_sigkill_mid_logging_window_then_resume_logs_the_uninterrupted_rows(tmp_path):
    """logging_steps 10, a checkpoint every 5 steps, SIGKILL right after checkpoint-15: the
    resumed run's metrics.jsonl rows equal the uninterrupted run's, loss values bit for bit
    (the window's loss sum, step and token counts travel in the checkpoint)."""
    # fp32: what is under test is the logging window (FP8 state is covered above); identical
    # delayed-scaling launches were seen to round differently from process to process
    run = {**NO_FP8_RUN, "fp8": False, "max_steps": 20, "save_steps": 5, "logging_steps": 10, "eval_steps": 10}
    assert _cli({**run, "output_dir": str(tmp_path / "ref")}) == 0
    ref = _rows(tmp_path / "ref")
    assert [r["step"] for r in ref if r["kind"] == "train"] == [10, 20]

    out = tmp_path / "killed"
    assert _cli({**run, "output_dir": str(out)}, kill_after="15") == -signal.SIGKILL
    assert [s for s, _ in list_checkpoints(str(out))] == [10, 15]
    assert [r["step"] for r in _rows(out) if r["kind"] == "train"] == [10]

    assert _cli({**run, "output_dir": str(out), "resume_from_checkpoint": "auto"}) == 0
    assert _rows(out) == ref
