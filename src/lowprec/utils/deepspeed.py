"""DeepSpeed ZeRO 1-3 glue (DeepSpeed is an optional extra; on CPU set ``DS_ACCELERATOR=cpu``).

``deepspeed.initialize`` takes the model and its optimizer together, so under DeepSpeed they
must come in the same ``prepare`` call (DeepSpeed's constraint, said in the error). FP8 keeps
working here: the model is converted before DeepSpeed wraps it and its forward runs inside the
FP8 region with the user's recipe (Accelerate passes only the legacy handler here, bug 3), and
``accelerator.autocast()`` is bf16 under fp8 (Accelerate uses the device default, bug 13).

lowprec's FP8AdamW (MS-AMP O2) is a valid client optimizer: ZeRO 1-3 step it on flat fp32
partitions and checkpoint its state per rank (docs/LOG.md, dsopt entry). Each partition concatenates
many parameters, so :func:`mark_partition_segments` tells FP8AdamW where they start (its FP8
blocks must not mix a parameter with a neighbour 1e5x larger). The one ZeRO feature that
cannot hold it is ``elastic_checkpoint``, which re-slices every state tensor by element count
(blockwise scales are not per element; measured: the checkpoint then fails to load with a bare
AssertionError): :func:`check_client_optimizer` rejects it up front.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

from lowprec.config.deepspeed_schema import check_deepspeed_config, deepspeed_config_error
from lowprec.logs import log_once

logger = logging.getLogger("lowprec")

__all__ = [
    "build_ds_config",
    "check_client_optimizer",
    "check_deepspeed_config",
    "deepspeed_config_error",
    "deepspeed_clip",
    "deepspeed_initialize",
    "mark_partition_segments",
    "DeepSpeedOptimizer",
]


def build_ds_config(
    plugin: Any,
    mixed_precision: str,
    micro_batch_size: int,
    accumulation_steps: int,
    world: int,
    skip_nonfinite: bool = False,
) -> dict:
    """The DeepSpeed config: the user's ``hf_ds_config`` with precision, ZeRO stage, batch sizes
    and clipping filled in where it does not set them; a conflicting precision is an error.
    ``skip_nonfinite`` (the non-finite guard is on) needs DeepSpeed's own bf16 overflow check."""
    cfg = copy.deepcopy(plugin.hf_ds_config or {})
    want_bf16 = mixed_precision in ("bf16", "fp8")  # FP8 sits on bf16, as in Accelerate
    want_fp16 = mixed_precision == "fp16"
    for key, want in (("bf16", want_bf16), ("fp16", want_fp16)):
        section = cfg.setdefault(key, {})
        if "enabled" in section and bool(section["enabled"]) != want:
            raise ValueError(
                f"DeepSpeed config has {key}.enabled={section['enabled']} but mixed_precision="
                f"{mixed_precision!r}; make them agree (fp8 trains on bf16)"
            )
        section["enabled"] = want
    if skip_nonfinite and want_bf16:
        if cfg["bf16"].get("check_grad_overflow") is False:
            raise ValueError(
                "DeepSpeed config has bf16.check_grad_overflow=false, so DeepSpeed would apply steps "
                "with NaN/inf gradients, but lowprec's non-finite guard is on: remove the key, or pass "
                "Accelerator(skip_nonfinite_steps=False) (trainer: skip_nonfinite_steps: false)"
            )
        cfg["bf16"]["check_grad_overflow"] = True
    zero = cfg.setdefault("zero_optimization", {})
    zero.setdefault("stage", plugin.zero_stage)
    for key, device in (
        ("offload_optimizer", plugin.offload_optimizer_device),
        ("offload_param", plugin.offload_param_device),
    ):
        if device not in (None, "none"):
            zero.setdefault(key, {"device": device})
    cfg.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
    cfg.setdefault("gradient_accumulation_steps", accumulation_steps)
    cfg.setdefault("train_batch_size", micro_batch_size * accumulation_steps * world)
    if plugin.gradient_clipping is not None:
        cfg.setdefault("gradient_clipping", plugin.gradient_clipping)
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 10**9)
    return cfg


