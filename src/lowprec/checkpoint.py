"""``save_state`` / ``load_state`` / ``save_model`` for the Accelerator.

A checkpoint directory holds, per prepared object: ``model_{i}.safetensors`` (or
``pytorch_model_{i}.bin`` with ``safe_serialization=False``; FP8 scaling state included, as
buffers), ``optimizer_{i}.safetensors`` (or ``.bin``), ``scheduler_{i}.bin``, ``dataloader_{i}.json`` (position),
``scaler.pt``, ``custom_checkpoint_{i}.pkl``, ``random_states_{rank}.pkl``, under FSDP2 and DeepSpeed
``buffers_{i}_rank{rank}.safetensors`` (each process's own FP8 scaling state) and
``lowprec_state.json`` (precision and backend, checked on load).

Writes are atomic: everything goes to a sibling temporary directory that replaces the target
only when complete, so a crash never leaves a half-written checkpoint under the real name.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import shutil
from typing import Any

import torch

from lowprec.utils.distributed import (
    full_model_state_dict,
    is_fsdp2,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)

__all__ = ["save_state", "load_state", "save_model", "save_tensors", "load_tensors", "save_optimizer", "load_optimizer"]

META = "lowprec_state.json"

logger = logging.getLogger("lowprec")


# --------------------------------------------------------------------------- tensors
def save_tensors(state_dict: dict, path: str, safe: bool) -> None:
    """safetensors (shared tensors stored once, aliases in the metadata) or pickle."""
    if not safe:
        torch.save(state_dict, path)
        return
    from safetensors.torch import save_file

    seen: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for key, t in state_dict.items():
        t = t.detach()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype) if t.numel() else None
        if ident is not None and ident in seen:  # the same tensor twice (tied weights): store once
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        tensors[key] = t
    # safetensors refuses distinct tensors that share memory (views) and non-contiguous ones:
    # copy exactly those, not the whole model
    storages: dict[int, int] = {}
    for t in tensors.values():
        if t.numel():
            storages[t.untyped_storage().data_ptr()] = storages.get(t.untyped_storage().data_ptr(), 0) + 1
    tensors = {
        k: t.contiguous().clone() if (not t.is_contiguous() or (t.numel() and storages[t.untyped_storage().data_ptr()] > 1)) else t
        for k, t in tensors.items()
    }
    save_file(tensors, path, metadata={"format": "pt", "aliases": json.dumps(aliases)})


def load_tensors(path: str) -> dict:
    if not path.endswith(".safetensors"):
        return torch.load(path, map_location="cpu", weights_only=False)
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for key, target in aliases.items():
        tensors[key] = tensors[target]
    return tensors


def save_optimizer(state_dict: dict, path_stem: str, safe: bool) -> None:
    """Optimizer state: tensors in safetensors, the rest (param groups, step counts kept as
    numbers) as JSON in its metadata; or one pickle with ``safe=False``."""
    if not safe:
        torch.save(state_dict, path_stem + ".bin")
        return
    tensors: dict[str, torch.Tensor] = {}
    skeleton: dict[str, dict] = {}
    for pid, entry in state_dict["state"].items():
        skeleton[str(pid)] = {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{pid}/{k}"] = v.detach().cpu().contiguous()
                skeleton[str(pid)][k] = None
            else:
                skeleton[str(pid)][k] = v
    meta = {"state": skeleton, "param_groups": state_dict["param_groups"],
            "int_keys": all(isinstance(k, int) for k in state_dict["state"]),
            # JSON has no tuples: remember which group values were (Adam's betas), so a loaded
            # optimizer's state_dict equals the saved one
            "tuple_keys": [[k for k, v in g.items() if isinstance(v, tuple)] for g in state_dict["param_groups"]]}
    from safetensors.torch import save_file

    save_file({k: v.clone() for k, v in tensors.items()}, path_stem + ".safetensors",
              metadata={"lowprec_optimizer": json.dumps(meta)})


def load_optimizer(path_stem: str) -> dict:
    if os.path.isfile(path_stem + ".bin"):
        return torch.load(path_stem + ".bin", map_location="cpu", weights_only=False)
    from safetensors import safe_open

    with safe_open(path_stem + ".safetensors", framework="pt") as f:
        meta = json.loads(f.metadata()["lowprec_optimizer"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    state: dict = {}
    for pid, entry in meta["state"].items():
        key = int(pid) if meta["int_keys"] else pid
        state[key] = {k: tensors[f"{pid}/{k}"] if v is None else v for k, v in entry.items()}
    groups = meta["param_groups"]
    for g, keys in zip(groups, meta.get("tuple_keys", [])):
        g.update({k: tuple(g[k]) for k in keys})
    return {"state": state, "param_groups": groups}


def _model_file(directory: str, i: int, safe: bool) -> str:
    return os.path.join(directory, f"model_{i}.safetensors" if safe else f"pytorch_model_{i}.bin")


# --------------------------------------------------------------------------- RNG
def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- save / load
def _broadcast_str(acc: Any, text: str) -> str:
    if not acc.use_distributed:
        return text
    import torch.distributed as dist

    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _per_rank_buffers(model: Any) -> bool:
    """Engines that keep each process's buffers apart (so each process saves its own)."""
    return is_fsdp2(model) or _is_ds(model)


