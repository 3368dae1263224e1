"""What the command lines share: absl's flag parsing with every error one line and exit status 2
(`--help` exits 0), the folders they write (one line for one that cannot be written), and the
quiet console log (and its copy in a run's workdir).

    app.run(main, flags_parser=cli.parse_flags)      # in `if __name__ == "__main__":`
    cli.quiet_console()                              # first thing in main(argv)
    cli.check_writable("--output", out)              # before the work: exit 2 if it cannot be written
    with cli.writing("--output", out): ...           # the writes: an OSError is one line, exit 2 (full: 1)

The console at the default verbosity keeps this project's own lines (settings, progress with
ETA, evaluations, checkpoint saves) and the warnings and errors of other libraries, except
orbax's bookkeeping (its warnings: at --verbosity=1) and what libraries say after a full disk
(the run ends with its own one line; tensorstore's late "Event loop is closed" tracebacks too);
the logging writer's scalar dumps (trainers/writers.py) and TensorFlow's C++ notices at import
(when something loads it: a tfds dataset, clu's writer of a remote workdir) appear only with
`--verbosity=1` (absl's `-v 1`), which shows everything. Imports absl only, so that `--help`
answers before JAX or TensorFlow load.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.abc
import importlib.machinery
import logging as std_logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from absl import flags, logging

EXIT_USAGE = 2  # a bad command line, as argparse and the launchers exit; a folder that cannot be written
EXIT_DISK_FULL = 1  # a write that found the disk full (main: a save that failed for lack of space)
_HELP_FLAGS = ("--help", "-help", "--helpshort", "-helpshort", "--helpfull", "-helpfull", "--helpxml", "-helpxml", "-?")


def exit_status(err: BaseException) -> int:
    """The exit status of a one-line error: 2 for a bad value the user gave (a ValueError: a flag,
    a config arg, an override, a config field; as for a bad command line), 1 for what failed
    (missing data, a damaged or foreign checkpoint, a busy workdir); an error class may set its own
    `exit_status`."""
    return getattr(err, "exit_status", EXIT_USAGE if isinstance(err, ValueError) else 1)


def fail(err: BaseException) -> NoReturn:
    """One `error: ...` line on stderr (copied to the console log when one is open), then exit with
    `exit_status(err)`."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    copy_line(f"error: {err}")
    sys.exit(exit_status(err))


def usage_error(message: str) -> NoReturn:
    """One `error: ...` line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def cause_chain(err: BaseException) -> list[BaseException]:
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


def one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def config_spec(argv: list[str]) -> str | None:
    """The value of --config on the command line (`--config=X` or `--config X`), last one wins."""
    spec = None
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            spec = arg.partition("=")[2]
        elif arg == "--config" and i + 1 < len(argv):
            spec = argv[i + 1]
    return spec


def config_file_error(spec: str | None) -> str | None:
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
    chain = cause_chain(err)
    if any(isinstance(e, OSError) for e in chain):  # e.g. an override of a config that did not load
        missing = config_file_error(config_spec(argv))
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
    text = one_line(text).split(" Currently supported types are:")[0]  # ml_collections' list of types
    if "--" not in text.partition(":")[0]:
        culprit = _culprit(best, argv)
        if culprit is None and ("config file" in str(err) or any("config arg" in str(e) for e in chain)):
            spec = config_spec(argv)
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


def unwritable(path: str) -> str | None:
    """Why the local folder `path` (made if missing) cannot be written, naming the nearest path
    that exists: '<p> is a file, not a directory' or '<p> is not writable (a read-only file
    system | permission denied)'; None where it can be (or for a bucket URL: not checked)."""
    if "://" in path:
        return None
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the folder that will hold it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "permission denied"
        return f"{existing} is not writable ({why})"
    return None


def check_writable(flag: str, path: str, file: bool = False) -> None:
    """`--flag=path`, a folder a command will write into (`file`: a file, whose folder is
    checked), that cannot be written: one `error:` line, exit status 2 (as main's unwritable
    --workdir). Nothing is created."""
    why = unwritable(os.path.dirname(os.path.abspath(path)) if file else path)
    if why:
        usage_error(f"{flag}={path}: {why}")


