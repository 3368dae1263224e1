"""Device mesh and the `(regex, rule)` list that decides how every array is sharded.

`config.mesh` gives each axis its size, one size may be -1 (all the rest), axis order data then
fsdp: `{'data': -1, 'fsdp': 1}` is data-parallel, `{'data': -1, 'fsdp': 8}` FSDP over 8 devices
(`--config.mesh.fsdp=8` on the command line). The older list of `(axis, size)` pairs,
`[('data', 2), ('fsdp', 4)]`, is still accepted.
`config.sharding_rules` is a list of `(regex, rule)`; the first regex that matches a leaf's path
(e.g. 'params/block_0/MultiHeadAttention/query') decides. Rules:
  'fsdp'       shard the largest dimension divisible by the fsdp axes, else replicate;
  'replicate'  every device holds the whole array;
  a tuple      an explicit PartitionSpec, e.g. (None, 'fsdp').
Optimizer-state leaves carry their parameter's path inside theirs, so one rule list covers both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXES = ("data", "fsdp")  # the batch is split over both; fsdp also splits parameters
MESH_AXES = DATA_AXES


def _mesh_axes(mesh: Any) -> list[tuple[str, Any]]:
    """(axis, size) pairs in mesh order (data, then fsdp) from a ConfigDict/dict or the old list."""
    if hasattr(mesh, "items"):  # ConfigDict or dict: {'data': -1, 'fsdp': 1}
        unknown = [name for name in mesh if name not in MESH_AXES]
        if unknown:
            raise ValueError(
                f"config.mesh.{unknown[0]}={mesh[unknown[0]]!r} is an unknown mesh axis; "
                f"allowed: {', '.join(MESH_AXES)}"
            )
        return [(name, mesh[name]) for name in MESH_AXES if name in mesh]
    try:  # the old form: [('data', -1), ('fsdp', 1)]
        axes = [(name, size) for name, size in mesh]
    except (TypeError, ValueError):
        raise ValueError(
            f"config.mesh={mesh!r} must be axis sizes like {{'data': -1, 'fsdp': 1}} (or (axis, size) pairs)"
        ) from None
    names = [name for name, _ in axes]
    for name in names:
        if name not in MESH_AXES or names.count(name) > 1:
            what = "an unknown mesh axis" if name not in MESH_AXES else "repeated"
            raise ValueError(
                f"config.mesh.{name} (in config.mesh={list(mesh)}) is {what}; allowed: {', '.join(MESH_AXES)}"
            )
    return axes


def mesh_shape(mesh: Any, num_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(axis names, sizes) of `config.mesh` over `num_devices`, the -1 resolved; one-line errors.

    `mesh` is a ConfigDict/dict `{'data': -1, 'fsdp': 1}` (axis order: data, then fsdp) or the
    older list of (axis, size) pairs.
    """
    axes = _mesh_axes(mesh)
    if not axes:
        raise ValueError(f"config.mesh={mesh!r} has no axes; allowed: {', '.join(MESH_AXES)}")
    names = tuple(name for name, _ in axes)
    for name, size in axes:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not (size > 0 or size == -1):
            raise ValueError(
                f"config.mesh.{name}={size!r} must be a positive integer, or -1 for all the remaining devices"
            )
    sizes = [int(size) for _, size in axes]
    if sizes.count(-1) > 1:
        both = " and ".join(f"config.mesh.{n}=-1" for n, s in axes if s == -1)
        raise ValueError(f"{both}: at most one axis may be -1 (all the remaining devices)")
    known = math.prod(s for s in sizes if s != -1)
    spelled = " × ".join(f"config.mesh.{n}={s}" for n, s in zip(names, sizes) if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"{spelled} does not divide the {num_devices} devices; allowed: divisors of {num_devices}")
        sizes[sizes.index(-1)] = num_devices // known
    elif known != num_devices:
        raise ValueError(
            f"{spelled} is {known} devices but {num_devices} are available (set one axis to -1 to take the rest)"
        )
    return names, tuple(sizes)


def make_mesh(mesh: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The device mesh of `config.mesh` (see `mesh_shape`) over `devices` (default: all)."""
    devices = list(devices if devices is not None else jax.devices())
    names, sizes = mesh_shape(mesh, len(devices))
    return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in DATA_AXES if a in mesh.axis_names)


def num_data_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in data_axes(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over every data axis."""
    return NamedSharding(mesh, P(data_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def fsdp_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """Shards the largest dimension divisible by the fsdp axis size; replicates otherwise."""
    size = mesh.shape.get("fsdp", 1)
    if size == 1 or not shape:
        return P()
    for dim in np.argsort(shape)[::-1]:
        if shape[dim] % size == 0 and shape[dim] >= size:
            spec = [None] * len(shape)
            spec[dim] = "fsdp"
            return P(*spec)
    return P()


def path_str(path: tuple[Any, ...]) -> str:
    """'params/block_0/MlpBlock_0/Dense_0/kernel' from a jax key path."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _spec_for(path: str, shape: Sequence[int], mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> P:
    for pattern, rule in rules:
        if re.search(pattern, path):
            if rule == "fsdp":
                return fsdp_spec(shape, mesh)
            if rule == "replicate":
                return P()
            spec = P(*rule)
            if len(spec) > len(shape):
                return P()  # e.g. a scalar count inside an optimizer state
            return spec
    return P()


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]], prefix: str = "") -> Any:
    """NamedShardings for every leaf of an (abstract) pytree, by the rules on its path."""

    def leaf(path: tuple[Any, ...], x: Any) -> NamedSharding:
        name = f"{prefix}/{path_str(path)}" if prefix else path_str(path)
        return NamedSharding(mesh, _spec_for(name, getattr(x, "shape", ()), mesh, rules))

    return jax.tree_util.tree_map_with_path(leaf, tree)


def validate_rules(rules: Sequence[Any]) -> None:
    for item in rules:
        ok = isinstance(item, (tuple, list)) and len(item) == 2
        if ok:
            pattern, rule = item
            try:
                re.compile(pattern)
            except (re.error, TypeError):
                ok = False
            ok = ok and (rule in ("fsdp", "replicate") or isinstance(rule, (tuple, list)))
        if not ok:
            raise ValueError(
                f"config.sharding_rules entry {item!r} is malformed; "
                "allowed: (regex, 'fsdp' | 'replicate' | partition tuple)"
            )
