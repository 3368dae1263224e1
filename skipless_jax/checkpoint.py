"""Orbax checkpoints of the train state: async saves, keep-N, restore onto target shardings.

A checkpoint holds the whole train state pytree (step, params, optimizer state, RNG, the
non-finite counters) plus a small JSON `meta` item (the data position and the config). The
data a step sees depends only on (seed, step), so the step is the data iterator's state.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

STATE, META = "state", "meta"


def _abs(path: str) -> str:
    """Absolute local paths; bucket URLs (gs://...) unchanged."""
    return path if "://" in path else os.path.abspath(path)


def _is_dir(path: str) -> bool:
    return epath.Path(path).is_dir()  # local folders and buckets alike


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


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Starts an (async) save of `state` at `step`; a step already saved is skipped."""
    if step in mngr.all_steps():
        return
    mngr.save(
        step,
        args=ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
        ),
        force=True,
    )


def abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings, for `restore`."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


class IncompatibleCheckpointError(ValueError):
    """A readable checkpoint whose parameters do not match the model this config builds."""


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
    except Exception:  # noqa: BLE001 - no usable metadata: let the restore decide
        return
    wanted = _param_shapes(abstract_state["params"])
    if saved_shapes == wanted:
        return
    missing = sorted(set(wanted) - set(saved_shapes))
    extra = sorted(set(saved_shapes) - set(wanted))
    shape = sorted(k for k in set(wanted) & set(saved_shapes) if wanted[k] != saved_shapes[k])
    what = "; ".join(
        f"{label} {names[0]}{f' (+{len(names) - 1} more)' if len(names) > 1 else ''}"
        for label, names in (("not in the checkpoint:", missing), ("only in the checkpoint:", extra),
                             ("other shape:", shape)) if names
    )
    raise IncompatibleCheckpointError(
        f"the checkpoint of step {step} in {mngr.directory} was written for other parameters ({what}); "
        "resume it with the config that wrote it, or start in a new workdir"
    )


def restore_latest(
    mngr: ocp.CheckpointManager, abstract_state: Any, set_aside: bool = True
) -> Optional[tuple[int, Any, dict[str, Any]]]:
    """(step, state, meta) of the newest readable checkpoint, or None if there is none.

    A checkpoint that fails to read (truncated, corrupted) is reported and the one before it
    is tried, so a crash during a save never loses the run. With `set_aside`, the unreadable
    step folder is moved to `checkpoints_unreadable/` next to the manager's directory, so that
    the resumed run saves that step again (and keep-N never keeps it over a good one).
    A readable checkpoint written for other parameters raises IncompatibleCheckpointError and
    is left in place.
    """
    for step in sorted(mngr.all_steps(), reverse=True):
        _check_compatible(mngr, step, abstract_state)
        error = None
        try:
            restored = mngr.restore(
                step,
                args=ocp.args.Composite(
                    **{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
                ),
            )
        except Exception as err:  # noqa: BLE001 - any read failure means: try the previous one
            error = _one_line(err)
        if _everywhere(error is None):  # every process resumes from the same step
            return step, restored[STATE], dict(restored[META] or {})
        logging.error(
            "Checkpoint at step %d is unreadable (%s); trying the previous one.",
            step, error or "unreadable in another process",
        )
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


def restore_from_path(path: str, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
    """Restores from a workdir, its `checkpoints/` folder, or one step folder of another run."""
    path = _abs(path)
    candidates = [os.path.join(path, "checkpoints"), path]
    for directory in candidates:
        if _is_dir(directory):
            mngr = ocp.CheckpointManager(directory, item_names=(STATE, META), options=ocp.CheckpointManagerOptions(read_only=True, create=False))
            if mngr.all_steps():
                found = restore_latest(mngr, abstract_state, set_aside=False)  # another run's files
                mngr.close()
                if found is not None:
                    return found
    parent, name = os.path.split(path)
    if name.isdigit() and _is_dir(parent):
        mngr = ocp.CheckpointManager(parent, item_names=(STATE, META), options=ocp.CheckpointManagerOptions(read_only=True, create=False))
        restored = mngr.restore(
            int(name),
            args=ocp.args.Composite(
                **{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
            ),
        )
        mngr.close()
        return int(name), restored[STATE], dict(restored[META] or {})
    raise FileNotFoundError(f"no readable checkpoint at {path!r}")


def restore_params(path: str, abstract_params: Any, key: str = "params") -> tuple[int, Any]:
    """Only the parameters of a checkpoint (e.g. `config.init_from`, analysis of a run).

    `abstract_params` gives the target shapes, dtypes and shardings (a sub-tree is enough);
    `key` names the state entry to read ("teacher": DINO's EMA teacher). The optimizer state in
    the checkpoint is not read.
    """
    path = _abs(path)
    directory = os.path.join(path, "checkpoints") if _is_dir(os.path.join(path, "checkpoints")) else path
    mngr = ocp.CheckpointManager(directory, item_names=(STATE, META), options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            restored = mngr.restore(
                step,
                args=ocp.args.Composite(
                    **{STATE: ocp.args.PyTreeRestore(
                        item={key: abstract_params},
                        restore_args=jax.tree.map(
                            lambda x: ocp.ArrayRestoreArgs(sharding=getattr(x, "sharding", None)),
                            {key: abstract_params},
                        ),
                        partial_restore=True,
                    )}
                ),
            )
        except Exception as err:  # noqa: BLE001
            logging.error("Checkpoint at step %d is unreadable (%s); trying the previous one.", step, _one_line(err))
            continue
        mngr.close()
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


def load_raw(workdir: str, step: Optional[int] = None) -> tuple[int, Any]:
    """(step, state) of a checkpoint as saved, on this process's first device (inspection, tests).

    Shapes and dtypes come from the checkpoint's metadata, so a checkpoint written by any mesh
    or number of processes reads in one process.
    """
    mngr = _metadata_reader(os.path.join(_abs(workdir), "checkpoints"))
    step = max(mngr.all_steps()) if step is None else step
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), mngr.item_metadata(step)[STATE].tree
    )
    restored = mngr.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)}))
    mngr.close()
    return step, restored[STATE]
