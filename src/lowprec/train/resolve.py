"""Resolve a validated :class:`TrainConfig` against the machine, once, with reasons.

Every ``auto`` (``bf16``, ``torch_compile``, ``use_tensorboard``) and every machine-dependent
rule (FP8 on an old GPU, bf16 without support, missing optional packages) is decided here from a
:class:`Capabilities` object. The trainer reads only the resulting :class:`RunPlan`; nothing
else probes the hardware. Tests pass hand-made capabilities to cover GPUs they do not have.
"""

from __future__ import annotations

import importlib.util
import math
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from lowprec.decision import Decision
from lowprec.state import fp8_capability_decision
from lowprec.train.axolotl_defaults import differing_defaults
from lowprec.train.config import TrainConfig
from lowprec.train.hf_model import tokenizer_choice
from lowprec.train.adapters import check_adapter_backend

__all__ = ["Capabilities", "Decision", "RunPlan", "resolve", "precision_label", "total_steps"]

logger = logging.getLogger("lowprec")

OPTIONAL_PACKAGES = ("transformers", "tensorboard", "deepspeed", "peft", "bitsandbytes")


@dataclass(frozen=True)
class Capabilities:
    """What the machine offers. ``cuda_capability`` is None on a CPU-only machine."""

    cuda_capability: Optional[tuple[int, int]] = None
    packages: frozenset = frozenset()

    @classmethod
    def detect(cls) -> "Capabilities":
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        found = frozenset(p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is not None)
        return cls(cuda_capability=cap, packages=found)

    @property
    def device(self) -> str:
        return "cpu" if self.cuda_capability is None else "cuda"

    def sm(self) -> str:
        return "" if self.cuda_capability is None else f"sm_{self.cuda_capability[0]}{self.cuda_capability[1]}"


@dataclass(frozen=True)
class RunPlan:
    """How the run trains. ``mixed_precision`` is what the Accelerator gets."""

    mixed_precision: str  # no | fp16 | bf16 | fp8
    bf16_autocast: bool  # bf16 autocast around non-FP8 ops (under fp8 or bf16: true)
    weights_dtype: str  # float32 | bfloat16 (bf16: full)
    torch_compile: bool
    use_tensorboard: bool
    label: str  # fp32 | fp16 | bf16 | bf16-full | fp8 | fp8-full
    decisions: dict = field(default_factory=dict)
    # the sm_89 decision of an FP8 run on a GPU, for the Accelerator (which logs it and does not
    # make it again); None on CPU, without FP8 or when the run fell back to bf16
    fp8_hardware: Optional[Decision] = None

    def log(self, skip: "set[str] | frozenset[str]" = frozenset()) -> None:
        """Each decision once; ``skip``: keys the accelerator already logged (device...)."""
        for key, d in self.decisions.items():
            if key not in skip:
                logger.info("lowprec: %s = %s (%s)", key, d.value, d.reason)


def precision_label(mixed_precision: str, weights_dtype: str) -> str:
    base = {"no": "fp32"}.get(mixed_precision, mixed_precision)
    if weights_dtype == "bfloat16":
        return "bf16-full" if base in ("fp32", "bf16") else f"{base}-full"
    return base


def _bf16(cfg: TrainConfig, caps: Capabilities) -> Decision:
    v = cfg.bf16
    if v == "auto":
        if cfg.fp16:
            return Decision(False, "bf16: auto and fp16: true")
        if caps.cuda_capability is None:
            return Decision(True, "bf16: auto on CPU: torch.autocast runs bfloat16 on CPU")
        if caps.cuda_capability >= (8, 0):
            return Decision(True, f"bf16: auto on {caps.sm()} (bf16 needs sm_80+)")
        return Decision(False, f"bf16: auto on {caps.sm()}, which has no bf16 (needs sm_80+)")
    if v in (True, "full") and caps.cuda_capability is not None and caps.cuda_capability < (8, 0):
        raise ValueError(
            f"bf16: {str(v).lower()} on a GPU without bfloat16 ({caps.sm()}, needs sm_80+); "
            "set bf16: false and fp16: true"
        )
    return Decision(v, "from the config")


