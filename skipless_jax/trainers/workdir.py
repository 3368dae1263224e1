"""The workdir at a run's start: whether it already holds a finished run (its final metrics,
decided once and broadcast), and the history a resumed run continues from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath

from skipless_jax import checkpoint
from skipless_jax.pretrained import check_saved_config
from skipless_jax.trainers.outcome import FINAL_METRICS


def read_final_metrics(workdir: str) -> dict[str, Any] | None:
    """The workdir's final metrics; None when the file is missing or unreadable (one warning naming it)."""
    path = epath.Path(workdir, FINAL_METRICS)
    if not path.exists():
        return None
    try:
        final = json.loads(path.read_text())
    except (ValueError, OSError) as err:
        logging.warning("%s is unreadable (%s); it is not used.", path, err)
        return None
    return final if isinstance(final, dict) else None


def open_workdir(
    config: ml_collections.ConfigDict, workdir: str, total_steps: int, allow_config_change: bool,
    derived: Mapping[str, Any] | None = None,
) -> tuple[Any, dict[str, Any] | None]:
    """(checkpoint manager of `workdir`, the final metrics if the run already finished there, else None).

    The saved config is compared first (`check_saved_config` with the trainer's `derived` values,
    in every process); whether the run
    finished is decided once, by process 0, and broadcast (`agreed`), so that no process resumes
    while another stops. A finished run's manager is closed.
    """
    mngr = checkpoint.manager(workdir, keep=config.get("keep_checkpoints", 3))
    finished = agreed(finished_run(config, workdir, mngr, total_steps, allow_config_change, derived))
    if finished is not None:
        logging.info("%s already finished at step %d; its final metrics are unchanged.", workdir, total_steps)
        mngr.close()
    return mngr, finished


def agreed(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Process 0's `value` (a JSON dict or None) in every process; itself with one process."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    padded = np.zeros(size, np.uint8)
    padded[: min(size, len(data))] = data[:size]
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(padded)).astype(np.uint8).tobytes())


def finished_run(
    config: ml_collections.ConfigDict, workdir: str, mngr: Any, total_steps: int, allow_config_change: bool,
    derived: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Before anything is restored: the saved config must match (`check_saved_config`); then the
    final metrics of a run that already reached `total_steps` in `workdir`, else None."""
    changed = check_saved_config(config, workdir, allow_config_change, derived)
    final = read_final_metrics(workdir)
    if (
        changed
        or final is None
        or final.get("step") != total_steps
        or not set(final) - {"step"}  # `{"step": N}`: what a rerun wrote before final_evaluation existed
        or max(mngr.all_steps(), default=None) != total_steps
    ):
        return None
    return final


def truncate_history(path: epath.Path, last_step: int) -> None:
    """Keeps the records of `path` up to `last_step` (a resumed run's checkpoint), once at start;
    a line cut short by a crash is dropped."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(f"{line}\n" for line in kept))


def resumed_core_hours(path: epath.Path, key: str = "perf/core_hours") -> float:
    """The `key` (perf/core_hours or perf/core_hours_total) of the last record of `path` (history
    truncated to the resumed checkpoint), which a resumed run continues; 0.0 without one. The
    time between that record and the checkpoint is not counted (at most a log period's)."""
    if not path.exists():
        return 0.0
    hours = 0.0
    for line in path.read_text().splitlines():
        hours = json.loads(line).get(key, hours)
    return float(hours)
