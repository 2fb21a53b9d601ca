"""The trainer's YAML schema (``lowprec train my.yaml``): Axolotl's key names, strict checking.

The keys live in mixins by topic (``config.model``, ``config.data``, ``config.optim``,
``config.output``, ``config.fp8``, ``config.dist``, ``config.adapter``); :class:`TrainConfig`
composes them into one flat mapping (as Axolotl's YAML is flat) and holds the cross-topic rules.

Every key is a field of :class:`TrainConfig` with a description; ``lowprec train --help`` and
the ``--key value`` override flags are generated from it. Unlike Axolotl:

* unknown keys are errors with a "did you mean" (Axolotl drops them silently), at every level;
* every documented value validates, ``bf16: full`` included (Axolotl documents it and rejects it);
* known-bad combinations are rejected here with the fix in the message; the ones that depend on
  the machine (GPU generation, installed packages) are checked against a :class:`Capabilities`
  object passed in, so tests cover them without the hardware;
* ``bf16: true`` means float32 master weights under bf16 autocast (Axolotl loads bf16 weights);
  ``bf16: full`` is pure bf16 weights, no autocast.

Loading: :func:`load_config` reads YAML, applies ``--key value`` overrides (values parsed as
YAML, so ``--fp8_filter "[q_proj]"`` works) and validates; every error is one ``ValueError``
line naming the key and the fix. ``auto`` values are resolved later, once, by
:mod:`lowprec.train.resolve`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, Sequence, cast, get_args

import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr, TypeAdapter, ValidationError, model_validator

from lowprec.catalog import check_fsdp_fp8_all_gather, check_tensor_parallel
from lowprec.errors import did_you_mean
from lowprec.train.axolotl_keys import screen_top_level
from lowprec.train.config.inert import inert_keys
from lowprec.train.config.adapter import AdapterKeys
from lowprec.train.config.base import yaml_text
from lowprec.train.config.compare import CompareKeys, CompareSpec, check_fp8_backend
from lowprec.train.config.data import DataKeys, DatasetSpec
from lowprec.train.config.dist import DistributedKeys, FSDPConfig
from lowprec.guard_settings import check_act_with_fp8_all_gather, check_health_for_guard
from lowprec.train.config.fp8 import FP8RecipeSpec, PrecisionKeys, yaml_spelling
from lowprec.train.config.model import ModelKeys
from lowprec.train.config.optim import LR_SCHEDULERS, OPTIMIZERS, OptimKeys
from lowprec.train.config.output import OutputKeys
from lowprec.train.model_config import LlamaConfig
from lowprec.config.yaml_file import read_yaml_mapping

__all__ = [
    "TrainConfig",
    "DatasetSpec",
    "FP8RecipeSpec",
    "FSDPConfig",
    "CompareSpec",
    "load_config",
    "parse_config",
    "parse_override_value",
    "config_field_help",
    "render_config_keys",
    "write_config_keys",
    "OPTIMIZERS",
    "LR_SCHEDULERS",
]


# pydantic lists inherited fields in reverse MRO order: the bases are written last topic first so
# that `lowprec train --help` and cli/train_keys.py list model, data, optim, output, precision,
# distributed, adapter keys in that order.
class TrainConfig(CompareKeys, AdapterKeys, DistributedKeys, PrecisionKeys, OutputKeys, OptimKeys, DataKeys, ModelKeys):
    """Everything ``lowprec train`` reads. Keys follow Axolotl where Axolotl has one."""

    _notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per key the config sets that does nothing given the rest
        (:mod:`lowprec.train.config.inert`); the trainer logs each once."""
        return self._notes

    def _check_expert_parallel(self) -> None:
        """``ep_size`` > 1: what expert parallelism runs with (one error naming the key each)."""
        ep = self.ep_size
        if ep == 1:
            if self.ep_combine != "hp":
                raise ValueError(
                    f"ep_combine: {self.ep_combine} is the expert outputs' wire format under expert parallelism: "
                    "set ep_size > 1 or drop ep_combine"
                )
            return
        if not self.fp8:  # a library backend: check_fp8_backend refuses ep_size
            raise ValueError(f"ep_size: {ep} shards lowprec's FP8 experts: set fp8: true")
        if self.adapter is not None and self.lora_target_parameters:
            raise ValueError(
                f"ep_size: {ep} with lora_target_parameters: adapters on the expert weights are not sharded with "
                "them; put LoRA on attention (lora_target_modules) with the experts frozen, or set ep_size: 1"
            )
        for key, on in (
            ("tensor_parallel_size", self.tensor_parallel_size > 1),
            ("deepspeed", self.deepspeed is not None),
        ):
            if on:
                raise ValueError(
                    f"ep_size: {ep} with {key}: expert parallelism runs the other weights under DDP or FSDP2 and does not "
                    f"compose with {key} yet; drop {key} or set ep_size: 1"
                )
        sharded = self.fsdp_config is not None and self.fsdp_config.state_dict_type == "SHARDED_STATE_DICT"
        for key in ("save_steps", "saves_per_epoch"):
            if getattr(self, key) is not None and sharded:
                raise ValueError(
                    f"ep_size: {ep} with {key} and fsdp_config.state_dict_type: SHARDED_STATE_DICT: every process "
                    "holds other experts under the same names, which a sharded checkpoint cannot tell apart; use "
                    f"state_dict_type: FULL_STATE_DICT (it gathers every expert) or drop {key}"
                )
        if self.base_model.startswith("builtin:"):
            n = LlamaConfig.from_name(self.base_model[len("builtin:") :]).n_experts
            if not n:
                raise ValueError(
                    f"ep_size: {ep} with {self.base_model}, which has no experts; use base_model: builtin:moe-tiny "
                    "or set ep_size: 1"
                )
            if n % ep:
                raise ValueError(
                    f"ep_size: {ep} does not divide {self.base_model}'s {n} experts; set ep_size to a divisor of {n}"
                )

    @model_validator(mode="after")
    def _combinations(self) -> "TrainConfig":
        if self.fp16 and self.bf16 not in ("auto", False):
            raise ValueError(
                f"fp16: true and bf16: {yaml_text(self.bf16)} are both set; keep one (bf16 is the safer choice)"
            )
        if self.fp8 and self.fp16:
            # FP8 GEMMs run inside bf16 (or fp32) autocast; fp16 would be dropped without a word
            raise ValueError(
                "fp8: true and fp16: true are both set; FP8 runs on top of bf16: drop fp16 (keep bf16: auto or true)"
            )
        if not self.fp8 and "fp8_recipe" in self.model_fields_set:
            raise ValueError(
                f"fp8_recipe is set but fp8 is {yaml_text(self.fp8)}: the recipe would do nothing; "
                "set fp8: true or drop fp8_recipe"
            )
        if self.fp8_enable_fsdp_float8_all_gather and self.fsdp_version != 2:
            raise ValueError(
                "fp8_enable_fsdp_float8_all_gather: true requires FSDP2; add fsdp_version: 2 (and run with "
                "--num_processes N) or drop fp8_enable_fsdp_float8_all_gather"
            )
        if self.fp8_enable_fsdp_float8_all_gather and not self.fp8:
            raise ValueError("fp8_enable_fsdp_float8_all_gather: true needs fp8: true; set fp8: true or drop it")
        recipe = cast(FP8RecipeSpec, self.fp8_recipe)  # PrecisionKeys._recipe made a name a spec
        if self.fp8_enable_fsdp_float8_all_gather:
            check_fsdp_fp8_all_gather(recipe.name)
        recompute = self.fp8_force_recompute_fp8_weight_in_bwd
        if recompute != "auto" and not self.fp8:
            raise ValueError(
                f"fp8_force_recompute_fp8_weight_in_bwd: {yaml_text(recompute)} needs fp8: true; set fp8: true or drop it"
            )
        in_recipe = recipe.overrides.get("force_recompute_fp8_weight_in_bwd", "auto")
        if recompute != "auto" and in_recipe not in ("auto", None, recompute):
            raise ValueError(
                f"fp8_force_recompute_fp8_weight_in_bwd: {yaml_text(recompute)} and fp8_recipe."
                f"force_recompute_fp8_weight_in_bwd: {yaml_text(in_recipe)} disagree; keep one"
            )
        tp = self.tensor_parallel_size
        if tp > 1 and self.deepspeed is not None:
            raise ValueError(f"tensor_parallel_size: {tp} runs with FSDP2, not deepspeed; drop one of them")
        if tp > 1 and self.fp8:
            check_tensor_parallel(recipe.name, what=f"tensor_parallel_size: {tp} with fp8")
        if self.sequence_parallel and (tp == 1 or self.sequence_len % tp):
            raise ValueError(
                f"sequence_parallel: true splits each sequence over the tensor_parallel_size ({tp}) "
                f"processes: set tensor_parallel_size > 1 and a sequence_len it divides (now {self.sequence_len})"
            )
        self._check_expert_parallel()
        if self.fsdp_config is not None and self.fsdp_version != 2:
            raise ValueError("fsdp_config is set but fsdp_version is not; add fsdp_version: 2")
        if self.deepspeed is not None and self.fsdp_version is not None:
            raise ValueError("deepspeed and fsdp_version are both set; pick one")
        if self.fp8 and self.sequence_len % 16:
            raise ValueError(
                f"sequence_len: {self.sequence_len} with fp8: true; FP8 GEMMs need the token dimension in "
                f"multiples of 16: use sequence_len: {-(-self.sequence_len // 16) * 16}"
            )
        for per_epoch, steps in (("evals_per_epoch", "eval_steps"), ("saves_per_epoch", "save_steps")):
            if getattr(self, per_epoch) is not None and getattr(self, steps) is not None:
                raise ValueError(f"{per_epoch} and {steps} are both set; keep one")
        if self.warmup_ratio is not None and self.warmup_steps > 0:
            raise ValueError("warmup_ratio and warmup_steps are both set; keep one")
        if self.early_stopping_patience is not None and self.val_set_size == 0:
            raise ValueError(
                "early_stopping_patience needs validation losses; set val_set_size: 0.05 (and eval_steps or evals_per_epoch)"
            )
        # eval_steps / evals_per_epoch without validation data, loss_watchdog_patience without a
        # threshold: inert, as in Axolotl (config/inert.py drops them with a note before this runs)
        if self.base_model.startswith("builtin:"):
            builtin = LlamaConfig.from_name(self.base_model[len("builtin:") :])
            limit = builtin.max_seq_len
            if self.sequence_len > limit:
                raise ValueError(
                    f"sequence_len: {self.sequence_len} exceeds {self.base_model}'s max_seq_len {limit}; lower sequence_len"
                )
            if builtin.n_experts and tp > 1:
                raise ValueError(
                    f"tensor_parallel_size: {tp} with {self.base_model}: its experts have no tensor-parallel "
                    "plan; set tensor_parallel_size: 1 and shard with fsdp_version: 2, or shard the experts "
                    "with ep_size"
                )
        if (
            self.eval_table_size
            and self.eval_max_new_tokens is not None
            and self.eval_max_new_tokens >= self.sequence_len
        ):
            raise ValueError(
                f"eval_max_new_tokens: {self.eval_max_new_tokens} leaves no room for a prompt in sequence_len: "
                f"{self.sequence_len} (prompt and generation share it); lower it below {self.sequence_len}"
            )
        if (self.fp8_guard != "off" or self.fp8_health) and not self.fp8:
            key = f"fp8_guard: {self.fp8_guard}" if self.fp8_guard != "off" else "fp8_health: true"
            raise ValueError(f"{key} watches FP8 layers but fp8 is {yaml_text(self.fp8)}; set fp8: true or drop it")
        guard = cast(str, self.fp8_guard)  # PrecisionKeys._guard made a bool a mode
        check_health_for_guard(guard, self.fp8_health, yaml_spelling)
        check_act_with_fp8_all_gather(guard, self.fp8_enable_fsdp_float8_all_gather, yaml_spelling)
        check_fp8_backend(self)
        return self

    def to_yaml_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        recipe = cast(FP8RecipeSpec, self.fp8_recipe)  # PrecisionKeys._recipe made a name a spec
        d["fp8_recipe"] = {"name": recipe.name, **recipe.overrides}
        if not self.fp8:  # a recipe without fp8 does nothing (and is an error when read back)
            del d["fp8_recipe"]
        return d

    def replace(self, **changes: Any) -> "TrainConfig":
        """A validated copy with some keys changed (used by ``compare`` and overrides)."""
        data = self.to_yaml_dict()
        data.update(changes)
        if not data.get("fp8") and "fp8_recipe" not in changes:
            data.pop("fp8_recipe", None)  # e.g. `compare`'s fp32/bf16 variants of an fp8 config
        new = parse_config(data, "config")
        new._notes = tuple(dict.fromkeys(self._notes + new._notes))  # the dropped keys are not in data
        return new


