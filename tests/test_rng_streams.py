"""The random-stream tags (skipless_jax/rng_streams.py): no two streams share a tag, and every
fold_in / seed tag of the package is one of them."""

from __future__ import annotations

import ast
import os

from skipless_jax import rng_streams

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "skipless_jax")


def test_no_two_streams_share_a_tag():
    values = list(rng_streams.TAGS.values())
    assert len(rng_streams.TAGS) == 8 and len(set(values)) == len(values), rng_streams.TAGS
    assert min(values) > 1024  # above any micro-batch index folded into the same step key


def test_no_literal_tag_outside_the_module():
    """`fold_in(key, <int literal>)` and an int literal in `default_rng([...])` appear nowhere else."""
    found = []
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if not file.endswith(".py") or file == "rng_streams.py":
                continue
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                args = node.args[1:] if name == "fold_in" else (
                    node.args[0].elts if name == "default_rng" and node.args and isinstance(node.args[0], ast.List)
                    else [])
                if any(isinstance(a, ast.Constant) and isinstance(a.value, int) for a in args):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not found, f"literal stream tags (name them in skipless_jax/rng_streams.py): {found}"
