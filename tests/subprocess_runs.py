"""Runs the CLI in subprocesses (multi-process, kill and resume tests) on fake CPU devices.

Run as a script, it is `python -m skipless_jax.main` with three test hooks read from the
environment: SKIPLESS_STEP_DELAY (seconds slept before each train batch, so that a signal lands
mid-run), SKIPLESS_PROGRESS (a file that holds the step whose batch was last handed out) and
SKIPLESS_TOKEN_WAIT_S (how long a process looks for process 0's workdir token,
`distributed.TOKEN_WAIT_S`, 10 s for file systems slow to show a new file; a test of workdirs
that are not shared waits 1 s). None changes a number the trainer computes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "configs", "tiny.py")

# The XLA flags of every test process, in-process (conftest.py) and started (env() below):
# tiny test models, where XLA's backend optimizations cost more compile time than they save;
# XLA:CPU's elemental fusion emitter instead of its MLIR fusion emitters (a tiny train step
# compiles in half the time: 3.9 -> 2.1 s for configs/vitb_skipless.py's, measured); and no
# concurrency-optimized scheduler (it deadlocks XLA:CPU on programs with many small
# factorizations); and one LLVM module per program, not several compiled on threads (every core
# already runs a test: the i1k configs' one-step tests took 10 % less time, measured). The device
# count is added per process. Production runs use XLA's defaults.
XLA_TEST_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_enable_concurrency_optimized_scheduler=false --xla_cpu_parallel_codegen_split_count=1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_dir(tmp_path_factory) -> str:
    """A folder shared by every pytest-xdist worker of this session (this session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return str(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


def run_once(tmp_path_factory, name: str, overrides: Sequence[str], environ: dict[str, str], timeout: float) -> str:
    """The workdir of the CLI run `name` with `overrides`, trained once per session (xdist workers
    and test files that name the same run share it); its log is `<workdir>.log`."""
    workdir = os.path.join(session_dir(tmp_path_factory), name)
    with file_lock(workdir + ".lock"):
        if not os.path.exists(workdir + ".done"):
            shutil.rmtree(workdir, ignore_errors=True)
            run(command(workdir, overrides), environ, workdir + ".log", timeout)
            open(workdir + ".done", "w").close()
    return workdir


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Exclusive lock across processes (xdist workers), e.g. to compute a shared result once."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def env(num_devices: int, cache_dir: str | None = None, **extra: str) -> dict[str, str]:
    """A CPU-only environment with `num_devices` fake devices, one BLAS thread and the tests'
    XLA flags (XLA_TEST_FLAGS, as in the pytest process).

    `cache_dir`: JAX's persistent compilation cache, shared by the runs of a test session (a
    cached executable is the same program, so results are unchanged; only compile time goes);
    default: the pytest process's (conftest.py's `.xla_test_cache/`), so that no test process
    writes to the user's cache (`compilation_cache.default_dir`).
    """
    cache_dir = cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    out = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "SKIPLESS_"))}
    if cache_dir:
        out.update(
            JAX_COMPILATION_CACHE_DIR=str(cache_dir),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    out.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices} {XLA_TEST_FLAGS}",
        OPENBLAS_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )
    out.update(extra)
    return out


def command(workdir: str, overrides: Sequence[str] = (), process: tuple[str, int, int] | None = None,
            config: str = TINY) -> list[str]:
    """The CLI on the tiny config (or `config`); `process` = (coordinator address, process count, index)."""
    cmd = [sys.executable, os.path.abspath(__file__), f"--config={config}", f"--workdir={workdir}", *overrides]
    if process is not None:
        address, count, index = process
        cmd += [f"--coordinator_address={address}", f"--num_processes={count}", f"--process_id={index}"]
    return cmd


