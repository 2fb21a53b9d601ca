#!/usr/bin/env bash
# The GPU command (issue 22): bash benchmarks/gpu/run.sh OUT_DIR [--dry-run] [--parts a,b]
# On the GPU machine OUT_DIR is "$OUT"; benchmarks/gpu/README.md has the run tool's call.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
if [ $# -lt 1 ]; then echo "usage: bash benchmarks/gpu/run.sh OUT_DIR [--dry-run] [--parts setup,gpu_tests,linear,cast,train]" >&2; exit 2; fi
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu/run.py "$@"  # PYTHON: another interpreter (the tests pass theirs)
