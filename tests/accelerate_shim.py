"""Rebinds Hugging Face Accelerate's public objects to lowprec's, for running Accelerate's own
test files against lowprec (tests/test_accelerate_conformance.py copies this file as the
``conftest.py`` of the extracted test folder, so it runs before any test module is imported).

Rule: for each pair below, every name in the lowprec module's ``__all__`` that the Accelerate
module also has is replaced by lowprec's object; then every loaded ``accelerate.*`` module that
imported one of those objects by name (``from accelerate.state import PartialState``) gets
lowprec's too, so Accelerate's test helpers (``AccelerateTestCase`` resetting the state,
``debug_launcher``) act on lowprec's objects. Names lowprec does not export stay Accelerate's
(model-loading helpers, the test utilities themselves).

With ``LOWPREC_SHIM=0`` nothing is rebound (the same runner measures real Accelerate).

Subprocesses: the runner puts a ``sitecustomize.py`` that imports this module on ``PYTHONPATH``,
so the scripts Accelerate's tests launch (``accelerate launch -m tests.test_fp8``) run against
lowprec too, not only the pytest process.

Reached lowprec: on the lowprec side every rebound function and every rebound class's
``__init__`` is wrapped to leave a marker file the first time it runs in a process
(``$LOWPREC_REACHED``, one path per test, set by the pytest hooks below and inherited by launched
processes), so the runner can report how many passing tests actually ran lowprec code.
"""

from __future__ import annotations

import functools
import gc
import importlib
import inspect
import os
import sys
from enum import Enum

PAIRS = [
    ("accelerate", "lowprec"),
    ("accelerate.accelerator", "lowprec.accelerator"),
    ("accelerate.state", "lowprec.state"),
    ("accelerate.utils", "lowprec.utils"),
    ("accelerate.utils.dataclasses", "lowprec.kwargs"),
    ("accelerate.utils.dataclasses", "lowprec.utils.dataclasses"),
    ("accelerate.utils.dataclasses", "lowprec.state.partial"),
    ("accelerate.utils.other", "lowprec.utils.modeling"),
    ("accelerate.big_modeling", "lowprec.utils.modeling"),
    ("accelerate.state", "lowprec.state.partial"),
    ("accelerate.utils.random", "lowprec.utils.random"),
    ("accelerate.utils.operations", "lowprec.utils.operations"),
    ("accelerate.utils.memory", "lowprec.utils.memory"),
    ("accelerate.utils.imports", "lowprec.utils.imports"),
    ("accelerate.data_loader", "lowprec.utils.data_loader"),
    ("accelerate.data_loader", "lowprec.utils.dispatcher"),
    ("accelerate.optimizer", "lowprec.utils.optimizer"),
    ("accelerate.scheduler", "lowprec.utils.optimizer"),
    ("accelerate.tracking", "lowprec.tracking"),
]


REACHED = "LOWPREC_REACHED"
_marked: set = set()


def _mark() -> None:
    path = os.environ.get(REACHED)
    if path and path not in _marked:
        _marked.add(path)
        with open(path, "a"):
            pass


_wrappers: dict = {}


def _counted(obj):
    """``obj`` with a marker on use (functions: one wrapper each; classes: their ``__init__``, once)."""
    if inspect.isfunction(obj):
        if id(obj) not in _wrappers:

            @functools.wraps(obj)
            def wrapper(*args, **kwargs):
                _mark()
                return obj(*args, **kwargs)

            _wrappers[id(obj)] = wrapper
        return _wrappers[id(obj)]
    if inspect.isclass(obj) and not issubclass(obj, (Enum, BaseException)) and "_lowprec_counted" not in vars(obj):
        init = obj.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            _mark()
            init(self, *args, **kwargs)

        obj.__init__ = __init__
        obj._lowprec_counted = True
    return obj


def pytest_collection_finish(session) -> None:
    """Both sides: every object alive once the test modules are imported moves to the permanent
    generation (``gc.freeze``), so the ``gc.collect()`` Accelerate's and lowprec's memory helpers
    run (``find_executable_batch_size``: once per retry) walks only what the tests made: 18.5 s ->
    0.4 s for test_memory_utils.py (docs/LOG.md, branch acc, 2026-11-27). Nothing the tests create is kept alive.

    Before that, transformers' scheduler helpers are imported once here, so the workers
    ``debug_launcher`` forks inherit them instead of each importing transformers (test_scheduler's
    accumulation test: 15.4 s -> 6.0 s of CPU)."""
    if any("test_scheduler.py" in item.nodeid for item in session.items):
        try:
            importlib.import_module("transformers.optimization")
        except ImportError:
            pass  # test_scheduler's accumulation test is then skipped on both sides
    gc.collect()
    gc.freeze()


def pytest_runtest_setup(item) -> None:
    # Some of Accelerate's tests draw unseeded weights and compare with a tolerance: each test
    # starts from the same seed (from its id) on both sides, so neither side's result is luck
    import random
    import zlib

    import numpy
    import torch

    seed = zlib.crc32(item.nodeid.encode()) % (2**31)
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    folder = os.environ.get(REACHED + "_DIR")
    if folder:
        os.environ[REACHED] = os.path.join(folder, item.nodeid.replace("/", "_").replace("::", "__"))


def pytest_runtest_teardown(item) -> None:
    os.environ.pop(REACHED, None)


def rebind() -> dict:
    """Apply the rule above; returns {accelerate object id: lowprec object}."""
    swapped: dict[int, object] = {}
    for acc_name, lp_name in PAIRS:
        acc_mod = importlib.import_module(acc_name)
        lp_mod = importlib.import_module(lp_name)
        for name in getattr(lp_mod, "__all__", []):
            if hasattr(acc_mod, name):
                original = getattr(acc_mod, name)
                new = getattr(lp_mod, name)
                if original is not new:
                    new = _counted(new)
                    swapped[id(original)] = new
                    setattr(acc_mod, name, new)
    for mod_name, mod in list(sys.modules.items()):
        if not (mod_name == "accelerate" or mod_name.startswith("accelerate.")) or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            new = swapped.get(id(value))
            if new is not None and not attr.startswith("__"):
                setattr(mod, attr, new)
    return swapped


if os.environ.get("LOWPREC_SHIM", "1") != "0":
    import accelerate.test_utils  # noqa: F401  (loaded first, so its by-name imports are swapped too)

    _SWAPPED = rebind()
