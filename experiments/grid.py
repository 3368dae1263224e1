"""A resumable grid of training runs, shared by the experiment scripts.

Each run is a key (its row in the results), a config file under configs/ and its args. Runs
execute one after another in this process, each in a temporary workdir; every finished run is
merged into one JSON file under a lock, so a rerun skips what is done and several processes
can share a grid: worker i of n takes the runs at positions i, i + n, ... (tiny models use one
core badly, so two workers on a 2-core machine finish in about half the time).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Run(NamedTuple):
    key: str
    config: str  # a file name under configs/, without .py
    arg: str  # the config's args, e.g. "depth=8,seed=1"


def load_config(name: str, arg: str | None = None) -> Any:
    """configs/<name>.py's get_config(arg), the file loaded as the sweep loads it."""
    from skipless_jax import sweep

    return sweep.load_config_module(os.path.join(ROOT, "configs", f"{name}.py")).get_config(arg)


def _default_record(metrics: dict[str, float], workdir: str, config: Any) -> dict[str, Any]:
    return {k: metrics[k] for k in ("test_accuracy", "test_loss", "train_loss")}


def merge_save(path: str, key: str, result: dict[str, Any]) -> dict[str, dict]:
    """Adds one run to the JSON file at `path` under a lock; returns every run in it."""
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = load(path)
        results[key] = result
        with open(f"{path}.tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(f"{path}.tmp", path)
    return results


def load(path: str) -> dict[str, dict]:
    return json.load(open(path)) if os.path.exists(path) else {}


def run_grid(
    path: str,
    runs: list[Run],
    *,
    configure: Callable[[Any], None] | None = None,
    record: Callable[[dict[str, float], str, Any], dict[str, Any]] = _default_record,
    worker: int = 0,
    workers: int = 1,
    keep_workdirs: str | None = None,
) -> dict[str, dict]:
    """Trains every run of this worker's share that `path` does not hold yet; returns all results.

    configure(config) adjusts each config before training (periodic checkpoints off is always
    set); record(final metrics, workdir, config) gives what is kept of a run (read the workdir
    there). keep_workdirs: a folder where each run's workdir (its last checkpoint) is kept as
    `workdir_of(keep_workdirs, key)`, for evaluations after training; None: temporary workdirs.
    """
    from skipless_jax import trainers

    if not 0 <= worker < workers:
        raise ValueError(f"worker={worker} must be in [0, workers={workers})")
    for run in runs[worker::workers]:
        if run.key in load(path):
            continue
        config = load_config(run.config, run.arg)
        config.checkpoint_every_steps = 0
        if configure is not None:
            configure(config)
        trainer = trainers.get(config.get("trainer", "supervised"))
        if keep_workdirs is None:
            with tempfile.TemporaryDirectory() as workdir:
                metrics = trainer.train_and_evaluate(config, workdir)
                result = record(metrics, workdir, config)
        else:
            workdir = workdir_of(keep_workdirs, run.key)
            metrics = trainer.train_and_evaluate(config, workdir)  # resumes a run cut short
            result = record(metrics, workdir, config)
        print(run.key, {k: round(v, 4) for k, v in result.items() if isinstance(v, float)}, flush=True)
        merge_save(path, run.key, result)
    return load(path)


def workdir_of(root: str, key: str) -> str:
    """The kept workdir of the run `key` under `root` (the key with path-unsafe characters replaced)."""
    return os.path.join(root, "".join(c if c.isalnum() or c in "-_.=" else "_" for c in key))


def add_worker_args(parser: Any) -> None:
    parser.add_argument("--worker", type=int, default=0, help="this process's index (runs i, i+n, ...)")
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the grid (one per core)")