def _fp8_check(cfg: TrainConfig, caps: Capabilities) -> Optional[Decision]:
    """The sm_89 decision for an FP8 run on a GPU (``fp8``, ``fp8-emulate`` or ``bf16``); None
    on CPU or without FP8. Made once, here: the Accelerator is handed it (``RunPlan.fp8_hardware``)."""
    if not cfg.fp8 or caps.cuda_capability is None:
        return None
    return fp8_capability_decision(
        caps.cuda_capability,
        cfg.fp8_fallback,
        ("Set fp8: false and bf16: true, or fp8_fallback: emulate (FP8 numerics, slow) or fp8_fallback: bf16"),
    )


def _packages(cfg: TrainConfig, caps: Capabilities) -> None:
    import os

    def need(pkg: str, what: str) -> None:
        if pkg not in caps.packages:
            raise ValueError(f"{what} needs the optional package {pkg!r}: pip install {pkg}")

    if not cfg.base_model.startswith("builtin:"):
        need("transformers", f"base_model: {cfg.base_model} (a Hugging Face model directory)")
    if cfg.tokenizer not in (None, "byte"):
        if not os.path.isdir(cfg.tokenizer):
            raise ValueError(f"tokenizer: {cfg.tokenizer!r} is neither byte nor a local tokenizer directory")
        need("transformers", f"tokenizer: {cfg.tokenizer}")
    if cfg.use_tensorboard is True:
        need("tensorboard", "use_tensorboard: true")
    if cfg.deepspeed is not None:
        need("deepspeed", "deepspeed")

    check_adapter_backend(cfg.adapter, caps.packages)


def resolve(cfg: TrainConfig, caps: Optional[Capabilities] = None, world_size: int = 1) -> RunPlan:
    caps = caps or Capabilities.detect()
    _packages(cfg, caps)
    d: dict[str, Decision] = {}
    d["device"] = Decision(caps.device, "CUDA available" if caps.device == "cuda" else "no CUDA device")
    d["tokenizer"] = Decision(*tokenizer_choice(cfg))
    bf16 = _bf16(cfg, caps)
    d["bf16"] = bf16
    hardware = _fp8_check(cfg, caps)
    fallback = {"fp8": None, "fp8-emulate": "emulate"}.get(hardware.value, "bf16") if hardware else None
    if cfg.fp8 and fallback == "bf16":
        mp = Decision("bf16", f"fp8: true on {caps.sm()} (< sm_89) with fp8_fallback: bf16")
    elif cfg.fp8:
        why = "fp8: true" + (f", FP8 GEMMs emulated on {caps.sm()} (fp8_fallback: emulate)" if fallback else "")
        mp = Decision("fp8", why)
    elif bf16.value is True:
        mp = Decision("bf16", f"bf16: true ({bf16.reason})")
    elif cfg.fp16:
        mp = Decision("fp16", "fp16: true")
    else:
        mp = Decision(
            "no", "no fp8/bf16/fp16: float32" if bf16.value != "full" else "bf16: full: pure bf16 weights, no autocast"
        )
    d["mixed_precision"] = mp
    weights = "bfloat16" if bf16.value == "full" else "float32"
    d["weights_dtype"] = Decision(weights, "bf16: full" if weights == "bfloat16" else "float32 master weights")
    autocast = mp.value == "bf16" or (mp.value == "fp8" and bf16.value is True)
    if mp.value == "fp8":
        d["bf16_autocast"] = Decision(
            autocast,
            "non-FP8 ops in bf16 autocast (bf16 resolved true)"
            if autocast
            else f"bf16: {cfg.bf16}: non-FP8 ops in {weights}",
        )
    if cfg.torch_compile == "auto":
        d["torch_compile"] = Decision(caps.device == "cuda", f"torch_compile: auto on {caps.device}")
    else:
        d["torch_compile"] = Decision(bool(cfg.torch_compile), "from the config")
    if cfg.use_tensorboard == "auto":
        has = "tensorboard" in caps.packages
        d["use_tensorboard"] = Decision(has, "tensorboard installed" if has else "tensorboard not installed")
    else:
        d["use_tensorboard"] = Decision(bool(cfg.use_tensorboard), "from the config")
    differ = differing_defaults(cfg)
    if differ is not None:  # an Axolotl config trains otherwise where it leaves these out: say which
        d["defaults"] = Decision(
            differ, "not set in the config, and lowprec's default is not Axolotl's: set them to train as Axolotl"
        )
    if cfg.cpu_threads is not None:
        d["cpu_threads"] = Decision(cfg.cpu_threads, "cpu_threads from the config")
    else:
        d["cpu_threads"] = Decision(torch.get_num_threads(), "torch's default (OMP_NUM_THREADS or the core count)")
    if world_size > 1:
        d["distributed"] = _distributed(cfg, world_size)
    return RunPlan(
        mixed_precision=mp.value,
        bf16_autocast=autocast,
        weights_dtype=weights,
        torch_compile=d["torch_compile"].value,
        use_tensorboard=d["use_tensorboard"].value,
        label=precision_label(mp.value, weights),
        decisions=d,
        fp8_hardware=hardware if mp.value == "fp8" else None,
    )