# -------------------------------------------------------------------- loading
_hint = did_you_mean
# keys whose null means something (dataset_max_bytes: null = all); other keys at null take their default
_NULLABLE = {k for k, f in TrainConfig.model_fields.items() if type(None) in get_args(f.annotation)}
_DEFAULTS = {k: f.get_default(call_default_factory=True) for k, f in TrainConfig.model_fields.items()}


def _check_inert_values(data: dict[str, Any], inert: dict[str, str]) -> None:
    """An inert key that is a schema key still has the schema's type and bounds (an Axolotl
    config with ``eval_max_new_tokens: lots`` is wrong whether or not it is used)."""
    errors = []
    for key in inert:
        field = TrainConfig.model_fields.get(key)
        if field is None:
            continue
        adapter: TypeAdapter[Any] = TypeAdapter(
            Annotated[field.annotation, field], config=ConfigDict(strict=True, allow_inf_nan=False)
        )
        try:
            adapter.validate_python(data[key])
        except ValidationError as exc:
            errors += [{**e, "loc": (key, *e["loc"])} for e in exc.errors(include_url=False)]
    if errors:
        raise ValueError("; ".join(line for _, line in _describe_all(errors)[:3]))


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the location ``loc`` (for "did you mean" on unknown keys)."""
    model: Any = TrainConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        for sub in list(candidates):
            candidates += list(getattr(sub, "__args__", ()))
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


_TAG_WORDS = {"bool": "true or false", "str": "a string", "int": "an integer", "float": "a number"}
# pydantic's names for the branches of a Union, which it puts in an error's location: a type name
# (``int``), a parametrised type (``literal['auto','full']``, ``function-after[...]``) or a model
_TAG_SHAPE = __import__("re").compile(r"^[a-z][a-z-]*\[")


def _model_names(model: type[BaseModel], seen: set[str]) -> set[str]:
    """Class names of ``model`` and every model reachable from its fields (union branch tags)."""
    if model.__name__ in seen:
        return seen
    seen.add(model.__name__)
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                _model_names(t, seen)
            stack += list(getattr(t, "__args__", ()))
    return seen


_MODEL_TAGS = frozenset(_model_names(TrainConfig, set()))


def _split_loc(err: Mapping[str, Any]) -> tuple[tuple, Optional[str]]:
    """(key path, union branch tag or None) of a pydantic error: pydantic puts the branch of a
    Union in the loc. The last part of an unknown-key error is the user's key, whatever it looks
    like (``learning-rate``, ``learning rate``, an emoji), never a tag."""
    loc = err["loc"]
    parts, tag = [], None
    for i, p in enumerate(loc):
        users_key = err["type"] == "extra_forbidden" and i == len(loc) - 1
        if isinstance(p, int) or users_key or not (p in _TAG_WORDS or p in _MODEL_TAGS or _TAG_SHAPE.match(p)):
            parts.append(p)
        else:
            tag = p
    return tuple(parts), tag


def _normal_key(key: str) -> str:
    """``Learning-Rate``, ``learning rate``, ``léarning_rate`` -> ``learning_rate`` (for a hint)."""
    import unicodedata

    ascii_key = unicodedata.normalize("NFKD", key).encode("ascii", "ignore").decode()
    return "_".join(ascii_key.lower().replace("-", " ").replace(".", " ").split())


def _unknown_key(loc: tuple) -> str:
    """``unknown key 'fsdp_config.foo' ...`` with the closest key of the same mapping, or the
    mapping's keys when it has few."""
    owner = _model_at(loc)
    known = sorted(owner.model_fields) if owner is not None else []
    key = str(loc[-1])
    path = ".".join(str(p) for p in loc)
    normal = _normal_key(key)
    if normal in known and normal != key:
        hint = f" (did you mean {normal!r}? keys are ASCII names with underscores)"
    else:
        hint = _hint(key, known) or _hint(normal, known)
    if not hint and not key.isascii():
        hint = " (keys are ASCII names with underscores)"
    if len(loc) > 1 and known and len(known) <= 12:
        return f"unknown key {path!r}{hint}; {'.'.join(str(p) for p in loc[:-1])} takes {', '.join(known)}"
    return f"unknown key {path!r}{hint}; see `lowprec train --help` for the keys"


