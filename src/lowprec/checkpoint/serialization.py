"""Checkpoint files that cannot run code when read.

Pickle runs whatever a file tells it to (``__reduce__`` -> ``os.system``), so nothing here
unpickles freely:

* every object a checkpoint holds besides model and optimizer (LR schedulers, the grad scaler,
  registered custom objects, RNG states) is written by :func:`save_object` as one safetensors
  file: its tensors as tensors, everything else (numbers, strings, lists, tuples, dicts) as JSON
  in the file's metadata. A state that holds anything else is refused *when saving*, with the
  object named, instead of being written in a form a later load could not check;
* files in pickle format (``safe_serialization=False`` weights, checkpoints of earlier lowprec
  versions) are read by :func:`load_pickle` with ``torch.load(weights_only=True)``, whose
  unpickler builds tensors and plain containers only, plus the explicit allow-list
  :data:`LEGACY_ALLOWED` (numpy's array reconstruction, for the RNG states older versions
  pickled);
* DeepSpeed reads its own files with ``torch.load(weights_only=False)``; before it may,
  :func:`check_deepspeed_dir` lists the globals each file names (torch's opcode scan, nothing
  executed) and refuses any outside torch's safe set and :data:`DEEPSPEED_ALLOWED`;
* any file that fails to parse raises :class:`~lowprec.errors.CheckpointError`, one line naming
  the file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Optional, TypeVar

import torch

from lowprec.errors import CheckpointError

__all__ = [
    "save_tensors",
    "load_tensors",
    "save_optimizer",
    "load_optimizer",
    "parse_size",
    "write_sharded",
    "save_object",
    "load_object",
    "load_pickle",
    "read_checked",
    "check_deepspeed_dir",
    "deepspeed_mismatch",
    "saved_zero_stage",
    "zero_stage_mismatch",
    "LEGACY_ALLOWED",
    "DEEPSPEED_ALLOWED",
    "OBJECT_KEY",
    "load_error_reason",
]

OBJECT_KEY = "lowprec_object"  # the safetensors metadata entry holding the JSON skeleton
_T = TypeVar("_T")
# markers of values JSON has no literal for; a str-keyed dict using one of these keys is
# itself written through the pair-list form, so decoding is unambiguous
_MARKERS = ("__tensor__", "__tuple__", "__pairs__", "__ndarray__")


def _legacy_allowed() -> list:
    """Globals that RNG states pickled by earlier lowprec versions need: numpy's array
    reconstruction and dtypes (data, no code path of their own)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    allowed: list = [rebuild, np.ndarray, np.dtype]
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64")]
    # a file pickled under numpy 1.x names the function by its old module path
    allowed += [(rebuild, "numpy.core.multiarray._reconstruct")]
    return allowed


LEGACY_ALLOWED = _legacy_allowed()
# what DeepSpeed 0.1x pickles besides tensors (ZeRO 1-3, bf16/fp16/fp32; found by saving each):
# plain data classes and an enum, rebuilt without running code of theirs
DEEPSPEED_ALLOWED = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


