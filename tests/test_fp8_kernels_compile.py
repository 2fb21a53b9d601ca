"""The Triton kernels compile, through ptxas, to sm_89 (Ada) and sm_90 (Hopper) cubins (the
GEMMs to sm_100, Blackwell, too).

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
        # the software convert (SOFT_CAST) runs under the interpreter and, on a GPU, only in the GPU
        # tests' comparison with the hardware one (tests/test_fp8_kernels_gpu.py): Hopper's build only
        for soft in (False, True) if cc == 90 else (False,):
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
                 BLOCK_M=TILE[0], BLOCK_N=TILE[1], WRITE_Q=True, WRITE_T=True), TILE[2], (0, 1, 2, 3, 4, 5, 6, 7)),
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


@pytest.fixture(scope="module")
def compiled():
    """Every kernel compiled in one subprocess (triton imported once): ``(cast rows, blockwise rows,
    grouped GEMM rows: tensor/axis and block scales, grouped weight-gradient rows)``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    script = SCRIPT + "\n" + BLOCK_SCRIPT + "\n" + GROUPED_SCRIPT + "\n" + WGRAD_SCRIPT
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    return tuple(json.loads(line) for line in lines[-4:])


def test_kernels_compile_for_hopper(compiled):
    rows = compiled[0]
    assert len(rows) == (2 * 4 + 3) + (2 * 2 * 4 + 3)  # sm_89: no software convert; sm_90: both
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


