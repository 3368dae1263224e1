"""Nested mappings as flat ones: the one `flatten` of parameter trees, config dicts and checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(tree: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a<sep>b': 1}; leaves (anything not a Mapping) are kept as they are."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, sep, f"{prefix}{k}{sep}"))
        else:
            out[f"{prefix}{k}"] = v
    return out
