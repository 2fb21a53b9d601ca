"""Run one part of the GPU command as ``python child.py SCRIPT ARGS...`` (or ``-m MODULE ARGS...``),
with the top-level packages named in ``LOWPREC_GPU_BLOCK_IMPORTS`` (comma-separated) made
unimportable first.

Why: the GPU image has no pydantic. The rehearsal (``run.sh --dry-run``) runs every measuring
part with ``pydantic`` blocked, so a measuring part that starts to need it fails on CPU in CI,
not on the GPU after the set-up step's wheels failed to install. Nothing here imports torch.
"""

from __future__ import annotations

import importlib.abc
import os
import runpy
import sys

BLOCK_ENV = "LOWPREC_GPU_BLOCK_IMPORTS"


class _Blocker(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} ({BLOCK_ENV}: the GPU image lacks it unless the set-up step "
                f"installed it; this part must run without it)",
                name=fullname,
            )
        return None


def main(argv: list[str]) -> None:
    blocked = {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}
    if blocked:
        sys.meta_path.insert(0, _Blocker(blocked))
    if len(argv) >= 2 and argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    else:
        raise SystemExit("usage: child.py SCRIPT [ARGS...] | -m MODULE [ARGS...]")


if __name__ == "__main__":
    main(sys.argv[1:])
