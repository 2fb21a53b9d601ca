"""The Triton kernels compile, through ptxas, to sm_89 (Ada) and sm_90 (Hopper) cubins.

No GPU is needed to compile (triton ships ptxas), so this catches what the CPU interpreter
cannot: ops the real compiler rejects, and the hardware FP8 convert path (``SOFT_CAST=False``)
that only exists there. Skipped where triton is absent (CI). It runs in a subprocess because
the interpreter tests import triton with ``TRITON_INTERPRET=1``, which stays for the process.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# find_spec, not importorskip: importing triton here would stop the interpreter tests
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lowprec.fp8.kernels.triton_cast import amax_cols_kernel, cast_rowwise_kernel, cast_transpose_amax_kernel, recast_if_changed_kernel, delayed_scale_kernel
from lowprec.fp8.kernels.ops import DUAL_TILE, ROW_TILE, TILE, _EPS_BITS

CT = {"x_ptr": "*bf16", "scale_ptr": "*fp32", "q_ptr": "*u8", "qt_ptr": "*u8", "amax_ptr": "*i32",
      "M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "i32"}
RW = {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32", "M": "i32", "N": "i32",
      "stride_xm": "i32", "stride_xn": "i32", "col_scale_ptr": "*fp32", "qt_ptr": "*u8"}
RC = {"x_ptr": "*bf16", "used_ptr": "*fp32", "cast_ptr": "*fp32", "q_ptr": "*u8", "qt_ptr": "*u8",
      "M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "i32"}
DS = {"hist_ptr": "*fp32", "scale_ptr": "*fp32", "step_ptr": "*i64", "amax_ptr": "*fp32", "used_ptr": "*fp32",
      "old_ptr": "*fp32", "L": "i32"}
AC = {"x_ptr": "*bf16", "amax_ptr": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "i32"}
out = []
for cc in (89, 90):
    target = GPUTarget("cuda", cc, 32)
    for e4m3 in (True, False):
        for soft in (False, True):
            fp8_max = 448.0 if e4m3 else 57344.0
            ct = dict(FP8_MAX=fp8_max, E4M3=e4m3, WRITE_T=True, WRITE_AMAX=True, SOFT_CAST=soft,
                      BLOCK_M=TILE[0], BLOCK_N=TILE[1], WRITE_Q=True)
            rw = dict(FP8_MAX=fp8_max, E4M3=e4m3, POW2=True, SOFT_CAST=soft, EPS_BITS=_EPS_BITS,
                      BLOCK_M=ROW_TILE[0], BLOCK_N=ROW_TILE[1], ROW=True, COL=False)
            dual = dict(rw, BLOCK_M=DUAL_TILE[0], BLOCK_N=DUAL_TILE[1], COL=True)
            amax_only = dict(ct, WRITE_Q=False, WRITE_T=False)
            # What a launch on a contiguous tensor with dims divisible by 16 specialises to:
            # stride_xn == 1 a constant, pointers and M, N, stride_xm 16-divisible.
            kernels = [
                ("ct", cast_transpose_amax_kernel, CT, ct, TILE[2], (0, 1, 2, 3, 4, 5, 6, 7)),
                ("row", cast_rowwise_kernel, RW, rw, ROW_TILE[2], (0, 1, 2, 3, 4, 5, 7, 8)),
                ("dual", cast_rowwise_kernel, RW, dual, DUAL_TILE[2], (0, 1, 2, 3, 4, 5, 7, 8)),
                ("recast", recast_if_changed_kernel, RC, dict(FP8_MAX=fp8_max, E4M3=e4m3, SOFT_CAST=soft,
                 BLOCK_M=TILE[0], BLOCK_N=TILE[1]), TILE[2], (0, 1, 2, 3, 4, 5, 6, 7)),
            ]
            if e4m3 and not soft:  # no FP8 convert in these: compile them once per target
                kernels += [("amax", cast_transpose_amax_kernel, CT, amax_only, TILE[2], (0, 1, 2, 3, 4, 5, 6, 7)),
                            ("amax_cols", amax_cols_kernel, AC, dict(BLOCK_M=TILE[0], BLOCK_N=TILE[1]), TILE[2], (0, 1, 2, 3, 4)),
                            ("delayed", delayed_scale_kernel, DS, dict(FP8_MAX=448.0, EPS_BITS=_EPS_BITS, MARGIN=0, POW2=False,
                             INTERVAL=1, ALGO_MAX=True, BLOCK=1024), 4, (0, 6))]
            for name, fn, sig, const, warps, aligned in kernels:
                const = dict(const, stride_xn=1) if "stride_xn" in sig else const
                sig = dict(sig, **{k: "constexpr" for k in const})
                attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                                   target=target, options={"num_warps": warps})
                ptx = k.asm["ptx"]
                out.append(dict(cc=cc, kernel=name, e4m3=e4m3, soft=soft, cubin=len(k.asm["cubin"]),
                                hw_cvt=("cvt.rn.satfinite.e4m3x2.f32" in ptx) or ("cvt.rn.satfinite.e5m2x2.f32" in ptx),
                                atomics=ptx.count("atom.global"),
                                vector_loads="ld.global.v4" in ptx, vector_stores="st.global.v4" in ptx,
                                scalar_byte_stores=ptx.count("st.global.b8")))
print(json.dumps(out))
"""


def test_kernels_compile_for_hopper():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * (4 * 4 + 3)
    assert {r["cc"] for r in rows} == {89, 90}
    for r in rows:
        assert r["cubin"] > 0, r
        if r["kernel"] == "delayed":  # one program of scalar bookkeeping
            continue
        if r["kernel"] in ("amax", "amax_cols"):  # reads and atomics only
            assert r["atomics"] >= 1 and r["vector_loads"] and not r["hw_cvt"], r
            continue
        # the hardware path uses the round-to-nearest-even convert; the software one does not
        assert r["hw_cvt"] == (not r["soft"]), r
        # one atomic per tile for the tensor amax; none in the rowwise kernels
        assert r["atomics"] == (1 if r["kernel"] == "ct" else 0), r
        if r["kernel"] == "recast":  # a conditional re-cast: its stores are checked by the interpreter
            continue
        # 16-byte global loads and stores (both layouts of the transpose kernel): a
        # bandwidth-bound kernel that moves single bytes would be several times slower
        assert r["vector_loads"], r
        if r["kernel"] != "dual":
            assert r["vector_stores"] and r["scalar_byte_stores"] == 0, r
