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

Loading never unpickles code: DCP's ``.metadata`` pickle is read with an unpickler that builds
DCP's own metadata classes, torch dtypes/sizes and plain containers only; the ``.distcp`` files
hold tensors read by DCP through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from lowprec.errors import CheckpointError

__all__ = ["SHARDED", "uses_sharded", "save_sharded", "load_sharded", "SafeFileSystemReader"]

SHARDED = "SHARDED_STATE_DICT"


def uses_sharded(acc: Any, model: Any) -> bool:
    from lowprec.utils.distributed import is_fsdp2

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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise CheckpointError(f"checkpoint directory {directory} has no .metadata; the checkpoint is incomplete")
    inner = acc.unwrap_model(model)
    opts = _optimizers_of(acc, model)
    msd, osd = get_state_dict(inner, opts)  # the shapes and placements to read into
    state = {"model": msd, "optimizer": osd}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(directory))
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpoint of another model: one line, not a traceback
        raise CheckpointError(
            f"{directory} does not fit this run ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
            "was the checkpoint written by another script or model?"
        ) from None
    set_state_dict(inner, opts, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else (no ``__reduce__`` of a foreign class runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # DCP's metadata dataclasses and enums, no function
                return obj
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)) or obj is torch.Size:
                return obj
        # _get_layout maps a name to a torch.layout (torch's weights_only unpickler allows it too)
        if (module, name) in {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                              ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP checkpoint metadata; refused before loading")


def _storage_reader_base() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


class SafeFileSystemReader(_storage_reader_base()):  # type: ignore[misc]
    """DCP's ``FileSystemReader`` with the metadata read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint file {path} is not DCP metadata ({exc})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
