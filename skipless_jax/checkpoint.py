"""Orbax checkpoints of the train state: async saves, keep-N, restore onto target shardings.

A checkpoint holds the whole train state pytree (step, params, optimizer state, RNG, the
non-finite counters) plus a small JSON `meta` item (the data position, the config, and the
state's checksums). The data a step sees depends only on (seed, step), so the step is the data
iterator's state.

Checksums. Tensorstore stores the arrays compressed but without a checksum of their values, so
bytes damaged on disk may decode to other numbers without any error. `save` therefore records
one 64-bit checksum per array of the state (`meta["state_checksums"]`), and every restore
recomputes it from the restored arrays and compares: a checkpoint whose values differ from the
saved ones is treated exactly like an unreadable one (reported, set aside, the previous one
used). The checksum is a function of the *global* array's value only, so it verifies whatever
the mesh, the shardings or the number of processes of the saving and of the restoring run:

    checksum(x) = (sum_i h_0(i, w_i) mod 2^32, sum_i h_1(i, w_i) mod 2^32)

over the words w_i of the global array in row-major order (its elements bitcast to 32-bit words:
16- and 8-bit types zero-extended, 64-bit types two words, PRNG keys their key data), where i is
the word's global row-major index and h_k(i, w) = fmix32(fmix32(i ^ seed_k) + w) (murmur3's
finalizer; a bijection of w for each i, so one changed word always changes each lane, and a
random change leaves both lanes equal with probability 2^-64; moved words change it too, as h
depends on i). Integer addition mod 2^32 is associative and commutative, so the sum is exact in
any reduction order: it runs as one jitted reduction over each sharded array (each device sums
its shard, then an all-reduce of two words per array), with no gather and no host copy of the
state. Cost: one read of the state on its devices at every save (synchronous, before the async
save starts, since the trainer donates the state to its next step) and at every restore, plus
one compilation per state layout; about 20 integer operations per 32-bit word.
Replicated copies are not compared with each other (each device holds the same value; orbax
writes one replica). Checkpoints written before checksums were recorded restore with a warning
and no verification; a leaf restored to another dtype or shape than it was saved with is not
verified either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax import lax
from jax.experimental import multihost_utils

STATE, META = "state", "meta"
CHECKSUMS = "state_checksums"  # the key of `meta` that holds them
_ALGORITHM = "fmix32-sum-x2/v1"  # the checksum of the module docstring
_SEEDS = (0x9E3779B9, 0x7F4A7C15)


class IncompatibleCheckpointError(ValueError):
    """A readable checkpoint whose parameters do not match the model this config builds."""

    exit_status = 1  # the run cannot go on (cli.exit_status), not a bad value on the command line


class CorruptCheckpointError(ValueError):
    """A checkpoint whose restored values differ from the ones saved (their checksums)."""

    exit_status = 1


class DiskFullError(OSError):
    """A save that failed for lack of space; the checkpoints saved before it are kept."""


def _disk_full(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is a full disk: ENOSPC, or tensorstore's RESOURCE_EXHAUSTED."""
    seen = 0
    while err is not None and seen < 20:
        if getattr(err, "errno", None) == errno.ENOSPC or any(
                k in str(err) for k in ("RESOURCE_EXHAUSTED", "No space left on device")):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def disk_full_write(err: BaseException, workdir: str) -> DiskFullError | None:
    """A write in `workdir` other than a checkpoint save (the profiler trace, history.jsonl, the
    event files, the final metrics) that failed for lack of space, as one DiskFullError naming the
    file and the last good checkpoint; None for any other error (ENOSPC or 'No space left on
    device' only: a bare RESOURCE_EXHAUSTED may be a device's memory)."""
    seen = 0
    while err is not None and seen < 20:
        text = str(err)
        if getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in text:
            what = getattr(err, "filename", None) or _last_path(text.split("No space left on device")[0]) \
                or f"a file in {workdir}"
            good = _finished_in(os.path.join(_abs(workdir), "checkpoints"))
            return DiskFullError(
                f"the disk is full: writing {what} failed (No space left on device); "
                f"{f'the last good checkpoint is step {max(good)}, kept' if good else 'no checkpoint was saved yet'}; "
                "free space and rerun the same command to resume")
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _last_path(text: str) -> str | None:
    """The last file path (or bucket URL) in a library's error text, without its quotes and
    brackets ('... "/w/run/x.pb": [OS error 28] ...' -> '/w/run/x.pb'); None if it names none."""
    paths = re.findall(r"(?:\b[a-z][a-z0-9+]*://|(?<![\w.])/)[^\s\"'\[\]();,]+", text)
    return paths[-1].rstrip(":.") if paths else None


