"""Orbax checkpoints of the train state.

- `save_restore`: a run's own checkpoints (the manager, `save`, `restore_latest`), the one a
  training run reads.
- `integrity`: the per-array checksums saved with each checkpoint and verified at every restore.
- `disk_full`: a full disk as one line naming the last good checkpoint.
- `orbax_io`: orbax plumbing (item names, paths, read-only managers, the array handler).
- `read`: another run's checkpoints, read by the tools (`evaluate`, `export`, `analyze`,
  `init_from`, the converters).
"""

from skipless_jax.checkpoint.disk_full import DiskFullError, disk_full_as_one_error, disk_full_write
from skipless_jax.checkpoint.integrity import checksums
from skipless_jax.checkpoint.orbax_io import META, STATE
from skipless_jax.checkpoint.read import (
    load_raw,
    param_shapes,
    restore_from_path,
    restore_params,
    saved_config,
    state_entries,
)
from skipless_jax.checkpoint.save_restore import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    abstract,
    entries,
    manager,
    restore_latest,
    save,
)

__all__ = [
    "META", "STATE", "CorruptCheckpointError", "DiskFullError", "IncompatibleCheckpointError", "abstract",
    "checksums", "disk_full_as_one_error", "disk_full_write", "entries", "load_raw", "manager", "param_shapes",
    "restore_from_path", "restore_latest", "restore_params", "save", "saved_config", "state_entries",
]
