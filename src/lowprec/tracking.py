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
import warnings
from typing import Any, Callable, Optional, cast

from lowprec.accelerator_host import AcceleratorHost
from lowprec.state.process_group import destroy_group
from lowprec.utils.dataclasses import LoggerType
from lowprec.utils.imports import (
    is_comet_ml_available,
    is_mlflow_available,
    is_tensorboard_available,
    is_wandb_available,
)

__all__ = [
    "GeneralTracker",
    "TensorBoardTracker",
    "WandBTracker",
    "MLflowTracker",
    "CometMLTracker",
    "LOGGER_TYPE_TO_CLASS",
    "register_tracker_class",
    "filter_trackers",
    "TrackingMixin",
]

logger = logging.getLogger("lowprec")


class GeneralTracker:
    """Base for trackers. A subclass sets ``name`` and ``requires_logging_directory``; pass an
    instance in ``log_with``, or ``register_tracker_class`` it and pass its name."""

    # declared for the type checker only: a subclass sets them (register_tracker_class checks)
    name: str
    requires_logging_directory: bool
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


class _NoTracker(GeneralTracker):
    """What ``get_tracker`` returns on processes that run no tracker."""

    name = "none"
    requires_logging_directory = False


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
                raise TypeError(
                    f"TensorBoard cannot log {k}={type(v).__name__}; log numbers, strings or dicts of numbers"
                )
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _HostedTracker(GeneralTracker):
    """A tracker whose library keeps the run (not a directory of ours): ``run`` is the
    library's run object once started, and what ``tracker`` returns."""

    requires_logging_directory = False
    run: Any  # the library's run object, None until started

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        self.run_name, self.kwargs, self.run = run_name, kwargs, None

    @property
    def tracker(self) -> Any:
        return self.run


class WandBTracker(_HostedTracker):
    name = "wandb"

    def start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.run_name, **self.kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(_HostedTracker):
    name = "mlflow"

    def __init__(self, experiment_name: str, logging_dir: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(experiment_name, **kwargs)
        self.experiment_name, self.logging_dir = experiment_name, logging_dir

    def start(self) -> None:
        import mlflow

        if self.logging_dir is not None:
            mlflow.set_tracking_uri(self.logging_dir)
        mlflow.set_experiment(self.experiment_name)
        self.run = mlflow.start_run(**self.kwargs)

    def store_init_configuration(self, values: dict) -> None:
        import mlflow

        mlflow.log_params({k: str(v)[:250] for k, v in values.items()})

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        import mlflow

        mlflow.log_metrics({k: float(v) for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class CometMLTracker(_HostedTracker):
    name = "comet_ml"

    def start(self) -> None:
        import comet_ml

        self.run = comet_ml.start(project_name=self.run_name, **self.kwargs)

    @property
    def experiment(self) -> Any:
        """The Comet experiment (``tracker``)."""
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        self.run.log_parameters(values)

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log_metrics(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.end()


# tracker name -> class (built-ins, then those added by register_tracker_class)
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "mlflow": MLflowTracker,
    "comet_ml": CometMLTracker,
}
# built-in name -> (availability check, package to install)
_PACKAGES = {
    "tensorboard": (is_tensorboard_available, "tensorboard"),
    "wandb": (is_wandb_available, "wandb"),
    "mlflow": (is_mlflow_available, "mlflow"),
    "comet_ml": (is_comet_ml_available, "comet_ml"),
}


def register_tracker_class(tracker_class: type) -> None:
    """Make ``log_with="<tracker_class.name>"`` build this tracker: it is called with the project
    name (and the logging directory when ``requires_logging_directory``) plus its ``init_kwargs``."""
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"register_tracker_class needs a GeneralTracker subclass, got {tracker_class!r}")
    if not getattr(tracker_class, "name", None):
        raise ValueError(f"{tracker_class.__name__} needs a non-empty `name` class attribute to be registered")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(
            f"{tracker_class.__name__} needs a `requires_logging_directory` class attribute "
            "(True if it writes under the project's logging directory)"
        )
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(
            f"tracker name {tracker_class.name!r} was registered already; {tracker_class.__name__} replaces it",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def filter_trackers(log_with: Any, logging_dir: Optional[str] = None) -> list:
    """``log_with`` (a name, LoggerType, GeneralTracker or a list of them) as a list of tracker
    names and instances; an unknown or uninstalled tracker is an error that says what to do."""
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
            out += [n for n, (ok, _) in _PACKAGES.items() if ok() and n not in out]
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(
                f"log_with={item!r} is not a tracker; use one of {', '.join(LOGGER_TYPE_TO_CLASS)}, "
                "'all', a GeneralTracker instance, or register_tracker_class(...) first"
            )
        ok, package = _PACKAGES.get(name, (lambda: True, None))
        if not ok():
            raise ImportError(f"log_with={item!r} needs the {package} package: pip install {package}")
        if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"Logging with `{name}` requires a `logging_dir` to be passed in: use "
                "Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...)"
            )
        if name not in out:
            out.append(name)
    return out


class TrackingMixin(AcceleratorHost):
    """The Accelerator's tracker methods; needs ``self.log_with``, ``self.logging_dir``,
    ``self.is_main_process``, ``self.trackers``."""

    def init_trackers(
        self, project_name: str, config: Optional[dict] = None, init_kwargs: Optional[dict] = None
    ) -> None:
        """Start each tracker of ``log_with`` (main process only) and record ``config``."""
        init_kwargs = init_kwargs or {}
        self.trackers = []
        for item in self.log_with:
            if isinstance(item, GeneralTracker):
                tracker = item
            else:
                cls = LOGGER_TYPE_TO_CLASS[item]
                build = cast(Callable[..., GeneralTracker], cls)  # each class's own arguments (register_tracker_class)
                kw = init_kwargs.get(item, {})
                tracker = (
                    build(project_name, self.logging_dir, **kw)
                    if cls.requires_logging_directory
                    else build(project_name, **kw)
                )
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
            return _NoTracker()
        raise ValueError(
            f"{name!r} is not an initialized tracker; started: {[t.name for t in self.trackers]} "
            "(pass it in Accelerator(log_with=...) and call init_trackers)"
        )

    def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None:
        """Log ``values`` to every tracker (main process only)."""
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def end_training(self) -> None:
        """Close the trackers, wait for every process, then destroy the process group (as
        Accelerate; a later Accelerator creates a new one)."""
        import torch.distributed as dist

        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            destroy_group()
