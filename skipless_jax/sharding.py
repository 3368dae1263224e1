"""Device mesh and the `(regex, rule)` list that decides how every array is sharded.

`config.mesh` gives each axis its size, one size may be -1 (all the rest), axis order data then
fsdp: `{'data': -1, 'fsdp': 1}` is data-parallel, `{'data': -1, 'fsdp': 8}` FSDP over 8 devices
(`--config.mesh.fsdp=8` on the command line). The older list of `(axis, size)` pairs,
`[('data', 2), ('fsdp', 4)]`, is still accepted.
`config.sharding_rules` is a list of `(regex, rule)`; the first regex that matches a leaf's path
(e.g. 'params/block_0/MultiHeadAttention/query') decides. Rules:
  'fsdp'       shard the largest dimension divisible by the fsdp axes, else replicate;
  'replicate'  every device holds the whole array;
  a tuple      an explicit PartitionSpec, e.g. (None, 'fsdp'); its rank and the divisibility of
               every split dimension are checked against each leaf it matches (a one-line
               ValueError naming the leaf, its shape and the mesh axis) before anything compiles.
Optimizer-state leaves carry their parameter's path inside theirs, so one rule list covers both.
The trainers' state (`trainers/common.state_shardings`) adds three rules of its own:
  - leaves under `MIN_SHARD_SIZE` elements (biases, norms, the class token, counters) stay
    replicated under 'fsdp' and the optimizer-state rule;
  - PRNG keys (typed keys, or raw uint32 keys named `rng`/`key`) are always replicated;
  - optimizer-state leaves (ZeRO): the largest dimension divisible by all the data axes
    (data × fsdp) is split over them, even where the parameter is replicated, unless their
    rule is 'replicate' (`zero_spec`). The optimizer's update then runs on 1/N of its state on
    each device and is gathered back to the parameter's sharding.
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
# Leaves with fewer elements stay replicated (biases, norms, counters): splitting them saves
# nothing and costs a collective each.
MIN_SHARD_SIZE = 1024


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


def host_rows(mesh: Mesh, *arrays: Any) -> tuple[jax.Array, ...]:
    """Host arrays that every process holds whole, as global arrays with rows split over the
    mesh's data axes: each device receives only its own rows (no whole-array transfer, safe on
    many hosts). Row counts must divide by `num_data_shards(mesh)`."""
    rows = batch_sharding(mesh)
    return tuple(jax.make_array_from_callback(a.shape, rows, lambda index, a=a: a[index]) for a in arrays)


def on_mesh(x: Any) -> bool:
    """Whether `x` is a global array laid out over a mesh (e.g. rows split by `host_rows` or
    `Context.extract_rows`), not a host array."""
    return isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _largest_divisible(shape: Sequence[int], size: int, axes: Any) -> P | None:
    """`axes` on the largest dimension of `shape` divisible by `size` (None if there is none)."""
    for dim in np.argsort(shape, kind="stable")[::-1]:
        if shape[dim] % size == 0 and shape[dim] >= size:
            spec = [None] * len(shape)
            spec[dim] = axes
            return P(*spec)
    return None


def fsdp_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """Shards the largest dimension divisible by the fsdp axis size; replicates otherwise."""
    size = mesh.shape.get("fsdp", 1)
    if size == 1 or not shape:
        return P()
    return _largest_divisible(shape, size, "fsdp") or P()


def zero_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """ZeRO sharding of an optimizer-state leaf: its largest dimension divisible by the product
    of all the data axes (data × fsdp) split over them; else the largest divisible by one axis
    (fsdp first); else replicated."""
    axes = data_axes(mesh)
    if not shape or num_data_shards(mesh) == 1:
        return P()
    candidates = [(axes, num_data_shards(mesh))] if len(axes) > 1 else []
    candidates += [(a, mesh.shape[a]) for a in reversed(axes) if mesh.shape[a] > 1]
    for names, size in candidates:
        spec = _largest_divisible(shape, size, names)
        if spec is not None:
            return spec
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


def is_key(name: str, x: Any) -> bool:
    """A PRNG key: a typed key array, or a raw uint32 key whose path ends in `rng` or `key`."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.dtype(dtype) == np.uint32 and re.search(r"(^|[/_])(rng|key)$", name) is not None


