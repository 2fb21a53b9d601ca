"""The non-finite guard: a step whose loss or gradients hold NaN/inf does not touch the weights.

fp16's GradScaler already skips such steps (its reason to exist is overflow); under fp32, bf16
and FP8 nothing did, and one NaN step left the weights NaN for good. The guard works for every
precision:

* ``Accelerator.backward`` ORs "this loss is not finite" into a device flag (no host sync);
* at the optimizer step, one fused kernel per (device, dtype) checks every gradient
  (``torch._amp_foreach_non_finite_check_and_unscale_`` with scale 1, the kernel GradScaler
  uses), the flags are summed on the device and, with several processes, all-reduced (FSDP2
  shards hold different gradients; every process must take the same decision);
  inside ``Accelerator.join_uneven_inputs`` (DDP) there is no all-reduce: a process out of
  batches shadows DDP's collectives only; DDP's gradients are the same everywhere and a
  non-finite loss is made NaN before ``backward``, so every process decides alike;
* the decision costs one host read per optimizer step, the same one GradScaler makes in
  ``scaler.step``; under a GradScaler the scaler's own decision is used and nothing is added;
* a skipped step skips the optimizer and the backend's after-step hook (FP8 weight casts, MS-AMP
  state), and the LR scheduler with it; the backend's after-skip hook undoes what the step
  recorded in FP8 scaling state (the native engine: ``lowprec.fp8.step_stage``: amaxes, scales
  and counters back to their values before the step, bit for bit);
* every skip is logged once, with its step; after ``max_consecutive`` skips in a row
  :class:`~lowprec.errors.NonFiniteError` stops the run (the trainer exits with code 3);
* DeepSpeed engines step themselves and refuse NaN/inf gradients on their own: there the
  loss is made NaN when it is not finite (:meth:`NonFiniteGuard.nan_if_nonfinite`) and the
  wrapper (``lowprec.utils.deepspeed.DeepSpeedOptimizer``) counts DeepSpeed's decision.

:meth:`NonFiniteGuard.check_model` refuses to save or export a model with non-finite weights; it
reads each process's own part (FSDP2 shards, ZeRO-3 partitions) and all-reduces the verdict.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, cast

import torch

from lowprec.errors import NonFiniteError

__all__ = ["NonFiniteGuard", "nonfinite_flag"]

logger = logging.getLogger("lowprec")

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The process's own part of a DTensor (FSDP2) or of a ZeRO-3 parameter (whose ``data`` is an
    empty placeholder outside forward/backward; ``ds_tensor`` is this process's partition); the
    tensor itself otherwise."""
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    t = cast(Any, t).ds_tensor if getattr(t, "ds_tensor", None) is not None else t
    return t.coalesce().values() if t.is_sparse else t


def nonfinite_flag(tensors: Iterable[torch.Tensor], device: torch.device, fused: bool = False) -> torch.Tensor:
    """A float tensor on ``device``: > 0 when any of ``tensors`` holds a NaN or an inf. No sync.

    ``fused=True`` uses GradScaler's fused check, which multiplies by 1 in place (gradients
    only, never parameters: bit-exact, but an in-place write)."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        t = _local(t)
        # FP8 storage has no inf; a meta tensor (offloaded by a big-model dispatch) has no values here
        if t.is_floating_point() and t.numel() and t.element_size() > 1 and not t.is_meta:
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (dev, dtype), ts in groups.items():
        if fused and dtype in _FUSED_DTYPES:
            found = torch.zeros(1, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(ts, found, torch.ones((), dtype=torch.float32, device=dev))
            part = found[0]
        else:
            part = torch.stack([(~torch.isfinite(t)).any() for t in ts]).any().float()
        flag = flag + part.to(device)
    return flag


def _saved_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers (FP8 scaling state): what a checkpoint holds. Telemetry
    buffers are not saved and may rightly record the inf they saw."""
    out: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    for prefix, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, b))
    return out


