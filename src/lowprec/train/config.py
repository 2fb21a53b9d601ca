"""The trainer's YAML schema (``lowprec train my.yaml``): Axolotl's key names, strict checking.

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
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lowprec.catalog import FSDP_FP8_ALL_GATHER_UNSUPPORTED, RECIPE_NAMES, unread_recipe_fields
from lowprec.errors import did_you_mean

__all__ = [
    "TrainConfig",
    "DatasetSpec",
    "FP8RecipeSpec",
    "FSDPConfig",
    "load_config",
    "parse_config",
    "parse_override_value",
    "config_field_help",
    "render_config_keys",
    "OPTIMIZERS",
    "LR_SCHEDULERS",
]

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
LR_SCHEDULERS = ("cosine", "linear", "constant")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class DatasetSpec(_Strict):
    """One entry of ``datasets:`` (Axolotl's shape: ``- path: ...``, ``type: completion``)."""

    path: str = Field(description="builtin:stdlib (the bundled corpus) or a local .txt / .jsonl file or directory")
    type: Literal["completion"] = Field(
        default="completion", description="how the text is used: completion (plain language modelling)"
    )
    field: str = Field(default="text", description="the JSON field holding the text in .jsonl files")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if v.startswith("builtin:"):
            from lowprec.train.data import BUILTIN_CORPORA

            if v not in BUILTIN_CORPORA:
                raise ValueError(f"unknown builtin corpus {v!r}; use one of {', '.join(BUILTIN_CORPORA)}")
        return v


class FP8RecipeSpec(_Strict):
    """``fp8_recipe:`` as a mapping: a named recipe plus single-field overrides."""

    model_config = ConfigDict(extra="allow", frozen=True)  # recipe fields, checked in the validator

    name: str = Field(default="tensorwise", description=", ".join(RECIPE_NAMES))

    @model_validator(mode="after")
    def _known(self) -> "FP8RecipeSpec":
        # validation only (the engine's own messages: unknown name / field with "did you mean",
        # cross-field rules); the Recipe that runs is built once, by the backend
        self.to_recipe()
        unread = unread_recipe_fields(self.name, self.overrides)
        if unread:  # issue 10 item 8: a setting that does nothing is an error, not kept silently
            raise ValueError(
                f"fp8_recipe.{unread[0]}: the {self.name} recipe does not read it (it tunes "
                f"{'delayed scaling' if unread[0] != 'block_size' else 'blockwise scaling'}); drop it or "
                "pick a recipe that reads it"
            )
        return self

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def to_recipe(self):
        from lowprec.fp8.recipes import Recipe

        return Recipe.from_name(self.name, **self.overrides)


class FSDPConfig(_Strict):
    """``fsdp_config:`` (FSDP2, ``torch.distributed.fsdp.fully_shard``). Axolotl's keys."""

    reshard_after_forward: bool = Field(default=True, description="free gathered weights after forward (ZeRO-3 style)")
    transformer_layer_cls_to_wrap: str = Field(
        default="LlamaDecoderLayer", description="module class sharded as its own unit (one all-gather per block)"
    )
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP"] = Field(
        default="TRANSFORMER_BASED_WRAP", description="TRANSFORMER_BASED_WRAP (the only policy with FSDP2 here)"
    )
    offload_params: Literal[False] = Field(default=False, description="CPU offload of parameters (not supported: false)")
    state_dict_type: Literal["FULL_STATE_DICT"] = Field(
        default="FULL_STATE_DICT", description="checkpoints hold full (gathered) tensors"
    )


