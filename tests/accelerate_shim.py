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
"""

from __future__ import annotations

import importlib
import os
import sys

PAIRS = [
    ("accelerate", "lowprec"),
    ("accelerate.accelerator", "lowprec.accelerator"),
    ("accelerate.state", "lowprec.state"),
    ("accelerate.utils", "lowprec.utils"),
    ("accelerate.utils.dataclasses", "lowprec.kwargs"),
    ("accelerate.utils.dataclasses", "lowprec.utils.dataclasses"),
    ("accelerate.utils.dataclasses", "lowprec.process_state"),
    ("accelerate.utils.other", "lowprec.utils.modeling"),
    ("accelerate.big_modeling", "lowprec.utils.modeling"),
    ("accelerate.state", "lowprec.process_state"),
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
