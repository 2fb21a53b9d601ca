"""Sharded checkpoints for FSDP2 runs through ``torch.distributed.checkpoint`` (DCP).

Chosen by the FSDP plugin's ``state_dict_type="SHARDED_STATE_DICT"`` (Accelerate's name; env
``FSDP_STATE_DICT_TYPE``, ``lowprec launch --fsdp_state_dict_type``, trainer
``fsdp_config.state_dict_type``). Instead of gathering full tensors on every process and writing
them from the main one, each process writes its own shards of model and optimizer state
(``sharded_{i}/__{rank}_0.distcp`` plus DCP's ``.metadata``), in parallel, without a full copy
in memory anywhere.

Resharding: DCP records where every chunk of every tensor lives, so the same checkpoint loads
onto another number of processes (4 -> 2 -> 1): each process reads the chunks its new shards
overlap. The rest of a checkpoint moves with it (``lowprec.checkpoint``):

* FP8 scaling state (amax histories, scales, step counters) is part of the model state dict as
  replicated tensors (identical on every rank with ``reduce_amax``); the per-rank copies written
  beside it are restored where the same rank exists, else rank 0's are used (logged);
* RNG: rank ``r`` restores ``random_states_{r}`` when the saved run had that rank, else rank
  ``r mod saved`` (logged: the dropout streams differ from an uninterrupted run);
* data position: the samples consumed (``batches x batch_size x processes``) are kept, so a run
  that keeps its global batch (``batch_size x processes``) resumes on the next unseen batch;
  a global batch that does not divide the position is refused with the fix.

Loading never unpickles code. A sharded checkpoint holds three kinds of file, each read
without running anything of its own:

* ``.metadata`` (DCP pickles it): read by :class:`_MetadataUnpickler`, whose only globals are
  exact ``(module, name)`` pairs: DCP's metadata classes, ``torch.Size``, torch dtypes and
  layouts, paths and plain containers. Pickle is never asked to resolve a name itself, so a
  protocol-4 dotted name (``metadata`` + ``torch._strobelight....subprocess.Popen``) that
  would walk attributes to any object is refused like any other. The storage entries must name
  files inside the checkpoint directory. This happens before DCP starts, on every process;
* tensor items in ``__{rank}_0.distcp``: DCP itself reads them with ``torch.load(weights_only=True)``;
* byte items in the same files (the optimizer's ``param_groups`` values: lr, betas, flags):
  DCP's default planner reads them with ``torch.load(weights_only=False)``;
  :class:`SafeLoadPlanner` reads them with ``weights_only=True`` instead.

A file that is refused or damaged is one :class:`~lowprec.errors.CheckpointError` line naming it,
on every process (DCP's per-rank exception bundle is unwrapped).
"""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any, cast

import torch

from lowprec.errors import CheckpointError
from lowprec.checkpoint.fp8_fit import check_amax_histories
from lowprec.checkpoint.serialization import load_error_reason
from lowprec.utils.distributed import is_fsdp2

__all__ = [
    "SHARDED",
    "uses_sharded",
    "save_sharded",
    "load_sharded",
    "load_into",
    "SafeFileSystemReader",  # noqa: F822 - built on first access (module __getattr__)
    "SafeLoadPlanner",  # noqa: F822
]

SHARDED = "SHARDED_STATE_DICT"


def uses_sharded(acc: Any, model: Any) -> bool:
    plugin = acc.state.fsdp_plugin
    return is_fsdp2(model) and getattr(plugin, "state_dict_type", None) == SHARDED


def _optimizers_of(acc: Any, model: Any) -> list:
    opts = [o.optimizer for o in acc._optimizers if acc._optimizer_models.get(id(o)) is model]
    if len(opts) > 1:
        raise ValueError(
            f"{len(opts)} optimizers train one FSDP2 model; sharded checkpoints (SHARDED_STATE_DICT) hold one "
            "optimizer per model: use one optimizer with several param groups, or FULL_STATE_DICT"
        )
    return opts


