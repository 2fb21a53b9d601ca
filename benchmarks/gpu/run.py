"""The GPU command: check and measure everything GPU-only in one run, each part under its own
time budget, into one folder named after the GPU.

    bash benchmarks/gpu/run.sh "$OUT"              # on the GPU machine (README.md beside this file)
    bash benchmarks/gpu/run.sh /tmp/out --dry-run  # the rehearsal: every part, tiny, on CPU (CI)

Parts, in order (a part's budget is its hard timeout: its process group is killed there, and
what it wrote so far is kept; the next part starts either way):

=========  ======  ===================================================================
setup        30 s  carried wheels (pydantic, torchao) + lowprec, offline (setup_env.py)
gpu_tests   130 s  ``pytest -m gpu`` over every test file that has gpu tests, JUnit XML
moe          60 s  one grouped expert projection fwd+bwd per recipe beside bf16 (moe_part.py)
linear      105 s  Float8Linear fwd+bwd at the Llama-3-8B shapes + estimates (linear_part.py)
cast         30 s  fused casts' GB/s against a measured copy (benchmarks/cast.py)
train       110 s  4 Llama-3-8B layers, one variant at a time (train_part.py)
=========  ======  ===================================================================

``compile_diag.py`` (a compiled Float8Linear taken apart against eager, which found the zero
gradients of runs 4-5) left the plan once run 7 showed compiled equal to eager: it runs alone.

The predicted total is the sum of the budgets plus the driver's own start-up: the real run
cannot take longer than that, and it must stay under 8 minutes (the driver refuses a plan that
does not, exit 2). Output (at most 8 files: what the run tool brings back):
``<gpu>/{setup,gpu_tests,moe,linear,cast,train}.json`` (``gpu_tests.json`` holds the JUnit XML), ``summary.json``,
``summary.md``; each part's JSON holds its status, wall time, budget, the tail of its log and
its result. Compile and Triton caches go to /tmp, not to the output folder.

In ``--dry-run`` a part's timeout is ``DRY_RUN_TIMEOUT_S`` instead of its budget (a guard
against hangs: a CPU's durations say nothing about the GPU's), and every measuring part runs with ``pydantic`` made unimportable
(``child.py``): they must not need what the GPU image lacks. Nothing here imports torch: the
driver survives any part's crash and still writes the summary.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summary import junit_counts, render  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "gpu"
LIMIT_S = 480  # the issue: under 8 minutes on an H100
DRIVER_OVERHEAD_S = 10  # probing the device, writing the summary
BLOCK_IN_REHEARSAL = "pydantic"
DRY_RUN_TIMEOUT_S = 600


@dataclass
class Part:
    name: str
    budget_s: int
    what: str
    argv: list[str] = field(default_factory=list)  # filled in by plan()


PARTS = [
    Part("setup", 30, "carried wheels + lowprec, offline"),
    Part("gpu_tests", 130, "pytest -m gpu, JUnit XML (kept inside gpu_tests.json)"),
    Part("moe", 60, "one grouped expert projection fwd+bwd per recipe beside bf16, the kernels that ran"),
    Part("linear", 105, "Float8Linear fwd+bwd, Llama-3-8B shapes, eager then compiled, with estimates"),
    Part("cast", 30, "fused casts' GB/s against a measured copy"),
    Part("train", 110, "4 Llama-3-8B layers: tokens/s, peak memory, loss"),
]


def predicted_total_s(parts: list[Part]) -> int:
    return sum(p.budget_s for p in parts) + DRIVER_OVERHEAD_S


def gpu_test_files() -> list[str]:
    """Every test file with a test marked gpu (pytest is given files, not the folder: collecting
    the whole suite would import packages the GPU image lacks)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in p.read_text(encoding="utf-8")
    )