BLOCK_SCRIPT = r"""
import re
from lowprec.fp8.kernels.gemm_ops import GEMM_TILE
from lowprec.fp8.kernels.ops import BLOCK_WARPS, _EPS_BITS
from lowprec.fp8.kernels.triton_block import cast_blockwise_kernel
from lowprec.fp8.kernels.triton_block_gemm import block_scaled_mm_kernel
from lowprec.fp8.kernels.triton_mx import MX_TILE_N, cast_mx_kernel

BK = {"x_ptr": "*bf16", "q_ptr": "*u8", "qt_ptr": "*u8", "s_ptr": "*fp32", "st_ptr": "*fp32",
      "M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "i32"}
GM = {"a_ptr": "*u8", "b_ptr": "*u8", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*bf16", "M": "i32", "N": "i32",
      "K": "i32", "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32", "stride_sam": "i32",
      "stride_sak": "i32", "stride_sbk": "i32", "stride_sbn": "i32", "stride_cm": "i32", "stride_cn": "i32"}


def build(fn, sig, const, aligned, cc, warps, stages=None):
    sig = dict(sig, **{k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    opts = {"num_warps": warps, **({"num_stages": stages} if stages else {})}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", cc, 32), options=opts)


out = []
# the GEMM for every FP8 tensor-core generation it serves: Ada (mma.sync), Hopper (wgmma), Blackwell (tcgen05);
# A and B contiguous along K (what the fused casts write), the launch tiles ops.py uses on each
for cc in (89, 90, 100):
    bm, bn, warps, stages, gm = GEMM_TILE["sm89" if cc == 89 else "default"]
    const = dict(A_E4M3=True, B_E4M3=True, GROUP_N=128, SOFT_FP8=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=gm,
                 stride_ak=1, stride_bk=1, stride_cn=1)
    k = build(block_scaled_mm_kernel, GM, const, (0, 1, 2, 3, 4, 5, 6, 7, 8, 10), cc, warps, stages)
    ptx = k.asm["ptx"]
    out.append(dict(cc=cc, kernel="gemm", cubin=len(k.asm["cubin"]), shared=k.metadata.shared, spills=".local" in ptx,
                    mma=sorted(set(re.findall(r"(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\S*", ptx)))))
# the blockwise cast (hardware FP8 convert), 1-D tiles with both layouts, on Hopper
for square in (False,):
    const = dict(FP8_MAX=448.0, E4M3=True, POW2=True, SOFT_CAST=False, EPS_BITS=_EPS_BITS, BLOCK=128, SQUARE=square,
                 ROW=True, COL=True, stride_xn=1)
    k = build(cast_blockwise_kernel, BK, const, (0, 1, 2, 3, 4, 5, 6, 7), 90, BLOCK_WARPS)
    ptx = k.asm["ptx"]
    out.append(dict(cc=90, kernel="cast_2d" if square else "cast_1d", cubin=len(k.asm["cubin"]), spills=".local" in ptx,
                    hw_cvt="cvt.rn.satfinite.e4m3x2.f32" in ptx, vector_loads="ld.global.v4" in ptx,
                    vector_stores="st.global.v4" in ptx, scalar_byte_stores=ptx.count("st.global.b8")))
# the MXFP8 cast (both layouts from one read) where MXFP8 GEMMs run (Blackwell) and on Hopper
MX = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "qt_ptr": "*u8", "st_ptr": "*u8", "M": "i32", "N": "i32",
      "stride_xm": "i32", "stride_xn": "i32"}
for cc in (90, 100):
    const = dict(FP8_MAX=448.0, EMAX=8, E4M3=True, RCEIL=True, SOFT_CAST=False, ROW=True, COL=True, BLOCK_N=MX_TILE_N,
                 stride_xn=1)
    k = build(cast_mx_kernel, MX, const, (0, 1, 2, 3, 4, 5, 6, 7), cc, 4)
    ptx = k.asm["ptx"]
    out.append(dict(cc=cc, kernel="mx", cubin=len(k.asm["cubin"]), spills=".local" in ptx,
                    hw_cvt="cvt.rn.satfinite.e4m3x2.f32" in ptx, vector_loads="ld.global.v4" in ptx))
# the NVFP4 cast: 1x16 blocks (activations), and 16x16 tiles with both layouts (weights)
from lowprec.fp8.kernels.triton_nvfp4 import NV_TILE_M, NV_TILE_N, cast_nvfp4_kernel
NV = {"x_ptr": "*bf16", "s_ptr": "*fp32", "q_ptr": "*u8", "sc_ptr": "*u8", "qt_ptr": "*u8", "st_ptr": "*u8",
      "M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "i32", "key": "u32"}
for cc in (90, 100):
    for name, tile2d, sr in (("nvfp4", False, False), ("nvfp4_sr", False, True), ("nvfp4_2d", True, False)):
        const = dict(SOFT_CAST=False, TILE2D=tile2d, SR=sr, ROW=True, COL=tile2d, BLOCK_M=16 if tile2d else NV_TILE_M,
                     BLOCK_N=NV_TILE_N, stride_xn=1)
        k = build(cast_nvfp4_kernel, NV, const, (0, 2, 3, 4, 5, 6, 7, 8), cc, 4)
        ptx = k.asm["ptx"]
        out.append(dict(cc=cc, kernel=name, cubin=len(k.asm["cubin"]), spills=".local" in ptx,
                        hw_cvt="cvt.rn.satfinite.e4m3x2.f32" in ptx, vector_loads="ld.global.v4" in ptx))
# the weight-gradient operands' amax and cast with the random Hadamard transform in registers
from lowprec.fp8.kernels.ops_nvfp4 import _RHT_TILE_N
from lowprec.fp8.kernels.triton_nvfp4_dual import cast_nvfp4_dual_kernel, nvfp4_dual_amax_kernel
RA = {"t_ptr": "*bf16", "amax_ptr": "*i32", "sign_bits": "i32", "M": "i32", "N": "i32", "stride_m": "i32",
      "stride_n": "i32"}
DC = {"t_ptr": "*bf16", "s_ptr": "*fp32", "q_ptr": "*u8", "sc_ptr": "*u8", "qt_ptr": "*u8", "st_ptr": "*u8",
      "sign_bits": "i32", "M": "i32", "N": "i32", "stride_m": "i32", "stride_n": "i32", "key": "u32", "key_t": "u32"}
# the rotated operand alone (lowprec::rht_amax, lowprec::cast_nvfp4_rht): the dual kernels, plain half off
for cc in (90, 100):
    k = build(nvfp4_dual_amax_kernel, RA, dict(BLOCK_N=_RHT_TILE_N, PLAIN=False, stride_n=1), (0, 1, 3, 4, 5), cc, 4)
    out.append(dict(cc=cc, kernel="nvfp4_rht_amax", cubin=len(k.asm["cubin"]), spills=".local" in k.asm["ptx"],
                    hw_cvt=True, vector_loads=True))
    for sr in (False, True):
        const = dict(SOFT_CAST=False, SR=False, SR_T=sr, ROW=False, RHT=True, S_T=0, BLOCK_N=_RHT_TILE_N, stride_n=1)
        k = build(cast_nvfp4_dual_kernel, DC, const, (0, 1, 2, 3, 4, 5, 7, 8, 9), cc, 4)
        ptx = k.asm["ptx"]
        out.append(dict(cc=cc, kernel="nvfp4_rht_sr" if sr else "nvfp4_rht", cubin=len(k.asm["cubin"]),
                        spills=".local" in ptx, hw_cvt="cvt.rn.satfinite.e4m3x2.f32" in ptx, vector_loads=True))
# both operands of x / dY from one read: the two amaxes, the two casts (and the two-pass forms)
for cc in (90, 100):
    k = build(nvfp4_dual_amax_kernel, RA, dict(BLOCK_N=_RHT_TILE_N, PLAIN=True, stride_n=1), (0, 1, 3, 4, 5), cc, 4)
    out.append(dict(cc=cc, kernel="nvfp4_dual_amax", cubin=len(k.asm["cubin"]), spills=".local" in k.asm["ptx"],
                    hw_cvt=True, vector_loads=True))
    for name, sr, row, rot in (("nvfp4_dual", False, True, True), ("nvfp4_dual_sr", True, True, True),
                               ("nvfp4_dual_row_sr", True, True, False), ("nvfp4_dual_rht_sr", True, False, True)):
        const = dict(SOFT_CAST=False, SR=sr, SR_T=sr, ROW=row, RHT=rot, S_T=1, BLOCK_N=_RHT_TILE_N, stride_n=1)
        k = build(cast_nvfp4_dual_kernel, DC, const, (0, 1, 2, 3, 4, 5, 7, 8, 9), cc, 4)
        ptx = k.asm["ptx"]
        out.append(dict(cc=cc, kernel=name, cubin=len(k.asm["cubin"]), spills=".local" in ptx,
                        hw_cvt="cvt.rn.satfinite.e4m3x2.f32" in ptx, vector_loads=True))
print(json.dumps(out))
"""

