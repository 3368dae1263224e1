"""Orbax plumbing under the checkpoints: the item names, local and bucket paths, read-only
managers, and the array handler's replica-parallel threshold (registered at import)."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

STATE, META = "state", "meta"


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
