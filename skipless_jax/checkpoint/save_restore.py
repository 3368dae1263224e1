"""A run's checkpoints: async saves, keep-N, and the restore of the newest good one onto the
target shardings; a checkpoint written for other parameters is a one-line error.

A checkpoint holds the train state (step, params, optimizer state, RNG, the non-finite
counters) plus a small JSON `meta` item (the data position, the config, and the state's
checksums, checkpoint/integrity.py). The data a step sees depends only on (seed, step), so the
step is the data iterator's state.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from skipless_jax.checkpoint import integrity
from skipless_jax.checkpoint.disk_full import disk_full_as_one_error
from skipless_jax.checkpoint.orbax_io import META, STATE, abs_path, metadata_manager


class IncompatibleCheckpointError(ValueError):
    """A readable checkpoint whose parameters do not match the model this config builds."""

    exit_status = 1  # the run cannot go on (cli.exit_status), not a bad value on the command line


class CorruptCheckpointError(ValueError):
    """A checkpoint whose restored values differ from the ones saved (their checksums)."""

    exit_status = 1


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


def verify_restored(step: int, restored: Any) -> str | None:
    """`integrity.verify` of a restore's {STATE: the (whole or partial) state, META: meta}."""
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
        error, restored = restore_verified(mngr, step, full_args(target), verify_restored)
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