def run_cli(module: str, *args: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    """`python -m module args` from the checkout on one fake device (`env(1, **extra)`), its
    stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env(1, **extra))


def start(cmd: list[str], environ: dict[str, str], log: str) -> subprocess.Popen:
    """Starts `cmd` with stdout and stderr going to the file `log` (read it with `tail`)."""
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, env=environ, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def tail(log: str, chars: int = 4000) -> str:
    """The last `chars` characters of `log`; for a process that crashed, its crash report
    (faulthandler's "Fatal Python error" and the threads' stacks, without the list of extension
    modules that follows them) and what it printed just before."""
    with open(log, errors="replace") as f:
        text = f.read()
    crash = text.find("Fatal Python error")
    if crash < 0:
        return text[-chars:]
    end = text.find("\nExtension modules:", crash)
    report = text[crash:end if end >= 0 else len(text)]
    return (text[max(0, crash - chars // 4):crash] + report)[-chars:]


def finish(proc: subprocess.Popen, log: str, timeout: float) -> int:
    """Waits for `proc` at most `timeout` seconds (then kills it and fails) and returns its exit code."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{proc.args[2:4]} did not finish within {timeout} s; log tail:\n{tail(log)}") from None


def run(cmd: list[str], environ: dict[str, str], log: str, timeout: float) -> str:
    """Runs `cmd` to completion, fails with its log tail unless it exits 0, and returns the log."""
    code = finish(start(cmd, environ, log), log, timeout)
    assert code == 0, f"exit code {code}; log tail:\n{tail(log)}"
    return tail(log, 10**6)


def wait_until(condition: Callable[[], bool], procs: Sequence[subprocess.Popen], log: str, timeout: float) -> None:
    """Polls `condition` until true; fails early if any of `procs` exits, or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if any(p.poll() is not None for p in procs):
            raise AssertionError(
                f"a run exited ({[p.returncode for p in procs]}) before the condition held:\n{tail(log)}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s; log tail:\n{tail(log)}")
        time.sleep(0.02)


def read_progress(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def steps_on_disk(workdir: str) -> list[int]:
    """Finished checkpoint steps (orbax renames a step folder to its number when the save is final)."""
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def killed_then_rerun(workdir: str, cmd: list[str], environ: dict[str, str], folder: str, every: int, total: int,
                      timeout: float) -> tuple[int, str]:
    """Runs `cmd` (a run into `workdir` that saves every `every` of its `total` steps) slowed down,
    SIGKILLs it once the step-`every` checkpoint is on disk and two more steps ran, checks that
    it stopped short of the end, and reruns it to the end: (the last saved step, the rerun's log).
    Logs and the progress file go to `folder`."""
    progress, log = os.path.join(folder, "progress"), os.path.join(folder, "run.log")
    proc = start(cmd, dict(environ, SKIPLESS_STEP_DELAY="0.3", SKIPLESS_PROGRESS=progress), log)
    wait_until(lambda: every in steps_on_disk(workdir) and read_progress(progress) >= every + 2, [proc], log, timeout)
    proc.send_signal(signal.SIGKILL)
    assert finish(proc, log, timeout) == -signal.SIGKILL
    saved = steps_on_disk(workdir)
    assert saved and max(saved) < total, saved
    return max(saved), run(cmd, environ, os.path.join(folder, "restart.log"), timeout)


def _install_hooks() -> None:
    """Sets the workdir token's wait; wraps the train iterator: sleep before each batch and record
    the step it feeds (test hooks). The trainer copies `device_prefetch` batches ahead, so the
    batch of step k is read while step k − device_prefetch is next: that is the step recorded."""
    from skipless_jax import distributed
    from skipless_jax.data import device_input, inputs, text

    distributed.TOKEN_WAIT_S = float(os.environ.get("SKIPLESS_TOKEN_WAIT_S", distributed.TOKEN_WAIT_S))
    delay = float(os.environ.get("SKIPLESS_STEP_DELAY", "0"))
    progress = os.environ.get("SKIPLESS_PROGRESS")

    def slowed(config, start_step, process_index, process_count, **kwargs):  # kwargs: e.g. DINO's transforms
        ahead = device_input.device_prefetch(config)
        train_iterator = originals[config.get("trainer") == "lm"]
        for step, batch in enumerate(
            train_iterator(config, start_step, process_index, process_count, **kwargs), start_step + 1
        ):
            if progress:
                with open(progress + ".tmp", "w") as f:
                    f.write(str(max(step - ahead, start_step)))
                os.replace(progress + ".tmp", progress)
            time.sleep(delay)
            yield batch

    originals = {False: inputs.train_iterator, True: text.train_iterator}  # the lm trainer reads text
    inputs.train_iterator = text.train_iterator = slowed


if __name__ == "__main__":
    from skipless_jax import main

    _install_hooks()
    main.run()
