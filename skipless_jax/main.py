"""Entry point: `python -m skipless_jax.main --config=configs/X.py[:args] --workdir=DIR`.

Overrides: `--config.model.depth=8`. Multi-process: `--coordinator_address=HOST:PORT
--num_processes=N --process_id=I` (or the JAX_* environment, SLURM, Cloud TPU VMs).
"""

from __future__ import annotations

import importlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Config file, optionally with ':args'.", lock_config=False)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and logs go.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 in a multi-process run.")
flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
flags.mark_flags_as_required(["config", "workdir"])

# config.trainer -> the module whose `train_and_evaluate(config, workdir)` runs it.
TRAINERS = {"supervised": "skipless_jax.train", "dino": "skipless_jax.dino"}


class _ConsoleFilter:
    """Keeps the console to this project's and clu's lines, plus every warning and error."""

    def filter(self, record) -> bool:
        return record.levelno >= 30 or any(k in record.pathname for k in ("skipless_jax", "clu"))


def main(argv: list[str]) -> None:
    del argv
    logging.get_absl_handler().addFilter(_ConsoleFilter())
    from skipless_jax import checkpoint, distributed

    distributed.initialize(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes, flags.FLAGS.process_id)
    import jax

    config = flags.FLAGS.config
    trainer = config.get("trainer", "supervised")
    if trainer not in TRAINERS:
        sys.exit(f"error: config.trainer={trainer!r} is unknown; allowed: {sorted(TRAINERS)}")
    module = importlib.import_module(TRAINERS[trainer])
    try:  # configuration and missing-data errors: one line for the user, not a traceback
        module.check_config(config)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    try:
        metrics = module.train_and_evaluate(config, flags.FLAGS.workdir)
    except checkpoint.IncompatibleCheckpointError as err:  # a changed config in an old workdir
        sys.exit(f"error: {err}")
    if jax.process_index() == 0:
        summary = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("test_"))
        print(f"Final ({trainer}, step {metrics.get('step')}): {summary}", flush=True)
    logging.info("Done.")


if __name__ == "__main__":
    app.run(main)
