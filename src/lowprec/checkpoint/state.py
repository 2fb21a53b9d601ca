"""``save_state`` / ``load_state`` / ``save_model`` for the Accelerator.

A checkpoint directory holds, per prepared object: ``model_{i}.safetensors`` (or
``pytorch_model_{i}.bin`` with ``safe_serialization=False``; FP8 scaling state included, as
buffers), ``optimizer_{i}.safetensors`` (or ``.bin``), ``scheduler_{i}.safetensors``,
``dataloader_{i}.json`` (position), ``scaler.safetensors``, ``custom_checkpoint_{i}.safetensors``,
``random_states_{rank}.safetensors``, ``fp8_health_{i}.json`` (with ``NativeRecipeKwargs(fp8_guard=...)``
or ``fp8_health=True``: the guard's moves, streaks and step count), under FSDP2 and DeepSpeed
``buffers_{i}_rank{rank}.safetensors`` (each process's own FP8 scaling state) and
``lowprec_state.json`` (precision and backend, checked on load).

Loading never unpickles code (:mod:`lowprec.checkpoint.serialization`): safetensors and JSON are parsed,
``.bin`` weights and the ``.pkl``/``.bin``/``.pt`` files of earlier versions go through
``torch.load(weights_only=True)``; a file that does not parse is one error line naming it.
A model whose weights are not finite is refused by ``save_state`` and ``save_model``.

Writes are atomic: everything goes to a sibling temporary directory that replaces the target
only when complete, so a crash never leaves a half-written checkpoint under the real name; its
files and directories are fsynced before the rename and the parent after it, so this holds
across a power loss too (:mod:`lowprec.durable`). A full disk or a read-only directory is one
:class:`~lowprec.errors.StorageError` line; the temporary is removed and earlier checkpoints are
untouched.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import re
import shutil
from typing import Any

import torch

from lowprec.logs import log_once
from lowprec.distributed.expert_parallel import expert_parallel_names
from lowprec.durable import fsync_dir, fsync_tree, os_error_of, owner_alive, temp_suffix
from lowprec.checkpoint.serialization import (
    check_deepspeed_dir,
    deepspeed_mismatch,
    load_object,
    load_optimizer,
    load_pickle,
    load_tensors,
    read_checked,
    save_object,
    save_optimizer,
    saved_zero_stage,
    zero_stage_mismatch,
    save_tensors,
    write_sharded,
)
from lowprec.errors import CheckpointError, StorageError
from lowprec.export import FORMATS, export_model
from lowprec.utils.distributed import (
    full_model_state_dict,
    is_fsdp2,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from lowprec.checkpoint.fp8_fit import check_amax_histories
from lowprec.checkpoint.sharded import load_sharded, save_sharded, uses_sharded
from lowprec.utils.offload import fill_offloaded

__all__ = [
    "clean_interrupted_saves",
    "save_state",
    "load_state",
    "checkpoint_meta",
    "save_model",
    "save_tensors",
    "load_tensors",
    "save_optimizer",
    "load_optimizer",
]

META = "lowprec_state.json"

logger = logging.getLogger("lowprec")


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
    if any(expert_parallel_names(acc.unwrap_model(m)) and uses_sharded(acc, m) for m in acc._models):
        raise ValueError(
            f"save_state({output_dir!r}) with expert parallelism (ParallelismConfig(ep_size=...)) and FSDP2's "
            "SHARDED_STATE_DICT: every process holds other experts under the same names, which a sharded "
            "checkpoint cannot tell apart; use state_dict_type FULL_STATE_DICT (it gathers every expert)"
        )
    for m in acc._models:  # a NaN model would replace the last good checkpoint
        acc.nonfinite.check_model(m, f"save_state({output_dir!r})")
    # named with the main process's host and pid: a cleaner leaves a live writer's alone
    tmp = _broadcast_str(acc, f"{output_dir}.tmp-{temp_suffix()}")
    try:
        if acc.is_main_process:
            _clean_stale_siblings(output_dir)
            os.makedirs(tmp)
        acc.wait_for_everyone()
        _write_state(acc, tmp, safe_serialization)
        acc.wait_for_everyone()
        if acc.is_main_process:
            fsync_tree(tmp)  # the files reach the disk before the name does (power loss)
            _move_into_place(tmp, output_dir)
    except BaseException as exc:
        if acc.is_main_process:  # the previous checkpoint stays as it was; no half-written copy
            shutil.rmtree(tmp, ignore_errors=True)
        err = os_error_of(exc, tmp)
        if err is None:
            raise
        # a full disk / read-only directory: one line (the CLI's exit 74), not a traceback
        raise StorageError(
            err.errno,
            f"cannot write checkpoint {output_dir} ({err.strerror or err}"
            f"{'' if err.filename in (None, tmp) else ': ' + str(err.filename)}); "
            "it was not saved and the checkpoints before it are untouched",
        ) from None
    acc.wait_for_everyone()
    return output_dir


def _move_into_place(tmp: str, output_dir: str) -> None:
    """``tmp`` becomes ``output_dir`` (an earlier one moved aside, then removed); the parent is
    fsynced so the rename is durable. A failed rename puts the earlier one back."""
    old = f"{output_dir}.old-{temp_suffix()}"
    moved = False
    try:
        if os.path.exists(output_dir):
            os.replace(output_dir, old)
            moved = True
        os.replace(tmp, output_dir)
    except OSError:
        if moved and not os.path.exists(output_dir):
            os.replace(old, output_dir)
        raise
    fsync_dir(os.path.dirname(output_dir))
    shutil.rmtree(old, ignore_errors=True)


def _write_state(acc: Any, tmp: str, safe_serialization: bool) -> None:
    # collectives first (FSDP2 gathers full state on every process), files on the main process;
    # a DeepSpeed engine writes its own (partitioned) model and optimizer state

    sharded = [uses_sharded(acc, m) for m in acc._models]
    models = [
        None if _is_ds(m) or sh else full_model_state_dict(acc.unwrap_model(m), checkpoint=True)
        for m, sh in zip(acc._models, sharded)
    ]
    models = acc._run_save_hooks(tmp, models)  # a hook may write files into tmp, or drop a model
    for i, m in enumerate(acc._models):
        if _is_ds(m):
            m.save_checkpoint(os.path.join(tmp, f"deepspeed_{i}"), tag="state")
        elif sharded[i]:  # model and its optimizer, each process its own shards (checkpoint_sharded)
            save_sharded(acc, m, os.path.join(tmp, f"sharded_{i}"))
    skip = lambda owner: _is_ds(owner) or (owner is not None and uses_sharded(acc, owner))  # noqa: E731
    opts = [
        None
        if skip(acc._optimizer_models.get(id(o)))
        else full_optimizer_state_dict(acc._optimizer_models.get(id(o)), o.optimizer)
        for o in acc._optimizers
    ]
    if acc.is_main_process:
        for i, sd in enumerate(models):
            if sd is not None:
                save_tensors(sd, _model_file(tmp, i, safe_serialization), safe_serialization)
        for i, osd in enumerate(opts):
            if osd is not None:
                save_optimizer(osd, os.path.join(tmp, f"optimizer_{i}"), safe_serialization)
        for i, s in enumerate(acc._schedulers):
            save_object(s.state_dict(), os.path.join(tmp, f"scheduler_{i}.safetensors"), f"scheduler {i}")
        for i, d in enumerate(acc._dataloaders):
            with open(os.path.join(tmp, f"dataloader_{i}.json"), "w") as f:
                # samples per step over all processes: the position in another world size
                json.dump({**d.state_dict(), "global_batch": _global_batch(acc, d)}, f)
        if acc.scaler is not None:
            save_object(acc.scaler.state_dict(), os.path.join(tmp, "scaler.safetensors"), "the grad scaler")
        for i, m in enumerate(acc._models):  # NativeRecipeKwargs(fp8_guard=...): moves, streaks, step count
            health = acc._fp8_health.state_dict(acc.unwrap_model(m))
            if health is not None:
                with open(os.path.join(tmp, f"fp8_health_{i}.json"), "w") as f:
                    json.dump(health, f)
        for i, obj in enumerate(acc._custom_objects):
            save_object(
                obj.state_dict(),
                os.path.join(tmp, f"custom_checkpoint_{i}.safetensors"),
                f"registered object {i} ({type(obj).__name__})",
            )
        meta = {
            "mixed_precision": acc.mixed_precision,
            "fp8_backend": acc.fp8_backend.value,
            "fp8_backend_info": _jsonable(acc.fp8_backend_info),
            "num_processes": acc.num_processes,
            "step": acc.step,
            "optimizer_steps": acc.nonfinite.optimizer_steps,
            "safe_serialization": safe_serialization,
            "sharded": [i for i, sh in enumerate(sharded) if sh],  # reshardable onto another world size
            # which stage wrote each deepspeed_<i>/ (ZeRO-3's files and stage 1/2's do not load each other)
            "deepspeed_zero_stages": [m.zero_optimization_stage() if _is_ds(m) else None for m in acc._models],
        }
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
    save_object(_rng_state(), os.path.join(tmp, f"random_states_{acc.process_index}.safetensors"), "the RNG states")
    for i, m in enumerate(acc._models):
        if _per_rank_buffers(m):
            # FSDP2 and DeepSpeed do not synchronise buffers (DDP broadcasts rank 0's; DeepSpeed
            # writes rank 0's only): each process keeps its own FP8 scaling state (amax histories
            # of its own data), so each saves its own. Not the sharded experts' (expert
            # parallelism): the model file holds them whole, which loads on any process count
            inner = acc.unwrap_model(m)
            experts = set(expert_parallel_names(inner))
            buffers = {k: b.detach().cpu() for k, b in inner.named_buffers() if k not in experts}
            save_tensors(buffers, os.path.join(tmp, f"buffers_{i}_rank{acc.process_index}.safetensors"), True)


def _siblings(directory: str, kind: str) -> list[str]:
    """``<directory>.tmp-*`` / ``.old-*`` folders, newest first."""
    found = [p for p in glob.glob(glob.escape(directory) + f".{kind}-*") if os.path.isdir(p)]
    return sorted(found, key=os.path.getmtime, reverse=True)


def _clean_stale_siblings(output_dir: str) -> None:
    """Remove what a crashed save left beside the checkpoint. If the crash came between moving
    the old checkpoint aside and moving the new one in, the ``.old-*`` copy is the last complete
    checkpoint: it is put back under the real name first. A sibling whose writer still runs (its
    host and pid are in the name) is another process's save in progress: left alone."""
    olds = [p for p in _siblings(output_dir, "old") if not owner_alive(p, "old")]
    if not os.path.exists(output_dir) and olds and os.path.isfile(os.path.join(olds[0], META)):
        logger.warning("lowprec: %s was missing; restored the last complete checkpoint from %s", output_dir, olds[0])
        os.replace(olds.pop(0), output_dir)
    for stale in [p for p in _siblings(output_dir, "tmp") if not owner_alive(p, "tmp")] + olds:
        logger.warning("lowprec: removing %s left by an interrupted save_state", stale)
        shutil.rmtree(stale, ignore_errors=True)


