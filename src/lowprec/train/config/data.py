"""Trainer keys for the training data (``datasets:``, ``sequence_len``, ``val_set_size``)."""

from __future__ import annotations

import glob
import os
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationInfo, field_validator, model_validator

from lowprec.train.config.base import StrictModel
from lowprec.errors import did_you_mean
from lowprec.train.axolotl_keys import screen_dataset_entry
from lowprec.train.chat_templates import check_template
from lowprec.train.data_files import BUILTIN_CORPORA

__all__ = ["DatasetSpec", "DataKeys", "SpecialTokens", "DATASET_TYPES"]


DATASET_TYPES = ("completion", "alpaca", "input_output", "chat_template")
CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles templates know; others pass through as named
_EOS_CHOICES = ("turn", "all", "none", "last")


def _checked_template(v: Optional[str]) -> Optional[str]:
    if v is not None:
        try:
            check_template(v)
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("chat template: ")) from None
    return v


class DatasetSpec(StrictModel):
    """One entry of ``datasets:`` (Axolotl's shape: ``- path: ...``, ``type: alpaca``)."""

    path: str = Field(
        description="builtin:stdlib (the bundled corpus), a local .txt/.jsonl/.json/.parquet/.csv file, a "
        "directory of .txt/.jsonl files, a directory saved by `datasets` (save_to_disk), or a hub dataset id "
        "(org/name) in the local Hugging Face cache"
    )
    type: Optional[str] = Field(
        default=None,
        description="completion (text), alpaca (instruction/input/output), input_output (segments with "
        "labels), chat_template (messages); unset: completion, or pre-tokenized rows when they hold input_ids",
    )
    field: str = Field(default="text", description="the column holding the text (type: completion)")
    split: Optional[str] = Field(
        default=None, description="split of a `datasets` directory or cached hub dataset (default train)"
    )
    name: Optional[str] = Field(
        default=None, description="config of a cached hub dataset (its card's configs:, or its directory)"
    )
    ds_type: Optional[Literal["json", "parquet", "csv", "arrow"]] = Field(
        default=None, description="file format (read from the extension; checked when given)"
    )
    chat_template: Optional[str] = Field(
        default=None, description="this dataset's chat template (default: the top-level chat_template)"
    )
    chat_template_jinja: Optional[str] = Field(default=None, description="template text for chat_template: jinja")
    field_messages: str = Field(default="messages", description="the column holding the messages (type: chat_template)")
    message_property_mappings: Optional[dict[str, str]] = Field(
        default=None, description="message keys: {role: from, content: value} for ShareGPT-style data"
    )
    message_field_role: Optional[str] = Field(
        default=None, description="message key of the role (Axolotl's older spelling)"
    )
    message_field_content: Optional[str] = Field(
        default=None, description="message key of the content (older spelling)"
    )
    roles: Optional[dict[str, list[str]]] = Field(
        default=None, description="the data's role names per template role, e.g. {user: [human], assistant: [gpt]}"
    )
    roles_to_train: list[str] = Field(
        default_factory=lambda: ["assistant"], description="roles whose turns are trained"
    )
    train_on_eos: Literal["turn", "all", "none", "last"] = Field(
        default="turn", description="which end-of-turn tokens are trained: turn (of trained turns), all, none, last"
    )
    drop_system_message: bool = Field(default=False, description="leave system messages out")

    @model_validator(mode="before")
    @classmethod
    def _axolotl_keys(cls, v: Any) -> Any:
        return screen_dataset_entry(v, set(cls.model_fields))

    @field_validator("type", mode="before")
    @classmethod
    def _custom_format(cls, v: Any) -> Any:
        if isinstance(v, dict):  # Axolotl's user-defined prompt format: field_instruction, format, ...
            raise ValueError(
                f"a custom prompt format ({', '.join(map(str, list(v)[:4]))}{', ...' if len(v) > 4 else ''}) is an "
                "Axolotl form lowprec does not support; use type: alpaca (its fixed prompt), type: chat_template "
                "for conversations, or write the rendered prompt and answer as type: input_output segments"
            )
        return v

    @field_validator("type")
    @classmethod
    def _type(cls, v: Optional[str]) -> Optional[str]:
        if v is None or v in DATASET_TYPES:
            return v

        base = str(v).split(":")[0].split(".")[0]
        hint = {
            "sharegpt": "; ShareGPT data: type: chat_template, field_messages: conversations, "
            "message_property_mappings: {role: from, content: value}",
            "alpaca": "; the alpaca prompt is fixed: type: alpaca (for a chat format use type: chat_template)",
        }.get(base, did_you_mean(str(v), DATASET_TYPES))
        raise ValueError(
            f"dataset type {v!r} is not supported{hint}; use one of {', '.join(DATASET_TYPES)}, or no type for pre-tokenized input_ids"
        )

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if v.startswith("builtin:"):
            if v not in BUILTIN_CORPORA:
                raise ValueError(f"unknown builtin corpus {v!r}; use one of {', '.join(BUILTIN_CORPORA)}")
        return v

    @field_validator("chat_template_jinja")
    @classmethod
    def _jinja(cls, v: Optional[str]) -> Optional[str]:
        return _checked_template(v)

    @field_validator("roles")
    @classmethod
    def _roles(cls, v: Optional[dict[str, list[str]]]) -> Optional[dict[str, list[str]]]:
        """A mapping target that is a near miss of a template role (``asistant``) is a typo."""
        for role in v or {}:
            hint = did_you_mean(role, CHAT_ROLES)
            if role not in CHAT_ROLES and hint:
                raise ValueError(
                    f"{role!r} is not a chat role{hint}; map the data's role names to {', '.join(CHAT_ROLES)}"
                )
        return v

    @field_validator("roles_to_train")
    @classmethod
    def _roles_to_train(cls, v: list[str], info: ValidationInfo) -> list[str]:
        """Roles after the ``roles:`` mapping; a near miss of a known one (``asistant``) is a typo."""
        known = dict.fromkeys([*CHAT_ROLES, *(info.data.get("roles") or {})])
        for role in v:
            hint = did_you_mean(role, known)
            if role not in known and hint:
                raise ValueError(
                    f"{role!r} is not a role after the roles mapping{hint}; list roles of {', '.join(known)}"
                )
        return v

    @field_validator("train_on_eos", mode="before")
    @classmethod
    def _eos(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in _EOS_CHOICES:
            raise ValueError(f"{v!r} is not one of {', '.join(_EOS_CHOICES)}{did_you_mean(v, _EOS_CHOICES)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "DatasetSpec":
        if self.ds_type is not None and not self.path.startswith("builtin:"):
            ext = {"json": (".json", ".jsonl"), "parquet": (".parquet",), "csv": (".csv",), "arrow": ("",)}[
                self.ds_type
            ]
            if os.path.isfile(self.path) and not self.path.endswith(ext):
                raise ValueError(
                    f"ds_type: {self.ds_type} but {self.path!r} is not a {'/'.join(ext)} file; fix ds_type or path"
                )
        return self

    @property
    def role_key(self) -> str:
        return (self.message_property_mappings or {}).get("role") or self.message_field_role or "role"

    @property
    def content_key(self) -> str:
        return (self.message_property_mappings or {}).get("content") or self.message_field_content or "content"


class SpecialTokens(StrictModel):
    """``special_tokens:`` set on a Hugging Face tokenizer before tokenizing (Axolotl's keys)."""

    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    pad_token: Optional[str] = None
    unk_token: Optional[str] = None
    additional_special_tokens: Optional[list[str]] = None


# Hugging Face `datasets` builders that read local files: {path: json, data_files: a.jsonl} (Axolotl's
# local-file form) is the file a.jsonl, read as lowprec reads any local file; the value is its ds_type
_LOCAL_BUILDERS = {"json": "json", "csv": "csv", "parquet": "parquet", "arrow": "arrow", "text": None}


def _local_builder_entries(entry: Any) -> list[Any]:
    """``{path: json, data_files: [a.jsonl, b.jsonl]}`` -> ``[{path: a.jsonl}, {path: b.jsonl}]``
    (globs expanded, a ``{split: files}`` mapping read at ``split``, default train); other entries as given."""
    if not isinstance(entry, dict) or entry.get("path") not in _LOCAL_BUILDERS or entry.get("data_files") is None:
        return [entry]
    builder, files = entry["path"], entry["data_files"]
    rest = {k: v for k, v in entry.items() if k not in ("path", "data_files")}
    if isinstance(files, dict):
        split = rest.pop("split", None) or "train"
        if split not in files:
            raise ValueError(
                f"path: {builder} with data_files {sorted(files)} has no {split!r} split; set split: to one "
                "of them, or write path: <the file>"
            )
        files = files[split]
    names = [files] if isinstance(files, str) else files
    if not isinstance(names, list) or not names or not all(isinstance(f, str) for f in names):
        raise ValueError(
            f"path: {builder}: data_files must name local files (a path or a list); write path: <the file>"
        )
    if _LOCAL_BUILDERS[builder] and rest.get("ds_type") is None:
        rest["ds_type"] = _LOCAL_BUILDERS[builder]
    found = [g for f in names for g in (sorted(glob.glob(f)) if glob.has_magic(f) else [f])]
    return [{"path": f, **rest} for f in found or names]


class DataKeys(StrictModel):
    datasets: list[DatasetSpec] = Field(
        default_factory=lambda: [DatasetSpec(path="builtin:stdlib")],
        description="training text: [{path: builtin:stdlib}] (default) or local .txt/.jsonl files",
    )
    dataset_max_bytes: Optional[int] = Field(
        default=8_000_000,
        ge=1,
        description="read at most this many bytes of plain text (completion data without packing; null: all)",
    )
    val_set_size: float = Field(
        default=0.03, ge=0.0, lt=1.0, description="fraction of documents held out for validation (0: none)"
    )
    sequence_len: int = Field(default=128, ge=2, description="tokens per training sequence")
    train_on_inputs: bool = Field(
        default=False, description="false: prompt tokens (instructions, user turns) are labelled -100 and not learned"
    )
    sample_packing: Optional[bool] = Field(
        default=None, description="pack short examples into rows of sequence_len, each attending only to itself"
    )
    eval_sample_packing: Optional[bool] = Field(
        default=None, description="pack validation examples too (default: as sample_packing)"
    )
    pad_to_sequence_len: Optional[bool] = Field(
        default=None,
        description="pad every batch to sequence_len (default: true with packing; else to the longest, rounded to 16)",
    )
    dataset_prepared_path: Optional[str] = Field(
        default=None,
        description="directory caching tokenized data, keyed by tokenizer, data and config; reused next run",
    )
    chat_template: str = Field(
        default="tokenizer_default",
        description="template of type: chat_template data: tokenizer_default, chatml, llama3, jinja, "
        "tokenizer_default_fallback_chatml",
    )
    chat_template_jinja: Optional[str] = Field(default=None, description="template text for chat_template: jinja")
    eot_tokens: Optional[list[str]] = Field(default=None, description="end-of-turn strings trained with their turn")
    special_tokens: Optional[SpecialTokens] = Field(
        default=None,
        description="bos/eos/pad/unk tokens set on a Hugging Face tokenizer (e.g. pad_token: <|end_of_text|>)",
    )
    tokens: Optional[list[str]] = Field(
        default=None,
        description="tokens added to a Hugging Face tokenizer (the embeddings grow to fit; with "
        "adapter: lora set lora_modules_to_save: [embed_tokens, lm_head])",
    )

    @field_validator("datasets", mode="before")
    @classmethod
    def _datasets_shorthand(cls, v: Any) -> Any:
        """``datasets: data.txt`` or ``[a.txt, b.jsonl]`` mean ``[{path: ...}, ...]``."""
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            return [e for d in v for e in _local_builder_entries({"path": d} if isinstance(d, str) else d)]
        return v

    @field_validator("chat_template_jinja")
    @classmethod
    def _jinja(cls, v: Optional[str]) -> Optional[str]:
        return _checked_template(v)

    @field_validator("datasets")
    @classmethod
    def _datasets(cls, v: list[DatasetSpec]) -> list[DatasetSpec]:
        if not v:
            raise ValueError(
                "the list is empty; list at least one dataset (e.g. [{path: data.jsonl}]) or drop "
                "the key for the built-in corpus"
            )
        return v

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
