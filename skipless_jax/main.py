"""Entry point: `python -m skipless_jax.main --config=configs/X.py[:args] --workdir=DIR`.

Overrides: `--config.model.depth=8`, `--config.mesh.fsdp=8` (FSDP over 8 devices). Multi-process:
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or the JAX_* environment,
SLURM, Cloud TPU VMs).

A workdir resumes from its newest checkpoint, which must have been written by the same config;
`--allow_config_change` resumes it under a deliberately changed config (e.g. a longer schedule).

Exit status: 0 finished; 1 a bad config or data, or a checkpoint written by another config;
2 a bad command line (flags, config file, `:args`, overrides), one `error: ...` line each;
75 preempted (SIGTERM or a preemption notice): the step was saved, rerun the same command.
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Config file, optionally with ':args'.", lock_config=False)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and logs go (required).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 in a multi-process run.")
flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
flags.DEFINE_bool(
    "allow_config_change", False,
    "Resume a workdir whose checkpoint another config wrote (a deliberate change, e.g. a longer schedule).",
)

EXIT_USAGE = 2  # a bad command line, as argparse and the launchers exit
_HELP_FLAGS = ("--help", "-help", "--helpshort", "-helpshort", "--helpfull", "-helpfull", "--helpxml", "-helpxml", "-?")


class _ConsoleFilter:
    """Keeps the console to this project's and clu's lines, plus every warning and error."""

    def filter(self, record) -> bool:
        return record.levelno >= 30 or any(k in record.pathname for k in ("skipless_jax", "clu"))


def usage_error(message: str) -> NoReturn:
    """One `error: ...` line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and what caused it, outermost first (a context suppressed by `from None` ends it)."""
    out = [err]
    while len(out) < 20:
        e = out[-1]
        nxt = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if nxt is None or nxt in out:
            break
        out.append(nxt)
    return out


def _text(err: BaseException) -> str:
    # A KeyError's str() is the repr of its message; its first argument is the message itself.
    return str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _config_spec(argv: list[str]) -> str | None:
    """The value of --config on the command line (`--config=X` or `--config X`), last one wins."""
    spec = None
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            spec = arg.partition("=")[2]
        elif arg == "--config" and i + 1 < len(argv):
            spec = argv[i + 1]
    return spec


def _config_file_error(spec: str | None) -> str | None:
    path = (spec or "").split(":", 1)[0]
    if spec is not None and not os.path.isfile(path):
        return f"--config={spec}: no such config file {path!r}" if path else "--config= names no config file"
    return None


def _culprit(err: BaseException, argv: list[str]) -> str | None:
    """The override on the command line that an error is about, when it can be told."""
    overrides = [a for a in argv if a.startswith("--config.")]
    text = _text(err)
    field = re.search(r"\bconfig\.([\w.]+)", text)
    for arg in overrides:
        path = arg[2:].partition("=")[0]
        if field and (path == f"config.{field.group(1)}" or path.startswith(f"config.{field.group(1)}.")):
            return arg
    key = re.match(r"\W*(\w+)'", text) if isinstance(err, (KeyError, AttributeError)) else None
    for arg in overrides:  # a missing field's error names the key only
        if key and key.group(1) in arg[2:].partition("=")[0].split(".")[1:]:
            return arg
    return None


def flag_error_line(err: BaseException, argv: list[str]) -> str:
    """The one line that says what is wrong with the command line, from a parsing exception.

    absl and ml_collections wrap the useful message (an unknown `:arg`, a misspelt override
    key, a bad value) in other exceptions, some with a whole traceback inside their text: this
    takes the innermost message that is not such a wrapper, unless an outer one says more.
    """
    chain = _chain(err)
    if any(isinstance(e, OSError) for e in chain):  # e.g. an override of a config that did not load
        missing = _config_file_error(_config_spec(argv))
        if missing:
            return missing
    chain = [e for e in chain if "Traceback (most recent call last)" not in str(e)] or [err]
    best = chain[-1]
    for outer in reversed(chain[:-1]):  # an outer message that contains the inner one adds to it
        if _text(best) in _text(outer):
            best = outer
    text = _text(best)
    if isinstance(best, (KeyError, AttributeError)):
        lines = [line.strip().strip('"') for line in text.splitlines() if line.strip()]
        text = "no such field " + "; ".join(lines)
    elif not isinstance(best, (ValueError, flags.Error)):
        text = f"{type(best).__name__}: {text}"
    text = _one_line(text).split(" Currently supported types are:")[0]  # ml_collections' list of types
    if "--" not in text.partition(":")[0]:
        culprit = _culprit(best, argv)
        if culprit is None and ("config file" in str(err) or any("config arg" in str(e) for e in chain)):
            spec = _config_spec(argv)
            culprit = None if spec is None else f"--config={spec}"
        if culprit:
            text = f"{culprit}: {text}"
    if isinstance(best, flags.UnrecognizedFlagError):
        text += " (see --help)"
    return text


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with every error one line and exit status 2, and --help exiting 0."""
    cut = argv.index("--") if "--" in argv else len(argv)
    argv = [("--help" if a == "-h" else a) if i < cut else a for i, a in enumerate(argv)]
    try:
        return flags.FLAGS(argv)
    except SystemExit as exit_:  # absl's --help prints the usage, then exits with status 1
        if exit_.code == 1 and any(a in _HELP_FLAGS or a.startswith(("--help=", "--helpfull=")) for a in argv[1:cut]):
            sys.exit(0)
        raise
    except Exception as err:
        usage_error(flag_error_line(err, argv))


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
        usage_error(_config_file_error(spec) or f"--config={spec}: {_one_line(str(_chain(err)[-1]))}")
    workdir = flags.FLAGS.workdir
    if workdir is None:
        usage_error("--workdir=DIR is required: where checkpoints, metrics and logs go (see --help)")
    if not workdir.strip():
        usage_error(f"--workdir={workdir!r} is empty; it must name a directory for checkpoints, metrics and logs")


