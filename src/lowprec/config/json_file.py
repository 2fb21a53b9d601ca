"""Reading a JSON config file (a DeepSpeed config) with one-line errors: standard library only, so
the launcher reads one without importing PyYAML or pydantic."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["read_json_object"]


def read_json_object(path: str) -> dict[str, Any]:
    """A JSON file holding an object (a DeepSpeed config): ValueError with a one-line reason
    (missing, not JSON, not an object) for the caller to prefix with the key that named it."""
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} does not exist; give the path of a DeepSpeed JSON config")
    try:
        with open(path) as f:
            body = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path!r} is not valid JSON ({' '.join(str(exc).split())}); fix the file") from None
    if not isinstance(body, dict):
        raise ValueError(f"{path!r} holds a JSON {type(body).__name__}, not an object of DeepSpeed settings")
    return body
