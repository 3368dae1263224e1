"""Entry point: `python -m skipless_jax.main --config=configs/X.py[:args] --workdir=DIR`.

Overrides: `--config.model.depth=8`, `--config.mesh.fsdp=8` (FSDP over 8 devices). Multi-process:
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or the JAX_* environment,
SLURM, Cloud TPU VMs).

A workdir resumes from its newest checkpoint, which must have been written by the same config;
`--allow_config_change` resumes it under a deliberately changed config (e.g. a longer schedule).

Exit status: 0 finished; 1 missing data, a failed run, a checkpoint written by another config, or
a workdir another run holds (one line naming its host, pid and start time; a lock whose holder is
gone is taken over, skipless_jax/workdir_lock.py);
2 a bad command line or config value (flags, config file, `:args`, overrides, a value the
config checks refuse), one `error: ...` line each (cli.exit_status);
75 preempted (SIGTERM or a preemption notice): the step was saved, rerun the same command;
130 interrupted (Ctrl-C): the first saves the step it is at and exits 130 (rerun to resume), a
second exits at once. A --workdir that is a file or not writable, a missing `config.init_from`,
and a full disk during a save are one line each (the last keeps the last good checkpoint, status 1).

The console shows the settings once, progress with ETA, evaluations, checkpoint saves and the
warnings that matter; `--verbosity=1` adds the libraries' own lines (skipless_jax/cli.py). Process
0 appends the same lines (and the final or error line) to `DIR/console.log`. A workdir whose lock
names a live holder is refused before JAX loads (a single-process run; a multi-process one asks
in process 0 after it starts).
"""

from __future__ import annotations

import os
import sys

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from skipless_jax import cli, workdir_lock
from skipless_jax.cli import cause_chain, config_file_error, one_line, parse_flags, quiet_console, usage_error

config_flags.DEFINE_config_file("config", None, "Config file, optionally with ':args'.", lock_config=False)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and logs go (required).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 in a multi-process run.")
flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
flags.DEFINE_bool(
    "allow_config_change", False,
    "Resume a workdir whose checkpoint another config wrote (a deliberate change, e.g. a longer schedule).",
)


def check_flags(argv: list[str]) -> None:
    """What the flag definitions cannot say: required values, a loadable config file, no stray words."""
    if len(argv) > 1:
        usage_error(f"unexpected argument {argv[1]!r}; flags are written --name=value (see --help)")
    if flags.FLAGS.config is None:
        usage_error("--config=FILE[:ARGS] is required, e.g. --config=configs/quickstart.py (see --help)")
    spec = config_flags.get_config_filename(flags.FLAGS["config"])
    try:
        flags.FLAGS.config.get("trainer")
    except OSError as err:  # ml_collections defers a file that failed to load to the first access
        usage_error(config_file_error(spec) or f"--config={spec}: {one_line(str(cause_chain(err)[-1]))}")
    workdir = flags.FLAGS.workdir
    if workdir is None:
        usage_error("--workdir=DIR is required: where checkpoints, metrics and logs go (see --help)")
    if not workdir.strip():
        usage_error(f"--workdir={workdir!r} is empty; it must name a directory for checkpoints, metrics and logs")
    check_workdir(workdir)
    if one_process():  # a busy workdir: refused now, not after JAX and the trainer load (~10 s)
        try:
            workdir_lock.check_free(workdir)
        except workdir_lock.WorkdirBusy as err:
            sys.exit(f"error: {err}")


# What makes a run span processes (distributed.py; each of its processes shares the workdir, whose
# lock process 0 holds): any of these, and the flags, leave the lock to lock_workdir.
_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
                      "TPU_WORKER_HOSTNAMES")


def one_process() -> bool:
    """Whether nothing on the command line or in the environment starts a multi-process run."""
    f = flags.FLAGS
    return (f.coordinator_address is None and f.num_processes in (None, 1) and not f.process_id
            and not any(k in os.environ for k in _MULTI_PROCESS_ENV))


def check_workdir(workdir: str) -> None:
    """A local --workdir that cannot hold a run: one line naming the path and why (a bucket URL
    is not checked here). Nothing is created."""
    cli.check_writable("--workdir", workdir)


def check_sources(config: ml_collections.ConfigDict) -> None:
    """`config.resume` / `config.init_from` naming a local path without a checkpoint: ValueError
    naming the field and the path, before the workdir is created or anything compiles."""
    from skipless_jax import checkpoint

    for field in ("resume", "init_from"):
        path = config.get(field)
        if not path or "://" in str(path):
            continue
        if not os.path.exists(path):
            raise ValueError(f"config.{field}={path!r}: no such file or directory")
        if field == "init_from":
            try:
                checkpoint.state_entries(path)
            except FileNotFoundError as err:
                raise ValueError(f"config.{field}={path!r}: {err}") from None