def save_state(acc: Any, output_dir: str, safe_serialization: bool = True) -> str:
    output_dir = os.path.abspath(output_dir)
    tmp = _broadcast_str(acc, f"{output_dir}.tmp-{os.getpid()}")
    if acc.is_main_process:
        _clean_stale_siblings(output_dir)
        os.makedirs(tmp)
    acc.wait_for_everyone()
    try:
        _write_state(acc, tmp, safe_serialization)
    except BaseException:
        if acc.is_main_process:  # the previous checkpoint stays as it was; no half-written copy
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    acc.wait_for_everyone()
    if acc.is_main_process:
        old = f"{output_dir}.old-{os.getpid()}"
        if os.path.exists(output_dir):
            os.replace(output_dir, old)
        os.replace(tmp, output_dir)
        shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return output_dir


def _write_state(acc: Any, tmp: str, safe_serialization: bool) -> None:
    # collectives first (FSDP2 gathers full state on every process), files on the main process;
    # a DeepSpeed engine writes its own (partitioned) model and optimizer state
    models = [None if _is_ds(m) else full_model_state_dict(acc.unwrap_model(m)) for m in acc._models]
    models = acc._run_save_hooks(tmp, models)  # a hook may write files into tmp, or drop a model
    for i, m in enumerate(acc._models):
        if _is_ds(m):
            m.save_checkpoint(os.path.join(tmp, f"deepspeed_{i}"), tag="state")
    opts = [None if _is_ds(acc._optimizer_models.get(id(o))) else
            full_optimizer_state_dict(acc._optimizer_models.get(id(o)), o.optimizer) for o in acc._optimizers]
    if acc.is_main_process:
        for i, sd in enumerate(models):
            if sd is not None:
                save_tensors(sd, _model_file(tmp, i, safe_serialization), safe_serialization)
        for i, osd in enumerate(opts):
            if osd is not None:
                save_optimizer(osd, os.path.join(tmp, f"optimizer_{i}"), safe_serialization)
        for i, s in enumerate(acc._schedulers):
            torch.save(s.state_dict(), os.path.join(tmp, f"scheduler_{i}.bin"))
        for i, d in enumerate(acc._dataloaders):
            with open(os.path.join(tmp, f"dataloader_{i}.json"), "w") as f:
                json.dump(d.state_dict(), f)
        if acc.scaler is not None:
            torch.save(acc.scaler.state_dict(), os.path.join(tmp, "scaler.pt"))
        for i, obj in enumerate(acc._custom_objects):
            torch.save(obj.state_dict(), os.path.join(tmp, f"custom_checkpoint_{i}.pkl"))
        meta = {
            "mixed_precision": acc.mixed_precision,
            "fp8_backend": acc.fp8_backend.value,
            "fp8_backend_info": _jsonable(acc.fp8_backend_info),
            "num_processes": acc.num_processes,
            "step": acc.step,
            "safe_serialization": safe_serialization,
        }
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
    torch.save(_rng_state(), os.path.join(tmp, f"random_states_{acc.process_index}.pkl"))
    for i, m in enumerate(acc._models):
        if _per_rank_buffers(m):
            # FSDP2 and DeepSpeed do not synchronise buffers (DDP broadcasts rank 0's; DeepSpeed
            # writes rank 0's only): each process keeps its own FP8 scaling state (amax histories
            # of its own data), so each saves its own
            buffers = {k: b.detach().cpu() for k, b in acc.unwrap_model(m).named_buffers()}
            save_tensors(buffers, os.path.join(tmp, f"buffers_{i}_rank{acc.process_index}.safetensors"), True)


def _siblings(directory: str, kind: str) -> list[str]:
    """``<directory>.tmp-*`` / ``.old-*`` folders, newest first."""
    found = [p for p in glob.glob(glob.escape(directory) + f".{kind}-*") if os.path.isdir(p)]
    return sorted(found, key=os.path.getmtime, reverse=True)


