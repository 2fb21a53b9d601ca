"""What torch sees of this machine: for ``lowprec env`` (its FP8 GEMM paths) and ``lowprec config
--default`` (the settings chosen from it). Imports torch at its top, so both commands import this
module only when they ask (``lowprec env`` inside a probe, where a broken torch is reported)."""

from __future__ import annotations

import torch

from lowprec.config.env import LaunchSettings
from lowprec.fp8.gemm.block_triton import describe_cuda
from lowprec.fp8.gemm.cpu import cpu_gemm_choice

__all__ = ["blockwise_gemm", "cpu_fp8_gemm", "hardware_default"]


def blockwise_gemm(index: int) -> str:
    """The kernel the blockwise recipe's GEMMs take on CUDA device ``index`` (as the conversion report says)."""
    return describe_cuda(torch.device("cuda", index), 128)


def cpu_fp8_gemm() -> str:
    """The CPU FP8 GEMM this process uses and why: the same sentence the trainer logs."""
    return f"cpu: {cpu_gemm_choice().describe()}"


def hardware_default() -> tuple[LaunchSettings, str]:
    """Settings for this machine and the reason, resolved once (STYLE rule 4)."""
    if not torch.cuda.is_available():
        # use_cpu: true, so the file says what the machine is (not use_cpu: false on a GPU-less box)
        return LaunchSettings(mixed_precision="bf16", use_cpu=True), (
            "no CUDA device: use_cpu: true, bf16 autocast on CPU (FP8 runs here, correct but slower than bf16 because "
            f"of its casts; its GEMMs would be {cpu_gemm_choice().describe()})"
        )
    count = torch.cuda.device_count()
    cc = min(torch.cuda.get_device_capability(i) for i in range(count))
    if cc >= (8, 9):
        fp8 = LaunchSettings(mixed_precision="fp8", fp8_backend="native", fp8_recipe="tensorwise", num_processes=count)
        return fp8, (
            f"{count} GPU(s) with compute capability {cc[0]}.{cc[1]} >= 8.9: native FP8 GEMMs, tensorwise recipe"
        )
    if torch.cuda.is_bf16_supported():
        return LaunchSettings(mixed_precision="bf16", num_processes=count), (
            f"compute capability {cc[0]}.{cc[1]} < 8.9 has no FP8 GEMMs; bf16 is supported"
        )
    return LaunchSettings(mixed_precision="fp16", num_processes=count), (
        f"compute capability {cc[0]}.{cc[1]} has neither FP8 nor bf16: fp16 with loss scaling"
    )