def _tag_words(tag: Optional[str]) -> str:
    if tag is None:
        return "?"
    if tag.startswith("literal["):
        return " or ".join(tag[len("literal[") : -1].split(","))
    if tag.startswith(("dict", "function-after")) or "Spec" in tag or "Config" in tag:
        return "a mapping"
    if tag.startswith("list"):
        return "a list"
    return _TAG_WORDS.get(tag, tag)


def _describe_key(loc: tuple, errs: Sequence[Mapping[str, Any]]) -> str:
    key = ".".join(str(p) for p in loc) or "config"
    err = errs[0]
    if err["type"] == "extra_forbidden":
        return _unknown_key(loc)
    if err["type"] == "invalid_key":  # YAML reads `1:`, `yes:`, `~:` as a number, bool, null
        where = f" under {'.'.join(str(p) for p in loc[:-1])}" if len(loc) > 1 else ""
        return (
            f"key {yaml_text(err.get('input'))}{where} is not a name (YAML read it as "
            f"{type(err.get('input')).__name__}); keys are names such as learning_rate"
        )
    values = [e for e in errs if e["type"] in ("value_error", "assertion_error")]
    if values:
        msg = values[0]["msg"].removeprefix("Value error, ")
        return msg if key == "config" else f"{key}: {msg}"
    got = err.get("input")
    shown = "" if isinstance(got, dict) else f" (got {yaml_text(got)})"
    if len(errs) > 1:  # one error per Union branch: say what would have been accepted
        # sorted: typing caches Union[a, b] and Union[b, a] as one object, so the branches' order
        # is whichever spelling some module imported first wrote
        expected = " or ".join(sorted(dict.fromkeys(_tag_words(_split_loc(e)[1]) for e in errs)))
        return f"{key}: expected {expected}{shown}"
    return f"{key}: {err['msg']}{shown}"


