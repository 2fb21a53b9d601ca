#!/usr/bin/env bash
# Download the wheels the GPU image lacks (Python 3.12, manylinux x86-64) into
# benchmarks/gpu/wheels (git-ignored; the run tool carries it with carry=["benchmarks/gpu/wheels"]).
# The versions are the ones the CPU test suite runs with; torchao 0.18.0 is the first release whose
# extensions are built against torch's stable ABI with torch >= 2.11 as its floor (its
# torchao/__init__.py), and its wheel is cp310-abi3, so one file serves Python 3.12.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="${1:-$here/wheels}"
mkdir -p "$dest"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
dl() { python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
       "${plat[@]}" -d "$dest" "$@"; }
dl pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0
dl torchao==0.18.0
du -cb "$dest"/*.whl | tail -1 | awk '{printf "total %.1f MiB (limit 64 MiB with the working tree)\n", $1/1048576}'