def write_error(err: OSError, flag: str, path: str) -> tuple[str, int]:
    """(the one line, the exit status) of a write under `--flag=path` that raised `err`: a full
    disk (ENOSPC, or a save's DiskFullError) exits 1 as main's failed save; a read-only folder, a
    file where a folder goes or a refused permission exit 2 as main's unwritable --workdir."""
    text = one_line(str(err))
    if "disk is full" in text:  # a save's DiskFullError says it all
        return f"{flag}={path}: {text}", EXIT_DISK_FULL
    if err.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in text:
        return (f"{flag}={path}: the disk is full: writing {err.filename or f'a file in {path}'} failed "
                "(No space left on device)"), EXIT_DISK_FULL
    target = err.filename or path
    why = unwritable(target if err.errno in (errno.ENOTDIR, errno.EEXIST) else os.path.dirname(target) or path)
    return f"{flag}={path}: {why or f'writing {target} failed ({err.strerror or text})'}", EXIT_USAGE


@contextlib.contextmanager
def writing(flag: str, path: str) -> Iterator[None]:
    """The block's writes under `--flag=path`: an OSError there (but FileNotFoundError, a missing
    input) is `write_error`'s one `error:` line on stderr and its exit status, not a traceback."""
    try:
        yield
    except FileNotFoundError:  # a missing input: the command's own one line
        raise
    except OSError as err:
        sys.exit(say_write_error(err, flag, path))


def say_write_error(err: OSError, flag: str, path: str) -> int:
    """Prints `write_error`'s line on stderr as `error: ...`; returns its exit status."""
    line, status = write_error(err, flag, path)
    print(f"error: {line}", file=sys.stderr, flush=True)
    return status


# Library records kept on the console at the default verbosity: this Python level or above.
_LIBRARY_MIN_LEVEL = {"orbax": std_logging.ERROR}  # other libraries: WARNING
# The logging writer's '[step] name=value, ...' lines: every scalar again (TensorBoard and
# history.jsonl have them). Its '[Hyperparameters] {...}' (the settings, once) and the progress
# line ('Progress: 2.5 steps/s, 77.9% (700/899), ETA: 1m', same module) stay.
_SCALARS = "/skipless_jax/trainers/writers.py"


# A library's record that says the disk is full: the run stops with its own one line
# (checkpoint.DiskFullError), so the libraries' records from then on are not shown.
_DISK_FULL = ("No space left on device", "RESOURCE_EXHAUSTED: Error writing")


