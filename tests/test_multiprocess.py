"""Two processes × 2 fake CPU devices on 127.0.0.1 (gloo collectives): the same numbers as one
process with 4 devices, checkpoints that restore in one process, no hang when a peer dies, and
a one-line error (not a hang) when the processes are given workdirs they do not share."""

import json
import logging
import os
import re
import signal
import time

import jax
import numpy as np
import pytest

from skipless_jax import checkpoint
from skipless_jax.trainers import supervised
from skipless_jax.trainers.outcome import EXIT_PREEMPTED

import subprocess_runs as sr
from util import tiny_config

MESH = {"data": 2, "fsdp": 2}  # parameters sharded across the two processes
# Only hang guards: generous, so that a loaded machine never fails a test (no assertion depends
# on how long anything took). Gloo's 30 s rendezvous is handled by distributed.warm_up_collectives.
TIMEOUT = 900  # per run, and for the survivor of a kill to exit
HEARTBEAT = 30  # seconds before the coordination service declares a silent process dead
# ... where a test kills a process and waits for that verdict (the survivor blocks in a collective
# meanwhile): short, but still far beyond any scheduling delay of the service's heartbeat thread.
KILL_HEARTBEAT = 10
LONG_RUN = ["--config.total_steps=1000", "--config.checkpoint_every_steps=2"]  # stopped long before the end
DELAY = "0.3"  # seconds per step, so that a kill or a signal lands mid-run


def _environ(tmp_path_factory, **extra):
    cache = os.path.join(sr.session_dir(tmp_path_factory), "jax_cache")
    return sr.env(2, cache_dir=cache, **extra)


def _launch(workdir, overrides, environ, tmp_path, config_arg="", config_file=None):
    """Starts processes 0 and 1 of one run (tests/configs/tiny.py, or `config_file`); returns
    (processes, log paths, progress files)."""
    address = f"127.0.0.1:{sr.free_port()}"
    procs, logs, progress = [], [], []
    for index in range(2):
        logs.append(str(tmp_path / f"process_{index}.log"))
        progress.append(str(tmp_path / f"progress_{index}"))
        cmd = sr.command(workdir, overrides, (address, 2, index))
        if config_file is not None:
            cmd[2] = f"--config={config_file}"
        cmd[2] += config_arg
        procs.append(sr.start(cmd, dict(environ, SKIPLESS_PROGRESS=progress[-1]), logs[-1]))
    return procs, logs, progress


