"""``lowprec env``: what this machine offers for low-precision training (for bug reports).

Versions, OS, CPUs, CUDA devices with compute capability, whether FP8 GEMMs run natively
here (CUDA compute capability >= 8.9, or a CPU torch whose ``torch._scaled_mm`` accepts FP8)
or are emulated, which optional backends are installed (found through package metadata,
never imported: importing TransformerEngine or DeepSpeed can take seconds or fail), the
default config file, and the launch variables set in this shell. Each probe that fails is
reported as such; the command itself never fails.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Any, Callable

from lowprec import __version__
from lowprec.config.env import owned_env_var
from lowprec.backends.spec import specs
from lowprec.config.paths import default_config_path

__all__ = ["NAME", "HELP", "add_parser", "run", "collect", "OPTIONAL_PACKAGES"]  # noqa: F822 - module __getattr__

NAME = "env"
HELP = "print versions, devices, FP8 support and installed backends"

# import name -> distribution names to try (pip spells some differently): the FP8 backends'
# libraries as their declarations name them (lowprec.backends.spec), then the other extras
_OTHER_PACKAGES: dict[str, tuple[str, ...]] = {
    "deepspeed": ("deepspeed",),
    "transformers": ("transformers",),
    "accelerate": ("accelerate",),
}


def optional_packages() -> dict[str, tuple[str, ...]]:
    libs = {s.library: s.distributions or (s.library,) for s in specs() if s.library is not None}
    return {**libs, **_OTHER_PACKAGES}


def __getattr__(name: str) -> Any:
    if name == "OPTIONAL_PACKAGES":
        return optional_packages()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Print versions, devices, FP8 GEMM support, installed "
        "backends and the default config (for bug reports).",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a report must survive any broken install
        return f"unknown ({type(exc).__name__}: {exc})"


def package_version(import_name: str) -> str | None:
    """Installed version, or ``None``; metadata first, ``find_spec`` for source installs."""
    for dist in optional_packages().get(import_name, (import_name,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        found = importlib.util.find_spec(import_name) is not None
    except (ImportError, ValueError):
        found = False
    return "installed (version unknown)" if found else None


def _torch_info() -> dict[str, Any]:
    # torch inside the probe: a broken torch install is a line of the report, not a failed command
    import torch

    from lowprec.cli import hardware  # imports torch: inside the probe too

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    info["cuda_version"] = torch.version.cuda
    devices = []
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            devices.append(
                {
                    "index": i,
                    "name": torch.cuda.get_device_name(i),
                    "compute_capability": f"{cc[0]}.{cc[1]}",
                    "fp8_gemm": cc >= (8, 9),
                    "blockwise_gemm": _probe(functools.partial(hardware.blockwise_gemm, i)),
                }
            )
    info["devices"] = devices
    info["bf16_supported"] = _probe(lambda: torch.cuda.is_bf16_supported() if info["cuda_available"] else True)
    if devices:
        native = any(d["fp8_gemm"] for d in devices)
        info["fp8_gemm"] = (
            "native (CUDA compute capability >= 8.9)"
            if native
            else "emulated (needs CUDA compute capability >= 8.9; these GPUs are older)"
        )
    else:  # a probe of its own: a bad LOWPREC_CPU_FP8_GEMM is this line's, not torch's
        info["fp8_gemm"] = _probe(hardware.cpu_fp8_gemm)
    return info


def _fp8_backends() -> dict[str, dict[str, Any]]:
    """Every declared FP8 backend: what runs it here (its library, or lowprec's engine)."""

    out = {}
    for s in specs():
        runs = (
            "lowprec engine"
            if s.library is None
            else (s.library if s.available() else f"lowprec engine ({s.library} not installed)")
        )
        out[s.name] = {"fp8_backend": s.env_value, "kwargs": s.kwargs_class.__name__, "runs": runs}
    return out


def collect() -> dict[str, Any]:
    info: dict[str, Any] = {
        "lowprec": __version__,
        "python": sys.version.split()[0],
        "platform": _probe(platform.platform),
        "cpu_count": os.cpu_count(),
    }
    torch_info = _probe(_torch_info)
    if isinstance(torch_info, dict):
        info.update(torch_info)
    else:
        info["torch"] = torch_info
    info["optional_backends"] = {name: _probe(functools.partial(package_version, name)) for name in optional_packages()}
    info["fp8_backends"] = _probe(_fp8_backends)
    path = _probe(default_config_path)
    info["default_config"] = str(path)
    info["default_config_exists"] = _probe(lambda: path.is_file())
    if info["default_config_exists"] is True:
        info["default_config_text"] = _probe(path.read_text)
    info["launch_env"] = {k: v for k, v in sorted(os.environ.items()) if owned_env_var(k)}
    return info


def _format(info: dict[str, Any]) -> str:
    lines = ["lowprec environment", ""]
    for key in (
        "lowprec",
        "python",
        "platform",
        "cpu_count",
        "torch",
        "cuda_available",
        "cuda_version",
        "bf16_supported",
        "fp8_gemm",
    ):
        if key in info:
            lines.append(f"- {key}: {info[key]}")
    for dev in info.get("devices", []):
        lines.append(f"- cuda:{dev['index']}: {dev['name']} (compute capability {dev['compute_capability']})")
    lines.append("- optional backends:")
    for name, version in info["optional_backends"].items():
        lines.append(f"    {name}: {version or 'not installed'}")
    lines.append("- FP8 backends (--fp8_backend):")
    backends = info.get("fp8_backends")
    for b in backends.values() if isinstance(backends, dict) else ():
        lines.append(f"    {b['fp8_backend']}: {b['kwargs']}, runs on {b['runs']}")
    state = "present" if info.get("default_config_exists") is True else "not present"
    lines.append(f"- default config: {info['default_config']} ({state})")
    for text_line in str(info.get("default_config_text", "")).splitlines():
        lines.append(f"    {text_line}")
    lines.append(f"- launch variables set: {len(info['launch_env'])}")
    for k, v in info["launch_env"].items():
        lines.append(f"    {k}={v}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    info = collect()
    print(json.dumps(info, indent=2, default=str) if args.json else _format(info))
    return 0
