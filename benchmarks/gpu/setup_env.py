"""Set-up part of the GPU command: install the carried wheels (no network) and lowprec itself.

    python3 benchmarks/gpu/setup_env.py --wheels benchmarks/gpu/wheels --site /tmp/lowprec-gpu-site --out setup.json
    python3 benchmarks/gpu/setup_env.py ... --dry-run    # the rehearsal (CPU, any Python)

The GPU image (Python 3.12, torch 2.11.0+cu130) has neither pydantic nor torchao and cannot
reach a package index, so ``fetch_wheels.sh`` puts their wheels in ``benchmarks/gpu/wheels``
and the run tool carries that folder. Here:

1. ``pip install --no-index --find-links WHEELS --target SITE pydantic torchao``: pip resolves
   every dependency from the carried folder alone, so a missing or inconsistent wheel fails
   here, by name. ``--target`` leaves the image's environment untouched; later parts put SITE
   first on ``PYTHONPATH``.
2. The import check: ``import pydantic, torchao.float8, lowprec.train.config`` from SITE + src.
3. ``pip install -e . --no-deps --no-build-isolation --no-index``: lowprec builds offline with
   the image's setuptools (and gets its ``lowprec`` command).

In ``--dry-run`` step 1 resolves the same wheels for CPython 3.12 manylinux x86-64
(``--python-version/--platform``), whatever this Python is, into a temporary SITE; step 2 runs
only where this interpreter is CPython 3.12 on x86-64 (else it is reported as skipped, with
the reason); step 3 is ``pip install --dry-run`` (builds the metadata, changes nothing). Without
a wheels folder (CI) the wheel steps are reported as skipped and the exit code stays 0 in
``--dry-run`` (1 on the GPU, where the measuring parts then run without torchao).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ("pydantic", "torchao")  # pip resolves their dependencies from the wheels folder
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
IMPORT_CHECK = (
    "import pydantic, torchao, torchao.float8, lowprec.train.config; print(pydantic.VERSION, torchao.__version__)"
)


def _run(cmd: list[str], env: dict | None = None, timeout: float = 120) -> dict:
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    tail = (res.stdout + res.stderr).strip()[-1500:]
    return {
        "command": " ".join(cmd[2:] if cmd[:2] == [sys.executable, "-m"] else cmd),
        "rc": res.returncode,
        "seconds": round(time.monotonic() - t0, 2),
        "output_tail": tail,
    }


def installed_versions(site: Path) -> dict[str, str]:
    """name -> version of every distribution pip unpacked into ``site`` (from its dist-info)."""
    out = {}
    for d in sorted(site.glob("*.dist-info")):
        name, _, version = d.name[: -len(".dist-info")].rpartition("-")
        out[name.lower().replace("_", "-")] = version
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", default=str(ROOT / "benchmarks" / "gpu" / "wheels"))
    p.add_argument("--site", required=True, help="folder the wheels are installed into (--target)")
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    wheels, site = Path(a.wheels), Path(a.site)
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    py_matches = (
        sys.version_info[:2] == (3, 12) and platform.machine() == "x86_64" and sys.implementation.name == "cpython"
    )
    report: dict = {
        "dry_run": a.dry_run,
        "python": platform.python_version(),
        "wheels_dir": str(wheels),
        "wheels": [{"file": f.name, "bytes": f.stat().st_size} for f in files],
        "wheels_total_mib": round(sum(f.stat().st_size for f in files) / 2**20, 2),
        "steps": {},
    }
    ok = True
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    if not files:
        report["steps"]["wheels"] = {
            "status": "skipped",
            "reason": f"no wheels in {wheels}: run benchmarks/gpu/fetch_wheels.sh "
            "(the GPU run then has no pydantic and no torchao)",
        }
        ok = a.dry_run
    else:
        cmd = [
            *pip,
            "--no-index",
            "--find-links",
            str(wheels),
            "--target",
            str(site),
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            *REQUIRED,
        ]
        if a.dry_run:  # resolve the GPU image's interpreter's wheels, whatever this Python is
            cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
            for plat in PLATFORMS:
                cmd += ["--platform", plat]
        step = _run(cmd)
        step["installed"] = installed_versions(site) if site.is_dir() else {}
        missing = [n for n in REQUIRED if n not in step["installed"]]
        step["status"] = "ok" if step["rc"] == 0 and not missing else "failed"
        if missing:
            step["missing"] = missing
        report["steps"]["wheels"] = step
        ok &= step["status"] == "ok"
        if step["status"] == "ok" and (py_matches or not a.dry_run):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT / "src")]))
            env.pop("LOWPREC_GPU_BLOCK_IMPORTS", None)
            chk = _run([sys.executable, "-c", IMPORT_CHECK], env=env)
            chk["status"] = "ok" if chk["rc"] == 0 else "failed"
            report["steps"]["import_check"] = chk
            ok &= chk["status"] == "ok"
        else:
            report["steps"]["import_check"] = {
                "status": "skipped",
                "reason": (
                    "the wheel install failed"
                    if step["status"] != "ok"
                    else f"this interpreter is {sys.implementation.name} {platform.python_version()} on {platform.machine()}; "
                    "the wheels are for CPython 3.12 x86-64 (the GPU image)"
                ),
            }
    cmd = [*pip, "--no-deps", "--no-build-isolation", "--no-index", "-e", str(ROOT)]
    if a.dry_run:
        cmd.insert(4, "--dry-run")
    step = _run(cmd)
    step["status"] = "ok" if step["rc"] == 0 else "failed"
    report["steps"]["lowprec_install"] = step
    ok &= step["status"] == "ok"
    report["ok"] = bool(ok)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    for name, s in report["steps"].items():
        print(f"setup {name}: {s['status']} {s.get('reason', s.get('command', ''))}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