def clean_interrupted_saves(directory: str, names: str = r".+") -> None:
    """Put back and remove what saves killed mid-write left in ``directory``: the
    ``<name>.tmp-<host>-<pid>`` / ``<name>.old-...`` folders of the targets whose name fully
    matches the regex ``names``, by :func:`_clean_stale_siblings`' rule (a moved-aside last
    complete checkpoint returns under its name, a live writer's folders are left alone). A save
    cleans its own target's siblings only, so a run that never saves that name again (a fresh
    run, another ``max_steps``) calls this first; else they stay for good."""
    if not os.path.isdir(directory):
        return
    partial = re.compile(rf"^({names})\.(?:tmp|old)-[^/]*-\d+$")
    found = {m.group(1) for m in map(partial.match, os.listdir(directory)) if m}
    for name in sorted(found):
        _clean_stale_siblings(os.path.join(directory, name))


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
    meta = checkpoint_meta(input_dir)
    if meta["mixed_precision"] != acc.mixed_precision or meta["fp8_backend"] != acc.fp8_backend.value:
        raise ValueError(
            f"checkpoint {input_dir} was saved with mixed_precision={meta['mixed_precision']!r}, "
            f"fp8_backend={meta['fp8_backend']!r}; this Accelerator runs {acc.mixed_precision!r}, "
            f"{acc.fp8_backend.value!r}. Use the same settings, or load the weights alone with "
            "model.load_state_dict"
        )
    saved_procs = meta.get("num_processes", acc.num_processes)
    sharded = set(meta.get("sharded", []))
    reshard = saved_procs != acc.num_processes
    # a full-state model file holds every weight (expert parallelism: every expert, gathered) and
    # the optimizer file every state (the experts' moments gathered too), sharded (DCP) files
    # reshard: either loads on any process count. DeepSpeed's partitioned files do not.
    if reshard and any(_is_ds(m) for m in acc._models):
        raise ValueError(
            f"checkpoint {input_dir} was saved by {saved_procs} process(es) with DeepSpeed; this run has "
            f"{acc.num_processes}. Resume with the same number of processes (e.g. `lowprec launch "
            f"--num_processes {saved_procs}`), or load the weights alone with model.load_state_dict"
        )
    safe = meta.get("safe_serialization", True)
    _load_models(acc, input_dir, sharded, meta, reshard, safe)
    for i, m in enumerate(acc._models):  # the guard's moves: after the weights, before the next step
        where = os.path.join(input_dir, f"fp8_health_{i}.json")
        if os.path.isfile(where):
            inner = acc.unwrap_model(m)
            _apply(
                lambda st, inner=inner: acc._fp8_health.load_state_dict(inner, st, acc.is_main_process),
                read_checked(where, _read_json),
                where,
            )
    for i, o in enumerate(acc._optimizers):
        owner = acc._optimizer_models.get(id(o))
        if _is_ds(owner) or any(owner is acc._models[j] for j in sharded if j < len(acc._models)):
            continue  # DeepSpeed's own files / loaded with its model's shards
        osd = load_optimizer(os.path.join(input_dir, f"optimizer_{i}"))
        owner = acc._optimizer_models.get(id(o))
        _apply(
            lambda sd, owner=owner, o=o: load_full_optimizer_state_dict(owner, o.optimizer, sd),
            osd,
            os.path.join(input_dir, f"optimizer_{i}"),
        )
    for i, s in enumerate(acc._schedulers):
        _apply(s, _read_state(input_dir, f"scheduler_{i}", ".bin"))
    for i, d in enumerate(acc._dataloaders):
        where = os.path.join(input_dir, f"dataloader_{i}.json")
        _apply(d, _data_position(read_checked(where, _read_json), _global_batch(acc, d), where))
    if acc.scaler is not None:
        _apply(acc.scaler, _read_state(input_dir, "scaler", ".pt"))
    for i, obj in enumerate(acc._custom_objects):
        _apply(obj, _read_state(input_dir, f"custom_checkpoint_{i}", ".pkl"))
    acc.step = int(meta.get("step", 0))
    acc.nonfinite.optimizer_steps = int(meta.get("optimizer_steps", 0))
    _load_rng(acc, input_dir, saved_procs, reshard)
    acc.wait_for_everyone()