# --------------------------------------------------------------------------- encode / decode
def _encode(obj: Any, tensors: dict[str, torch.Tensor], what: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = obj.detach().cpu().contiguous().clone()  # clone: safetensors refuses shared memory
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_encode(v, tensors, what) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return {"__tuple__": [_encode(v, tensors, what) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _MARKERS for k in obj):
            return {k: _encode(v, tensors, what) for k, v in obj.items()}
        return {"__pairs__": [[_encode(k, tensors, what), _encode(v, tensors, what)] for k, v in obj.items()]}
    kind = type(obj).__module__
    if kind == "numpy":
        if hasattr(obj, "tolist") and hasattr(obj, "dtype") and getattr(obj, "ndim", 0) > 0:
            return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
        return obj.item()  # numpy scalar
    raise CheckpointError(
        f"{what}: its state_dict() holds a {type(obj).__module__}.{type(obj).__qualname__}, which a "
        "checkpoint cannot store without pickle; return tensors, numbers, strings, lists, tuples and dicts"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if len(obj) == 1 and "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if len(obj) == 1 and "__pairs__" in obj:
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in obj["__pairs__"]}
    if set(obj) == {"__ndarray__", "dtype"}:
        import numpy as np

        return np.asarray(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


# --------------------------------------------------------------------------- files
def save_object(state: Any, path: str, what: str) -> None:
    """``state`` (a state_dict) as one safetensors file: tensors + a JSON skeleton."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, what)
    save_file(tensors, path, metadata={OBJECT_KEY: json.dumps(skeleton)})


def load_error_reason(exc: BaseException) -> str:
    """Why a file did not load, in a few words. torch's weights-only refusal is a paragraph
    whose first sentences suggest ``weights_only=False`` (the code execution it just prevented):
    only the global it refused is kept."""
    text = " ".join(str(exc).split())
    if "Weights only load failed" in text:
        named = re.search(r"GLOBAL ([\w.]+)", text)
        if named:
            return f"it names {named.group(1)}, which is not data (weights-only allow-list): refused before anything in it ran"
        detail = re.search(r"WeightsUnpickler error: (.*?) Check the documentation", text)
        return f"not a tensor file: {detail.group(1) if detail else 'refused by the weights-only unpickler'}"
    return f"{type(exc).__name__}: {text[:200] or type(exc).__name__}"


def read_checked(path: str, reader: Callable[[str], _T]) -> _T:
    """``reader(path)``, with any failure to parse turned into one line naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete")
    try:
        return reader(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure is the same user-facing problem
        raise CheckpointError(
            f"checkpoint file {path} cannot be read ({load_error_reason(exc)}); it is damaged, "
            "was replaced, or was not written by lowprec: restore it or resume from another checkpoint"
        ) from None


def _read_object(path: str) -> Any:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if OBJECT_KEY not in meta:
            raise ValueError(f"no {OBJECT_KEY!r} metadata")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(json.loads(meta[OBJECT_KEY]), tensors)


def load_object(path: str) -> Any:
    """What :func:`save_object` wrote (no pickle involved)."""
    return read_checked(path, _read_object)


def _read_pickle(path: str) -> Any:
    with torch.serialization.safe_globals(LEGACY_ALLOWED):
        return torch.load(path, map_location="cpu", weights_only=True)


def load_pickle(path: str) -> Any:
    """A pickle-format file (``safe_serialization=False`` weights, older checkpoints) through
    torch's restricted unpickler: tensors, plain containers and :data:`LEGACY_ALLOWED` only; a
    file naming any other global (a class, ``os.system``) is refused before anything runs."""
    return read_checked(path, _read_pickle)


def _check_globals(path: str) -> None:
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)  # parses opcodes only
    bad = sorted(set(unsafe) - DEEPSPEED_ALLOWED)
    if bad:
        raise ValueError(f"it names {', '.join(bad[:3])}, which DeepSpeed never writes: refused before loading")


def check_deepspeed_dir(directory: str) -> None:
    """Refuse a DeepSpeed checkpoint directory holding a pickle that would run code on load."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} is missing; the checkpoint is incomplete")
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            if name == "latest" or name.endswith(".py"):  # a text tag and helper scripts DeepSpeed copies
                continue
            read_checked(os.path.join(root, name), _check_globals)


def saved_zero_stage(checkpoint: str, index: int, meta: dict) -> Optional[int]:
    """The ZeRO stage model ``index``'s ``deepspeed_<index>/`` was saved under: lowprec's record
    in ``meta`` where there is one; else 3 when DeepSpeed's model files are per rank (ZeRO-3
    writes ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``); else None: stage 1 or 2, one file
    format that either stage loads."""
    stages = meta.get("deepspeed_zero_stages") or []
    if index < len(stages) and isinstance(stages[index], int):
        return stages[index]
    for _, _, names in os.walk(os.path.join(checkpoint, f"deepspeed_{index}")):
        if any(n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt") for n in names):
            return 3
    return None


def _stage_name(stage: Optional[int]) -> str:
    return "ZeRO stage 1 or 2" if stage is None else f"ZeRO stage {stage}"


def zero_stage_mismatch(
    checkpoint: str, saved: Optional[int], current: Any, prefix: str, setting: str
) -> Optional[str]:
    """The line for a DeepSpeed checkpoint resumed under a ZeRO stage that cannot load its files
    (ZeRO-3 against stage 1 or 2: DeepSpeed itself stops with a bare ``AssertionError``); None
    where the stages load each other's files (1 and 2) or ``current`` is not a stage number."""
    if not isinstance(current, int) or (saved == 3) == (current == 3):
        return None
    return (
        f"{prefix}{checkpoint} was saved under DeepSpeed {_stage_name(saved)}, whose files DeepSpeed ZeRO stage "
        f"{current} cannot load: resume it with the stage that saved it (zero_optimization.stage in the {setting} "
        "config)"
    )


def deepspeed_mismatch(
    checkpoint: str, saved_under_ds: bool, prefix: str, setting: str, processes: int, stage: Optional[int] = None
) -> str:
    """The line for a checkpoint saved with DeepSpeed resumed without it, or the other way round:
    DeepSpeed writes its own partitioned model and optimizer files (``deepspeed_<i>/``) instead
    of ``model_<i>.safetensors`` and ``optimizer_<i>``, and neither loader reads the other's.
    ``processes``: the saved run's process count (DeepSpeed's files load on that count only);
    ``stage``: the ZeRO stage that saved it (:func:`saved_zero_stage`)."""
    if saved_under_ds:
        return (
            f"{prefix}{checkpoint} was saved under DeepSpeed (its model and optimizer are DeepSpeed's files in "
            f"deepspeed_0/, not model_0.safetensors): resume it with the {setting} settings that saved it "
            f"({_stage_name(stage)}), on {processes} process{'es' if processes > 1 else ''} "
            f"(--num_processes {processes})"
        )
    return (
        f"{prefix}{checkpoint} was saved without DeepSpeed (model_0.safetensors, no deepspeed_0/), which DeepSpeed "
        f"cannot load: resume it without {setting}"
    )


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: Any) -> int:
    """``100``, ``"10GB"``, ``"500MiB"`` -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size={size!r}; use bytes (an int) or a string like '10GB' or '500MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2) or "B"])


def write_sharded(
    state_dict: dict, directory: str, safe: bool, max_shard_size: Any, save: Callable[[dict, str, bool], None]
) -> None:
    """One file when it fits in ``max_shard_size``, else shards plus a JSON index mapping each
    tensor to its file (the layout transformers and Accelerate load)."""
    limit = parse_size(max_shard_size)
    shards: list[dict] = [{}]
    size = 0
    for k, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    if len(shards) == 1:
        save(state_dict, os.path.join(directory, f"{stem}.{ext}"), safe)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}"
        save(shard, os.path.join(directory, name), safe)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    with open(os.path.join(directory, f"{stem}.{ext}.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


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
        ident = (
            (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if t.numel()
            else None
        )
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
        k: t.contiguous().clone()
        if (not t.is_contiguous() or (t.numel() and storages[t.untyped_storage().data_ptr()] > 1))
        else t
        for k, t in tensors.items()
    }
    save_file(tensors, path, metadata={"format": "pt", "aliases": json.dumps(aliases)})


def load_tensors(path: str) -> dict:
    if not path.endswith(".safetensors"):
        return load_pickle(path)
    return read_checked(path, _read_tensors)


def _read_tensors(path: str) -> dict:
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
    meta = {
        "state": skeleton,
        "param_groups": state_dict["param_groups"],
        "int_keys": all(isinstance(k, int) for k in state_dict["state"]),
        # JSON has no tuples: remember which group values were (Adam's betas), so a loaded
        # optimizer's state_dict equals the saved one
        "tuple_keys": [[k for k, v in g.items() if isinstance(v, tuple)] for g in state_dict["param_groups"]],
    }
    from safetensors.torch import save_file

    save_file(
        {k: v.clone() for k, v in tensors.items()},
        path_stem + ".safetensors",
        metadata={"lowprec_optimizer": json.dumps(meta)},
    )


def load_optimizer(path_stem: str) -> dict:
    if os.path.isfile(path_stem + ".bin"):
        return load_pickle(path_stem + ".bin")
    return read_checked(path_stem + ".safetensors", _read_optimizer)


def _read_optimizer(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
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