def save_sharded(acc: Any, model: Any, directory: str) -> None:
    """Collective: every process writes its shards of ``model`` and its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    inner = acc.unwrap_model(model)
    msd, osd = get_state_dict(inner, _optimizers_of(acc, model))
    dcp.save({"model": msd, "optimizer": osd}, storage_writer=dcp.FileSystemWriter(directory))


def load_sharded(acc: Any, model: Any, directory: str) -> None:
    """Collective: read the chunks this process's shards need (any saved world size)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    inner = acc.unwrap_model(model)
    if os.path.isfile(os.path.join(directory, ".metadata")):  # else load_into names what is missing
        saved = _safe_classes()[0](directory).read_metadata().state_dict_metadata
        shapes = {k[len("model.") :]: tuple(getattr(m, "size", ())) for k, m in saved.items() if k.startswith("model.")}
        check_amax_histories(shapes, inner, directory)
    opts = _optimizers_of(acc, model)
    msd, osd = get_state_dict(inner, opts)  # the shapes and placements to read into
    state = load_into({"model": msd, "optimizer": osd}, directory)
    set_state_dict(inner, opts, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_into(state: dict, directory: str) -> dict:
    """Collective: fill ``state`` (DCP state dicts giving the shapes and placements to read into)
    from the checkpoint in ``directory``, read safely (:class:`SafeFileSystemReader`,
    :class:`SafeLoadPlanner`); a refused, damaged or foreign checkpoint is one
    :class:`~lowprec.errors.CheckpointError` line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise CheckpointError(f"checkpoint directory {directory} has no .metadata; the checkpoint is incomplete")
    reader_class, planner_class = _safe_classes()
    reader = reader_class(directory)
    reader.read_metadata()  # refused here, before DCP (which would log the error and try per-rank files)
    try:
        dcp.load(state, storage_reader=reader, planner=planner_class())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - another model's checkpoint: one line
        inner = _first_failure(exc)
        if isinstance(inner, CheckpointError):  # a refused or damaged file, named by the process that read it
            raise CheckpointError(str(inner)) from None
        raise CheckpointError(
            f"{directory} does not fit this run ({type(inner).__name__}: {' '.join(str(inner).split())[:200]}); "
            "was the checkpoint written by another script or model?"
        ) from None
    return state


def _first_failure(exc: BaseException) -> BaseException:
    """What a process raised inside DCP, which gathers every process's exception into one
    ``CheckpointException`` (a BaseException whose text is each rank's traceback): the first
    :class:`CheckpointError` of any rank, else rank 0's (the lowest failing) exception."""
    failures = getattr(exc, "failures", None) or {}
    found = [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
    own = [f for f in found if isinstance(f, CheckpointError)]
    return (own or found or [exc])[0]


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """Every global DCP's ``.metadata`` pickle uses (found by recording ``find_class`` while
    loading checkpoints of this module's tests), as exact pairs; no name is looked up by pickle."""
    import collections
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout  # torch.layout pickles as _get_layout("torch.strided")

    dcp_classes = (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
    allowed: dict[tuple[str, str], Any] = {
        (metadata.__name__, n): getattr(metadata, n) for n in dcp_classes if hasattr(metadata, n)
    }
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed[("torch.serialization", "_get_layout")] = _get_layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):  # checkpoint_id, if a Path
        allowed[("pathlib", n)] = allowed[("pathlib._local", n)] = getattr(pathlib, n)  # 3.13 pickles _local
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: a global outside :func:`_allowed_globals` (a
    function, a foreign class, a dotted name walking attributes) is refused before it is resolved."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        obj = _MetadataUnpickler._allowed.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which DCP metadata never holds: refused before anything in it ran"
            )
        return obj


class _SafeReading:
    """What :class:`SafeFileSystemReader` adds to DCP's ``FileSystemReader``: the metadata read by
    :class:`_MetadataUnpickler` (checked once, then reused) and each data file's failures named
    with its path."""

    _checked: Any = None
    fs: Any
    path: Any
    storage_data: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if self._checked is None:
            path = cast(Any, self)._get_metadata_path(None)  # the global file only (no per-rank fallback)
            try:
                with self.fs.create_stream(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except Exception as exc:  # noqa: BLE001 - refused, truncated or garbage: one line naming the file
                reason = str(exc) if isinstance(exc, pickle.UnpicklingError) else f"{type(exc).__name__}: {exc}"
                raise CheckpointError(
                    f"checkpoint file {path} is not DCP metadata ({' '.join(reason.split())[:200]})"
                ) from None
            if not isinstance(metadata, Metadata):
                raise CheckpointError(
                    f"checkpoint file {path} is not DCP metadata (it holds a {type(metadata).__name__})"
                )
            _check_storage(metadata, path)
            self._checked = metadata
        metadata = self._checked
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any):
        """DCP's reader, one data file at a time, so that a failure names its file."""
        import dataclasses
        from torch.futures import Future

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            path = os.path.join(str(self.path), name)
            try:
                cast(Any, super()).read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError as exc:
                raise CheckpointError(f"checkpoint file {path}: {exc}") from None
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
                raise CheckpointError(f"checkpoint file {path} cannot be read ({load_error_reason(exc)})") from None
        done: Future = Future()
        done.set_result(None)
        return done


def _check_storage(metadata: Any, path: str) -> None:
    """Every data file the metadata points to is a plain name inside the checkpoint directory."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"checkpoint file {path} is not DCP metadata (no storage table)")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:
            raise CheckpointError(f"checkpoint file {path} points outside its directory ({name!r}); refused")


class _SafeBytes:
    """What :class:`SafeLoadPlanner` changes in DCP's ``DefaultLoadPlanner``: byte items (non-tensor
    state: optimizer ``param_groups`` values) are read with ``torch.load(weights_only=True)``, not
    DCP's ``weights_only=False``."""

    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # DCP's own helper for the nested destination (the same call DefaultLoadPlanner makes)
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure: refused, one line
            raise CheckpointError(f"item {fqn} cannot be read ({load_error_reason(exc)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


@functools.cache
def _safe_classes() -> tuple[type, type]:
    """``(SafeFileSystemReader, SafeLoadPlanner)``: DCP's reader and planner with the safe parts
    above, built at first use: importing DCP costs every process ~0.6 s (it loads DTensor), and
    only a sharded checkpoint needs it."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    reader = type("SafeFileSystemReader", (_SafeReading, FileSystemReader), {"__module__": __name__})
    planner = type("SafeLoadPlanner", (_SafeBytes, DefaultLoadPlanner), {"__module__": __name__})
    return reader, planner


def __getattr__(name: str) -> Any:
    """``SafeFileSystemReader`` / ``SafeLoadPlanner``, built on first access (:func:`_safe_classes`)."""
    if name in ("SafeFileSystemReader", "SafeLoadPlanner"):
        return _safe_classes()[name == "SafeLoadPlanner"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