class TrainConfig(_Strict):
    """Everything ``lowprec train`` reads. Keys follow Axolotl where Axolotl has one."""

    # ---------------------------------------------------------------- model and data
    base_model: str = Field(
        default="builtin:llama-tiny",
        description="builtin:llama-tiny | builtin:llama-small | builtin:llama-base | builtin:llama-1b, "
        "or a local Hugging Face model directory (needs transformers)",
    )
    tokenizer: str = Field(
        default="byte", description="byte (built-in byte-level tokenizer) or a local Hugging Face tokenizer directory"
    )
    datasets: list[DatasetSpec] = Field(
        default_factory=lambda: [DatasetSpec(path="builtin:stdlib")],
        description="training text: [{path: builtin:stdlib}] (default) or local .txt/.jsonl files",
    )
    dataset_max_bytes: Optional[int] = Field(
        default=8_000_000, ge=1, description="read at most this many bytes of text (null: all)"
    )
    val_set_size: float = Field(
        default=0.03, ge=0.0, lt=1.0, description="fraction of documents held out for validation (0: none)"
    )
    sequence_len: int = Field(default=128, ge=2, description="tokens per training sequence")

    # ---------------------------------------------------------------- batches and schedule
    micro_batch_size: int = Field(default=8, ge=1, description="sequences per forward pass per process")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="micro-batches per optimizer step")
    num_epochs: Optional[float] = Field(
        default=None, gt=0, description="passes over the training data (used when max_steps is not set; default 1)"
    )
    max_steps: Optional[int] = Field(default=None, ge=1, description="optimizer steps to run (wins over num_epochs)")
    optimizer: str = Field(default="adamw_torch", description=f"one of {', '.join(OPTIMIZERS)}")
    learning_rate: float = Field(default=1e-3, gt=0, description="peak learning rate")
    lr_scheduler: str = Field(default="cosine", description=f"one of {', '.join(LR_SCHEDULERS)} (after warmup)")
    warmup_steps: int = Field(default=0, ge=0, description="linear warmup steps from 0 to learning_rate")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay (not applied to norms and biases)")
    adam_beta1: float = Field(default=0.9, gt=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(default=0.95, gt=0, lt=1, description="AdamW beta2")
    max_grad_norm: Optional[float] = Field(default=1.0, gt=0, description="clip the gradient norm (null: no clipping)")
    seed: int = Field(default=42, ge=0, description="seed of weights, data order and validation split")

    # ---------------------------------------------------------------- outputs
    output_dir: str = Field(default="./outputs/lowprec-run", description="where metrics, plots, checkpoints and the model go")
    logging_steps: int = Field(default=10, ge=1, description="log (and FP8 telemetry) every N steps")
    eval_steps: Optional[int] = Field(
        default=None, ge=1, description="validate every N steps (null: at the end only; needs val_set_size > 0)"
    )
    eval_batches: int = Field(default=20, ge=1, description="validation batches per evaluation")
    save_steps: Optional[int] = Field(default=None, ge=1, description="checkpoint every N steps (null: no checkpoints)")
    save_total_limit: Optional[int] = Field(default=2, ge=1, description="keep the last N checkpoints (null: all)")
    resume_from_checkpoint: Optional[str] = Field(
        default=None, description="auto (latest checkpoint in output_dir, if any) or a checkpoint directory"
    )
    use_tensorboard: Union[Literal["auto"], bool] = Field(
        default="auto", description="TensorBoard events in output_dir/runs (auto: when tensorboard is installed)"
    )
    cpu_threads: Optional[int] = Field(
        default=None, ge=1, description="intra-op CPU threads per process (null: torch's default, OMP_NUM_THREADS or all cores)"
    )
    progress_bar: bool = Field(default=True, description="show a tqdm progress bar (loss, tokens/s, lr, memory)")
    skip_nonfinite_steps: bool = Field(
        default=True, description="skip an optimizer step whose loss or gradients hold NaN/inf (weights unchanged)"
    )
    max_consecutive_skipped_steps: Optional[int] = Field(
        default=3, ge=1, description="stop (exit code 3) after this many skipped steps in a row (null: never)"
    )

    # ---------------------------------------------------------------- precision
    fp16: Optional[bool] = Field(default=None, description="fp16 autocast with a gradient scaler")
    bf16: Union[Literal["auto", "full"], bool] = Field(
        default="auto",
        description="auto (bf16 autocast where the device supports it), true (fp32 weights, bf16 autocast), "
        "full (pure bf16 weights, no autocast), false",
    )
    fp8: Optional[bool] = Field(default=None, description="FP8 GEMMs in the Linear layers (lowprec's engine)")
    fp8_recipe: Union[str, FP8RecipeSpec] = Field(
        default="tensorwise",
        description=f"named FP8 recipe ({', '.join(RECIPE_NAMES)}) or "
        "{name: ..., <recipe field>: ...}",
    )
    fp8_filter: list[str] = Field(
        default_factory=list,
        description="layer name patterns kept in high precision (a name part like o_proj, or a glob like "
        "model.layers.0.*), added to the defaults (first/last Linear, lm_head, router, gate)",
    )
    fp8_enable_fsdp_float8_all_gather: Optional[bool] = Field(
        default=None, description="all-gather FSDP2 weights in FP8 (needs fsdp_version: 2 and a per-tensor recipe)"
    )
    fp8_fallback: Optional[Literal["bf16", "emulate"]] = Field(
        default=None, description="on a GPU without FP8 (below sm_89): bf16 (train in bf16) or emulate (FP8 numerics, slow)"
    )
    torch_compile: Union[Literal["auto"], bool] = Field(
        default=False, description="torch.compile the model (auto: on CUDA only)"
    )

    # ---------------------------------------------------------------- distributed
    fsdp_version: Optional[int] = Field(default=None, description="2: shard the model with FSDP2 (under --num_processes N)")
    fsdp_config: Optional[FSDPConfig] = Field(default=None, description="FSDP2 settings (needs fsdp_version: 2)")
    deepspeed: Optional[Union[str, dict[str, Any]]] = Field(
        default=None, description="DeepSpeed config: a JSON file path or an inline mapping"
    )

    # ---------------------------------------------------------------- validators
    @field_validator("datasets", mode="before")
    @classmethod
    def _datasets_shorthand(cls, v: Any) -> Any:
        """``datasets: data.txt`` or ``[a.txt, b.jsonl]`` mean ``[{path: ...}, ...]``."""
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            return [{"path": d} if isinstance(d, str) else d for d in v]
        return v

    @field_validator("fp8_recipe")
    @classmethod
    def _recipe(cls, v: Union[str, FP8RecipeSpec]) -> FP8RecipeSpec:
        return FP8RecipeSpec(name=v) if isinstance(v, str) else v

    @field_validator("optimizer", "lr_scheduler")
    @classmethod
    def _named_choice(cls, v: str, info: Any) -> str:
        choices = {"optimizer": OPTIMIZERS, "lr_scheduler": LR_SCHEDULERS}[info.field_name]
        v = {"adamw": "adamw_torch"}.get(v, v) if info.field_name == "optimizer" else v
        if v not in choices:
            raise ValueError(f"unknown {info.field_name} {v!r}{_hint(v, choices)}; use one of {', '.join(choices)}")
        return v

    @field_validator("base_model")
    @classmethod
    def _model(cls, v: str) -> str:
        if v.startswith("builtin:"):
            from lowprec.train.model import MODEL_NAMES

            name = v[len("builtin:"):]
            if name not in MODEL_NAMES:
                raise ValueError(
                    f"unknown built-in model {v!r}{_hint(name, MODEL_NAMES)}; use one of "
                    + ", ".join(f"builtin:{n}" for n in MODEL_NAMES)
                )
        elif not os.path.exists(v):
            raise ValueError(
                f"{v!r} is neither builtin:<name> nor an existing local Hugging Face model directory; "
                "downloads are not supported: give a local path or builtin:llama-tiny"
            )
        return v

    @field_validator("deepspeed")
    @classmethod
    def _deepspeed(cls, v: Optional[Union[str, dict[str, Any]]]) -> Optional[Union[str, dict[str, Any]]]:
        if isinstance(v, str) and not os.path.isfile(v):
            raise ValueError(f"DeepSpeed config file {v!r} not found; give a JSON file path or an inline mapping")
        if isinstance(v, str):  # read now: a broken file would otherwise fail inside every worker
            from lowprec.config.yaml_file import read_json_object

            try:
                read_json_object(v)
            except ValueError as exc:
                raise ValueError(f"DeepSpeed config file: {exc}") from None
        return v

    @field_validator("fsdp_version")
    @classmethod
    def _fsdp_version(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v != 2:
            raise ValueError(f"{v} is not supported; lowprec shards with FSDP2 only: set fsdp_version: 2")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> "TrainConfig":
        if self.fp16 and self.bf16 not in ("auto", False):
            raise ValueError(f"fp16: true and bf16: {_yaml(self.bf16)} are both set; keep one (bf16 is the safer choice)")
        if self.fp8 and self.fp16:
            # FP8 GEMMs run inside bf16 (or fp32) autocast; fp16 would be dropped without a word
            raise ValueError(
                "fp8: true and fp16: true are both set; FP8 runs on top of bf16: drop fp16 (keep bf16: auto or true)"
            )
        if not self.fp8 and "fp8_recipe" in self.model_fields_set:
            raise ValueError(f"fp8_recipe is set but fp8 is {_yaml(self.fp8)}: the recipe would do nothing; "
                             "set fp8: true or drop fp8_recipe")
        if self.fp8_enable_fsdp_float8_all_gather and self.fsdp_version != 2:
            raise ValueError(
                "fp8_enable_fsdp_float8_all_gather: true requires FSDP2; add fsdp_version: 2 (and run with "
                "--num_processes N) or drop fp8_enable_fsdp_float8_all_gather"
            )
        if self.fp8_enable_fsdp_float8_all_gather and not self.fp8:
            raise ValueError("fp8_enable_fsdp_float8_all_gather: true needs fp8: true; set fp8: true or drop it")
        if self.fp8_enable_fsdp_float8_all_gather and self.fp8_recipe.name not in ("tensorwise", "delayed"):
            raise ValueError(
                f"fp8_enable_fsdp_float8_all_gather needs a per-tensor recipe, not {self.fp8_recipe.name!r} "
                "(rowwise scales are per row of each shard); use fp8_recipe: tensorwise or drop the all-gather"
            )
        if self.fp8 and self.fp8_enable_fsdp_float8_all_gather:
            # an accepted no-op flag is what Axolotl ships (force_recompute_fp8_weight_in_bwd); refuse
            raise ValueError(FSDP_FP8_ALL_GATHER_UNSUPPORTED)
        if self.fsdp_config is not None and self.fsdp_version != 2:
            raise ValueError("fsdp_config is set but fsdp_version is not; add fsdp_version: 2")
        if self.deepspeed is not None and self.fsdp_version is not None:
            raise ValueError("deepspeed and fsdp_version are both set; pick one")
        if self.fp8 and self.sequence_len % 16:
            raise ValueError(
                f"sequence_len: {self.sequence_len} with fp8: true; FP8 GEMMs need the token dimension in "
                f"multiples of 16: use sequence_len: {-(-self.sequence_len // 16) * 16}"
            )
        if self.eval_steps is not None and self.val_set_size == 0:
            raise ValueError("eval_steps is set but val_set_size is 0 (no validation data); set val_set_size: 0.03 or drop eval_steps")
        if self.base_model.startswith("builtin:"):
            from lowprec.train.model import LlamaConfig

            limit = LlamaConfig.from_name(self.base_model[len("builtin:"):]).max_seq_len
            if self.sequence_len > limit:
                raise ValueError(f"sequence_len: {self.sequence_len} exceeds {self.base_model}'s max_seq_len {limit}; lower sequence_len")
        return self

    # ---------------------------------------------------------------- helpers
    @property
    def dataset_paths(self) -> Union[str, list[str]]:
        paths = [d.path for d in self.datasets]
        if any(p.startswith("builtin:") for p in paths):
            if len(paths) > 1:
                raise ValueError("datasets: builtin:stdlib cannot be mixed with local files; list one or the other")
            return paths[0]
        return paths

    @property
    def text_field(self) -> str:
        fields = {d.field for d in self.datasets}
        if len(fields) > 1:
            raise ValueError(f"datasets use different fields {sorted(fields)}; use one text field for all files")
        return fields.pop()

    def to_yaml_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        d["fp8_recipe"] = {"name": self.fp8_recipe.name, **self.fp8_recipe.overrides}
        if not self.fp8:  # a recipe without fp8 does nothing (and is an error when read back)
            del d["fp8_recipe"]
        return d

    def replace(self, **changes: Any) -> "TrainConfig":
        """A validated copy with some keys changed (used by ``compare`` and overrides)."""
        data = self.to_yaml_dict()
        data.update(changes)
        if not data.get("fp8") and "fp8_recipe" not in changes:
            data.pop("fp8_recipe", None)  # e.g. `compare`'s fp32/bf16 variants of an fp8 config
        return parse_config(data, "config")


# -------------------------------------------------------------------- loading
_hint = did_you_mean


def _yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


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


_FIELD_PART = __import__("re").compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TAG_WORDS = {"bool": "true or false", "str": "a string", "int": "an integer", "float": "a number"}


def _split_loc(loc: tuple) -> tuple[tuple, Optional[str]]:
    """(key path, union branch tag or None): pydantic puts the branch of a Union in the loc."""
    parts, tag = [], None
    for p in loc:
        if isinstance(p, int) or (_FIELD_PART.match(p) and p not in _TAG_WORDS):
            parts.append(p)
        else:
            tag = p
    return tuple(parts), tag


def _tag_words(tag: Optional[str]) -> str:
    if tag is None:
        return "?"
    if tag.startswith("literal["):
        return " or ".join(tag[len("literal["):-1].split(","))
    if tag.startswith(("dict", "function-after")) or "Spec" in tag or "Config" in tag:
        return "a mapping"
    if tag.startswith("list"):
        return "a list"
    return _TAG_WORDS.get(tag, tag)


def _describe_key(loc: tuple, errs: list[dict[str, Any]]) -> str:
    key = ".".join(str(p) for p in loc) or "config"
    err = errs[0]
    if err["type"] == "extra_forbidden":
        owner = _model_at(loc)
        known = sorted(owner.model_fields) if owner is not None else []
        hint = _hint(str(loc[-1]), known)
        where = f" under {'.'.join(str(p) for p in loc[:-1])}" if len(loc) > 1 else ""
        return f"unknown key {str(loc[-1])!r}{where}{hint}; see `lowprec train --help` for the keys"
    values = [e for e in errs if e["type"] in ("value_error", "assertion_error")]
    if values:
        msg = values[0]["msg"].removeprefix("Value error, ")
        return msg if key == "config" else f"{key}: {msg}"
    got = err.get("input")
    shown = "" if isinstance(got, dict) else f" (got {_yaml(got)})"
    if len(errs) > 1:  # one error per Union branch: say what would have been accepted
        expected = " or ".join(dict.fromkeys(_tag_words(_split_loc(e["loc"])[1]) for e in errs))
        return f"{key}: expected {expected}{shown}"
    return f"{key}: {err['msg']}{shown}"


def _describe_all(errors: list[dict[str, Any]]) -> list[tuple[tuple, str]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for e in errors:
        groups.setdefault(_split_loc(e["loc"])[0], []).append(e)
    return [(loc, _describe_key(loc, errs)) for loc, errs in groups.items()]


def parse_config(data: Any, source: str = "config", flags: frozenset[str] | set[str] = frozenset()) -> TrainConfig:
    """Validate a mapping; raises ``ValueError`` with one line per problem (the first few).
    A problem with a key set by a ``--key`` flag (``flags``) is blamed on the flag."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of keys to values at the top level, got {type(data).__name__}")
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        found = _describe_all(exc.errors(include_url=False))[:3]
        # a flag names its key already: "flag --k: msg", not "flag --k: k: msg" (nested keys stay)
        lines = [f"flag --{loc[0]}: {line.removeprefix(f'{loc[0]}: ')}" if loc and loc[0] in flags else line
                 for loc, line in found]
        if all(loc and loc[0] in flags for loc, _ in found):
            raise ValueError("; ".join(lines)) from None
        where = source + (f" (with flags {', '.join('--' + f for f in sorted(flags))})" if flags and any(not loc for loc, _ in found) else "")
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
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} not found (working directory {os.getcwd()!r})")
        from lowprec.config.yaml_file import read_yaml_mapping

        data = _relative_to(p.parent, read_yaml_mapping(p, example="base_model: builtin:llama-tiny"))
    overrides = dict(overrides or {})
    recipe_overridden = any(k == "fp8_recipe" or k.startswith("fp8_recipe.") for k in overrides)
    if "fp8_recipe" in data and not overrides.get("fp8", True) and not recipe_overridden:
        # `--fp8 false` on an FP8 config: the file's recipe no longer applies; say so (not an
        # error: the flag, not the file, turned FP8 off)
        data = {k: v for k, v in data.items() if k != "fp8_recipe"}
        logging.getLogger("lowprec").info("lowprec: fp8_recipe in %s is not used: fp8 is false", source)
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
        data["datasets"] = [fix(d) if isinstance(d, str) else ({**d, "path": fix(d.get("path"))} if isinstance(d, dict) and "path" in d else d) for d in ds]
    if isinstance(data.get("deepspeed"), str):
        data["deepspeed"] = fix(data["deepspeed"])
    return data


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
    """The text of ``lowprec/train/config_keys.py``: the schema's keys, descriptions and defaults
    as plain data, so the CLI builds its flags and help without importing pydantic or torch.
    Regenerate with ``python -m lowprec.train.config``; a test fails when the file is stale."""
    rows = [(name, desc, _yaml(default)) for name, desc, default in config_field_help()]
    body = "".join(f"    ({n!r}, {d!r}, {v!r}),\n" for n, d, v in rows)
    return (
        '"""Generated from lowprec.train.config.TrainConfig by `python -m lowprec.train.config`;\n'
        "do not edit. (key, description, default as YAML) for every top-level config key.\"\"\"\n\n"
        '__all__ = ["KEYS"]\n\n'
        "KEYS = (\n" + body + ")\n"
    )


if __name__ == "__main__":
    _path = Path(__file__).with_name("config_keys.py")
    _path.write_text(render_config_keys())
    print(f"wrote {_path}")