def plan(parts: list[Part], out: Path, dry: bool, wheels: Path, site: Path) -> None:
    dr = ["--dry-run"] if dry else []
    child = [sys.executable, str(HERE / "child.py")]
    for p in parts:
        result = str(out / f"{p.name}.part.json")
        if p.name == "setup":
            p.argv = [
                *child,
                str(HERE / "setup_env.py"),
                "--wheels",
                str(wheels),
                "--site",
                str(site),
                "--out",
                result,
                *dr,
            ]
        elif p.name == "gpu_tests":
            p.argv = [
                *child,
                "-m",
                "pytest",
                "-m",
                "gpu",
                *gpu_test_files(),
                "-q",
                "-p",
                "no:cacheprovider",
                "-rfEs",
                f"--junitxml={out / 'gpu_tests.junit.xml'}",
                "-n",
                "0" if dry else "4",
            ]
        elif p.name == "moe":
            p.argv = [*child, str(HERE / "moe_part.py"), "--out", result, *dr]
        elif p.name == "linear":
            p.argv = [*child, str(HERE / "linear_part.py"), "--out", result, *dr]
        elif p.name == "cast":
            p.argv = [*child, str(ROOT / "benchmarks" / "cast.py"), "--out", result]
            p.argv += ["--tiny", "--modes", "eager", "--iters", "2", "--warmup", "1"] if dry else []
        elif p.name == "train":
            p.argv = [*child, str(HERE / "train_part.py"), "--out", result, *dr]


def probe_device(dry: bool) -> dict:
    """The GPU's name and capability, asked of a child process (the driver imports no torch)."""
    if dry:
        return {"name": "cpu-dry-run", "torch": _torch_version()}
    # a real run imports torch in a child: a broken CUDA set-up is reported, not raised
    code = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'name': torch.cuda.get_device_name() "
        "if c else 'no-cuda', 'capability': list(torch.cuda.get_device_capability()) if c else None, "
        "'torch': torch.__version__, 'cuda': torch.version.cuda}))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return (
        json.loads(res.stdout.strip().splitlines()[-1])
        if res.returncode == 0
        else {"name": "unknown", "error": res.stderr[-500:]}
    )


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown"


