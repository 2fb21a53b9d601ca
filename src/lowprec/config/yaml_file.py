"""Reading a YAML config file strictly: the one loader of the trainer and launch configs.

PyYAML keeps the last of two equal keys without a word (``learning_rate: 1.0e-3`` then
``learning_rate: 5.0`` trains at 5.0), and reads an empty or comment-only file as ``None``,
which a caller easily turns into "all defaults" (a 7725-step run nobody asked for). Both are
errors here, naming the file, the key and the lines.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from lowprec.errors import UsageError

__all__ = ["read_yaml_mapping"]


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping (at any depth)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    loader.flatten_mapping(node)  # resolves YAML merge keys (<<) first: merged keys may be overridden
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise UsageError(
                f"{loader.name}: key {key!r} is given twice (lines {seen[key]} and {line}); the first would be "
                "silently overridden: keep one"
            )
        if isinstance(key, (str, int, float, bool)):
            seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.2 floats: PyYAML (YAML 1.1) reads `2e-5` and `1e999` as strings, which a strict schema
# would refuse ("a valid number") although every Axolotl config writes learning rates so; read
# them as floats (`1e999` is then inf, and refused as not finite, not run).
_StrictLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml_mapping(path: str | os.PathLike[str], example: str = "key: value") -> dict[str, Any]:
    """The top-level mapping of the YAML file ``path``; every problem is one ``UsageError`` line
    naming the file (missing files are the caller's to report, with its own hint)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{p}: not a text file (byte {exc.object[exc.start]:#04x} at offset {exc.start} is not "
            "UTF-8); give a YAML config file"
        ) from None
    except OSError as exc:
        raise UsageError(f"{p}: cannot be read ({exc.strerror or exc}); give a readable YAML config file") from None
    loader = _StrictLoader(text)
    loader.name = str(p)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).split("\n")[0]
        raise UsageError(f"{p}:{where}: not valid YAML ({problem}); fix the syntax") from None
    finally:
        loader.dispose()
    if data is None:
        raise UsageError(
            f"{p}: the file is empty (or holds only comments); write the settings (e.g. `{example}`), "
            "or leave the file out to use the defaults"
        )
    if not isinstance(data, dict):
        raise UsageError(f"{p}: expected a mapping of keys to values at the top level, got {type(data).__name__}")
    return data
