"""The training loop of ``lowprec train``: optimizer steps, logging windows, evaluation, checkpoints.

``trainer.train`` sets a run up (data, model, resume) and hands a :class:`Run` to
:func:`run_loop`; everything the loop changes lives on :class:`Loop` (the current logging
window) and on the run's ``TrainerState`` (what a checkpoint saves).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

import torch

from lowprec.errors import NonFiniteError
from lowprec.train import checkpoints as ckpt
from lowprec.train.config import TrainConfig
from lowprec.train.metrics import MetricsWriter, peak_memory_mb
from lowprec import fp8 as fp8_engine
from lowprec.train.metrics import truncate_after
from lowprec.train.spikes import SpikeDetector

logger = logging.getLogger("lowprec")

__all__ = ["Run", "Loop", "run_loop", "evaluate"]


@dataclass
class Run:
    """What the phases of one training run share (built once by ``trainer.train``)."""

    cfg: TrainConfig
    acc: Any
    output_dir: str
    total: int
    label: str
    model: torch.nn.Module
    inner: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any
    val_loader: Any
    state: ckpt.TrainerState
    writer: MetricsWriter = field(init=False)  # opened by the trainer once a resume has cut metrics.jsonl back
    fp8_layers: bool
    main: bool
    fp8_nothing_converted: bool = False  # fp8: true on lowprec's engine, and no layer converted
    model_config: Any = None
    tokenizer: Any = None  # saved next to a Hugging Face model's export
    on_log: Optional[Callable[[dict], None]] = None
    eval_every: Optional[int] = None  # eval_steps, or resolved from evals_per_epoch
    save_every: Optional[int] = None  # save_steps, or resolved from saves_per_epoch
    table: Any = None  # generations.EvalTable with eval_table_size
    health: Any = None  # lowprec.fp8.observe.guard.HealthMonitor (fp8_health / fp8_guard)
    on_move: Optional[Callable[[], None]] = None  # fp8_guard: act moved a layer (rewrite the conversion report)
    kept_moves: list = field(default_factory=list)  # a checkpoint's moves, resumed with fp8_guard off

    def stop_line(self, text: str) -> str:
        last = ckpt.latest_checkpoint(self.output_dir)
        none = "none yet" if self.save_every else "none (set save_steps to write checkpoints)"
        return f"{text}; last good checkpoint: {last or none}"


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, n_batches: int, accelerator) -> float:
    """Mean validation loss over the first ``n_batches`` batches (the same ones every time)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    loader.set_epoch(0)
    for i, batch in enumerate(loader):
        if i >= n_batches:
            break
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        total[0] += model(**batch).loss.double()
        total[1] += 1
    total = accelerator.reduce(total, "sum")
    model.train(was_training)
    return float(total[0] / total[1])


def _experts_summary(tele: dict[str, dict]) -> dict[str, dict]:
    """Per experts module: the tokens each expert took and the busiest expert's share of them
    (1 / n_experts when the router balances the load)."""
    out = {}
    for name, entry in tele.items():
        tokens = entry["tokens"]
        total = sum(tokens)
        out[name] = {"tokens": tokens, "max_share": max(tokens) / total if total else 0.0}
    return out


def _telemetry_summary(tele: dict) -> dict:
    return {
        layer: {op: {k: float(f"{v:.6g}") for k, v in stats.items()} for op, stats in ops.items()}
        for layer, ops in tele.items()
    }


