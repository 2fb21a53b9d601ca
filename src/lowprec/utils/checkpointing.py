"""The Accelerator's checkpoint API around ``lowprec.checkpoint``: project layout and automatic
checkpoint naming (``ProjectConfiguration``), save/load pre-hooks, custom objects, and sharded
``save_model`` files (Accelerate's ``model-0000i-of-0000n.safetensors`` + index)."""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
from typing import Any, Callable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from lowprec.accelerator_host import AcceleratorHost
from lowprec.checkpoint.serialization import parse_size, write_sharded
from lowprec.utils.dataclasses import ProjectConfiguration

__all__ = ["CheckpointingMixin", "parse_size", "write_sharded"]

logger = logging.getLogger("lowprec")


def _state() -> Any:
    """``lowprec.checkpoint.state``, loaded when the Accelerator first saves or loads. Loading it
    with the Accelerator made Accelerate's own ``debug_launcher`` tests fail (their FileStore's
    temporary file was gone before the launcher removed it; ``tests/test_imports.py``)."""
    from lowprec.checkpoint import state  # lazy on purpose: see above

    return state


def _numbered(folder: str) -> list[str]:
    """``checkpoint_{n}`` folders in ``folder``, oldest (smallest n) first."""
    if not os.path.isdir(folder):
        return []
    found = [d for d in os.listdir(folder) if re.fullmatch(r"checkpoint_\d+", d)]
    return [os.path.join(folder, d) for d in sorted(found, key=lambda d: int(d.split("_")[1]))]


