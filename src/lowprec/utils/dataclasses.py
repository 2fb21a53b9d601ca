"""Accelerate's configuration dataclasses for data loading and project layout, and ``LoggerType``.

``DataLoaderConfiguration`` fields lowprec does not act on are refused when set to a value that
would change behaviour (never accepted and ignored).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional

from lowprec.kwargs import KwargsHandler
from lowprec.logs import log_once
from lowprec.config.values import parse_bool
from lowprec.utils.imports import is_torchdata_stateful_dataloader_available

__all__ = [
    "DataLoaderConfiguration",
    "ProjectConfiguration",
    "LoggerType",
    "ProfileKwargs",
    "TorchDynamoPlugin",
    "FP8BackendType",
]


class FP8BackendType(str, Enum):
    """Accelerate's enum (``accelerate.utils.dataclasses.FP8BackendType``), plus NATIVE; compares
    equal to its string value."""

    NO = "NO"
    NATIVE = "NATIVE"
    AO = "AO"
    TE = "TE"
    MSAMP = "MSAMP"


class LoggerType(str, Enum):
    """Experiment trackers by name (``Accelerator(log_with=...)``)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"

    def __str__(self) -> str:
        return self.value


def require_torchdata(where: str) -> None:
    """``use_stateful_dataloader=True`` (``where`` names the call): one ImportError naming the fix
    where torchdata is missing (as Accelerate, which builds a torchdata ``StatefulDataLoader``),
    else a log line: lowprec's prepared dataloaders keep their position themselves."""
    if not is_torchdata_stateful_dataloader_available():
        raise ImportError(
            f"{where} needs torchdata>=0.8, which is not installed: pip install torchdata, or leave "
            "use_stateful_dataloader False (lowprec's prepared dataloaders resume mid-epoch without it)"
        )
    log_once(
        "lowprec: use_stateful_dataloader=True: prepared dataloaders save and restore their "
        "position themselves (state_dict/load_state_dict); they are not torchdata StatefulDataLoaders"
    )


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards dataloaders.

    - ``split_batches``: each batch the dataloader yields is split across processes (its batch size
      must divide by the number of processes); otherwise each process gets whole batches.
    - ``even_batches``: pad the last step so every process runs the same number of batches (the
      padding is dropped again by ``gather_for_metrics``); ``False`` gives some processes one
      batch less.
    - ``use_seedable_sampler`` / ``data_seed``: shuffling always uses a generator seeded
      identically on every process (``data_seed`` when given, else the torch seed) plus the
      epoch; a DataLoader's own generator is followed instead unless ``use_seedable_sampler``.
    - ``dispatch_batches``: process 0 reads the dataloader and sends each process its batch
      (``DataLoaderDispatcher``); ``None``: only for an ``IterableDataset`` on several processes
      (as Accelerate), a map-style dataset is sharded.
    - ``non_blocking``: asynchronous host-to-device copies.
    - ``use_stateful_dataloader``: lowprec's prepared dataloader already saves and restores its
      position (``state_dict`` / ``load_state_dict``); ``True`` needs torchdata, as in Accelerate.
    """

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        if self.use_stateful_dataloader:
            require_torchdata("DataLoaderConfiguration(use_stateful_dataloader=True)")


@dataclass
class ProjectConfiguration:
    """Where checkpoints and logs go. With ``automatic_checkpoint_naming`` ``save_state()`` writes
    ``{project_dir}/checkpoints/checkpoint_{iteration}`` and keeps at most ``total_limit`` of them
    (oldest removed first); ``load_state()`` reads the newest."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"ProjectConfiguration(total_limit={self.total_limit}); use a positive count or None")

    @property
    def checkpoints_dir(self) -> Optional[str]:
        return None if self.project_dir is None else os.path.join(self.project_dir, "checkpoints")


@dataclass(frozen=True)
class ProfileKwargs(KwargsHandler):
    """``accelerator.profile()`` settings (pass in ``kwargs_handlers`` or to ``profile``):
    ``torch.profiler`` options; ``schedule_option`` is ``torch.profiler.schedule``'s keywords;
    ``output_trace_dir`` gets one Chrome trace per process."""

    activities: Optional[tuple] = None  # "cpu", "cuda" or ProfilerActivity members
    schedule_option: Optional[dict] = None
    on_trace_ready: Optional[Callable[[Any], None]] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    output_trace_dir: Optional[str] = None


DYNAMO_PREFIX = "ACCELERATE_DYNAMO_"


@dataclass(frozen=True)
class TorchDynamoPlugin(KwargsHandler):
    """``torch.compile`` settings for the models ``prepare`` returns (Accelerate's plugin).

    Each field unset reads what ``accelerate launch --dynamo_*`` exports
    (``ACCELERATE_DYNAMO_BACKEND`` / ``_MODE`` / ``_USE_FULLGRAPH`` / ``_USE_DYNAMIC``), else the
    default; ``backend="no"`` compiles nothing.
    """

    backend: Optional[str] = None
    mode: Optional[str] = None
    fullgraph: Optional[bool] = None
    dynamic: Optional[bool] = None
    options: Optional[dict] = None
    disable: bool = False

    def __post_init__(self) -> None:
        env = os.environ
        backend = self.backend if self.backend is not None else env.get(DYNAMO_PREFIX + "BACKEND", "no")
        object.__setattr__(self, "backend", str(backend).lower())
        object.__setattr__(
            self, "mode", self.mode if self.mode is not None else env.get(DYNAMO_PREFIX + "MODE", "default")
        )
        for name in ("fullgraph", "dynamic"):  # accelerate launch exports ACCELERATE_DYNAMO_USE_<FIELD>
            var = next(
                (DYNAMO_PREFIX + v for v in (f"USE_{name.upper()}", name.upper()) if DYNAMO_PREFIX + v in env), None
            )
            if getattr(self, name) is None and var is not None:
                object.__setattr__(self, name, parse_bool(env[var]))
        if self.fullgraph is None:
            object.__setattr__(self, "fullgraph", False)

    @property
    def enabled(self) -> bool:
        return self.backend != "no" and not self.disable

    def compile_kwargs(self) -> dict:
        """Keywords for ``torch.compile``."""
        kw: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.options:
            kw["options"] = self.options
        else:
            kw["mode"] = None if self.mode == "default" else self.mode
        return kw
