"""The checksums that verify a restored checkpoint (docs/method/runs.md §15).

`save` records one 64-bit checksum per array of the state in the checkpoint's `meta`; every
restore recomputes it from the restored arrays and compares. Tensorstore stores no checksum of
the values, so bytes damaged on disk could otherwise decode to other numbers without an error.
The checksum depends on the global array's value only, so it verifies across meshes, shardings
and process counts. It runs as one jitted integer reduction per device set (no gather, no host
copy), or on the host for a CPU array this process holds whole. Checkpoints written before
checksums were recorded restore with a warning and no verification; so does a leaf restored to
another dtype or shape than it was saved with.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax

CHECKSUMS = "state_checksums"  # the key of `meta` that holds them
ALGORITHM = "fmix32-sum-x2/v1"  # the checksum of the module docstring
_SEEDS = (0x9E3779B9, 0x7F4A7C15)


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The array as uint32 words, shape x.shape + (words per element,): row-major is the word order."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    size = np.dtype(x.dtype).itemsize
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)[..., None]
    if size in (1, 2):
        return lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)[..., None]
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2)
    raise TypeError(f"no checksum for dtype {x.dtype}")


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32[2]: the two lanes of the checksum of the global value of `x` (traced)."""
    words = _words(x)
    index, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for axis in reversed(range(words.ndim)):  # global row-major index, mod 2^32, no reshape
        index = index + lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return jnp.stack([jnp.sum(_fmix32(_fmix32(index ^ jnp.uint32(seed)) + words), dtype=jnp.uint32) for seed in _SEEDS])


@jax.jit
def _checksums_of(leaves: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.stack([_leaf_checksum(x) for x in leaves])


def _host_words(x: jax.Array) -> np.ndarray | None:
    """`_words` in numpy (flattened) for a CPU array held whole by this process with elements of
    ≤ 4 bytes, else None (computed on the devices instead)."""
    if not (x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())):
        return None
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    if a.dtype.kind not in "biuf" and a.dtype.name != "bfloat16" or a.dtype.itemsize > 4:
        return None
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return a.reshape(-1).view(unsigned).astype(np.uint32)


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _host_checksum(words: np.ndarray) -> np.ndarray:
    """`_leaf_checksum` of row-major words (uint32 arithmetic wraps as on the devices)."""
    index = (np.arange(words.size, dtype=np.uint64) % 2**32).astype(np.uint32)
    with np.errstate(over="ignore"):
        return np.array([np.sum(_fmix32_np(_fmix32_np(index ^ np.uint32(seed)) + words), dtype=np.uint32)
                         for seed in _SEEDS])


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey (namedtuples), SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaf_path(path: tuple[Any, ...]) -> str:
    """'opt_state/0/mu/block_0/kernel': the same for a namedtuple, a dict or a list of the tree."""
    return "/".join(_key_name(k) for k in path)


def _describe(x: Any) -> str:
    is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return f"{x.dtype if is_key else np.dtype(x.dtype).name}{list(x.shape)}"


@functools.cache
def _has_checksum(dtype: Any) -> bool:
    """Whether `_words` takes arrays of `dtype` (it depends on the dtype only; traced once each)."""
    try:
        jax.eval_shape(_words, jax.ShapeDtypeStruct((1,), dtype))
    except TypeError:
        return False
    return True


def _hex(lanes: Any) -> str:
    return "".join(f"{int(v):08x}" for v in lanes)


def checksums(tree: Any, prefix: str = "") -> dict[str, str]:
    """{leaf path: "<dtype>[<shape>]:<16 hex digits>"} of every array of `tree`.

    Every process must call this at the same point (the sums of arrays spanning processes are
    collectives). Leaves that are not arrays (or of a dtype without a checksum) are left out.
    """
    leaves = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(x, jax.Array):
            try:
                x = jnp.asarray(x)
            except (TypeError, ValueError):
                continue
        if not _has_checksum(x.dtype):
            continue
        leaves.append((prefix + _leaf_path(path), x))
    # On the host where this process holds a CPU array whole (no compilation); otherwise one
    # jitted sum per device set (all the arrays of a mesh in one program).
    sums: list[Any] = [None] * len(leaves)
    groups: dict[Any, list[int]] = {}
    for i, (_, x) in enumerate(leaves):
        words = _host_words(x)
        if words is not None:
            sums[i] = _hex(_host_checksum(words))
            continue
        devices = tuple(sorted(d.id for d in x.sharding.device_set)) if getattr(x, "committed", True) else None
        groups.setdefault(devices, []).append(i)
    results = [(indices, _checksums_of(tuple(leaves[i][1] for i in indices))) for indices in groups.values()]
    for indices, result in results:
        for i, lanes in zip(indices, np.asarray(jax.device_get(result))):
            sums[i] = _hex(lanes)
    return {name: f"{_describe(x)}:{s}" for (name, x), s in zip(leaves, sums)}


def verify(step: int, tree: Any, saved: dict[str, Any] | None, prefix: str = "") -> str | None:
    """None when the restored `tree` has the saved checksums, else why not (one line).

    `saved`: meta[CHECKSUMS] of the checkpoint (None: written before checksums, not verified).
    `prefix`: the path of `tree` in the saved state (a partial restore).
    """
    if not saved or "leaves" not in saved:
        logging.warning(
            "Checkpoint at step %d has no checksums (written before they were recorded); restored unverified.", step
        )
        return None
    if saved.get("algorithm") != ALGORITHM:
        logging.warning(
            "Checkpoint at step %d has checksums of another kind (%s); restored unverified.",
            step,
            saved.get("algorithm"),
        )
        return None
    expected = saved["leaves"]
    got = checksums(tree, prefix)
    bad, unverified = [], 0
    for name, value in got.items():
        if name not in expected:
            unverified += 1
        elif expected[name].rsplit(":", 1)[0] != value.rsplit(":", 1)[0]:
            unverified += 1  # restored to another dtype or shape: the words differ
        elif expected[name] != value:
            bad.append(name)
    if unverified:
        logging.warning(
            "Checkpoint at step %d: %d restored arrays not verified (no saved checksum of that dtype and shape).",
            step,
            unverified,
        )
    if not bad:
        return None
    more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
    return (f"corrupt: the values of {bad[0]}{more} differ from the saved ones "
            f"(checksum {got[bad[0]]}, saved {expected[bad[0]]})")


def split_meta(meta: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(meta as the caller saved it, the checksums)."""
    meta = dict(meta or {})
    return meta, meta.pop(CHECKSUMS, None)