def main(argv: list[str]) -> None:
    check_flags(argv)
    logging.get_absl_handler().addFilter(_ConsoleFilter())
    from skipless_jax import distributed

    try:
        distributed.initialize(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes, flags.FLAGS.process_id)
    except ValueError as err:  # inconsistent multi-process flags
        usage_error(str(err))
    import jax

    from skipless_jax import checkpoint, compilation_cache, trainers
    from skipless_jax.trainers.nonfinite import NonFiniteError
    from skipless_jax.trainers.perf import DoesNotFit
    from skipless_jax.trainers.run import EXIT_PREEMPTED, Preempted

    config = flags.FLAGS.config
    trainer = config.get("trainer", "supervised")
    try:  # configuration and missing-data errors: one line for the user, not a traceback
        compilation_cache.setup(config)  # before anything compiles
        module = trainers.get(trainer)
        module.check_config(config)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    try:
        metrics = module.train_and_evaluate(
            config, flags.FLAGS.workdir, allow_config_change=flags.FLAGS.allow_config_change
        )
    except (
        checkpoint.IncompatibleCheckpointError, checkpoint.CorruptCheckpointError, NonFiniteError, DoesNotFit
    ) as err:
        sys.exit(f"error: {err}")
    except Preempted as err:  # saved and stopped: not finished, so no final metrics
        print(
            f"Preempted at step {err.step}: checkpoint saved in {flags.FLAGS.workdir}; "
            f"rerun the same command to resume (exit status {EXIT_PREEMPTED}).",
            file=sys.stderr, flush=True,
        )
        sys.exit(EXIT_PREEMPTED)
    if jax.process_index() == 0:
        summary = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())
                            if not k.startswith("train_") and k != "step" and isinstance(v, (int, float)))
        print(f"Final ({trainer}, step {metrics.get('step')}): {summary}", flush=True)
    logging.info("Done.")


def run() -> None:
    """`python -m skipless_jax.main`: absl's app.run with the one-line flag errors."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