def _clean_stale_siblings(output_dir: str) -> None:
    """Remove what a crashed save left beside the checkpoint. If the crash came between moving
    the old checkpoint aside and moving the new one in, the ``.old-*`` copy is the last complete
    checkpoint: it is put back under the real name first."""
    olds = _siblings(output_dir, "old")
    if not os.path.exists(output_dir) and olds and os.path.isfile(os.path.join(olds[0], META)):
        logger.warning("lowprec: %s was missing; restored the last complete checkpoint from %s", output_dir, olds[0])
        os.replace(olds.pop(0), output_dir)
    for stale in _siblings(output_dir, "tmp") + olds:
        logger.warning("lowprec: removing %s left by an interrupted save_state", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _resolve_input(input_dir: str) -> str:
    if os.path.exists(input_dir):
        return input_dir
    olds = [p for p in _siblings(input_dir, "old") if os.path.isfile(os.path.join(p, META))]
    if olds:
        logger.warning("lowprec: %s is missing (a save_state was interrupted); loading %s instead", input_dir, olds[0])
        return olds[0]
    return input_dir


def load_state(acc: Any, input_dir: str) -> None:
    input_dir = _resolve_input(os.path.abspath(input_dir))
    meta_path = os.path.join(input_dir, META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{input_dir} is not a lowprec checkpoint (no {META}); pass the directory save_state wrote")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta["mixed_precision"] != acc.mixed_precision or meta["fp8_backend"] != acc.fp8_backend.value:
        raise ValueError(
            f"checkpoint {input_dir} was saved with mixed_precision={meta['mixed_precision']!r}, "
            f"fp8_backend={meta['fp8_backend']!r}; this Accelerator runs {acc.mixed_precision!r}, "
            f"{acc.fp8_backend.value!r}. Use the same settings, or load the weights alone with "
            "model.load_state_dict"
        )
    saved_procs = meta.get("num_processes", acc.num_processes)
    if saved_procs != acc.num_processes:
        raise ValueError(
            f"checkpoint {input_dir} was saved by {saved_procs} process(es); this run has "
            f"{acc.num_processes}. Resume with the same number of processes (e.g. `lowprec launch "
            f"--num_processes {saved_procs}`), or load the weights alone with model.load_state_dict"
        )
    safe = meta.get("safe_serialization", True)
    to_load = acc._run_load_hooks(input_dir)  # a hook may read its files, or drop a model
    for i, m in enumerate(acc._models):
        inner = acc.unwrap_model(m)
        if id(m) not in to_load:
            continue
        if _is_ds(m):
            m.load_checkpoint(os.path.join(input_dir, f"deepspeed_{i}"), tag="state")
        else:
            load_full_model_state_dict(inner, load_tensors(_model_file(input_dir, i, safe)))
        own = os.path.join(input_dir, f"buffers_{i}_rank{acc.process_index}.safetensors")
        if _per_rank_buffers(m) and os.path.isfile(own):
            with torch.no_grad():
                named = dict(inner.named_buffers())
                for k, v in load_tensors(own).items():
                    named[k].copy_(v)
    for i, o in enumerate(acc._optimizers):
        if _is_ds(acc._optimizer_models.get(id(o))):
            continue
        osd = load_optimizer(os.path.join(input_dir, f"optimizer_{i}"))
        load_full_optimizer_state_dict(acc._optimizer_models.get(id(o)), o.optimizer, osd)
    for i, s in enumerate(acc._schedulers):
        s.load_state_dict(torch.load(os.path.join(input_dir, f"scheduler_{i}.bin"), weights_only=False))
    for i, d in enumerate(acc._dataloaders):
        with open(os.path.join(input_dir, f"dataloader_{i}.json")) as f:
            d.load_state_dict(json.load(f))
    if acc.scaler is not None:
        acc.scaler.load_state_dict(torch.load(os.path.join(input_dir, "scaler.pt"), weights_only=False))
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(torch.load(os.path.join(input_dir, f"custom_checkpoint_{i}.pkl"), weights_only=False))
    acc.step = int(meta.get("step", 0))
    rng = os.path.join(input_dir, f"random_states_{acc.process_index}.pkl")
    if os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    else:
        from lowprec.backends.base import log_once

        log_once(f"lowprec: {rng} is missing; random states were not restored (the resumed run's "
                 "dropout/shuffle streams will differ)")
    acc.wait_for_everyone()


def save_model(acc: Any, model: Any, save_directory: str, safe_serialization: bool = True, max_shard_size: Any = "10GB") -> None:
    """Plain weights (no FP8 scaling state, no wrappers) that load into the unconverted model."""
    inner = acc.unwrap_model(model)
    if _is_ds(model) and model.zero_optimization_stage() == 3:
        sd = model._zero3_consolidated_16bit_state_dict()  # collective; full on the main process only
    else:
        sd = full_model_state_dict(inner)
    if acc.is_main_process:
        if acc.backend is not None:
            sd = acc.backend.plain_state_dict(sd)
        os.makedirs(save_directory, exist_ok=True)
        from lowprec.utils.checkpointing import write_sharded

        write_sharded(sd, save_directory, safe_serialization, max_shard_size, save_tensors)
    acc.wait_for_everyone()


def _is_ds(obj: Any) -> bool:
    return type(obj).__name__ == "DeepSpeedEngine"


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))