def checkpoint_meta(input_dir: str) -> dict:
    """A checkpoint's ``lowprec_state.json`` (precision, backend, process count); a file that
    does not parse is one error line naming it."""
    return read_checked(os.path.join(input_dir, META), _read_meta)


def _load_models(acc: Any, input_dir: str, sharded: set, meta: dict, reshard: bool, safe: bool) -> None:
    """Each prepared model's weights (DeepSpeed's own files, FSDP2 shards or one full state) and
    its per-rank FP8 scaling buffers."""
    saved_procs = meta.get("num_processes", acc.num_processes)
    to_load = acc._run_load_hooks(input_dir)  # a hook may read its files, or drop a model
    for i, m in enumerate(acc._models):
        inner = acc.unwrap_model(m)
        if id(m) not in to_load:
            continue
        saved_under_ds = os.path.isdir(os.path.join(input_dir, f"deepspeed_{i}"))
        stage = saved_zero_stage(input_dir, i, meta) if saved_under_ds else None
        if saved_under_ds != _is_ds(m) and (saved_under_ds or os.path.isfile(_model_file(input_dir, i, safe))):
            raise CheckpointError(
                deepspeed_mismatch(input_dir, saved_under_ds, "checkpoint ", "DeepSpeed", saved_procs, stage)
            )
        if _is_ds(m):
            wrong = zero_stage_mismatch(input_dir, stage, m.zero_optimization_stage(), "checkpoint ", "DeepSpeed")
            if wrong is not None:
                raise CheckpointError(wrong)
            check_deepspeed_dir(os.path.join(input_dir, f"deepspeed_{i}"))  # DeepSpeed itself unpickles freely
            m.load_checkpoint(os.path.join(input_dir, f"deepspeed_{i}"), tag="state")
        elif i in sharded:
            load_sharded(acc, m, os.path.join(input_dir, f"sharded_{i}"))
        else:
            path = _model_file(input_dir, i, safe)
            sd = load_tensors(path)
            check_amax_histories({k: v.shape for k, v in sd.items()}, inner, path)
            _apply(lambda sd, inner=inner: load_full_model_state_dict(inner, sd), sd, path)
        own = os.path.join(input_dir, f"buffers_{i}_rank{acc.process_index}.safetensors")
        if (
            reshard
            and not os.path.isfile(own)
            and glob.glob(os.path.join(glob.escape(input_dir), f"buffers_{i}_rank*"))
        ):
            log_once(
                f"lowprec: {os.path.basename(own)} is not in the checkpoint (saved by {saved_procs} processes); "
                "this process keeps the FP8 scaling state of the loaded model state (rank 0's)"
            )
        if _per_rank_buffers(m) and os.path.isfile(own):
            with torch.no_grad():
                named = dict(inner.named_buffers())
                kept = load_tensors(own)
                check_amax_histories({k: v.shape for k, v in kept.items()}, inner, own)
                for k, v in kept.items():
                    if named[k].shape != v.shape:  # copy_ would broadcast, or fail in a traceback
                        raise CheckpointError(
                            f"{own} holds {k} of shape {tuple(v.shape)}, this model's is {tuple(named[k].shape)} "
                            f"(an earlier lowprec kept each process's experts' FP8 state there): resume it on "
                            f"{saved_procs} processes"
                        )
                    named[k].copy_(v)


