"""Reading another run's checkpoints (or this run's, from outside it): the newest good state or
only its parameters, the raw saved state, the saved config, and the state's entries and shapes
from the metadata alone. Used by `evaluate`, `export`, `analyze`, `init_from` and the converters.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from skipless_jax.checkpoint import integrity, orbax_io, save_restore
from skipless_jax.checkpoint.orbax_io import META, STATE
from skipless_jax.checkpoint.save_restore import CorruptCheckpointError


def restore_from_path(path: str, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
    """Restores from a workdir, its `checkpoints/` folder, or one step folder of another run.

    A workdir or folder: its newest good checkpoint (as `restore_latest`, nothing moved). One
    step folder: that step, or CorruptCheckpointError when its values differ from the saved ones.
    """
    path = orbax_io.abs_path(path)
    candidates = [os.path.join(path, "checkpoints"), path]
    for directory in candidates:
        if orbax_io.is_dir(directory):
            mngr = orbax_io.read_only_manager(directory)
            if mngr.all_steps():
                found = save_restore.restore_latest(mngr, abstract_state, set_aside=False)  # another run's files
                mngr.close()
                if found is not None:
                    return found
    parent, name = os.path.split(path)
    if name.isdigit() and orbax_io.is_dir(parent):
        mngr = orbax_io.read_only_manager(parent)
        args = save_restore.full_args(save_restore.entries(abstract_state))
        restored = mngr.restore(int(name), args=ocp.args.Composite(**args))
        mngr.close()
        error = save_restore.verify_restored(int(name), restored)
        if error is not None:
            raise CorruptCheckpointError(f"the checkpoint at {path} is unusable: {error}")
        return int(name), save_restore.like(restored[STATE], abstract_state), integrity.split_meta(restored[META])[0]
    raise FileNotFoundError(f"no readable checkpoint at {path!r}")


def restore_params(path: str, abstract_params: Any, key: str = "params") -> tuple[int, Any]:
    """Only the parameters of a checkpoint (e.g. `config.init_from`, analysis of a run).

    `abstract_params` gives the target shapes, dtypes and shardings (a sub-tree is enough);
    `key` names the state entry to read ("teacher": DINO's EMA teacher). The optimizer state in
    the checkpoint is not read. The arrays read are verified against the saved checksums; a
    checkpoint that fails to read or verify is reported and the one before it is used.
    """
    path = orbax_io.abs_path(path)
    directory = os.path.join(path, "checkpoints") if orbax_io.is_dir(os.path.join(path, "checkpoints")) else path
    mngr = orbax_io.read_only_manager(directory)
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

    skipped = []
    for step in sorted(mngr.all_steps(), reverse=True):
        error, restored = save_restore.restore_verified(mngr, step, args, save_restore.verify_restored)
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



def load_raw(workdir: str, step: int | None = None, verify: bool = True) -> tuple[int, Any]:
    """(step, state) of a checkpoint as saved, on this process's first device (inspection, tests).

    Shapes and dtypes come from the checkpoint's metadata, so a checkpoint written by any mesh
    or number of processes reads in one process. With `verify`, values that differ from the
    saved checksums raise CorruptCheckpointError.
    """
    mngr = orbax_io.metadata_manager(os.path.join(orbax_io.abs_path(workdir), "checkpoints"))
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
        error = save_restore.verify_restored(step, restored)
        if error is not None:
            raise CorruptCheckpointError(f"the checkpoint of step {step} in {workdir} is unusable: {error}")
    return step, restored[STATE]


def saved_config(workdir_or_checkpoint_dir: str, step: int | None = None) -> dict[str, Any] | None:
    """The config (`config.to_json()` parsed) saved with the newest (or the given) checkpoint.

    Accepts a workdir, its `checkpoints/` folder or one step folder. None when there is no
    checkpoint (of that step) or it holds no config. A newest checkpoint whose `meta` does not
    read is skipped for the one before it (when no step is given).
    """
    path = orbax_io.abs_path(workdir_or_checkpoint_dir)
    parent, name = os.path.split(path.rstrip("/"))
    if orbax_io.is_dir(os.path.join(path, "checkpoints")):
        directory = os.path.join(path, "checkpoints")
    elif name.isdigit() and orbax_io.is_dir(os.path.join(path, META)):  # one step folder
        directory, step = parent, int(name) if step is None else step
    else:
        directory = path
    if not orbax_io.is_dir(directory):
        return None
    mngr = orbax_io.read_only_manager(directory)
    try:
        steps = sorted(mngr.all_steps(), reverse=True)
        if step is not None:
            steps = [s for s in steps if s == step]
        for s in steps:
            try:
                meta = mngr.restore(s, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
            except Exception as err:
                logging.warning("The meta of the checkpoint at step %d is unreadable (%s).", s,
                                save_restore.one_line(err))
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
    path = orbax_io.abs_path(path)
    directory = os.path.join(path, "checkpoints") if orbax_io.is_dir(os.path.join(path, "checkpoints")) else path
    if not orbax_io.is_dir(directory):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    mngr = orbax_io.metadata_manager(directory)
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
        raise ValueError(f"the checkpoint at {orbax_io.abs_path(path)!r} has no {key!r} (it has {sorted(tree)})")
    from skipless_jax.sharding import path_str  # the names trainers and rules use

    return {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree[key])[0]}