def check_client_optimizer(optimizer: Any, config: dict) -> None:
    """Reject DeepSpeed settings that would silently corrupt FP8AdamW's compressed state."""
    # lowprec.optim imports torch.distributed.tensor (~0.4 s), and the Accelerator imports this module
    from lowprec.optim import FP8AdamW

    if not isinstance(optimizer, FP8AdamW):
        return
    if (config.get("zero_optimization") or {}).get("elastic_checkpoint"):
        raise ValueError(
            "DeepSpeed zero_optimization.elastic_checkpoint=true cannot hold lowprec's FP8AdamW "
            "state (MS-AMP O2): it re-slices optimizer state by element (FP8 block scales are "
            "not per element) and such a checkpoint fails to load. Set elastic_checkpoint to "
            "false (the default)"
        )


def deepspeed_initialize(model: Any, optimizer: Any, config: dict) -> tuple[Any, Any]:
    check_client_optimizer(optimizer, config)
    try:
        import deepspeed
    except ImportError:
        raise ValueError(
            "DeepSpeed was asked for (deepspeed_plugin / ACCELERATE_USE_DEEPSPEED) but is not "
            "installed: pip install 'lowprec[deepspeed]' (on CPU also set DS_ACCELERATOR=cpu)"
        ) from None
    _no_shm_build_on_cpu(deepspeed)
    try:
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except Exception as exc:
        line = deepspeed_config_error(exc, config, "DeepSpeed config")
        if line is None:
            raise
        raise ValueError(line) from None
    mark_partition_segments(ds_optimizer)
    return engine, ds_optimizer


def _no_shm_build_on_cpu(deepspeed: Any) -> None:
    """On its CPU accelerator, DeepSpeed's communication backend JIT-compiles a shared-memory
    all-reduce (``deepspeed_shm_comm``) when it starts: about a minute of C++ on two cores, which
    needs a compiler, and again whenever the cached build's command differs (two commands were
    seen alternating on one machine, 40-200 s a build). Only DeepSpeed's inference all-reduce uses
    it; ZeRO training sends its collectives through ``torch.distributed``. So it is marked
    unavailable before ``deepspeed.initialize`` and never built (said once)."""
    try:
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            return
        compatible = deepspeed.ops.__compatible_ops__
    except (ImportError, AttributeError):  # another DeepSpeed: leave it as it is
        return
    if compatible.get("deepspeed_shm_comm"):
        compatible["deepspeed_shm_comm"] = False
        log_once(
            "lowprec: DeepSpeed on CPU: its shared-memory all-reduce op (used by inference only) is neither "
            "compiled nor used; ZeRO's collectives go through torch.distributed",
            logging.INFO,
        )


def _overlaps(lengths: list[int], start: int, end: int) -> list[int]:
    """Lengths of the pieces of consecutive intervals (``lengths`` from 0) inside [start, end)."""
    out, cur = [], 0
    for n in lengths:
        piece = min(cur + n, end) - max(cur, start)
        if piece > 0:
            out.append(piece)
        cur += n
    if end > max(cur, start):  # the group's trailing alignment padding
        out.append(end - max(cur, start))
    return out


def _zero_partitions(zo: Any) -> list[tuple[Any, list[int]]]:
    """(flat fp32 partition, lengths of the model parameters' pieces in it) for ZeRO 1-2 and 3."""
    import torch.distributed as dist

    if hasattr(zo, "single_partition_of_fp32_groups"):  # ZeRO 1-2: flat group, cut into equal parts
        out = []
        for i, flat in enumerate(zo.single_partition_of_fp32_groups):
            tensors = zo.round_robin_bit16_groups[i]
            pads = getattr(zo, "round_robin_bit16_padding", None)
            pads = pads[i] if pads else [0] * len(tensors)
            lengths = [n for t, pad in zip(tensors, pads) for n in (t.numel(), pad)]
            start = int(zo.partition_size[i]) * dist.get_rank(group=zo.real_dp_process_group[i])
            out.append((flat, _overlaps(lengths, start, start + flat.numel())))
        return out
    if hasattr(zo, "fp32_partitioned_groups_flat"):  # ZeRO 3: each parameter's own partition, end to end
        return [
            (flat, [t.numel() for t in zo.fp16_partitioned_groups[i]])
            for i, flat in enumerate(zo.fp32_partitioned_groups_flat)
        ]
    return []