def _explicit_spec(name: str, shape: Sequence[int], mesh: Mesh, pattern: str, rule: Any) -> P:
    """The explicit PartitionSpec `rule` for leaf `name`, checked: one-line ValueErrors."""
    spec = P(*rule)
    where = f"config.sharding_rules entry ({pattern!r}, {tuple(rule)!r}) matches {name} of shape {tuple(shape)}"
    if len(spec) > len(shape):
        raise ValueError(f"{where}: the rule has {len(spec)} dimensions, the leaf {len(shape)}")
    for dim, axes in enumerate(spec):
        if axes is None:
            continue
        names = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        for axis in names:
            if axis not in mesh.shape:
                raise ValueError(f"{where}: mesh axis {axis!r} is not in the mesh {dict(mesh.shape)}")
        size = math.prod(mesh.shape[a] for a in names)
        if shape[dim] % size:
            raise ValueError(
                f"{where}: dimension {dim} ({shape[dim]}) is not divisible by mesh axis "
                f"{'×'.join(names)} of size {size}"
            )
    return spec


def _spec_for(
    path: str, x: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]], min_size: int = 0, zero: bool = False
) -> P:
    shape = tuple(getattr(x, "shape", ()))
    if not shape or is_key(path, x):
        return P()  # scalars have nothing to split; a key is never split
    small = math.prod(shape) < min_size
    for pattern, rule in rules:
        if re.search(pattern, path):
            if rule == "replicate":
                return P()
            if zero:
                return P() if small else zero_spec(shape, mesh)
            if rule == "fsdp":
                return P() if small else fsdp_spec(shape, mesh)
            return _explicit_spec(path, shape, mesh, pattern, rule)
    return P()


def tree_shardings(
    tree: Any,
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]],
    prefix: str = "",
    *,
    min_size: int = 0,
    zero: Sequence[str] = (),
) -> Any:
    """NamedShardings for every leaf of an (abstract) pytree, by the rules on its path.

    `min_size`: leaves with fewer elements stay replicated under 'fsdp' (and ZeRO).
    `zero`: path prefixes (e.g. 'opt_state') of optimizer-state subtrees, whose leaves get
    `zero_spec` unless their rule is 'replicate'. Keys and scalars are always replicated.
    """

    def leaf(path: tuple[Any, ...], x: Any) -> NamedSharding:
        name = f"{prefix}/{path_str(path)}" if prefix else path_str(path)
        is_zero = any(name == z or name.startswith(f"{z}/") for z in zero)
        return NamedSharding(mesh, _spec_for(name, x, mesh, rules, min_size, is_zero))

    return jax.tree_util.tree_map_with_path(leaf, tree)


def constrain_batch(x: jax.Array, dim: int = 0) -> jax.Array:
    """`x` with dimension `dim` split over the data axes of the current mesh (`jax.set_mesh`),
    so that a reshape or transpose around it cannot silently gather the batch; unchanged
    outside a mesh or when the dimension does not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    size = math.prod(mesh.shape[a] for a in axes)
    if size == 1 or x.shape[dim] % size:
        return x
    spec = [None] * x.ndim
    spec[dim] = axes
    return jax.lax.with_sharding_constraint(x, P(*spec))


def validate_rules(rules: Sequence[Any]) -> None:
    """One-line errors for a malformed rule list (shapes are checked in `tree_shardings`)."""
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
        if isinstance(rule, (tuple, list)):
            for axes in rule:
                names = axes if isinstance(axes, (tuple, list)) else (axes,)
                bad = [a for a in names if a is not None and a not in MESH_AXES]
                if bad:
                    raise ValueError(
                        f"config.sharding_rules entry {tuple(item)!r} names mesh axis {bad[0]!r}; "
                        f"allowed: {', '.join(MESH_AXES)} or None"
                    )