def _reap(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


def _resume_in_one_process(workdir, caplog):
    """Continues `workdir` to step 7 on one device, checking that it resumed at step 5."""
    config = tiny_config(total_steps=7, log_every_steps=1)
    config.mesh = {"data": 1}
    with caplog.at_level(logging.INFO, logger="absl"):
        metrics = supervised.train_and_evaluate(
            config, workdir, devices=jax.devices()[:1], allow_config_change=True
        )  # a longer schedule
    assert metrics["step"] == 7
    assert any(re.search(r"Resumed from .* at step 5\.", r.getMessage()) for r in caplog.records)
    caplog.clear()
    return checkpoint.load_raw(workdir, 7)[1]


@pytest.mark.slow
def test_two_processes_equal_one_process_and_checkpoint_restores_in_one(tmp_path, tmp_path_factory, caplog):
    # Two processes × 2 devices, 5 steps, data 2 × fsdp 2.
    multi = str(tmp_path / "two_processes")
    # tests/configs/tiny.py:fsdp=2 is MESH over the 4 global devices.
    procs, logs, _ = _launch(
        multi, ["--config.total_steps=5", "--config.log_every_steps=5"], _environ(tmp_path_factory), tmp_path, ":fsdp=2"
    )
    for proc, log in zip(procs, logs):
        assert sr.finish(proc, log, TIMEOUT) == 0, sr.tail(log)
    for i, log in enumerate(logs):  # every process reports itself and its local devices
        assert re.search(
            rf"Process {i}/2, local devices \[\d+, \d+\], global devices 4, mesh {{'data': 2, 'fsdp': 2}}",
            sr.tail(log, 10**6),
        )

    # One process × 4 devices, same mesh.
    single = str(tmp_path / "one_process")
    config = tiny_config(total_steps=5, log_every_steps=5)
    config.mesh = MESH
    expected = supervised.train_and_evaluate(config, single, devices=jax.devices()[:4])

    with open(os.path.join(multi, "final_metrics.json")) as f:  # written by process 0 only
        got = json.load(f)
    for key in ("train_loss", "test_loss", "test_accuracy"):
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5)
    multi_state, single_state = checkpoint.load_raw(multi, 5)[1], checkpoint.load_raw(single, 5)[1]
    assert int(multi_state["step"]) == 5
    _close(multi_state["params"], single_state["params"])
    _close(multi_state["opt_state"], single_state["opt_state"])

    # The two-process checkpoint resumes in one process on one device, as the one-process one does.
    _close(_resume_in_one_process(multi, caplog)["params"], _resume_in_one_process(single, caplog)["params"])


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["kill-worker", "kill-coordinator"])
def test_killed_peer_stops_the_other_process_without_hanging(tmp_path, tmp_path_factory, victim):
    workdir = str(tmp_path / "run")
    procs, logs, progress = _launch(
        workdir,
        LONG_RUN,
        _environ(tmp_path_factory, SKIPLESS_STEP_DELAY=DELAY, JAX_HEARTBEAT_TIMEOUT=str(KILL_HEARTBEAT)),
        tmp_path,
    )
    try:
        sr.wait_until(lambda: 2 in sr.steps_on_disk(workdir), procs, logs[0], TIMEOUT)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = 1 - victim
        code = sr.finish(procs[survivor], logs[survivor], TIMEOUT)
        elapsed = time.monotonic() - killed
    finally:
        _reap(procs)
    out = sr.tail(logs[survivor], 10**6)
    assert code != 0, out[-3000:]
    assert sr.read_progress(progress[survivor]) < 1000
    # JAX's coordination service names the cause: a peer stopped sending heartbeats, or the
    # coordinator (process 0) is gone.
    assert re.search(r"another task died|stopped sending heartbeats|leader task was preempted/died", out), out[-3000:]
    print(f"survivor exited with {code} {elapsed:.1f} s after the kill")


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_the_same_saved_step(tmp_path, tmp_path_factory):
    """The one preemption rule (trainers/signals.py, read by the one loop in trainers/loop.py):
    jax.distributed's preemption service, no Python handler, so both processes save the same step
    and exit 75. Run with the DINO trainer, whose state holds the most (student, teacher, centre);
    the supervised trainer's preemption is tested in one process (tests/test_preemption.py)."""
    workdir = str(tmp_path / "run")
    config_file = os.path.join(sr.ROOT, "tests", "configs", "tiny_dino.py")
    environ = _environ(tmp_path_factory, SKIPLESS_STEP_DELAY=DELAY, JAX_HEARTBEAT_TIMEOUT=str(HEARTBEAT))
    procs, logs, _ = _launch(workdir, LONG_RUN, environ, tmp_path, config_file=config_file)
    try:
        sr.wait_until(lambda: 2 in sr.steps_on_disk(workdir), procs, logs[0], TIMEOUT)
        procs[1].send_signal(signal.SIGTERM)  # e.g. one host of a pod is told first
        codes = [sr.finish(proc, log, TIMEOUT) for proc, log in zip(procs, logs)]
    finally:
        _reap(procs)
    assert codes == [EXIT_PREEMPTED] * 2, [sr.tail(log, 6000) for log in logs]
    stops = [re.findall(r"Stopping at step (\d+) on a preemption", sr.tail(log, 10**6)) for log in logs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    assert max(sr.steps_on_disk(workdir)) == int(stops[0][0])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_unshared_workdirs_are_a_one_line_error_in_every_process(tmp_path, tmp_path_factory):
    """Each process gets its own --workdir: process 1 does not see process 0's token, and both
    exit 2 (a bad --workdir) with the same one-line error naming process 1, before anything compiles (no hang)."""
    address = f"127.0.0.1:{sr.free_port()}"
    environ = _environ(tmp_path_factory, JAX_HEARTBEAT_TIMEOUT=str(HEARTBEAT), SKIPLESS_TOKEN_WAIT_S="1")
    workdirs = [str(tmp_path / f"workdir_{index}") for index in range(2)]
    procs, logs = [], []
    try:
        for index in range(2):
            logs.append(str(tmp_path / f"process_{index}.log"))
            procs.append(sr.start(sr.command(workdirs[index], [], (address, 2, index)), environ, logs[-1]))
        codes = [sr.finish(proc, log, TIMEOUT) for proc, log in zip(procs, logs)]
    finally:
        _reap(procs)
    assert codes == [2, 2], [sr.tail(log, 2000) for log in logs]
    for index, log in enumerate(logs):
        errors = [line for line in sr.tail(log, 10**6).splitlines() if line.startswith("error: ")]
        assert errors == [
            f"error: --workdir={workdirs[index]} is not shared by the processes: process(es) [1] of 2 (this is "
            f"process {index}) do not see the token process 0 wrote to {workdirs[index]}/.process_0_token; give "
            "every process the same directory on a file system they all mount"
        ], sr.tail(log, 3000)
        assert "Train step per device" not in sr.tail(log, 10**6)  # stopped before the step compiled
    assert not os.path.exists(os.path.join(workdirs[0], ".process_0_token"))  # removed by process 0
    assert not os.path.exists(os.path.join(workdirs[1], "checkpoints"))


def test_started_processes_compile_under_the_pytest_process_xla_flags():
    """subprocess_runs.env keeps conftest.py's compile flags (one definition, XLA_TEST_FLAGS)."""
    flags = sr.env(2, JAX_PLATFORMS="cpu")["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=2" in flags
    assert "--xla_backend_optimization_level=0" in flags
    assert set(sr.XLA_TEST_FLAGS.split()) <= set(flags) & set(os.environ["XLA_FLAGS"].split())
