"""Experiment trackers, Accelerate-named: ``Accelerator(log_with="tensorboard", project_dir=...)``,
``init_trackers``, ``log``, ``get_tracker``, ``end_training``.

TensorBoard writes real event files (``torch.utils.tensorboard``); Weights & Biases, MLflow and
Comet run when their package is installed. Asking for a tracker whose package is missing is an
error naming the package (never a silent no-op); ``log_with="all"`` takes the installed ones.
Trackers run on the main process only.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from lowprec.utils.dataclasses import LoggerType
from lowprec.utils.imports import is_comet_ml_available, is_mlflow_available, is_tensorboard_available, is_wandb_available

__all__ = ["GeneralTracker", "TensorBoardTracker", "WandBTracker", "MLflowTracker", "CometMLTracker",
           "filter_trackers", "TrackingMixin"]

logger = logging.getLogger("lowprec")


class GeneralTracker:
    """Base for trackers; a custom subclass may be passed in ``log_with`` as an instance."""

    name = "general"
    requires_logging_directory = False
    main_process_only = True

    def start(self) -> None:
        """Called once on the main process by ``init_trackers``."""

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        pass

    def finish(self) -> None:
        pass

    @property
    def tracker(self) -> Any:
        return self


class TensorBoardTracker(GeneralTracker):
    """Scalars, strings (``add_text``) and dicts of scalars (``add_scalars``) to event files under
    ``{logging_dir}/{run_name}``."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.kwargs = kwargs
        self.writer: Any = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict) -> None:
        plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
        self.writer.add_hparams(plain, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        for k, v in values.items():
            if isinstance(v, (int, float)) or (hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1):
                self.writer.add_scalar(k, float(v), global_step=step, **kwargs)
            elif isinstance(v, str):
                self.writer.add_text(k, v, global_step=step, **kwargs)
            elif isinstance(v, dict):
                self.writer.add_scalars(k, v, global_step=step, **kwargs)
            else:
                raise TypeError(f"TensorBoard cannot log {k}={type(v).__name__}; log numbers, strings or dicts of numbers")
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandBTracker(GeneralTracker):
    name = "wandb"

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        self.run_name, self.kwargs, self.run = run_name, kwargs, None

    def start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.run_name, **self.kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(GeneralTracker):
    name = "mlflow"

    def __init__(self, experiment_name: str, logging_dir: Optional[str] = None, **kwargs: Any) -> None:
        self.experiment_name, self.logging_dir, self.kwargs, self.run = experiment_name, logging_dir, kwargs, None

    def start(self) -> None:
        import mlflow

        if self.logging_dir is not None:
            mlflow.set_tracking_uri(self.logging_dir)
        mlflow.set_experiment(self.experiment_name)
        self.run = mlflow.start_run(**self.kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        import mlflow

        mlflow.log_params({k: str(v)[:250] for k, v in values.items()})

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        import mlflow

        mlflow.log_metrics({k: float(v) for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class CometMLTracker(GeneralTracker):
    name = "comet_ml"

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        self.run_name, self.kwargs, self.experiment = run_name, kwargs, None

    def start(self) -> None:
        import comet_ml

        self.experiment = comet_ml.start(project_name=self.run_name, **self.kwargs)

    @property
    def tracker(self) -> Any:
        return self.experiment

    def store_init_configuration(self, values: dict) -> None:
        self.experiment.log_parameters(values)

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self.experiment.log_metrics(values, step=step, **kwargs)

    def finish(self) -> None:
        self.experiment.end()


# name -> (tracker class, availability check, package to install)
_TRACKERS = {
    LoggerType.TENSORBOARD: (TensorBoardTracker, is_tensorboard_available, "tensorboard"),
    LoggerType.WANDB: (WandBTracker, is_wandb_available, "wandb"),
    LoggerType.MLFLOW: (MLflowTracker, is_mlflow_available, "mlflow"),
    LoggerType.COMETML: (CometMLTracker, is_comet_ml_available, "comet_ml"),
}


def filter_trackers(log_with: Any, logging_dir: Optional[str] = None) -> list:
    """``log_with`` (a name, LoggerType, GeneralTracker or a list of them) as a list of names and
    tracker instances; an unknown or uninstalled tracker is an error that says what to do."""
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    out: list = []
    for item in items:
        if isinstance(item, GeneralTracker):
            out.append(item)
            continue
        name = str(item).lower()
        if name == LoggerType.ALL:
            out += [t for t, (_, ok, _) in _TRACKERS.items() if ok() and t not in out]
            continue
        try:
            kind = LoggerType(name)
        except ValueError:
            raise ValueError(f"log_with={item!r} is not a tracker; use one of {', '.join(t.value for t in _TRACKERS)}, "
                             "'all', or a GeneralTracker instance") from None
        if kind not in _TRACKERS:
            raise ValueError(f"log_with={item!r}: lowprec has no {kind.value} tracker; use one of "
                             f"{', '.join(t.value for t in _TRACKERS)} or pass a GeneralTracker instance")
        cls, ok, package = _TRACKERS[kind]
        if not ok():
            raise ImportError(f"log_with={item!r} needs the {package} package: pip install {package}")
        if cls.requires_logging_directory and logging_dir is None:
            raise ValueError(f"log_with={item!r} writes files: pass Accelerator(project_dir=...) "
                             "or ProjectConfiguration(logging_dir=...)")
        if kind not in out:
            out.append(kind)
    return out


class TrackingMixin:
    """The Accelerator's tracker methods; needs ``self.log_with``, ``self.logging_dir``,
    ``self.is_main_process``, ``self.trackers``."""

    def init_trackers(self, project_name: str, config: Optional[dict] = None, init_kwargs: Optional[dict] = None) -> None:
        """Start each tracker of ``log_with`` (main process only) and record ``config``."""
        init_kwargs = init_kwargs or {}
        self.trackers = []
        for item in self.log_with:
            if isinstance(item, GeneralTracker):
                tracker = item
            else:
                cls = _TRACKERS[item][0]
                kw = init_kwargs.get(item.value, {})
                tracker = cls(project_name, self.logging_dir, **kw) if cls.requires_logging_directory else cls(project_name, **kw)
            if self.is_main_process or not tracker.main_process_only:
                tracker.start()
                if config is not None:
                    tracker.store_init_configuration(config)
                self.trackers.append(tracker)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its underlying object with ``unwrap=True``); on processes
        without trackers a do-nothing ``GeneralTracker``."""
        for tracker in self.trackers:
            if tracker.name == str(name):
                return tracker.tracker if unwrap else tracker
        if not self.is_main_process:
            return GeneralTracker()
        raise ValueError(f"{name!r} is not an initialized tracker; started: {[t.name for t in self.trackers]} "
                         "(pass it in Accelerator(log_with=...) and call init_trackers)")

    def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None:
        """Log ``values`` to every tracker (main process only)."""
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def end_training(self) -> None:
        """Close the trackers, then wait for every process."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.wait_for_everyone()
