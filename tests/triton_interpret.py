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

        _patch_once_per_launch()
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return ops, gemm_ops


# The self-check's probe for 16-divisible dims under the interpreter (the GPU's is 256 x 512,
# selfcheck.PROBE_DIVISIBLE): whole tiles of every kernel (64 x 64, 32 x 128, 16 x 64, 128 x 128
# blocks) and ragged ones past them at 16-aligned edges, not square (a store that swapped the dims
# cannot pass); 5x fewer elements, and the interpreter's cost is per program instance. Set per
# test by the interpreter modules' ``interpret`` fixture.
PROBE_DIVISIBLE = (144, 176)

_LAUNCHES: list[set] = []  # per running interpreted launch: the language modules it has patched


def _patch_once_per_launch() -> None:
    """Triton's interpreter re-patches ``triton.language`` (an ``inspect.getmembers`` scan of its
    modules) at every call of a ``@triton.jit`` helper inside a kernel, not only at the launch:
    a quarter to a third of the interpreter tests' time, for kernels built of helpers. The launch
    patches those modules and restores them when it ends, so within it a helper that sees the
    same modules finds them patched already; skip that repeat. A helper that sees another module
    of the language is patched as before. Kernels run the same operations either way. Where the
    interpreter's internals differ (another Triton), nothing is changed."""
    import inspect

    try:
        from triton.runtime import interpreter

        import triton.language as tl

        patch, launch, scope = interpreter._patch_lang, interpreter.GridExecutor.__call__, interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return
    if getattr(patch, "_once_per_launch", False):
        return

    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        if _LAUNCHES:
            seen = langs(fn)
            if seen and seen <= _LAUNCHES[-1]:
                return scope()  # patched by this launch already: nothing of its own to restore
            _LAUNCHES[-1].update(seen)
        return patch(fn)

    def run_launch(self, *args, **kwargs):
        _LAUNCHES.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            _LAUNCHES.pop()

    patch_lang._once_per_launch = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = run_launch
