"""Kill and resume: after SIGKILL, SIGTERM or a corrupted latest checkpoint, the restarted run
ends bitwise equal to an uninterrupted run of the same config (CLI in subprocesses, 1 CPU device)."""

import glob
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from skipless_jax import checkpoint
from skipless_jax.trainers.outcome import EXIT_PREEMPTED

import subprocess_runs as sr

STEPS, EVERY = 12, 4
OVERRIDES = [f"--config.total_steps={STEPS}", f"--config.checkpoint_every_steps={EVERY}", "--config.keep_checkpoints=2"]
DELAY = "0.3"  # seconds per step in the runs that get a signal, so that it lands mid-run
TIMEOUT = 300  # per run; a hang fails the test instead of stalling it


@pytest.fixture(scope="module")
def environ(tmp_path_factory):
    return sr.env(1, cache_dir=os.path.join(sr.session_dir(tmp_path_factory), "jax_cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, environ):
    """(workdir, final state) of the uninterrupted run, computed once per session (xdist workers share it)."""
    workdir = sr.run_once(tmp_path_factory, "preemption_uninterrupted", OVERRIDES, environ, TIMEOUT)
    assert sr.steps_on_disk(workdir) == [8, 12]
    return workdir, checkpoint.load_raw(workdir, STEPS)[1]


def _assert_bitwise_equal(workdir, expected):
    step, state = checkpoint.load_raw(workdir, STEPS)
    assert step == int(state["step"]) == STEPS
    for part in ("params", "opt_state", "rng", "nonfinite"):
        jax.tree.map(np.testing.assert_array_equal, state[part], expected[part])


def _signal_mid_run(tmp_path, environ, signum):
    """Starts a slowed run, waits for its first checkpoint and two more steps, sends `signum`.

    Returns (workdir, process, step whose batch was handed out when the signal went, log path).
    """
    workdir, progress, log = str(tmp_path / "run"), str(tmp_path / "progress"), str(tmp_path / "run.log")
    slowed = dict(environ, SKIPLESS_STEP_DELAY=DELAY, SKIPLESS_PROGRESS=progress)
    proc = sr.start(sr.command(workdir, OVERRIDES), slowed, log)
    sr.wait_until(
        lambda: EVERY in sr.steps_on_disk(workdir) and sr.read_progress(progress) >= EVERY + 2, [proc], log, TIMEOUT
    )
    at = sr.read_progress(progress)
    proc.send_signal(signum)
    return workdir, proc, at, log


@pytest.mark.slow
def test_sigkill_then_restart_equals_uninterrupted(tmp_path, environ, reference):
    workdir, proc, at, log = _signal_mid_run(tmp_path, environ, signal.SIGKILL)
    assert sr.finish(proc, log, TIMEOUT) == -signal.SIGKILL
    saved = sr.steps_on_disk(workdir)
    assert at < STEPS and saved and max(saved) < STEPS, (at, saved)
    out = sr.run(sr.command(workdir, OVERRIDES), environ, str(tmp_path / "restart.log"), TIMEOUT)
    assert f"at step {max(saved)}." in out  # "Resumed from <dir> at step N."
    _assert_bitwise_equal(workdir, reference[1])


@pytest.mark.slow
def test_sigterm_saves_the_current_step_exits_preempted_and_resumes_equal(tmp_path, environ, reference):
    workdir, proc, at, log = _signal_mid_run(tmp_path, environ, signal.SIGTERM)
    assert sr.finish(proc, log, TIMEOUT) == EXIT_PREEMPTED, sr.tail(log)
    text = sr.tail(log, 10**6)
    assert "Preempted at step" in text and "Final (" not in text and "Done." not in text
    assert not os.path.exists(os.path.join(workdir, "final_metrics.json"))  # not finished
    saved = max(sr.steps_on_disk(workdir))
    # The signal lands while step `at` is fetched or computed; that step finishes and is saved.
    assert saved in (at, at + 1) and saved < STEPS, (at, saved)
    assert f"Stopping at step {saved} on a preemption/termination signal" in sr.tail(log, 10**6)
    assert int(checkpoint.load_raw(workdir, saved)[1]["step"]) == saved
    out = sr.run(sr.command(workdir, OVERRIDES), environ, str(tmp_path / "restart.log"), TIMEOUT)
    assert f"at step {saved}." in out
    _assert_bitwise_equal(workdir, reference[1])


def _garble(path, rng):
    """Random bytes over the file, its first and last 16 bytes kept (same size)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(16)
        f.write(rng.integers(0, 256, max(size - 32, 0), dtype=np.uint8).tobytes())


def _truncate(path, rng):
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize(
    "damage, pattern",
    [(_garble, "state/ocdbt.process_*/d/*"), (_truncate, "state/**/*")],
    ids=["garbled-array-data", "truncated-files"],
)
@pytest.mark.slow
def test_corrupted_latest_checkpoint_falls_back_to_previous(tmp_path, environ, reference, damage, pattern):
    workdir = str(tmp_path / "run")
    shutil.copytree(reference[0], workdir)
    os.remove(os.path.join(workdir, "final_metrics.json"))  # died after its last save (a finished run is not re-run)
    files = [
        f for f in glob.glob(os.path.join(workdir, "checkpoints", str(STEPS), pattern), recursive=True)
        if os.path.isfile(f)
    ]
    assert files
    rng = np.random.default_rng(0)
    for f in files:
        damage(f, rng)
    out = sr.run(sr.command(workdir, OVERRIDES), environ, str(tmp_path / "restart.log"), TIMEOUT)
    assert f"Checkpoint at step {STEPS} is unreadable" in out
    assert f"at step {STEPS - EVERY}." in out
    # The unreadable folder is kept aside and the step is saved again, equal to the original.
    assert os.path.isdir(os.path.join(workdir, "checkpoints_unreadable", str(STEPS)))
    _assert_bitwise_equal(workdir, reference[1])