@contextlib.contextmanager
def disk_full_as_one_error(mngr: ocp.CheckpointManager, step: int | None) -> Iterator[None]:
    """Turns a full disk under `mngr` (a save, or its async completion) into DiskFullError: one line
    naming the folder and the last good checkpoint."""
    try:
        yield
    except Exception as err:
        if not _disk_full(err):
            raise
        good = _finished_steps(mngr)  # a failed save never got its final name
        raise DiskFullError(
            f"the disk is full: a checkpoint save in {mngr.directory} failed (No space left on device; step "
            f"{step}, or the save before it still finishing in the background); the last good checkpoint is "
            f"{f'step {max(good)}' if good else 'none'}, kept; free space and rerun the same command to resume"
        ) from None


def _finished_steps(mngr: ocp.CheckpointManager) -> list[int]:
    """The step folders on disk that orbax finished (renamed to their number)."""
    return _finished_in(mngr.directory)


def _finished_in(checkpoints: str) -> list[int]:
    directory = epath.Path(checkpoints)
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def _abs(path: str) -> str:
    """Absolute local paths; bucket URLs (gs://...) unchanged."""
    return path if "://" in path else os.path.abspath(path)


def _is_dir(path: str) -> bool:
    return epath.Path(path).is_dir()  # local folders and buckets alike


# Orbax writes a replicated array cooperatively, each replica a slice (replica-parallel), and
# each slice of a new shape is a compiled program. Only arrays of ≥ 4 MiB per replica are split
# (the large kernels and optimizer moments, where parallel writing pays); smaller ones are
# written whole by one replica. The handler is otherwise orbax's default (orbax 0.12.8).
REPLICA_PARALLEL_MIN_BYTES = 4 << 20


# The orbax versions whose array-metadata store sits at the private path below (the public API
# does not export it); tests/test_lifecycle.py fails loudly when the installed orbax moves it.
ORBAX_PRIVATE_PATH_CHECKED = ("0.12.8",)


def _array_metadata_store() -> Any:
    """orbax's array-metadata store (what its default jax.Array handler is built with): the one
    use of a private orbax path, behind a version check; None (orbax's handler kept, every
    replicated array written replica-parallel) on another orbax where the path is gone."""
    if ocp.__version__ not in ORBAX_PRIVATE_PATH_CHECKED:
        logging.warning("orbax %s is not one of %s that skipless_jax.checkpoint was checked with",
                        ocp.__version__, ORBAX_PRIVATE_PATH_CHECKED)
    try:
        from orbax.checkpoint._src.metadata import array_metadata_store
    except ImportError:
        return None
    return array_metadata_store.Store()


def _register_array_handler() -> None:
    store = _array_metadata_store()
    if store is None:
        logging.warning("orbax %s: no array-metadata store at the checked path; its default array handler is kept",
                        ocp.__version__)
        return
    handler = ocp.type_handlers.ArrayHandler(array_metadata_store=store,
                                             min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES)
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


_register_array_handler()


def manager(workdir: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.join(_abs(workdir), "checkpoints"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        ),
        item_names=(STATE, META),
    )


def entries(state: Any) -> Any:
    """What a checkpoint keeps of a train state: a trainer's state (a flax.struct dataclass,
    trainers/) as the mapping of its fields that are set, by name (a None field, e.g. no model
    EMA, is not an entry); a mapping (a converter's state) as it is. A checkpoint's layout is
    therefore that of the mapping, and `load_raw` reads any checkpoint as one."""
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if getattr(state, f.name) is not None}
    return state


def _like(restored: Any, target: Any) -> Any:
    """A restored mapping of `entries(target)` as the type of `target` (a train state's dataclass)."""
    return target.replace(**restored) if dataclasses.is_dataclass(target) else restored


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any], *, announce: bool = True) -> None:
    """Starts an (async) save of `state` at `step`; a step already saved is skipped.

    The state's checksums are computed before this returns (the caller may donate `state`
    right after) and are saved in `meta` under CHECKSUMS. `announce`: the console line a run
    shows for each save (a converter's own success line names the folder instead).
    """
    if step in mngr.all_steps():
        return
    state = entries(state)
    meta = dict(meta, **{CHECKSUMS: {"algorithm": _ALGORITHM, "leaves": checksums(state)}})
    if announce:
        logging.info("Saving the checkpoint of step %d in %s.", step, mngr.directory)
    with disk_full_as_one_error(mngr, step):
        mngr.save(
            step,
            args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}),
            force=True,
        )


def abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings, for `restore`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# ---- Checksums (see the module docstring).


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


def _verify(step: int, tree: Any, saved: dict[str, Any] | None, prefix: str = "") -> str | None:
    """None when the restored `tree` has the saved checksums, else why not (one line).

    `saved`: meta[CHECKSUMS] of the checkpoint (None: written before checksums, not verified).
    `prefix`: the path of `tree` in the saved state (a partial restore).
    """
    if not saved or "leaves" not in saved:
        logging.warning(
            "Checkpoint at step %d has no checksums (written before they were recorded); restored unverified.", step
        )
        return None
    if saved.get("algorithm") != _ALGORITHM:
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


def _split_meta(meta: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(meta as the caller saved it, the checksums)."""
    meta = dict(meta or {})
    return meta, meta.pop(CHECKSUMS, None)


# ---- Restore.


def _param_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_compatible(mngr: ocp.CheckpointManager, step: int, abstract_state: Any) -> None:
    """Raises IncompatibleCheckpointError when the checkpoint's parameter names or shapes differ
    from `abstract_state`'s (a changed config resumed in an old workdir). Unreadable metadata
    passes: reading the checkpoint then fails and it is treated as corrupt."""
    try:
        reader = _metadata_reader(str(mngr.directory))
        saved_shapes = _param_shapes(reader.item_metadata(step)[STATE].tree["params"])
        reader.close()
    except Exception:
        return
    wanted = _param_shapes(abstract_state["params"])
    if saved_shapes == wanted:
        return
    missing = sorted(set(wanted) - set(saved_shapes))
    extra = sorted(set(saved_shapes) - set(wanted))
    shape = sorted(k for k in set(wanted) & set(saved_shapes) if wanted[k] != saved_shapes[k])
    what = "; ".join(
        f"{label} {names[0]}{f' (+{len(names) - 1} more)' if len(names) > 1 else ''}"
        for label, names in (
            ("not in the checkpoint:", missing),
            ("only in the checkpoint:", extra),
            ("other shape:", shape),
        )
        if names
    )
    raise IncompatibleCheckpointError(
        f"the checkpoint of step {step} in {mngr.directory} was written for other parameters ({what}); "
        "resume it with the config that wrote it, or start in a new workdir"
    )


def _restore_verified(
    mngr: ocp.CheckpointManager, step: int, args: dict[str, Any], verify: Any
) -> tuple[str | None, Any]:
    """(None, restored) or (why the checkpoint is unusable, None), the same in every process.

    `verify(step, restored)` -> None or the reason it is corrupt; it runs in every process once
    every process has read the checkpoint (its sums are collectives).
    """
    error, restored = None, None
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(**args))
    except Exception as err:
        error = _one_line(err)
    if not _everywhere(error is None):
        return error or "unreadable in another process", None
    error = verify(step, restored)
    if not _everywhere(error is None):
        return error or "corrupt in another process", None
    return None, restored


def _full_args(abstract_state: Any) -> dict[str, Any]:
    return {STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}


def _verify_full(step: int, restored: Any) -> str | None:
    return _verify(step, restored[STATE], _split_meta(restored[META])[1])


def restore_latest(
    mngr: ocp.CheckpointManager, abstract_state: Any, set_aside: bool = True
) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, meta) of the newest readable checkpoint, or None if there is none.

    A checkpoint that fails to read (truncated, corrupted) or whose values differ from the
    saved checksums is reported and the one before it is tried, so a crash during a save or a
    damaged file never loses the run. With `set_aside`, the unreadable step folder is moved to
    `checkpoints_unreadable/` next to the manager's directory, so that the resumed run saves
    that step again (and keep-N never keeps it over a good one); nothing is deleted.
    A readable checkpoint written for other parameters raises IncompatibleCheckpointError and
    is left in place.
    """
    skipped, target = [], entries(abstract_state)
    for step in sorted(mngr.all_steps(), reverse=True):
        _check_compatible(mngr, step, target)
        error, restored = _restore_verified(mngr, step, _full_args(target), _verify_full)
        if error is None:
            if skipped:
                logging.warning(
                    "Using the checkpoint of step %d (unreadable: step %s).", step, ", ".join(map(str, skipped))
                )
            return step, _like(restored[STATE], abstract_state), _split_meta(restored[META])[0]
        logging.error("Checkpoint at step %d is unreadable (%s); trying the previous one.", step, error)
        skipped.append(step)
        if set_aside:
            _set_aside(mngr, step)
    return None


def _one_line(err: BaseException, limit: int = 300) -> str:
    """The root cause of `err` on one line (orbax wraps tensorstore's reason in long reprs)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip().splitlines()
    text = text[0] if text else ""
    return f"{type(err).__name__}: {text[:limit]}"


def _everywhere(ok: bool) -> bool:
    """True when `ok` holds in every process (all processes call this at the same point)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _set_aside(mngr: ocp.CheckpointManager, step: int) -> None:
    """Moves step folder `step` to `<dir>_unreadable/<step>[.n]` (process 0) and rescans."""
    if jax.process_index() == 0:
        source = epath.Path(mngr.directory) / str(step)
        parent = epath.Path(str(mngr.directory).rstrip("/") + "_unreadable")
        parent.mkdir(parents=True, exist_ok=True)
        target, n = parent / str(step), 0
        while target.exists():
            n += 1
            target = parent / f"{step}.{n}"
        source.rename(target)
        logging.error("Moved the unreadable checkpoint of step %d to %s.", step, target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")
    mngr.reload()


def _reader(directory: str) -> ocp.CheckpointManager:
    """A read-only manager of another run's (or this run's) checkpoint folder."""
    return ocp.CheckpointManager(
        directory, item_names=(STATE, META), options=ocp.CheckpointManagerOptions(read_only=True, create=False)
    )


def restore_from_path(path: str, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
    """Restores from a workdir, its `checkpoints/` folder, or one step folder of another run.

    A workdir or folder: its newest good checkpoint (as `restore_latest`, nothing moved). One
    step folder: that step, or CorruptCheckpointError when its values differ from the saved ones.
    """
    path = _abs(path)
    candidates = [os.path.join(path, "checkpoints"), path]
    for directory in candidates:
        if _is_dir(directory):
            mngr = _reader(directory)
            if mngr.all_steps():
                found = restore_latest(mngr, abstract_state, set_aside=False)  # another run's files
                mngr.close()
                if found is not None:
                    return found
    parent, name = os.path.split(path)
    if name.isdigit() and _is_dir(parent):
        mngr = _reader(parent)
        restored = mngr.restore(int(name), args=ocp.args.Composite(**_full_args(entries(abstract_state))))
        mngr.close()
        error = _verify_full(int(name), restored)
        if error is not None:
            raise CorruptCheckpointError(f"the checkpoint at {path} is unusable: {error}")
        return int(name), _like(restored[STATE], abstract_state), _split_meta(restored[META])[0]
    raise FileNotFoundError(f"no readable checkpoint at {path!r}")


def restore_params(path: str, abstract_params: Any, key: str = "params") -> tuple[int, Any]:
    """Only the parameters of a checkpoint (e.g. `config.init_from`, analysis of a run).

    `abstract_params` gives the target shapes, dtypes and shardings (a sub-tree is enough);
    `key` names the state entry to read ("teacher": DINO's EMA teacher). The optimizer state in
    the checkpoint is not read. The arrays read are verified against the saved checksums; a
    checkpoint that fails to read or verify is reported and the one before it is used.
    """
    path = _abs(path)
    directory = os.path.join(path, "checkpoints") if _is_dir(os.path.join(path, "checkpoints")) else path
    mngr = _reader(directory)
    args = {
        STATE: ocp.args.PyTreeRestore(
            item={key: abstract_params},
            restore_args=jax.tree.map(
                lambda x: ocp.ArrayRestoreArgs(sharding=getattr(x, "sharding", None)),
                {key: abstract_params},
            ),
            partial_restore=True,
        ),
        META: ocp.args.JsonRestore(),
    }

    def verify(step: int, restored: Any) -> str | None:
        return _verify(step, restored[STATE], _split_meta(restored[META])[1])

    skipped = []
    for step in sorted(mngr.all_steps(), reverse=True):
        error, restored = _restore_verified(mngr, step, args, verify)
        if error is not None:
            logging.error("Checkpoint at step %d is unreadable (%s); trying the previous one.", step, error)
            skipped.append(step)
            continue
        mngr.close()
        if skipped:
            logging.warning(
                "Using the parameters of step %d (unreadable: step %s).", step, ", ".join(map(str, skipped))
            )
        return step, restored[STATE][key]
    mngr.close()
    raise FileNotFoundError(f"no readable checkpoint with parameters at {path!r}")


def _metadata_reader(directory: str) -> ocp.CheckpointManager:
    """A read-only manager of `directory` that knows the items' handlers (for their metadata)."""
    return ocp.CheckpointManager(
        directory,
        item_handlers={STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
    )


def load_raw(workdir: str, step: int | None = None, verify: bool = True) -> tuple[int, Any]:
    """(step, state) of a checkpoint as saved, on this process's first device (inspection, tests).

    Shapes and dtypes come from the checkpoint's metadata, so a checkpoint written by any mesh
    or number of processes reads in one process. With `verify`, values that differ from the
    saved checksums raise CorruptCheckpointError.
    """
    mngr = _metadata_reader(os.path.join(_abs(workdir), "checkpoints"))
    step = max(mngr.all_steps()) if step is None else step
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), mngr.item_metadata(step)[STATE].tree
    )
    items = {STATE: ocp.args.StandardRestore(target)}
    if verify:
        items[META] = ocp.args.JsonRestore()
    restored = mngr.restore(step, args=ocp.args.Composite(**items))
    mngr.close()
    if verify:
        error = _verify_full(step, restored)
        if error is not None:
            raise CorruptCheckpointError(f"the checkpoint of step {step} in {workdir} is unusable: {error}")
    return step, restored[STATE]


def saved_config(workdir_or_checkpoint_dir: str, step: int | None = None) -> dict[str, Any] | None:
    """The config (`config.to_json()` parsed) saved with the newest (or the given) checkpoint.

    Accepts a workdir, its `checkpoints/` folder or one step folder. None when there is no
    checkpoint (of that step) or it holds no config. A newest checkpoint whose `meta` does not
    read is skipped for the one before it (when no step is given).
    """
    path = _abs(workdir_or_checkpoint_dir)
    parent, name = os.path.split(path.rstrip("/"))
    if _is_dir(os.path.join(path, "checkpoints")):
        directory = os.path.join(path, "checkpoints")
    elif name.isdigit() and _is_dir(os.path.join(path, META)):  # one step folder
        directory, step = parent, int(name) if step is None else step
    else:
        directory = path
    if not _is_dir(directory):
        return None
    mngr = _reader(directory)
    try:
        steps = sorted(mngr.all_steps(), reverse=True)
        if step is not None:
            steps = [s for s in steps if s == step]
        for s in steps:
            try:
                meta = mngr.restore(s, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
            except Exception as err:
                logging.warning("The meta of the checkpoint at step %d is unreadable (%s).", s, _one_line(err))
                continue
            config = (meta or {}).get("config")
            if config is None:
                return None
            return json.loads(config) if isinstance(config, str) else dict(config)
        return None
    finally:
        mngr.close()


def _metadata_tree(path: str) -> Any:
    """The state tree (shapes, dtypes) of the newest checkpoint at `path` (a workdir or its
    checkpoints/ folder), from the metadata alone (no array is read)."""
    path = _abs(path)
    directory = os.path.join(path, "checkpoints") if _is_dir(os.path.join(path, "checkpoints")) else path
    if not _is_dir(directory):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    mngr = _metadata_reader(directory)
    try:
        steps = mngr.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint at {path!r}")
        return mngr.item_metadata(max(steps))[STATE].tree
    finally:
        mngr.close()


def state_entries(path: str) -> list[str]:
    """The top-level state entries ('params', 'opt_state', 'batch_stats', ...) of the newest checkpoint at `path`."""
    return sorted(_metadata_tree(path))


def param_shapes(path: str, key: str = "params") -> dict[str, tuple[int, ...]]:
    """{'block_0/MlpBlock_0/Dense_0/kernel': shape, ...} of `state[key]` in the newest checkpoint
    at `path` (a workdir or its checkpoints/ folder), from the metadata alone (no array is read)."""
    tree = _metadata_tree(path)
    if key not in tree:
        raise ValueError(f"the checkpoint at {_abs(path)!r} has no {key!r} (it has {sorted(tree)})")
    from skipless_jax.sharding import path_str  # the names trainers and rules use

    return {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree[key])[0]}