def _load_rng(acc: Any, input_dir: str, saved_procs: int, reshard: bool) -> None:
    """This process's random states (saved process r mod N's when the process count changed)."""
    rng = os.path.join(input_dir, f"random_states_{acc.process_index % saved_procs if reshard else acc.process_index}")
    if reshard:
        log_once(
            f"lowprec: resumed on {acc.num_processes} processes from a checkpoint of {saved_procs}: process r "
            f"restores the random states of saved process r mod {saved_procs} (dropout/shuffle streams "
            "differ from an uninterrupted run)"
        )
    if os.path.isfile(rng + ".safetensors") or os.path.isfile(rng + ".pkl"):
        where = rng + (".safetensors" if os.path.isfile(rng + ".safetensors") else ".pkl")
        state = _read_state(input_dir, os.path.basename(rng), ".pkl")
        try:
            _set_rng_state(state)
        except Exception as exc:  # noqa: BLE001 - a well-formed file with the wrong contents
            raise CheckpointError(
                f"checkpoint file {where} does not hold RNG states ({type(exc).__name__}: {exc})"
            ) from None
    else:
        log_once(
            f"lowprec: {rng}.safetensors is missing; random states were not restored (the resumed run's "
            "dropout/shuffle streams will differ)"
        )


def _global_batch(acc: Any, loader: Any) -> int | None:
    """Samples one step takes over all processes (None where the loader has no fixed batch)."""
    bs = getattr(loader, "batch_size", None)
    if not isinstance(bs, int):
        return None
    return bs if getattr(acc, "split_batches", False) else bs * acc.num_processes