# shared memory one block may use (opt-in maximum): Ada 99 KiB, Hopper and Blackwell 227 KiB
SHARED_LIMIT = {89: 101376, 90: 232448, 100: 232448}
MMA = {
    89: "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    90: "wgmma.mma_async.sync.aligned",
    100: "tcgen05.mma",
}


def test_blockwise_kernels_compile_for_ada_hopper_and_blackwell(compiled):
    """The Triton blockwise GEMM to sm_89/sm_90/sm_100 cubins on FP8 tensor-core instructions,
    within each one's shared memory and without spills; the blockwise cast (both layouts of
    1-D tiles) with 16-byte loads and stores and the hardware round-to-nearest-even convert; the
    MXFP8 cast (both layouts) and the NVFP4 cast (1x16 blocks, round to nearest or stochastic;
    16x16 tiles, both layouts) to sm_90 / sm_100 cubins, without spills, on the hardware convert."""
    rows = compiled[1]
    gemms = [r for r in rows if r["kernel"] == "gemm"]
    assert [r["cc"] for r in gemms] == [89, 90, 100]
    for r in rows:
        assert r["cubin"] > 0 and not r["spills"], r
    for r in gemms:
        assert r["shared"] <= SHARED_LIMIT[r["cc"]], r
        assert any(MMA[r["cc"]] in m for m in r["mma"]), r
        assert all("e4m3" in m or "f8f6f4" in m for m in r["mma"] if "mma" in m), r  # FP8 operands, not upcast
    for r in rows:
        if r["kernel"].startswith("cast"):
            assert r["hw_cvt"] and r["vector_loads"] and r["vector_stores"] and r["scalar_byte_stores"] == 0, r
    # the MXFP8 cast on the hardware round-to-nearest-even convert, for Hopper and Blackwell
    assert [(r["cc"], r["hw_cvt"]) for r in rows if r["kernel"] == "mx"] == [(90, True), (100, True)]
    # the NVFP4 cast (its E4M3 block scales on the hardware convert): 1x16 round to nearest and
    # stochastic, 16x16 tiles with both layouts, the random Hadamard transform's amax and casts,
    # both operands of one tensor from one read (amaxes; casts, one pass or two), both targets
    nv = [(r["cc"], r["kernel"], r["hw_cvt"]) for r in rows if r["kernel"].startswith("nvfp4")]
    kinds = ("nvfp4", "nvfp4_sr", "nvfp4_2d", "nvfp4_rht_amax", "nvfp4_rht", "nvfp4_rht_sr", "nvfp4_dual_amax")
    kinds += ("nvfp4_dual", "nvfp4_dual_sr", "nvfp4_dual_row_sr", "nvfp4_dual_rht_sr")
    assert sorted(nv) == sorted((cc, k, True) for cc in (90, 100) for k in kinds), nv


