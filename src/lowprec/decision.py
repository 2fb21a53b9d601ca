"""A resolved value and the reason it was chosen (torch-free; used by every resolver)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Decision"]


@dataclass(frozen=True)
class Decision:
    value: Any
    reason: str