class CheckpointingMixin(AcceleratorHost):
    """Needs ``self.is_main_process``, ``self._models``, ``self._custom_objects``."""

    def _init_project(self, project_dir: Optional[str], project_config: Optional[ProjectConfiguration]) -> None:
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        self._save_model_state_pre_hook: dict = collections.OrderedDict()
        self._load_model_state_pre_hook: dict = collections.OrderedDict()

    @property
    def project_dir(self) -> Optional[str]:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> Optional[str]:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets."""
        return self.project_configuration.iteration

    # ------------------------------------------------------------------ hooks
    def register_save_state_pre_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs before ``save_state`` writes (files it writes
        into ``output_dir`` become part of the checkpoint); removing a state dict from ``weights``
        skips writing that model."""
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(models, input_dir)`` runs before ``load_state`` reads; removing a model from
        ``models`` skips loading its weights."""
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def _run_save_hooks(self, output_dir: str, weights: list) -> list:
        """Called by ``lowprec.checkpoint`` with the state dicts it is about to write; returns
        them with ``None`` for each one a hook removed."""
        if not self._save_model_state_pre_hook:
            return weights
        kept = list(weights)
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, kept, output_dir)
        ids = {id(w) for w in kept}
        return [w if id(w) in ids else None for w in weights]

    def _run_load_hooks(self, input_dir: str) -> set:
        """Ids of the models whose weights ``load_state`` should load."""
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, input_dir)
        return {id(m) for m in models}

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` saved and restored with the state."""
        bad = [
            f"Item at index {i} (`{type(o).__name__}`)"
            for i, o in enumerate(objects)
            if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:  # one line (lowprec's rule); names each item as Accelerate's message does
            raise ValueError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to be "
                "stored; invalid: " + ", ".join(bad)
            )
        self._custom_objects.extend(objects)

    # ------------------------------------------------------------------ save / load
    def _auto_dir(self) -> str:
        folder = self.project_configuration.checkpoints_dir
        if folder is None:
            raise ValueError(
                "automatic_checkpoint_naming needs a project directory: "
                "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)"
            )
        return folder

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **_: Any) -> str:
        """Everything needed to resume (models, optimizers, schedulers, dataloader positions,
        scaler, registered objects, RNG), written atomically. With automatic checkpoint naming and
        no ``output_dir``: ``{project_dir}/checkpoints/checkpoint_{iteration}``, keeping at most
        ``total_limit`` (the oldest are removed after the new one is complete)."""

        pc = self.project_configuration
        if pc.automatic_checkpoint_naming and output_dir is None:
            output_dir = os.path.join(self._auto_dir(), f"checkpoint_{pc.iteration}")
            if os.path.exists(output_dir):
                raise ValueError(
                    f"checkpoint directory {output_dir} already exists; set "
                    "ProjectConfiguration(iteration=...) to the next free number"
                )
        elif output_dir is None:
            output_dir = os.path.join(self._need_project_dir(), "checkpoint")
        path = _state().save_state(self, output_dir, safe_serialization)
        pc.iteration += 1  # every save counts (Accelerate's save_iteration), named ones or not
        if pc.automatic_checkpoint_naming:
            if pc.total_limit is not None and self.is_main_process:
                for old in _numbered(self._auto_dir())[: -pc.total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
            self.wait_for_everyone()
        return path

    def _need_project_dir(self) -> str:
        if self.project_dir is None:
            raise ValueError("save_state/load_state need a directory (or Accelerator(project_dir=...))")
        return self.project_dir

    def load_state(self, input_dir: Optional[str] = None, map_location: Any = None, **_: Any) -> None:
        """Restore what ``save_state`` wrote. Without ``input_dir``: the newest automatically
        named checkpoint, else ``{project_dir}/checkpoint``. Optimizer state always lands on its
        parameters' device (``map_location`` 'cpu'/'on_device' accepted for Accelerate's sake)."""

        if map_location not in (None, "cpu", "on_device"):
            raise TypeError(f"Unsupported optimizer map location passed: {map_location!r}; use 'cpu' or 'on_device'")
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            found = _numbered(self._auto_dir())
            if not found:
                raise ValueError(f"no checkpoint_* folder in {self._auto_dir()} to load")
            input_dir = found[-1]
        elif input_dir is None:
            input_dir = os.path.join(self._need_project_dir(), "checkpoint")
        _state().load_state(self, input_dir)
        self._continue_numbering(input_dir)

    def _continue_numbering(self, loaded: str) -> None:
        """After loading ``checkpoint_{n}`` of the automatic naming, the next ``save_state`` writes
        ``checkpoint_{n+1}``: a resumed run keeps saving (Accelerate leaves ``iteration`` at 0, so
        its next save reuses the oldest slot's number under ``total_limit``, and the newest state
        then sorts first and is the next one removed); an ``iteration`` already past it is kept."""
        pc = self.project_configuration
        if not pc.automatic_checkpoint_naming or pc.checkpoints_dir is None:
            return
        match = re.fullmatch(r"checkpoint_(\d+)", os.path.basename(os.path.normpath(loaded)))
        if match is None or os.path.realpath(os.path.dirname(os.path.normpath(loaded))) != os.path.realpath(
            pc.checkpoints_dir
        ):
            return
        if pc.iteration <= int(match.group(1)):
            pc.iteration = int(match.group(1)) + 1
            logger.info("lowprec: load_state(%s): the next save_state writes checkpoint_%d", loaded, pc.iteration)

    def save_model(
        self,
        model: Any,
        save_directory: str,
        max_shard_size: Any = "10GB",
        safe_serialization: bool = True,
        fp8_format: Optional[str] = None,
    ) -> None:
        """Plain weights that load into the unconverted model (``model.safetensors``, or shards of
        at most ``max_shard_size`` plus ``model.safetensors.index.json``); weights a big-model
        dispatch offloaded to disk or CPU are read back from its hooks, as Accelerate does.

        ``fp8_format="hf-fp8" | "compressed-tensors"``: an FP8 export for inference engines instead
        (``lowprec.export.export_model``: the trained scales where the recipe and format agree,
        high-precision layers kept bf16), written by the main process."""

        if fp8_format is not None:
            _state().save_fp8_model(self, model, save_directory, fp8_format)
            return

        # meta parameters: read back from a big-model dispatch's offload hooks, or an error naming
        # the first one (lowprec.utils.offload)
        _state().save_model(self, model, save_directory, safe_serialization, max_shard_size)

    def save(self, obj: Any, f: str, safe_serialization: bool = False) -> None:
        """``torch.save`` (or safetensors) on the main process only."""
        if self.is_main_process:
            if safe_serialization:
                from safetensors.torch import save_file

                save_file(obj, f, metadata={"format": "pt"})
            else:
                torch.save(obj, f)