def _describe_all(errors: Sequence[Mapping[str, Any]]) -> list[tuple[tuple, str]]:
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for e in errors:
        groups.setdefault(_split_loc(e)[0], []).append(e)
    return [(loc, _describe_key(loc, errs)) for loc, errs in groups.items()]


def parse_config(data: Any, source: str = "config", flags: frozenset[str] | set[str] = frozenset()) -> TrainConfig:
    """Validate a mapping; raises ``ValueError`` with one line per problem (the first few).
    A problem with a key set by a ``--key`` flag (``flags``) is blamed on the flag."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of keys to values at the top level, got {type(data).__name__}")
    try:
        notes = inert_keys(data, _DEFAULTS)
        screened, inert = screen_top_level(data, set(TrainConfig.model_fields), _NULLABLE, notes)
        _check_inert_values(data, inert)
        cfg = TrainConfig.model_validate(screened)
        cfg._notes = tuple(inert.values())
        return cfg
    except ValueError as exc:
        if not isinstance(exc, ValidationError):  # an Axolotl key lowprec does not support
            raise ValueError(f"{source}: {exc}") from None
        found = _describe_all(exc.errors(include_url=False))[:3]
        # a flag names its key already: "flag --k: msg", not "flag --k: k: msg" (nested keys stay)
        lines = [
            f"flag --{loc[0]}: {line.removeprefix(f'{loc[0]}: ')}" if loc and loc[0] in flags else line
            for loc, line in found
        ]
        if all(loc and loc[0] in flags for loc, _ in found):
            raise ValueError("; ".join(lines)) from None
        where = source + (
            f" (with flags {', '.join('--' + f for f in sorted(flags))})"
            if flags and any(not loc for loc, _ in found)
            else ""
        )
        raise ValueError(f"{where}: " + "; ".join(lines)) from None


def parse_override_value(text: str) -> Any:
    """A ``--key value`` flag's value, read as YAML (numbers, booleans, lists, mappings).
    ``3e-4`` is a float here although YAML 1.1 reads it as a string."""
    try:
        return float(text) if _looks_float(text) else yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _looks_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return not text.strip().lstrip("+-").isdigit() and text.strip().lower() not in ("nan", "inf", "infinity", "-inf")


def load_config(path: Optional[str | os.PathLike], overrides: Optional[dict[str, Any]] = None) -> TrainConfig:
    """Read YAML (or nothing), apply overrides (already-parsed values), validate."""
    data: dict[str, Any] = {}
    source = "config"
    if path is not None:
        p = Path(path)
        source = str(p)
        if p.is_dir():
            raise ValueError(
                f"config file {str(p)!r} is a directory; give the YAML file (e.g. {str(p / 'config.yaml')!r})"
            )
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} not found (working directory {os.getcwd()!r})")

        data = _relative_to(p.parent, read_yaml_mapping(p, example="base_model: builtin:llama-tiny"))
    overrides = dict(overrides or {})
    recipe_overridden = any(k == "fp8_recipe" or k.startswith("fp8_recipe.") for k in overrides)
    if "fp8_recipe" in data and not overrides.get("fp8", True) and not recipe_overridden:
        # `--fp8 false` on an FP8 config: the file's recipe no longer applies; say so (not an
        # error: the flag, not the file, turned FP8 off)
        data = {k: v for k, v in data.items() if k != "fp8_recipe"}
        logging.getLogger("lowprec").info("lowprec: fp8_recipe in %s is not used: fp8 is false", source)
    if data.get("strict") is True or overrides.get("strict") is True:
        # Axolotl's strict: command-line overrides may only change keys the file sets
        extra = sorted({k.split(".")[0] for k in overrides} - set(data) - {"strict"})
        if extra:
            raise ValueError(
                f"strict: true in {source}: flag(s) {', '.join('--' + k for k in extra)} set keys the file does not "
                "have; add them to the file or set strict: false"
            )
    for key, value in overrides.items():
        _set_dotted(data, key, value)
    return parse_config(data, source, flags={k.split(".")[0] for k in overrides or {}})


def _relative_to(base: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Relative data / deepspeed paths that do not exist from the working directory but do
    next to the config file are read from there (so examples run from any directory)."""

    def fix(path: Any) -> Any:
        if not isinstance(path, str) or path.startswith("builtin:") or os.path.isabs(path) or os.path.exists(path):
            return path
        return str(base / path) if (base / path).exists() else path

    data = dict(data)
    ds = data.get("datasets")
    if isinstance(ds, str):
        data["datasets"] = fix(ds)
    elif isinstance(ds, list):
        data["datasets"] = [
            fix(d)
            if isinstance(d, str)
            else (
                {**d, "path": fix(d.get("path")), **_fixed_data_files(d, fix)}
                if isinstance(d, dict) and "path" in d
                else d
            )
            for d in ds
        ]
    if isinstance(data.get("deepspeed"), str):
        data["deepspeed"] = fix(data["deepspeed"])
    return data


