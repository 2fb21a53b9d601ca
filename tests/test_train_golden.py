"""The quickstart's per-step loss curve on CPU against the checked-in golden curve.

Regenerate (only for an intended numerics change): tests/golden/make_quickstart_golden.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "quickstart_loss.json")
sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))

from make_quickstart_golden import CONFIG, OVERRIDES, run_curve  # noqa: E402

# CPU runs are bit-for-bit reproducible here (1 or 2 threads give identical curves); the
# tolerance only absorbs a different CPU's matmul rounding, far below what a bug moves.
RTOL = 2e-3


def test_quickstart_golden_loss_curve(tmp_path):
    from lowprec.train.config import load_config
    from lowprec.train.data import corpus_fingerprint

    golden = json.load(open(GOLDEN))
    assert golden["overrides"] == OVERRIDES, "the golden file was made with other overrides: regenerate it"
    here = corpus_fingerprint(load_config(CONFIG).dataset_max_bytes)
    if here != golden["corpus_fingerprint"]:
        pytest.skip(
            f"corpus fingerprint differs: golden curve trained on {golden['corpus_fingerprint']} "
            f"(Python {golden['python']}), this machine's stdlib corpus is {here}; the losses cannot "
            "match on different text. Regenerate with tests/golden/make_quickstart_golden.py to compare here"
        )
    got = run_curve(str(tmp_path))
    assert len(got["losses"]) == len(golden["losses"]) == 16
    assert got["losses"][-1] < got["losses"][0] - 1.5  # the curve itself shows learning
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], golden["losses"]))
    assert worst <= RTOL, (
        f"quickstart loss curve moved: max relative difference {worst:.2e} > {RTOL:.0e}\n"
        f"got    {[round(x, 5) for x in got['losses']]}\ngolden {[round(x, 5) for x in golden['losses']]}"
    )
    assert got["final_eval_loss"] == pytest.approx(golden["final_eval_loss"], rel=RTOL)