def main(argv: list[str]) -> None:
    check_flags(argv)
    quiet_console()
    cli.hold_console()  # for DIR/console.log, which process 0 opens once the workdir is locked
    from skipless_jax import distributed

    try:
        distributed.initialize(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes, flags.FLAGS.process_id)
    except ValueError as err:  # inconsistent multi-process flags
        usage_error(str(err))
    import jax

    from skipless_jax import compilation_cache, trainers

    config = flags.FLAGS.config
    trainer = trainers.name_of(config)
    try:  # configuration and missing-data errors: one line for the user, not a traceback
        compilation_cache.setup(config)  # before anything compiles
        module = trainers.get(trainer)
        module.check_config(config)
        check_sources(config)
        distributed.check_shared_workdir(flags.FLAGS.workdir)  # multi-process: one line, not a hang
        lock_workdir(flags.FLAGS.workdir)
    except (ValueError, FileNotFoundError, workdir_lock.WorkdirBusy) as err:
        cli.fail(err)  # a bad config value: status 2; missing data or a busy workdir: 1
    if jax.process_index() == 0:  # the console from here on, also in the workdir
        cli.copy_console(os.path.join(flags.FLAGS.workdir, cli.CONSOLE_LOG))
    try:
        metrics = train(module, config)
    except SystemExit as stop:  # its one line (printed as the interpreter exits), in the copy too
        if isinstance(stop.code, str):
            cli.copy_line(stop.code)
        raise
    finally:
        workdir_lock.release(flags.FLAGS.workdir)
    if jax.process_index() == 0:
        cli.echo(f"Final ({trainer}, step {metrics.get('step')}): {final_summary(metrics)}")
    logging.info("Done.")


def final_summary(metrics: dict) -> str:
    """'name=value, ...' of the final metrics but the train ones: floats to 4 decimals, integers
    (an LM's corpus statistics) as they are."""
    return ", ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.4f}" for k, v in sorted(metrics.items())
                     if not k.startswith("train_") and k != "step" and isinstance(v, (int, float)))


def lock_workdir(workdir: str) -> None:
    """Process 0 takes the workdir's lock (skipless_jax/workdir_lock.py; the processes of one run
    share the workdir); every process raises the same WorkdirBusy when another run holds it.
    A bucket URL is not locked (object stores have no exclusive create through gfile): one
    warning line says so."""
    import jax

    from skipless_jax.trainers.workdir import agreed

    if "://" in workdir:
        logging.warning("--workdir=%s is a bucket: it is not locked against a second run; start one run per "
                        "workdir.", workdir)
        return
    busy = None
    if jax.process_index() == 0:
        try:
            workdir_lock.acquire(workdir)
        except workdir_lock.WorkdirBusy as err:
            busy = {"error": str(err)}
    busy = agreed(busy)
    if busy is not None:
        raise workdir_lock.WorkdirBusy(busy["error"])


def train(module, config: ml_collections.ConfigDict) -> dict:
    """The trainer's run, with every way it stops (but a finish) as one line and its exit status."""
    from skipless_jax import checkpoint
    from skipless_jax.trainers.devices import DoesNotFit
    from skipless_jax.trainers.nonfinite import NonFiniteError
    from skipless_jax.trainers.outcome import EXIT_INTERRUPTED, EXIT_PREEMPTED
    from skipless_jax.trainers.run import Preempted

    try:
        metrics = module.train_and_evaluate(
            config, flags.FLAGS.workdir, allow_config_change=flags.FLAGS.allow_config_change
        )
    except (
        checkpoint.IncompatibleCheckpointError, checkpoint.CorruptCheckpointError, NonFiniteError, DoesNotFit,
        checkpoint.DiskFullError,
    ) as err:
        sys.exit(f"error: {err}")
    except Preempted as err:  # saved and stopped: not finished, so no final metrics
        status = EXIT_INTERRUPTED if err.interrupted else EXIT_PREEMPTED
        cli.echo(
            f"{'Interrupted' if err.interrupted else 'Preempted'} at step {err.step}: checkpoint saved in "
            f"{flags.FLAGS.workdir}; rerun the same command to resume (exit status {status}).",
            file=sys.stderr,
        )
        sys.exit(status)
    except KeyboardInterrupt:  # Ctrl-C before the loop watches for it (or in a multi-process run)
        cli.echo("Interrupted before anything was saved (exit status 130).", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as err:  # a full disk under another write: the trace, history, event files, final metrics
        full = checkpoint.disk_full_write(err, flags.FLAGS.workdir)
        if full is None:
            raise
        sys.exit(f"error: {full}")
    return metrics


def run() -> None:
    """`python -m skipless_jax.main`: absl's app.run with the one-line flag errors."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
