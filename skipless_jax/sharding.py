"""Device mesh and the `(regex, rule)` list that decides how every array is sharded.

`config.mesh` is a list of `(axis_name, size)` pairs, one size may be -1 (all the rest):
`[('data', -1), ('fsdp', 1)]` is data-parallel, `[('data', 2), ('fsdp', 4)]` FSDP on 8 devices.
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
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA_AXES = ("data", "fsdp")  # the batch is split over both; fsdp also splits parameters
MESH_AXES = DATA_AXES


def mesh_shape(axes: Sequence[tuple[str, int]], num_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Resolves the -1 entry; raises a one-line error if the sizes do not match the devices."""
    names = tuple(name for name, _ in axes)
    sizes = [int(size) for _, size in axes]
    unknown = [n for n in names if n not in MESH_AXES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"config.mesh={list(axes)} has unknown or repeated axes {unknown}; allowed: {list(MESH_AXES)}")
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"config.mesh={list(axes)}: sizes must be positive, with at most one -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"config.mesh={list(axes)} does not divide the {num_devices} devices")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"config.mesh={list(axes)} has {math.prod(sizes)} devices but {num_devices} are available"
        )
    return names, tuple(sizes)


def make_mesh(axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    names, sizes = mesh_shape(axes, len(devices))
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
                f"config.sharding_rules entry {item!r} is malformed; allowed: (regex, 'fsdp' | 'replicate' | partition tuple)"
            )