def _distributed(cfg: TrainConfig, world_size: int) -> Decision:
    """How the processes share the work: DDP, FSDP2, DeepSpeed, TP (tensor_parallel_size
    processes split each Linear) or TP x FSDP2 (FSDP2 over the tensor-parallel groups)."""
    tp = cfg.tensor_parallel_size
    if tp > 1:
        groups = world_size // tp
        kind = "TP x FSDP2" if groups > 1 else "TP"
        why = f"{world_size} processes, tensor_parallel_size: {tp}"
        return Decision(kind, why + (f" x {groups} FSDP2 shards, fsdp_version: 2" if groups > 1 else ""))
    kind = "FSDP2" if cfg.fsdp_version == 2 else ("DeepSpeed" if cfg.deepspeed is not None else "DDP")
    return Decision(
        kind, f"{world_size} processes" + {"FSDP2": ", fsdp_version: 2", "DeepSpeed": ", deepspeed"}.get(kind, "")
    )


def total_steps(cfg: TrainConfig, batches_per_epoch: int, decisions: dict, main: bool) -> int:
    """Optimizer steps of the run (``max_steps`` or epochs), with warmup clamped for smoke runs."""
    per_epoch = batches_per_epoch // cfg.gradient_accumulation_steps
    if cfg.max_steps is not None:
        total = cfg.max_steps
        why = "max_steps" + (" (wins over num_epochs)" if cfg.num_epochs is not None else "")
    else:
        epochs = cfg.num_epochs if cfg.num_epochs is not None else 1.0
        total = max(1, math.ceil(epochs * per_epoch))
        why = f"num_epochs: {epochs} x {per_epoch} steps per epoch" + ("" if cfg.num_epochs else " (default 1 epoch)")
    decisions["total_steps"] = Decision(total, why)
    if cfg.warmup_ratio is not None:  # Axolotl: warmup_steps = ratio x the run's steps
        decisions["warmup_steps"] = Decision(
            int(cfg.warmup_ratio * total), f"warmup_ratio: {cfg.warmup_ratio} x {total} steps"
        )
    elif cfg.warmup_steps >= total:  # a smoke run (--max_steps 3) of a config with a long warmup
        warmup = max(0, total - 1)
        decisions["warmup_steps"] = Decision(
            warmup, f"warmup_steps: {cfg.warmup_steps} clamped to the run's {total} steps"
        )
        if main:
            logger.warning(
                "lowprec: note: warmup_steps: %d clamped to %d for this %d-step run", cfg.warmup_steps, warmup, total
            )
    for steps in ("eval_steps", "save_steps"):  # a fraction of the run, as transformers: ceil(fraction x steps)
        fraction = getattr(cfg, steps)
        if isinstance(fraction, float):
            decisions[steps] = Decision(max(1, math.ceil(fraction * total)), f"{steps}: {fraction} x {total} steps")
    # evals_per_epoch / saves_per_epoch -> a step interval, as Axolotl: steps per epoch // N
    for key, steps in (("evals_per_epoch", "eval_steps"), ("saves_per_epoch", "save_steps")):
        n = getattr(cfg, key)
        if n is not None:
            decisions[steps] = Decision(max(1, per_epoch // n), f"{key}: {n} in {per_epoch} steps per epoch")
    if main:
        logger.info("lowprec: total_steps = %d (%s)", total, why)
        for key in ("warmup_steps", "eval_steps", "save_steps"):
            if key in decisions and (key != "warmup_steps" or cfg.warmup_ratio is not None):
                logger.info("lowprec: %s = %s (%s)", key, decisions[key].value, decisions[key].reason)
    return total