@dataclass
class Loop:
    """The loop's counters: the current logging window and the last losses."""

    run: Run
    tokens_per_step: int
    batches: Any
    bar: Any = None
    skipped: int = 0
    last_train: Optional[float] = None
    last_eval: Optional[float] = None
    window_steps: int = 0
    window_tokens: int = 0
    window_t0: float = field(default_factory=time.perf_counter)
    # the window's loss sum; run_loop puts it on the accelerator's device
    window_loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    high_loss_steps: int = 0  # loss_watchdog: optimizer steps in a row above the threshold
    best_eval: Optional[float] = None
    evals_without_gain: int = 0  # early_stopping_patience
    stop_early: bool = False
    untrained: bool = False  # this step's micro-batches had no label to learn (all -100)
    spikes: Any = None  # spikes.SpikeDetector with loss_spike
    rollbacks: int = 0  # loss_spike: act, in this process
    rolled_back: bool = False  # the last optimizer_step ended in a rollback

    def optimizer_step(self) -> tuple[float, Optional[torch.Tensor]]:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the
        learning rate it used and the grad norm when clipped. Adds its mean loss to the window."""
        run = self.run
        cfg, acc, model, optimizer = run.cfg, run.acc, run.model, run.optimizer
        step_loss = torch.zeros((), dtype=torch.float64, device=acc.device)
        grad_norm = None
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
        seen = 0  # tokens in this step's batches (rows may be shorter than sequence_len when padded to the longest)
        self.untrained = True  # until a micro-batch of this step has a label to learn
        for _ in range(cfg.gradient_accumulation_steps):
            raw = next(self.batches)
            labels = raw.get("labels")  # on the CPU still: counting costs no device sync
            self.untrained = self.untrained and labels is not None and not bool((labels[..., 1:] != -100).any())
            batch = {k: v.to(acc.device, non_blocking=True) for k, v in raw.items()}
            seen += batch["input_ids"].numel()
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                step_loss += loss.detach().double()
                if acc.sync_gradients:
                    if cfg.max_grad_norm is not None:
                        grad_norm = acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    self._step_optimizer()
        run.state.step += 1
        step_tokens = seen * acc.num_processes  # = tokens_per_step for fixed-length blocks
        run.state.tokens += step_tokens
        if cfg.loss_watchdog_threshold is not None:
            self._watch(float(acc.reduce(step_loss / cfg.gradient_accumulation_steps, "mean")))
        self.rolled_back = False
        if self.spikes is not None:
            loss = float(acc.reduce(step_loss / cfg.gradient_accumulation_steps, "mean"))
            hit = self.spikes.observe(loss)
            if hit is not None and self._spike(loss, *hit):
                return lr, grad_norm
        self.window_loss += step_loss / cfg.gradient_accumulation_steps
        self.window_steps += 1
        self.window_tokens += step_tokens
        return lr, grad_norm

    def _spike(self, loss: float, z: float, median: float) -> bool:
        """A loss spike at this step (``spikes.py``): log it; with act, roll back. True when rolled back."""
        import logging

        run, log = self.run, logging.getLogger("lowprec")
        cfg, step = run.cfg, run.state.step
        rec = {"kind": "loss_spike", "step": step, "loss": loss, "z": z, "median": median, "rolled_back_to": None}
        path = ckpt.latest_checkpoint(run.output_dir) if cfg.loss_spike == "act" else None
        what = f"loss spike at step {step}: loss {loss:.4g}, robust z {z:.3g} over the last {cfg.loss_spike_window} steps (median {median:.4g})"
        if cfg.loss_spike == "act" and self.rollbacks >= cfg.loss_spike_max_rollbacks:
            raise NonFiniteError(
                f"loss_spike: {what}, after {self.rollbacks} rollback(s) (loss_spike_max_rollbacks: "
                f"{cfg.loss_spike_max_rollbacks}); lower the learning rate or check the data"
            )
        if path is None:
            if run.main:
                log.warning(
                    "lowprec: %s%s",
                    what,
                    "; no checkpoint to roll back to yet (set save_steps)" if cfg.loss_spike == "act" else "",
                )
            run.writer.write(rec)
            return False
        self.rollbacks += 1
        run.acc.load_state(path)  # weights, optimizer, schedule, RNG, FP8 state, data position, TrainerState
        back = run.state.step
        if run.main:
            log.warning(
                "lowprec: %s; rolled back to %s and skipping the %d step(s) of batches after it (rollback %d of %d)",
                what,
                path,
                step - back,
                self.rollbacks,
                cfg.loss_spike_max_rollbacks,
            )
        if run.health is not None:  # the checkpoint's moves, not the ones made since
            run.health.clear_moves()
            run.health.load_state_dict(run.state.fp8_guard or {})
        if run.state.loop is not None:
            self.restore_window(run.state.loop)
        self.batches = run.loader.forever()
        for _ in range((step - back) * cfg.gradient_accumulation_steps):  # PaLM: skip the batches that spiked
            next(self.batches)
        if run.main:  # metrics.jsonl as at the checkpoint, then the spike
            tb = run.writer._tb is not None
            run.writer.close()
            truncate_after(run.output_dir, back)
            run.writer = MetricsWriter(run.output_dir, True, tb, append=True, step=back)
        run.writer.write({**rec, "rolled_back_to": back})
        if self.bar is not None:
            self.bar.n = back
            self.bar.refresh()
        self.rolled_back = True
        return True

    def _watch(self, loss: float) -> None:
        """Axolotl's loss watchdog: a loss above the threshold for ``patience`` steps in a row
        means training has broken down; stop (exit code 3) instead of burning the budget."""
        cfg = self.run.cfg
        threshold = cast(float, cfg.loss_watchdog_threshold)  # optimizer_step calls _watch only when it is set
        self.high_loss_steps = self.high_loss_steps + 1 if loss > threshold else 0
        patience = cfg.loss_watchdog_patience or 3
        if self.high_loss_steps >= patience:
            raise NonFiniteError(
                f"loss_watchdog: training loss above loss_watchdog_threshold: {cfg.loss_watchdog_threshold} for "
                f"{patience} steps in a row (last {loss:.4g} at step {self.run.state.step}); lower the learning rate "
                "or raise the threshold"
            )

    def _step_optimizer(self) -> None:
        run = self.run
        try:
            run.optimizer.step()
        except NonFiniteError:  # the last skip of too many in a row: count it too
            run.writer.write({"kind": "skip", "step": run.state.step + 1, "skipped_steps": self.skipped + 1})
            if self.untrained:  # mean loss over 0 tokens = NaN: not a learning-rate problem
                raise NonFiniteError(
                    f"no trainable tokens in the batch at step {run.state.step + 1} (every label is -100, so the "
                    "loss is 0/0 = NaN): check the data (train_on_inputs, roles_to_train, a damaged "
                    "dataset_prepared_path cache)"
                ) from None
            raise
        if run.acc.optimizer_step_was_skipped:  # NaN/inf loss or gradients, every precision
            self.skipped += 1
            run.writer.write({"kind": "skip", "step": run.state.step + 1, "skipped_steps": self.skipped})
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)

    def log_window(self, lr: float, grad_norm) -> None:
        run = self.run
        acc, state = run.acc, run.state
        loss_mean = float(acc.reduce(self.window_loss / self.window_steps, "mean"))
        elapsed = time.perf_counter() - self.window_t0
        state.train_time_s += elapsed
        rec = {
            "kind": "train",
            "step": state.step,
            "loss": loss_mean,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens": state.tokens,
            "skipped_steps": self.skipped,  # optimizer steps skipped for NaN/inf (the fp16 scaler's too)
            "tokens_per_s": self.window_tokens / max(elapsed, 1e-9),
            "peak_mem_mb": peak_memory_mb(acc.device),
            "epoch": run.loader.epoch + run.loader.position / max(1, len(run.loader)),
        }
        run.writer.write(rec)
        self.last_train = loss_mean
        if run.on_log is not None and run.main:
            run.on_log(rec)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{loss_mean:.4f}",
                tok_s=f"{rec['tokens_per_s']:.0f}",
                lr=f"{rec['lr']:.2e}",
                mem=f"{rec['peak_mem_mb']:.0f}MB",
                refresh=False,
            )
        if run.fp8_layers:
            tele = fp8_engine.telemetry(run.inner)
            record: dict[str, Any] = {"kind": "fp8", "step": state.step, "layers": _telemetry_summary(tele)}
            experts = _experts_summary(fp8_engine.expert_telemetry(run.inner))
            if experts:  # MoE: tokens routed to each expert in the step's last forward
                record["experts"] = experts
            run.writer.write(record)
            fp8_engine.disable_telemetry(run.inner)
            if run.health is not None:
                self._check_health(tele)
        self.window_loss.zero_()
        self.window_steps, self.window_tokens, self.window_t0 = 0, 0, time.perf_counter()

    def _check_health(self, tele: dict) -> None:
        run = self.run
        moved = False
        for rec in run.health.check(run.state.step, tele):
            run.writer.write(rec)
            moved = moved or bool(rec.get("moved"))
        if moved and run.on_move is not None and run.main:
            run.on_move()

    def eval_and_save(self) -> None:
        run = self.run
        cfg, state = run.cfg, run.state
        at_end = state.step == run.total
        if run.val_loader is not None and ((run.eval_every is not None and state.step % run.eval_every == 0) or at_end):
            t = time.perf_counter()
            self.last_eval = evaluate(run.model, run.val_loader, cfg.eval_batches, run.acc)
            run.writer.write({"kind": "eval", "step": state.step, "loss": self.last_eval})
            if run.main:  # above the progress bar when there is one
                said = f"lowprec: step {state.step}: validation loss {self.last_eval:.4f}"
                if self.bar is not None:
                    self.bar.write(said, file=sys.stderr)
                else:
                    logger.info(said)
            if run.table is not None:  # every process generates (a sharded forward needs them all)
                record = run.table.generate(run.model, state.step, run.acc.device, run.acc.num_processes)
                run.writer.write(record)
                if run.main:
                    run.table.write(record)
            self._early_stopping(self.last_eval)
            at_end = at_end or self.stop_early
            self.window_t0 += time.perf_counter() - t  # evaluation time is not training time
        if run.save_every is not None and (state.step % run.save_every == 0 or at_end):
            t = time.perf_counter()
            state.loop = self.window_state()
            state.fp8_guard = (
                run.health.state_dict()
                if run.health is not None
                else ({"moved": run.kept_moves} if run.kept_moves else None)
            )
            run.acc.save_state(ckpt.checkpoint_dir(run.output_dir, state.step))
            if run.main:
                ckpt.rotate(run.output_dir, cfg.save_total_limit)
            self.window_t0 += time.perf_counter() - t

    # the counters a checkpoint keeps (the window's loss sum and time apart)
    _SAVED = ("window_steps", "window_tokens", "skipped", "high_loss_steps", "best_eval", "evals_without_gain")

    def window_state(self) -> dict[str, Any]:
        """The open logging window and the loop's counters, for the checkpoint (JSON numbers and
        one float64 tensor: exact). Each process's loss sum is averaged over the processes first,
        since only the main process writes it: one process resumes bit-exactly, several to
        rounding (the mean of sums is taken in another order)."""
        acc = self.run.acc
        loss = self.window_loss.clone()
        if acc.num_processes > 1:
            loss = acc.reduce(loss, "mean")
        return {
            "window_loss": loss.cpu(),
            "window_s": time.perf_counter() - self.window_t0,
            **{k: getattr(self, k) for k in self._SAVED},
        }

    def restore_window(self, saved: dict[str, Any]) -> None:
        self.window_loss.copy_(saved["window_loss"])
        self.window_t0 = time.perf_counter() - float(saved["window_s"])
        for k in self._SAVED:
            setattr(self, k, saved[k])

    def _early_stopping(self, loss: float) -> None:
        """Hugging Face's EarlyStoppingCallback rule: stop after ``early_stopping_patience``
        evaluations in a row without a lower validation loss."""
        patience = self.run.cfg.early_stopping_patience
        if patience is None:
            return
        if self.best_eval is None or loss < self.best_eval:
            self.best_eval, self.evals_without_gain = loss, 0
            return
        self.evals_without_gain += 1
        if self.evals_without_gain >= patience:
            self.stop_early = True
            if self.run.main:
                import logging

                logging.getLogger("lowprec").warning(
                    "lowprec: early stopping at step %d: validation loss %.4f has not improved on %.4f for %d "
                    "evaluations (early_stopping_patience: %d)",
                    self.run.state.step,
                    loss,
                    self.best_eval,
                    patience,
                    patience,
                )


class SigintLatch:
    """Ctrl-C during the loop stops it at the end of the step; a second Ctrl-C stops it at once.

    Python's default handler raises ``KeyboardInterrupt`` wherever the main thread is, and Python
    prints and drops an exception raised inside a weakref callback or ``__del__`` ("Exception
    ignored in ..."); such finalizers run at arbitrary points of a step (the shared-cast slots'),
    and the full suite once caught a Ctrl-C lost that way: the run went on and ended with exit 0.
    So the first Ctrl-C only sets a flag (and says so), which the loop turns into
    ``KeyboardInterrupt`` at the next step boundary: the usual summary and resume line follow. Only
    Python's default handler is replaced (a launcher's or a user's own is left alone), in the main
    thread, and it is restored when the loop ends."""

    def __init__(self) -> None:
        self.hit = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.hit:  # the second Ctrl-C: now
            raise KeyboardInterrupt
        self.hit = True
        sys.stderr.write("\nlowprec: stopping at the end of this step (Ctrl-C again to stop now)\n")

    def __enter__(self) -> "SigintLatch":
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def run_loop(run: Run) -> Loop:
    """Train from ``run.state.step`` to ``run.total``; returns the loop (its last losses)."""
    cfg, acc = run.cfg, run.acc
    tokens_per_step = (
        cfg.micro_batch_size
        * cfg.sequence_len
        * cfg.gradient_accumulation_steps
        * acc.num_processes
        // cfg.tensor_parallel_size
    )
    loop = Loop(run, tokens_per_step, run.loader.forever())
    loop.window_loss = torch.zeros((), dtype=torch.float64, device=acc.device)
    if cfg.loss_spike != "off":
        loop.spikes = SpikeDetector(cfg.loss_spike_window, cfg.loss_spike_zscore)
    if run.state.loop is not None:  # resumed mid-window: the window goes on, not restarts
        loop.restore_window(run.state.loop)
    if run.main and cfg.progress_bar:
        from tqdm.auto import tqdm

        loop.bar = tqdm(
            total=run.total, initial=run.state.step, desc=f"train {run.label}", unit="step", dynamic_ncols=True
        )
    run.model.train()
    latch = SigintLatch()
    try:
        latch.__enter__()
        while run.state.step < run.total and not loop.stop_early:
            if latch.hit:  # Ctrl-C during the last step
                raise KeyboardInterrupt
            logging_now = (run.state.step + 1) % cfg.logging_steps == 0 or run.state.step + 1 == run.total
            if run.fp8_layers and logging_now:
                fp8_engine.enable_telemetry(run.inner)
                if run.health is not None:
                    run.health.arm(run.state.step + 1)
            lr, grad_norm = loop.optimizer_step()
            if loop.rolled_back:  # loss_spike: act restored a checkpoint: nothing of this step is logged
                if run.fp8_layers and logging_now:
                    fp8_engine.disable_telemetry(run.inner)
                    if run.health is not None:
                        run.health.probe.take()
                continue
            if logging_now:
                loop.log_window(lr, grad_norm)
            if loop.bar is not None:
                loop.bar.update(1)
            loop.eval_and_save()
        if latch.hit:  # Ctrl-C during the last step: stopped there, nothing more runs
            raise KeyboardInterrupt
    finally:
        latch.__exit__()
        if loop.bar is not None:
            loop.bar.close()
    return loop