class ConsoleFilter:
    """This project's records (but the scalar dumps), the settings and progress lines, other
    libraries' warnings and errors (orbax's errors only; none after one that says the disk is full)."""

    def __init__(self):
        self.disk_full = False

    def filter(self, record: std_logging.LogRecord) -> bool:
        path = record.pathname.replace(os.sep, "/")
        if path.endswith(_SCALARS) and str(record.msg).startswith("[%d]"):
            return False
        if "/skipless_jax/" in path:
            return True
        if self.disk_full or any(k in record.getMessage() for k in _DISK_FULL):
            self.disk_full = True
            return False
        level = next((v for k, v in _LIBRARY_MIN_LEVEL.items() if f"/{k}/" in path), std_logging.WARNING)
        if record.levelno < level:
            return False
        # A library's error is one line; its traceback comes back as the exception this project reports.
        record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def _stderr_fd_muted():
    """File descriptor 2 to /dev/null (C++ libraries write there directly), sys.stderr flushed first."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _MutedTensorFlowImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The first import of TensorFlow, by whatever imports it (tfds, clu's remote writer), with
    file descriptor 2 muted in the main thread: its C++ notices at import (oneDNN, absl's
    pre-initialization warning, CPU features) ignore TF_CPP_MIN_LOG_LEVEL. In another thread
    it imports as usual (notices shown), so that no other thread's output is lost."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "tensorflow" or threading.current_thread() is not threading.main_thread():
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # once: the nested import below finds the real package
        with _stderr_fd_muted():
            module = importlib.import_module(spec.name)  # the import lock of the name is this thread's
        self._spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._spec  # importlib set it to this loader's spec: the real one again


class _LateLoopCallbacks:
    """sys.unraisablehook without the `RuntimeError: Event loop is closed` tracebacks of
    tensorstore's callbacks that reach orbax's event loop after it closed (a failed save, e.g.
    a full disk, which the run reports in its own line); anything else goes to `previous`."""

    def __init__(self, previous: Any):
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        self.previous(unraisable)


CONSOLE_LOG = "console.log"  # main's copy of its console in the workdir


class _ConsoleCopy(std_logging.FileHandler):
    """The log records the console shows (its handler's filters: quiet_console's at the default
    verbosity), in absl's format, appended to a file; a write that fails (a full disk) ends the
    copy, not the command."""

    def __init__(self, path: str):
        super().__init__(path, mode="a", encoding="utf-8")
        self.setFormatter(logging.PythonFormatter())
        for f in logging.get_absl_handler().filters:
            self.addFilter(f)
        self.failed = False

    def emit(self, record: std_logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: std_logging.LogRecord | None) -> None:
        self.failed = True

    def line(self, text: str) -> None:
        with contextlib.suppress(Exception):
            if not self.failed and self.stream is not None:
                self.stream.write(text.rstrip("\n") + "\n")
                self.stream.flush()


class _Held(std_logging.Handler):
    """The console's records before the file of its copy can exist (a run's checks come before
    its workdir is made), at most MAX_HELD."""

    MAX_HELD = 1000

    def __init__(self):
        super().__init__()
        for f in logging.get_absl_handler().filters:
            self.addFilter(f)
        self.records: list[std_logging.LogRecord] = []

    def emit(self, record: std_logging.LogRecord) -> None:
        if len(self.records) < self.MAX_HELD:
            self.records.append(record)


_copies: list[_ConsoleCopy] = []
_held: list[_Held] = []


def hold_console() -> None:
    """Keeps the console's log records from now on, for `copy_console` to write first; ends the
    copy and the holding of an earlier command in this process (main called again in-process)."""
    root = std_logging.getLogger()
    for handler in [*_held, *_copies]:
        root.removeHandler(handler)
        handler.close()
    _held.clear()
    _copies.clear()
    held = _Held()
    std_logging.getLogger().addHandler(held)
    _held.append(held)


def copy_console(path: str) -> None:
    """From now on, the console's log records and `echo`'s lines also go to the file `path`
    (appended: a resumed run adds to it), after those held since `hold_console`. Call after
    `quiet_console`, once the folder exists."""
    for held in _held:
        std_logging.getLogger().removeHandler(held)
    records = [r for held in _held for r in held.records]
    _held.clear()
    try:
        copy = _ConsoleCopy(path)
    except OSError:  # a folder that cannot take it: the command says so where it writes its own files
        return
    for record in records:
        copy.emit(record)
    std_logging.getLogger().addHandler(copy)
    _copies.append(copy)


def echo(text: str, file: Any = None) -> None:
    """`print(text)` (to stdout, or `file`), and the same line in the console's copy, if any."""
    print(text, file=file or sys.stdout, flush=True)
    copy_line(text)


def copy_line(text: str) -> None:
    """`text` as a line of the console's copy, if any (a line printed elsewhere, e.g. by sys.exit)."""
    for copy in _copies:
        copy.line(text)


def quiet_console(tensorflow: bool = True) -> None:
    """The default console (module docstring); call it after the flags are parsed. With
    `tensorflow` (a command that may load it: a tfds dataset, clu's writer of a remote workdir),
    TensorFlow's first import, when it comes, runs with file descriptor 2 muted: its C++ notices
    at import (oneDNN, absl's pre-initialization warning) ignore TF_CPP_MIN_LOG_LEVEL. Nothing
    imports TensorFlow here (a local run's writers do not need it). Nothing changes at
    `--verbosity` 1 or more."""
    if logging.get_verbosity() > logging.INFO:
        return
    handler = logging.get_absl_handler()
    if not any(isinstance(f, ConsoleFilter) for f in handler.filters):
        handler.addFilter(ConsoleFilter())
    if not isinstance(sys.unraisablehook, _LateLoopCallbacks):
        sys.unraisablehook = _LateLoopCallbacks(sys.unraisablehook)
    if tensorflow and "tensorflow" not in sys.modules and not any(
        isinstance(f, _MutedTensorFlowImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _MutedTensorFlowImport())