def run_part(p: Part, env: dict, timeout_s: float | None = None) -> dict:
    """Run one part under its budget (or ``timeout_s``); its output is streamed (prefixed) and its tail kept."""
    timeout_s = p.budget_s if timeout_s is None else timeout_s
    print(f"\n=== {p.name} (budget {p.budget_s} s, timeout {timeout_s} s): {p.what}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        p.argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )  # its own group: a timeout kills compile workers too
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            print(f"[{p.name}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    status = None
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        status, rc = "timeout", None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    reader.join(timeout=10)
    wall = round(time.monotonic() - t0, 1)
    status = status or ("ok" if rc == 0 else "failed")
    print(f"=== {p.name}: {status} in {wall} s", flush=True)
    return {
        "part": p.name,
        "status": status,
        "rc": rc,
        "wall_s": wall,
        "budget_s": p.budget_s,
        "timeout_s": timeout_s,
        "what": p.what,
        "command": shlex.join(p.argv[2:]),
        "log_tail": "".join(lines)[-6000:],
    }


def collect(p: Part, rec: dict, out: Path) -> dict:
    """Fold the part's own JSON (or its JUnit file) into its record, and write ``<part>.json``."""
    raw = out / f"{p.name}.part.json"
    if raw.exists():
        try:
            rec["result"] = json.loads(raw.read_text())
        except json.JSONDecodeError as e:  # killed mid-write cannot happen (atomic), but say so if it does
            rec["result_error"] = str(e)
        raw.unlink()
    junit = out / "gpu_tests.junit.xml"
    if p.name == "gpu_tests" and junit.exists():
        rec["result"] = junit_counts(junit)
        # the report travels inside gpu_tests.json: the run tool brings back 8 files at most
        rec["junit_xml"] = junit.read_text(encoding="utf-8", errors="replace")
        junit.unlink()
        if rec["status"] == "failed" and rec["result"]["failures"] + rec["result"]["errors"]:
            rec["note"] = f"{rec['result']['failures'] + rec['result']['errors']} test(s) failed"
    for tmp in out.glob("*.tmp"):  # a part killed between writing and renaming: only 8 files come back
        tmp.unlink()
    res = rec.get("result") or {}
    if rec["status"] == "timeout" and res:
        rec["note"] = "stopped at its budget; the results written so far are kept"
    if p.name == "setup" and res.get("steps", {}).get("wheels", {}).get("status") == "skipped":
        rec["status"] = "skipped" if res.get("dry_run") else rec["status"]
        rec["note"] = res["steps"]["wheels"]["reason"]
    elif p.name == "setup" and res.get("steps", {}).get("import_check", {}).get("status") == "skipped":
        rec["note"] = "import check skipped: " + res["steps"]["import_check"]["reason"]
    (out / f"{p.name}.json").write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="output folder (on the GPU machine: $OUT); a subfolder named after the GPU is made")
    ap.add_argument("--dry-run", action="store_true", help="the CPU rehearsal: every part on tiny shapes")
    ap.add_argument(
        "--parts", default=",".join(p.name for p in PARTS), help="comma-separated subset, in the plan's order"
    )
    ap.add_argument("--wheels", default=str(HERE / "wheels"))
    a = ap.parse_args(argv)
    wanted = [w.strip() for w in a.parts.split(",") if w.strip()]
    unknown = sorted(set(wanted) - {p.name for p in PARTS})
    if unknown:
        print(f"error: --parts: unknown part(s) {unknown}; choose from {[p.name for p in PARTS]}", file=sys.stderr)
        return 2
    parts = [p for p in PARTS if p.name in wanted]
    total = predicted_total_s(PARTS)
    print(
        f"predicted total of the real run: {total} s ({total / 60:.1f} min; limit {LIMIT_S} s): "
        + ", ".join(f"{p.name} {p.budget_s} s" for p in PARTS)
        + f", driver {DRIVER_OVERHEAD_S} s",
        flush=True,
    )
    if total >= LIMIT_S:
        print(
            f"error: the parts' budgets add up to {total} s, over the {LIMIT_S} s limit: lower a budget in {__file__}",
            file=sys.stderr,
        )
        return 2
    t0 = time.monotonic()
    device = probe_device(a.dry_run)
    if not a.dry_run and not device.get("capability"):
        # the real run installs lowprec into this Python (pip install -e): never on a machine without a GPU
        print(
            f"error: no CUDA device here ({device.get('name')}: {device.get('error', '')[-300:]}); "
            "on a CPU machine run the rehearsal: bash benchmarks/gpu/run.sh OUT --dry-run",
            file=sys.stderr,
        )
        return 2
    out = Path(a.out) / slug(device["name"])
    out.mkdir(parents=True, exist_ok=True)
    # a rehearsal keeps its installs under its own output folder: two at once (the test suite's
    # workers) must not share a site folder; the real run's $OUT carries results only
    cache = Path(a.out) / "rehearsal-cache" if a.dry_run else Path(tempfile.gettempdir()) / "lowprec-gpu-run"
    site = cache / "site"
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        TRITON_CACHE_DIR=str(cache / "triton"),
    )
    paths = [str(ROOT / "src"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if a.dry_run:
        env.update(OMP_NUM_THREADS="1", LOWPREC_TEST_THREADS="1")
    plan(parts, out, a.dry_run, Path(a.wheels), site)
    records = {}
    for p in parts:
        # the wheels' folder goes first on the path once the set-up installed them (real run only:
        # the rehearsal's site holds CPython 3.12 binaries)
        part_env = dict(
            env, PYTHONPATH=os.pathsep.join(([str(site)] if site.is_dir() and not a.dry_run else []) + paths)
        )
        if a.dry_run and p.name != "setup":
            part_env["LOWPREC_GPU_BLOCK_IMPORTS"] = BLOCK_IN_REHEARSAL
        records[p.name] = collect(p, run_part(p, part_env, DRY_RUN_TIMEOUT_S if a.dry_run else p.budget_s), out)
    summary = {
        "device": device.get("name"),
        "capability": device.get("capability"),
        "torch": device.get("torch"),
        "cuda": device.get("cuda"),
        "dry_run": a.dry_run,
        "command": shlex.join(["bash", "benchmarks/gpu/run.sh", *(argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "predicted_total_s": total,
        "limit_s": LIMIT_S,
        "budgets_s": {p.name: p.budget_s for p in PARTS},
        "wall_s": round(time.monotonic() - t0, 1),
        "parts": {n: {k: r.get(k) for k in ("status", "wall_s", "budget_s", "note")} for n, r in records.items()},
        "blocked_imports_in_measuring_parts": BLOCK_IN_REHEARSAL if a.dry_run else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = render(summary, records)
    (out / "summary.md").write_text(md)
    print("\n" + md, flush=True)
    print(f"wrote {out}: " + ", ".join(sorted(f.name for f in out.iterdir())), flush=True)
    bad = [n for n, r in records.items() if r["status"] not in ("ok", "skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