GROUPED_SCRIPT = r"""
from lowprec.fp8.kernels.gemm_ops import GROUPED_TILE
from lowprec.fp8.kernels.triton_grouped_gemm import grouped_scaled_mm_kernel

GG = {"a_ptr": "*u8", "b_ptr": "*u8", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "offs_ptr": "*i32", "c_ptr": "*bf16",
      "N": "i32", "K": "i32", "E": "i32", "TILES_M": "i32", "stride_am": "i32", "stride_ak": "i32", "stride_be": "i32",
      "stride_bk": "i32", "stride_bn": "i32", "stride_sam": "i32", "stride_sae": "i32", "stride_sak": "i32",
      "stride_sbe": "i32", "stride_sbk": "i32", "stride_sbn": "i32", "stride_cm": "i32", "stride_cn": "i32"}
names = list(GG)
bm, bn, bk, warps, stages, gm = GROUPED_TILE["default"]
out = []
# the grouped GEMM on every FP8 tensor-core generation, with the operands grouped_fn hands it. Tensor /
# row scales: the output GEMM's B from (E, N, K) weights (contiguous along K) and E4M3 A; grad_input's
# B (E, K, N) (contiguous along N) and tensorwise's E5M2 dY as A. Block scales (the blockwise recipe,
# 128-blocks): B contiguous along K (the output GEMM's transposed weights, grad_input's W cast
# transposed on CUDA) with E4M3 or E5M2 A (a HYBRID recipe's dY), and B contiguous along N.
modes = [(False, True, True), (False, False, False), (True, True, True), (True, True, False), (True, False, True)]
for cc in (89, 90, 100):
    for block, k_major, a_e4m3 in modes:
        const = dict(A_E4M3=a_e4m3, B_E4M3=True, BLOCK_SCALES=block, SOFT_FP8=False, BLOCK_M=bm, BLOCK_N=bn,
                     BLOCK_K=bk, GROUP_M=gm, stride_ak=1, stride_cn=1, **({"stride_bk": 1} if k_major else {"stride_bn": 1}))
        aligned = [names.index(x) for x in ("a_ptr", "b_ptr", "sa_ptr", "sb_ptr", "offs_ptr", "c_ptr", "N", "K",
                                            "stride_am", "stride_be", "stride_cm", "stride_bn" if k_major else "stride_bk")]
        k = build(grouped_scaled_mm_kernel, GG, const, aligned, cc, warps, stages)
        ptx = k.asm["ptx"]
        out.append(dict(cc=cc, block=block, k_major=k_major, a_e4m3=a_e4m3, cubin=len(k.asm["cubin"]),
                        shared=k.metadata.shared, spills=".local" in ptx,
                        mma=sorted(set(re.findall(r"(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\S*", ptx)))))
print(json.dumps(out))
"""


GROUPED_MMA = {**MMA, 89: "mma.sync.aligned.m16n8k32.row.col.f32"}  # e4m3 or e5m2 A


@pytest.mark.parametrize("block", [False, True])
def test_grouped_gemm_compiles_for_ada_hopper_and_blackwell(compiled, block):
    """The Triton grouped GEMM (one launch for all experts; tensor / row scales, and the blockwise
    recipe's block scales) to sm_89/sm_90/sm_100 cubins on FP8 tensor-core instructions, for both
    B layouts (K- and N-contiguous) and E4M3 / E5M2 A, within each one's shared memory and without
    spills."""
    rows = [r for r in compiled[2] if r["block"] == block]
    assert sorted({r["cc"] for r in rows}) == [89, 90, 100] and len(rows) == (9 if block else 6)
    for r in rows:
        assert r["cubin"] > 0 and not r["spills"], r
        assert r["shared"] <= SHARED_LIMIT[r["cc"]], r
        assert any(GROUPED_MMA[r["cc"]] in m for m in r["mma"]), r
        fp8 = "e4m3" if r["a_e4m3"] else "e5m2"
        if r["cc"] != 100:  # tcgen05's kind::f8f6f4 names no operand format; the others do
            assert all(fp8 in m for m in r["mma"]), r  # FP8 operands, not upcast