def _fixed_data_files(entry: dict[str, Any], fix: Any) -> dict[str, Any]:
    """``data_files`` (Axolotl's ``path: json`` form) found next to the config as ``path`` is."""
    files = entry.get("data_files")
    if isinstance(files, str):
        return {"data_files": fix(files)}
    if isinstance(files, list):
        return {"data_files": [fix(f) for f in files]}
    if isinstance(files, dict):
        return {"data_files": {k: [fix(f) for f in v] if isinstance(v, list) else fix(v) for k, v in files.items()}}
    return {}


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``fsdp_config.reshard_after_forward`` sets a nested key."""
    *parents, last = key.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if isinstance(child, str) and part == "fp8_recipe":
            child = {"name": child}
        if not isinstance(child, dict):
            child = {}
        node[part] = child
        node = child
    node[last] = value


def config_field_help() -> list[tuple[str, str, Any]]:
    """(key, description, default) for every top-level key, in schema order."""
    out = []
    for name, field in TrainConfig.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        elif isinstance(default, list):
            default = [d.model_dump() if isinstance(d, BaseModel) else d for d in default]
        out.append((name, field.description or "", default))
    return out


def render_config_keys() -> str:
    """The text of ``lowprec/cli/train_keys.py``: the schema's keys, descriptions and defaults
    as plain data, so the CLI builds its flags and help without importing pydantic or torch.
    Regenerate with ``python -m lowprec.train.config``; a test fails when the file is stale."""
    rows = [(name, desc, yaml_text(default)) for name, desc, default in config_field_help()]
    body = "".join(f"    ({n!r}, {d!r}, {v!r}),\n" for n, d, v in rows)
    return (
        '"""Generated from lowprec.train.config.TrainConfig by `python -m lowprec.train.config`;\n'
        'do not edit. (key, description, default as YAML) for every top-level config key."""\n\n'
        '__all__ = ["KEYS"]\n\n'
        "KEYS = (\n" + body + ")\n"
    )


def write_config_keys() -> Path:
    """Regenerate ``lowprec/cli/train_keys.py`` (``python -m lowprec.train.config``)."""
    path = Path(__file__).parent.parent.parent / "cli" / "train_keys.py"
    path.write_text(render_config_keys())
    return path