def mark_partition_segments(ds_optimizer: Any) -> int:
    """Tell an FP8AdamW client optimizer where each model parameter starts inside ZeRO's flat
    fp32 partitions (``lowprec.optim.set_block_segments``); returns how many partitions were
    marked. A layout this code does not recognise is logged and left unsegmented (FP8AdamW then
    runs its blocks over the flat partition: correct, less precise at parameter boundaries)."""
    from lowprec.optim import FP8AdamW, set_block_segments  # torch.distributed.tensor: as check_client_optimizer

    client = getattr(ds_optimizer, "optimizer", None)
    if not isinstance(client, FP8AdamW) or client.block_size is None:
        return 0
    marked = 0
    for flat, lengths in _zero_partitions(ds_optimizer):
        if client.state.get(flat) or sum(lengths) != flat.numel():
            logger.warning(
                "lowprec: FP8AdamW under DeepSpeed: could not map a ZeRO partition of %d elements "
                "to model parameters; its FP8 blocks run across parameter boundaries",
                flat.numel(),
            )
            continue
        set_block_segments(flat, lengths)
        marked += 1
    return marked


class DeepSpeedOptimizer:
    """What ``prepare`` returns for the optimizer under DeepSpeed: ``step`` runs the engine's step
    (DeepSpeed decides on accumulation boundaries), ``zero_grad`` is the engine's business.

    The non-finite guard (:mod:`lowprec.utils.nonfinite`): DeepSpeed ZeRO 1-3 already refuse to
    apply a step whose gradients hold NaN/inf, under every precision (fp16: its loss scaler; bf16
    and fp32: ``bf16.check_grad_overflow`` and the invalid-norm test, DeepSpeed >= 0.16), and
    clear the gradients; ``Accelerator.backward`` turns a non-finite loss into NaN gradients
    (``nan_if_nonfinite``) so a finite-gradient ``loss + inf`` is refused the same way. Here
    each accumulation boundary is counted, a refused step skips the backend's after-step hook,
    is logged, and counts toward ``max_consecutive_skipped_steps`` like elsewhere."""

    def __init__(self, engine: Any, optimizer: Any, guard: Any = None) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.guard = guard
        self.scaler = None
        self.unscaled = False
        self.after_step: Optional[Any] = None
        self.after_skip: Optional[Any] = None  # a refused step: the backend discards its FP8 amaxes
        self._skipped = False

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)

    def step(self, closure: Any = None) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        if not boundary:
            return None
        self._skipped = not self.engine.was_step_applied()
        hook = self.after_skip if self._skipped else self.after_step
        if hook is not None:
            hook()
        if self.guard is None:
            return None
        counts, why = True, "loss or gradients not finite (DeepSpeed refused the step)"
        if self._skipped and self.engine.fp16_enabled():
            # an overflow under a large loss scale is the scaler's normal work (as for GradScaler)
            scale = float(getattr(self.optimizer, "loss_scale", 1.0))
            counts = self.guard.loss_was_nonfinite() or scale < 1.0
            why = f"DeepSpeed's loss scaler found inf/nan (scale lowered to {scale:g})"
        self.guard.record(self._skipped, counts=counts, why=why)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine zeroes gradients at each boundary

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last accumulation boundary's update was refused (inf/nan)."""
        return self._skipped

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


def deepspeed_clip(engine: Any, max_norm: float) -> None:
    """DeepSpeed clips inside its own step (the gradients are partitioned by then): hand it
    ``max_norm`` for the step that follows. The norm is known only after that step
    (``engine.get_global_grad_norm()``, what ``Accelerator.clip_grad_norm_`` returns)."""
    engine._config.gradient_clipping = max_norm
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = max_norm
    return None