WGRAD_SCRIPT = r"""
from lowprec.fp8.kernels.gemm_ops import GEMM_TILE, WGRAD_TILE
from lowprec.fp8.kernels.triton_grouped_wgrad import grouped_block_wgrad_kernel, grouped_wgrad_kernel

GW = {"dy_table_ptr": "*i64", "x_table_ptr": "*i64", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*fp32",
      "N": "i32", "K": "i32", "TILES_N": "i32", "TILES_K": "i32", "stride_sae": "i32", "stride_san": "i32",
      "stride_sbe": "i32", "stride_sbk": "i32", "stride_ce": "i32", "stride_cn": "i32", "stride_ck": "i32"}
names = list(GW)
bm, bn, bk, warps, stages, gm = WGRAD_TILE["default"]
out = []
# the grouped weight gradient on every FP8 tensor-core generation: tensorwise's E5M2 dY and rowwise's E4M3,
# both operands as the fused casts write them on CUDA (token stride 1); on Hopper also row-major groups
modes = [(89, False, True), (89, True, True), (90, False, True), (90, True, True), (90, True, False),
         (100, False, True), (100, True, True)]
for cc, a_e4m3, unit in modes:
    const = dict(A_E4M3=a_e4m3, B_E4M3=True, DY_TOKEN_UNIT=unit, X_TOKEN_UNIT=unit, SOFT_FP8=False, BLOCK_M=bm,
                 BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, stride_ck=1)
    aligned = [names.index(x) for x in ("dy_table_ptr", "x_table_ptr", "sa_ptr", "sb_ptr", "c_ptr", "N", "K",
                                        "stride_ce", "stride_cn")]
    k = build(grouped_wgrad_kernel, GW, const, aligned, cc, warps, stages)
    ptx = k.asm["ptx"]
    out.append(dict(cc=cc, block=False, a_e4m3=a_e4m3, unit=unit, cubin=len(k.asm["cubin"]), shared=k.metadata.shared,
                    spills=".local" in ptx, mma=sorted(set(re.findall(r"(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\S*", ptx)))))
# block scales along the tokens (the blockwise recipe): the dense blockwise GEMM's tiles, BLOCK_K = 128
BW = {"dy_table_ptr": "*i64", "x_table_ptr": "*i64", "first_tile_ptr": "*i64", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
      "c_ptr": "*fp32", "N": "i32", "K": "i32", "TILES_N": "i32", "TILES_K": "i32", "stride_sat": "i32",
      "stride_san": "i32", "stride_sbt": "i32", "stride_sbk": "i32", "stride_ce": "i32", "stride_cn": "i32",
      "stride_ck": "i32"}
names = list(BW)
for cc, unit in ((89, True), (90, True), (90, False), (100, True)):
    bm, bn, warps, stages, gm = GEMM_TILE["sm89" if cc == 89 else "default"]
    const = dict(A_E4M3=True, B_E4M3=True, DY_TOKEN_UNIT=unit, X_TOKEN_UNIT=unit, SOFT_FP8=False, BLOCK_M=bm,
                 BLOCK_N=bn, BLOCK_K=128, GROUP_M=gm, stride_ck=1, stride_san=1, stride_sbk=1)
    aligned = [names.index(x) for x in ("dy_table_ptr", "x_table_ptr", "first_tile_ptr", "sa_ptr", "sb_ptr", "c_ptr",
                                        "N", "K", "stride_sat", "stride_sbt", "stride_ce", "stride_cn")]
    k = build(grouped_block_wgrad_kernel, BW, const, aligned, cc, warps, stages)
    ptx = k.asm["ptx"]
    out.append(dict(cc=cc, block=True, a_e4m3=True, unit=unit, cubin=len(k.asm["cubin"]), shared=k.metadata.shared,
                    spills=".local" in ptx, mma=sorted(set(re.findall(r"(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\S*", ptx)))))
print(json.dumps(out))
"""


@pytest.mark.parametrize("block", [False, True])
def test_grouped_wgrad_compiles_for_ada_hopper_and_blackwell(compiled, block):
    """The grouped weight gradient (one launch for all experts, group addresses from a table) to
    sm_89/sm_90/sm_100 cubins on FP8 tensor-core instructions with E5M2 (tensorwise's dY) and E4M3
    A, operands contiguous along the tokens or not, within shared memory and without spills;
    ``block``: its block mode (the blockwise recipe: one 128-token scale tile per step, E4M3)."""
    rows = [r for r in compiled[3] if r["block"] == block]
    assert sorted({r["cc"] for r in rows}) == [89, 90, 100] and len(rows) == (4 if block else 7)
    for r in rows:
        assert r["cubin"] > 0 and not r["spills"], r
        assert r["shared"] <= SHARED_LIMIT[r["cc"]], r
        assert any(GROUPED_MMA[r["cc"]] in m for m in r["mma"]), r
        if r["cc"] != 100:  # tcgen05's kind::f8f6f4 names no operand format
            assert all(("e4m3" if r["a_e4m3"] else "e5m2") in m for m in r["mma"]), r  # FP8, not upcast
