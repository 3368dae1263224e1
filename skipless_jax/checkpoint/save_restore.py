"""A run's checkpoints: async saves, keep-N, and the restore of the newest good one onto the
target shardings, with one-line errors for a full disk and an incompatible checkpoint.

A checkpoint holds the train state (step, params, optimizer state, RNG, the non-finite
counters) plus a small JSON `meta` item (the data position, the config, and the state's
checksums, checkpoint/integrity.py). The data a step sees depends only on (seed, step), so the
step is the data iterator's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from skipless_jax.checkpoint import integrity

STATE, META = "state", "meta"


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
            good = _finished_in(os.path.join(abs_path(workdir), "checkpoints"))
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


def abs_path(path: str) -> str:
    """Absolute local paths; bucket URLs (gs://...) unchanged."""
    return path if "://" in path else os.path.abspath(path)


def is_dir(path: str) -> bool:
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
        os.path.join(abs_path(workdir), "checkpoints"),
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


def like(restored: Any, target: Any) -> Any:
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
    meta = dict(meta, **{integrity.CHECKSUMS: {"algorithm": integrity.ALGORITHM, "leaves": integrity.checksums(state)}})
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



def _param_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_compatible(mngr: ocp.CheckpointManager, step: int, abstract_state: Any) -> None:
    """Raises IncompatibleCheckpointError when the checkpoint's parameter names or shapes differ
    from `abstract_state`'s (a changed config resumed in an old workdir). Unreadable metadata
    passes: reading the checkpoint then fails and it is treated as corrupt."""
    try:
        reader = metadata_manager(str(mngr.directory))
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


def restore_verified(
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
        error = one_line(err)
    if not _everywhere(error is None):
        return error or "unreadable in another process", None
    error = verify(step, restored)
    if not _everywhere(error is None):
        return error or "corrupt in another process", None
    return None, restored


def full_args(abstract_state: Any) -> dict[str, Any]:
    return {STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}


def verify_full(step: int, restored: Any) -> str | None:
    return integrity.verify(step, restored[STATE], integrity.split_meta(restored[META])[1])


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
        error, restored = restore_verified(mngr, step, full_args(target), verify_full)
        if error is None:
            if skipped:
                logging.warning(
                    "Using the checkpoint of step %d (unreadable: step %s).", step, ", ".join(map(str, skipped))
                )
            return step, like(restored[STATE], abstract_state), integrity.split_meta(restored[META])[0]
        logging.error("Checkpoint at step %d is unreadable (%s); trying the previous one.", step, error)
        skipped.append(step)
        if set_aside:
            _set_aside(mngr, step)
    return None


def one_line(err: BaseException, limit: int = 300) -> str:
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



def read_only_manager(directory: str) -> ocp.CheckpointManager:
    """A read-only manager of another run's (or this run's) checkpoint folder."""
    return ocp.CheckpointManager(
        directory, item_names=(STATE, META), options=ocp.CheckpointManagerOptions(read_only=True, create=False)
    )



def metadata_manager(directory: str) -> ocp.CheckpointManager:
    """A read-only manager of `directory` that knows the items' handlers (for their metadata)."""
    return ocp.CheckpointManager(
        directory,
        item_handlers={STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
    )