class NonFiniteGuard:
    """Per-Accelerator state of the guard: the pending loss flag and the skip counters."""

    def __init__(
        self,
        enabled: bool = True,
        max_consecutive: Optional[int] = 3,
        distributed: bool = False,
        device: Optional[torch.device] = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"skip_nonfinite_steps={enabled!r}: use True or False")
        if max_consecutive is not None and (
            isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1
        ):
            raise ValueError(
                f"max_consecutive_skipped_steps={max_consecutive!r}: use an integer >= 1 (or None: never stop)"
            )
        self.enabled = enabled
        self.max_consecutive = max_consecutive
        self.distributed = distributed
        self.device = device or torch.device("cpu")
        self._loss_flag: Optional[torch.Tensor] = None
        # True inside ``join_uneven_inputs`` under DDP: a process that ran out of batches shadows
        # DDP's collectives only, so the decision must take none of its own. DDP's all-reduce
        # leaves the same gradients on every process, and ``backward`` makes a non-finite loss
        # reach them as NaN (``nan_if_nonfinite``): each process decides alone, all alike.
        self.ranks_agree = False
        self.optimizer_steps = 0  # optimizer.step() calls at sync points, 1-based in messages
        self.skipped = 0
        self.consecutive = 0

    # -------------------------------------------------------------- during the step
    def note_loss(self, loss: Any) -> None:
        """Remember (on the device) whether ``loss`` is finite; called by ``backward``."""
        if not self.enabled or not isinstance(loss, torch.Tensor):
            return
        bad = (~torch.isfinite(loss.detach())).any().float()
        self._loss_flag = bad if self._loss_flag is None else self._loss_flag + bad.to(self._loss_flag.device)

    def nan_if_nonfinite(self, loss: Any) -> Any:
        """``loss`` times 1, or times NaN when it is not finite (device-side, no sync): engines
        that run their own overflow check on the gradients (DeepSpeed) then refuse a step whose
        loss alone was not finite (``loss + inf`` has finite gradients). Bit-exact otherwise."""
        if not self.enabled or not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            return loss
        ok = torch.isfinite(loss.detach()).all()
        return loss * torch.where(
            ok,
            torch.ones((), dtype=loss.dtype, device=loss.device),
            torch.full((), float("nan"), dtype=loss.dtype, device=loss.device),
        )

    def _reduce(self, flag: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def step_is_nonfinite(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this optimizer step must be skipped (one host read)."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        flag = nonfinite_flag(grads, self.device, fused=True)
        if self._loss_flag is not None:
            flag = flag + self._loss_flag.to(flag.device)
        return bool((flag if self.ranks_agree else self._reduce(flag)).item() > 0)

    def loss_flag_pending(self) -> bool:
        return self._loss_flag is not None

    def fold_into_scaler(self, scaler: Any, optimizer: Any) -> None:
        """Add the loss flag to GradScaler's per-device found-inf tensors of ``optimizer`` (set by
        ``unscale_``; private but stable since torch 1.6), so ``scaler.step`` skips on it too."""
        infs = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device") or {}
        for found in infs.values():
            found.add_(cast(torch.Tensor, self._loss_flag).to(found.device))  # set: loss_flag_pending()
            break

    def loss_was_nonfinite(self) -> bool:
        """Host read of the loss flag; only called after a scaler already skipped the step."""
        return self._loss_flag is not None and bool(self._loss_flag.item() > 0)

    def _is_main(self) -> bool:
        import torch.distributed as dist

        return not (self.distributed and dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def record(self, skipped: bool, counts: bool = True, why: str = "loss or gradients not finite") -> None:
        """Count an optimizer step; log a skip; stop after too many in a row.

        ``counts=False``: a skip that does not count toward the stop (the fp16 scaler lowering
        its scale after an overflow is the scaler working, not a broken run)."""
        self.optimizer_steps += 1
        self._loss_flag = None
        if not skipped:
            self.consecutive = 0
            return
        self.skipped += 1
        if counts:
            self.consecutive += 1
        if self._is_main():  # every process takes the same (all-reduced) decision: say it once
            logger.warning(
                "lowprec: optimizer step %d: %s; step skipped, weights unchanged (%d skipped in a row, %d in all)",
                self.optimizer_steps,
                why,
                self.consecutive,
                self.skipped,
            )
        if self.enabled and counts and self.max_consecutive is not None and self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{self.consecutive} consecutive optimizer steps (up to step {self.optimizer_steps}) had "
                f"non-finite loss or gradients (limit max_consecutive_skipped_steps={self.max_consecutive}); "
                "the run diverged: lower the learning rate or check the data, then resume from the last good checkpoint"
            )

    # -------------------------------------------------------------- saving
    @torch.no_grad()
    def check_model(self, model: Any, what: str) -> None:
        """Raise :class:`NonFiniteError` if ``model``'s parameters or buffers are not finite."""
        if not isinstance(model, torch.nn.Module):
            return
        named = _saved_tensors(model)
        flag = nonfinite_flag([t for _, t in named], self.device)
        if not self._reduce(flag).item() > 0:
            return
        name = next(
            (
                n
                for n, t in named
                if _local(t).is_floating_point()
                and _local(t).element_size() > 1
                and not torch.isfinite(_local(t)).all()
            ),
            "a tensor of another process",
        )
        raise NonFiniteError(
            f"{what}: the model's weights are not finite ({name} holds NaN/inf); nothing was saved, so "
            "the last good checkpoint stays as it was"
        )