def _data_position(state: Any, global_batch: int | None, where: str) -> Any:
    """The saved loader position in this run's batches: the same samples consumed."""
    if not isinstance(state, dict):
        return state
    saved = state.pop("global_batch", None)
    if saved is None or global_batch is None or saved == global_batch:
        return state
    samples = int(state["batches_yielded"]) * saved
    if samples % global_batch:
        raise CheckpointError(
            f"{where}: the saved run consumed {samples} samples ({saved} per step); this run takes "
            f"{global_batch} per step, which does not divide them. Keep batch_size x processes at {saved}"
        )
    return {**state, "batches_yielded": samples // global_batch}


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _read_meta(path: str) -> dict:
    meta = _read_json(path)
    if not isinstance(meta, dict) or not {"mixed_precision", "fp8_backend"} <= set(meta):
        raise ValueError("not a lowprec_state.json mapping (needs mixed_precision and fp8_backend)")
    procs = meta.get("num_processes", 1)
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        # a hand-edited value would otherwise end up in advice such as `--num_processes 0`
        raise ValueError(f"num_processes is {procs!r}, not a process count >= 1")
    return meta


def _read_state(directory: str, stem: str, legacy_ext: str) -> Any:
    """``<stem>.safetensors`` (this version), else ``<stem><legacy_ext>`` (earlier versions'
    pickle, read with the restricted unpickler)."""
    path = os.path.join(directory, stem + ".safetensors")
    legacy = os.path.join(directory, stem + legacy_ext)
    if not os.path.isfile(path) and os.path.isfile(legacy):
        return load_pickle(legacy)
    return load_object(path)


def _apply(obj: Any, state: Any, where: str = "") -> None:
    """``obj.load_state_dict(state)`` (or ``obj(state)``); a parsed file whose contents do not
    fit is one line too, naming the file when given."""
    try:
        obj(state) if callable(obj) and not hasattr(obj, "load_state_dict") else obj.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001
        what = where or f"the checkpoint's state for {type(obj).__name__}"
        raise CheckpointError(
            f"{what} does not fit this run ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
            "was the checkpoint written by another script or model?"
        ) from None


def save_model(
    acc: Any, model: Any, save_directory: str, safe_serialization: bool = True, max_shard_size: Any = "10GB"
) -> None:
    """Plain weights (no FP8 scaling state, no wrappers) that load into the unconverted model."""

    inner = acc.unwrap_model(model)
    if _is_ds(model) and model.zero_optimization_stage() == 3:
        sd = model._zero3_consolidated_16bit_state_dict()  # collective; full on the main process only
    else:
        sd = fill_offloaded(inner, full_model_state_dict(inner))  # disk-offloaded weights read back
    acc.nonfinite.check_model(model, f"save_model({save_directory!r})")
    if acc.is_main_process:
        if acc.backend is not None:
            sd = acc.backend.plain_state_dict(sd)
        os.makedirs(save_directory, exist_ok=True)

        write_sharded(sd, save_directory, safe_serialization, max_shard_size, save_tensors)
    acc.wait_for_everyone()


def save_fp8_model(acc: Any, model: Any, save_directory: str, fp8_format: str) -> None:
    """``Accelerator.save_model(..., fp8_format=...)``: an FP8 export of the whole model, which one
    process must hold (one process or DDP; a sharded model is refused in one line)."""
    if fp8_format not in FORMATS:
        raise ValueError(
            f"save_model(fp8_format={fp8_format!r}): choose one of {', '.join(FORMATS)}, or leave it "
            "unset for plain weights"
        )
    inner = acc.unwrap_model(model)
    if _is_ds(model) or any(type(p).__name__ == "DTensor" for p in inner.parameters()):
        raise ValueError(
            f"save_model(fp8_format={fp8_format!r}) needs the whole model in one process (one process "
            "or DDP); under FSDP2 / DeepSpeed save plain weights (no fp8_format), load them into the model in one "
            "process and call lowprec.export.export_model(model, DIR, format=...) (fp8.convert it with the run's "
            "recipe first to export its FP8 casts)"
        )
    acc.nonfinite.check_model(model, f"save_model({save_directory!r})")
    if acc.is_main_process:
        export_model(inner, save_directory, format=fp8_format)
    acc.wait_for_everyone()


def _is_ds(obj: Any) -> bool:
    return type(obj).__name__ == "DeepSpeedEngine"


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))
