"""The FP8 guard through ``lowprec train`` on the tiny run: act records its moves (and moves back)
and a resume keeps them bit for bit; ``lowprec report`` draws and tabulates them; the outlier
reproducer (benchmarks/fp8_guard_repro.py) flags and moves only the injected layer. The guard's
pieces and signals: test_fp8_guard.py."""

from __future__ import annotations

import base64
import io
import os
from html.parser import HTMLParser

import torch

from lowprec.cli.main import main
from lowprec.train.config import load_config
from lowprec.train.metrics import read_metrics
from lowprec.train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")


# every layer whose input max-to-rms exceeds 4 is unhealthy: on the tiny run this moves some
# layers and not others, early, deterministically
ACT = {
    "fp8_guard": "act",
    "fp8_guard_patience": 2,
    "fp8_guard_thresholds": {"max_to_rms": 4.0},
    "fp8_health_sqnr_every": 3,
    "save_steps": 4,
    "eval_steps": None,
    "val_set_size": 0.0,
    "use_tensorboard": False,
}


def test_act_run_records_moves_and_resume_keeps_them_bit_exactly(tmp_path):
    ref = train(load_config(TINY, {**ACT, "output_dir": str(tmp_path / "ref")}))
    out = ref.output_dir
    moves = read_metrics(out, "fp8_guard")
    assert moves and all(r["moved"] and r["signal"] == "input.max_to_rms" and r["value"] > 4.0 for r in moves)
    assert len({r["layer"] for r in moves}) == len(moves) < 27  # each layer once; not every layer
    health = read_metrics(out, "fp8_health")
    assert [r["step"] for r in health] == list(range(1, 9))
    sampled = [r["step"] for r in health if any(v["sqnr_db"] is not None for v in r["layers"].values())]
    assert sampled == [1, 4, 7]  # fp8_health_sqnr_every: 3
    report = open(os.path.join(out, "fp8_conversion.txt")).read()
    assert f"fp8_guard: {len(moves)} layer(s) moved to high precision (bf16)" in report
    assert all(f"step {r['step']}: {r['layer']}" in report for r in moves)
    assert os.path.isfile(ref.files["fp8_report"])  # drawn with the moves (plots.py)
    _check_report(out, moves)
    # resume from step 4 (some moves before it, maybe some after): the same run, bit for bit
    first = [r for r in moves if r["step"] <= 4]
    assert first, moves
    res_dir = tmp_path / "res"
    import shutil

    shutil.copytree(os.path.join(out, "checkpoint-4"), res_dir / "checkpoint-4")
    res = train(load_config(TINY, {**ACT, "output_dir": str(res_dir), "resume_from_checkpoint": "auto"}))
    assert dict(res.train_losses) == {s: v for s, v in ref.train_losses if s > 4}
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(out, "model.safetensors")), load_file(str(res_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r for r in read_metrics(str(res_dir), "fp8_guard")] == [r for r in moves if r["step"] > 4]
    assert all(f"step {r['step']}: {r['layer']}" in open(res_dir / "fp8_conversion.txt").read() for r in moves)


def test_act_run_moves_layers_back_and_a_resume_after_a_move_back_is_bit_exact(tmp_path):
    """fp8_guard_recover_after: 1 on the tiny run (max-to-rms threshold 4, as above): some moved
    layer's input calms down, it moves back; records, conversion report and health report show
    it; a run resumed from the first checkpoint after the move back continues bit for bit (a
    layer in the wrong precision would change the losses)."""
    import shutil

    from safetensors.torch import load_file

    cfg = {**ACT, "fp8_guard_recover_after": 1, "save_steps": 2}
    ref = train(load_config(TINY, {**cfg, "output_dir": str(tmp_path / "ref")}))
    out = ref.output_dir
    events = read_metrics(out, "fp8_guard")
    backs = [r for r in events if r.get("direction") == "to_fp8"]
    assert backs and all(r["moved"] and r["checks"] == 1 for r in backs)
    for b in backs:  # each undoes an earlier move of its layer, with that move's signal
        move = [r for r in events if r["layer"] == b["layer"] and r["step"] < b["step"] and "direction" not in r][-1]
        assert (move["signal"], move["value"]) == (b["signal"], b["value"])
    report = open(os.path.join(out, "fp8_conversion.txt")).read()
    assert f", {len(backs)} moved back to FP8 (" in report
    assert all(f"step {b['step']}: {b['layer']}  moved back to FP8 after 1 healthy checks" in report for b in backs)
    assert main(["report", out, "--layers", "3"]) == 0
    page = _Page()
    page.feed(open(os.path.join(out, "health_report.html")).read())
    cells = {r[1]: r[5] for r in page.rows if r}
    assert all(f"step {b['step']}: moved back to FP8" in cells[b["layer"]] for b in backs)
    at = backs[0]["step"] + backs[0]["step"] % 2  # the first checkpoint (every 2 steps) holding the move back
    assert at < 8, backs
    res_dir = tmp_path / "res"
    shutil.copytree(os.path.join(out, f"checkpoint-{at}"), res_dir / f"checkpoint-{at}")
    res = train(load_config(TINY, {**cfg, "output_dir": str(res_dir), "resume_from_checkpoint": "auto"}))
    assert dict(res.train_losses) == {s: v for s, v in ref.train_losses if s > at}
    a, b = load_file(os.path.join(out, "model.safetensors")), load_file(str(res_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_metrics(str(res_dir), "fp8_guard") == [r for r in events if r["step"] > at]


class _Page(HTMLParser):
    """Collects the table's rows and the images; a tag left open or closed twice is an error."""

    VOID = {"meta", "img", "br", "link"}

    def __init__(self):
        super().__init__()
        self.stack, self.rows, self.imgs, self.cell = [], [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs))
        if tag == "tr":
            self.rows.append([])
        if tag == "td":
            self.cell = ""
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, (tag, self.stack)
        if tag == "td":
            self.rows[-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def _check_report(out, moves):
    """lowprec report: a valid self-contained page (no browser here: parsed, and its image
    decoded), the guard's layers first with their moves, the PNG next to it."""
    assert main(["report", out, "--layers", "3"]) == 0
    page = _Page()
    page.feed(open(os.path.join(out, "health_report.html")).read())
    page.close()
    assert page.stack == []  # every tag closed
    (img,) = page.imgs
    assert img["src"].startswith("data:image/png;base64,")  # self-contained: nothing to fetch
    from PIL import Image

    png = Image.open(io.BytesIO(base64.b64decode(img["src"].split(",", 1)[1])))
    assert png.format == "PNG" and png.size[1] > 400
    body = [r for r in page.rows if r]
    assert len(body) == 27  # every FP8 layer of llama-tiny, once
    first = [r[1] for r in body[: len(moves)]]
    assert first == [m["layer"] for m in moves]  # the moved layers head the table, in order
    assert all(f"step {m['step']}: moved to bf16" in r[5] for m, r in zip(moves, body))
    assert os.path.isfile(os.path.join(out, "health_report.png"))


def test_report_without_health_records_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 3.0}\n')
    assert main(["report", str(tmp_path)]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [
        f"lowprec: error: {tmp_path}: metrics.jsonl has no fp8_health records; train with fp8_health: true "
        "(or fp8_guard: warn | act) to record them"
    ]


def _repro(tmp_path, *args: str) -> dict:
    """benchmarks/fp8_guard_repro.py with ``args`` (1 thread); its JSON's runs."""
    import json
    import subprocess
    import sys

    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "fp8_guard_repro.py"), *args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.load(open(out))["runs"]


REPRO_LAYER = "model.layers.1.mlp.down_proj"


def test_reproducer_flags_and_moves_only_the_injected_layer(tmp_path):
    """benchmarks/fp8_guard_repro.py in a few steps (its numbers come from 200: docs/LOG.md, branch health):
    the outlier grows to 2^30 by step 4, so warn and act fire on its layer and no other."""
    runs = _repro(tmp_path, "--steps", "8", "--check", "2", "--variants", "warn,act", "--bits", "30", "--patience", "2")
    assert runs["act"]["1"]["moved"] == [REPRO_LAYER] and runs["act"]["1"]["moved_back"] == []
    assert [e["layer"] for e in runs["warn"]["1"]["events"]] == [REPRO_LAYER] and not runs["warn"]["1"]["moved"]


def test_reproducer_moves_the_layer_back_once_the_outlier_fades(tmp_path):
    """The outlier grows to 2^30 over 6 steps, holds, and from step 7.2 shrinks back to nothing
    by step 13.2 (``--fade``): act moves its layer at step 4 (checks every 2 steps, patience 2);
    the side casts see input underflow above 2% until step 10 and below it from step 12, so with
    M = 2 the layer moves back at step 14 and the rest of the run is FP8 again."""
    args = ["--steps", "24", "--check", "2", "--variants", "act", "--bits", "30", "--patience", "2"]
    run = _repro(tmp_path, *args, "--grow", "0.25", "--fade", "0.3", "--recover-after", "2")["act"]["1"]
    assert run["moved"] == [REPRO_LAYER] and run["moved_back"] == [[REPRO_LAYER, 14]]
    side = {h["step"]: h for h in run["health"] if h["side_cast"]}
    assert sorted(side) == [6, 8, 10, 12, 14]  # measured on the side while moved, not after
    assert side[10]["input_underflow"] > 0.02 > side[12]["input_underflow"]
