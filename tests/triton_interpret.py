"""Loading the Triton kernels' operators under Triton's CPU interpreter, for the interpreter test
modules (test_fp8_kernels_interpret.py: the casts; test_fp8_gemm_kernels_interpret.py: the GEMMs).

Triton reads ``TRITON_INTERPRET`` when it is imported (its standard library) and when it decorates
kernels, so the operators must be imported with the variable set, and before anything imports
triton for a device. The first interpreter module imports them; the second finds them already
interpreted (``ops._INTERPRETED``, decided from the kernel objects at import) and reuses them.
"""

import os
import sys

import pytest
import torch


def load(test_file: str):
    """``(ops, gemm_ops)`` under the interpreter; skips where a GPU is present (the compiled kernels'
    tests run there) or triton is missing, and fails where triton was imported for a device first
    (the module's tests would silently not run)."""
    name = os.path.basename(test_file)
    if torch.cuda.is_available():
        pytest.skip(
            f"a GPU is present: test_fp8_kernels_gpu.py covers the compiled kernels ({name})", allow_module_level=True
        )
    loaded = sys.modules.get("lowprec.fp8.kernels.ops")
    interpreted = loaded is not None and getattr(loaded, "_INTERPRETED", False)
    if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET") and not interpreted:
        # a module imported before this one (at collection) imported triton, for a device. Import such
        # packages (compressed_tensors, torch._dynamo, ...) inside the tests that need them, or
        # find_spec them (tests/test_export_moe.py).
        pytest.fail(
            f"triton was imported before tests/{name} (by a test module at import time or by conftest): "
            "the Triton-interpreter tests cannot run in this process",
            pytrace=False,
        )
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        from lowprec.fp8.kernels import gemm_ops, ops
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return ops, gemm_ops
