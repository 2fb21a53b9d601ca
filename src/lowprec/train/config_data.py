"""Trainer keys for the training data (``datasets:``, ``sequence_len``, ``val_set_size``)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from lowprec.train.config_base import StrictModel

__all__ = ["DatasetSpec", "DataKeys"]


class DatasetSpec(StrictModel):
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


class DataKeys(StrictModel):
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

    @field_validator("datasets", mode="before")
    @classmethod
    def _datasets_shorthand(cls, v: Any) -> Any:
        """``datasets: data.txt`` or ``[a.txt, b.jsonl]`` mean ``[{path: ...}, ...]``."""
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            return [{"path": d} if isinstance(d, str) else d for d in v]
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
