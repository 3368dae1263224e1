"""The command line (`python -m skipless_jax.main`) and the launchers' exit statuses.

Bad input is one `error: ...` line on stderr, no traceback, before anything compiles: exit 2
for the command line (flags, config file, `:args`, overrides, process flags), 1 for a config
that loads but is wrong. A run stopped by a preemption exits 75 (EXIT_PREEMPTED) without the
final summary; the launchers pass 75 on as "rerun to resume" and 0 as finished.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from absl import flags

import subprocess_runs as sr

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "configs" / "tiny.py")
QUICKSTART = str(ROOT / "configs" / "quickstart.py")
TIMEOUT = 300  # generous: the machine may be loaded; every command here stops before compiling


def cli(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "skipless_jax.main", *args], capture_output=True, text=True, timeout=TIMEOUT,
        cwd=ROOT, env=sr.env(8, **extra_env),
    )


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], errors[0]
    assert "Final (" not in result.stdout
    return errors[0]


# ---------------------------------------------------------------------------------------------
# Flag parsing: exit 2, one line.


@pytest.mark.parametrize(
    "args, words",
    [
        (["--config=nope.py"], ["--config=nope.py", "no such config file", "'nope.py'"]),
        (["--config=nope.py", "--config.model.depth=3"], ["--config=nope.py", "no such config file"]),
        ([f"--config={QUICKSTART}", "--config.modle.depth=3"], ["--config.modle.depth=3", "'modle'", '"model"']),
        ([f"--config={QUICKSTART}", "--config.model.nosuch=3"], ["--config.model.nosuch=3", "no such field 'nosuch'"]),
        ([f"--config={QUICKSTART}", "--config.model.depth=abc"], ["--config.model.depth=abc", "'abc'"]),
        (
            [f"--config={QUICKSTART}:foo=1"],
            [f"--config={QUICKSTART}:foo=1", "config arg 'foo=1' is unknown", "allowed:"],
        ),
        ([f"--config={QUICKSTART}:depth=x"], ["depth='x' must be of type int"]),
        ([f"--config={QUICKSTART}", "--no_such_flag=1"], ["no_such_flag"]),
        ([f"--config={QUICKSTART}", "--num_processes=two"], ["--num_processes=two"]),
    ],
    ids=["missing-file", "missing-file-override", "misspelt-key", "unknown-field", "bad-value", "unknown-arg",
         "bad-arg-value", "unknown-flag", "bad-flag-value"],
)
def test_flag_errors_are_one_line_with_status_2(tmp_path, args, words):
    assert_one_line_error(cli(*args, f"--workdir={tmp_path}"), 2, *words)


@pytest.mark.parametrize(
    "args, words",
    [
        ([f"--config={TINY}", "--workdir="], ["--workdir=''", "empty"]),
        ([f"--config={TINY}"], ["--workdir=DIR is required"]),
        (["--workdir=w"], ["--config=FILE[:ARGS] is required"]),
        ([f"--config={TINY}", "--workdir=w", "stray"], ["unexpected argument 'stray'"]),
    ],
    ids=["empty-workdir", "no-workdir", "no-config", "positional"],
)
def test_required_flags_are_one_line_with_status_2(tmp_path, args, words):
    result = cli(*args)
    assert_one_line_error(result, 2, *words)
    assert not (ROOT / "checkpoints").exists()  # nothing trained into the current directory


def test_help_exits_0_and_prints_the_usage():
    for flag in ("--help", "-h"):
        result = cli(flag)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("Entry point: `python -m skipless_jax.main"), result.stdout[:500]
        for name in ("--config", "--workdir", "--allow_config_change", "--num_processes"):
            assert name in result.stdout
        assert "Exit status" in result.stdout and "75" in result.stdout


# ---------------------------------------------------------------------------------------------
# Processes and the mesh: errors before anything compiles.


@pytest.mark.parametrize(
    "args, words",
    [
        (["--num_processes=2", "--process_id=0"], ["--num_processes=2", "--coordinator_address"]),
        (["--process_id=1"], ["--process_id=1", "--coordinator_address"]),
        (["--num_processes=2", "--process_id=2", "--coordinator_address=127.0.0.1:1"], ["--process_id=2", "[0, 2)"]),
        (["--num_processes=2", "--process_id=-1", "--coordinator_address=127.0.0.1:1"], ["--process_id=-1", "[0, 2)"]),
        (["--num_processes=0"], ["--num_processes=0", "positive"]),
    ],
    ids=["no-coordinator", "id-without-count", "id-too-large", "id-negative", "zero-processes"],
)
@pytest.mark.slow
def test_inconsistent_process_flags_are_one_line_with_status_2(tmp_path, args, words):
    assert_one_line_error(cli(f"--config={TINY}", f"--workdir={tmp_path}", *args), 2, *words)


def test_check_processes_accepts_single_and_explicit_multi_process(monkeypatch):
    from skipless_jax import distributed

    for key in ("SLURM_NTASKS", "SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(key, raising=False)
    distributed.check_processes(None, None, None)
    distributed.check_processes(None, 1, 0)
    distributed.check_processes("10.0.0.1:1234", 4, 3)
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    distributed.check_processes(None, 2, 1)  # SLURM names the coordinator


@pytest.mark.slow
def test_mesh_fsdp_override_that_does_not_divide_the_devices_is_one_line(tmp_path):
    result = cli(f"--config={TINY}", "--config.mesh.fsdp=3", f"--workdir={tmp_path}")
    assert_one_line_error(result, 2, "config.mesh.fsdp=3 does not divide the 8 devices")
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_bad_config_value_on_the_command_line_is_one_line(tmp_path):
    result = cli(f"--config={TINY}", "--config.optimizer.lr=inf", f"--workdir={tmp_path}")
    assert_one_line_error(result, 2, "config.optimizer.lr=inf must be a finite number > 0")


# ---------------------------------------------------------------------------------------------
# In process: the mesh from the command line, and main() on a stand-in trainer.


@pytest.fixture
def parsed(monkeypatch):
    """Parses a command line into absl's FLAGS through main's parser; restores FLAGS after."""
    from skipless_jax import main

    def parse(*args: str) -> list[str]:
        argv = ["skipless_jax.main", *args]
        monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from sys.argv
        return main.parse_flags(argv)

    yield parse
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:  # the overrides' flags
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()


def test_mesh_fsdp_override_builds_an_fsdp_mesh(parsed, tmp_path):
    from skipless_jax import sharding

    parsed(f"--config={TINY}", "--config.mesh.fsdp=2", f"--workdir={tmp_path}")
    assert flags.FLAGS.config.mesh.to_dict() == {"data": -1, "fsdp": 2}
    mesh = sharding.make_mesh(flags.FLAGS.config.mesh)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 2}
    assert mesh.axis_names == ("data", "fsdp")


def test_tiny_config_fsdp_arg_still_sets_the_mesh(parsed, tmp_path):
    from skipless_jax import sharding

    parsed(f"--config={TINY}:fsdp=4", f"--workdir={tmp_path}")
    assert dict(sharding.make_mesh(flags.FLAGS.config.mesh).shape) == {"data": 2, "fsdp": 4}


def test_old_list_mesh_still_builds():
    from skipless_jax import sharding

    assert dict(sharding.make_mesh([("data", 2), ("fsdp", 4)]).shape) == {"data": 2, "fsdp": 4}
    assert dict(sharding.make_mesh({"fsdp": 2, "data": -1}).shape) == {"data": 4, "fsdp": 2}  # data first


class _Trainer(types.SimpleNamespace):
    """A stand-in trainer module: records its calls, then returns or raises `outcome`."""

    def check_config(self, config, num_devices=None):
        self.checked = True

    def train_and_evaluate(self, config, workdir, devices=None, allow_config_change=False):
        self.calls.append({"workdir": workdir, "allow_config_change": allow_config_change})
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


@pytest.fixture
def trainer(monkeypatch):
    from skipless_jax import distributed, trainers

    fake = _Trainer(calls=[], outcome={"step": 12, "test_accuracy": 0.5})
    monkeypatch.setattr(trainers, "get", lambda name: fake)
    monkeypatch.setattr(distributed, "initialize", lambda *args: None)  # one process, whatever the environment
    return fake


def _main(parsed, *args: str) -> None:
    from skipless_jax import main

    main.main(parsed(*args))


def test_main_finishes_with_the_final_summary(parsed, trainer, tmp_path, capsys):
    _main(parsed, f"--config={TINY}", f"--workdir={tmp_path}")
    assert trainer.calls == [{"workdir": str(tmp_path), "allow_config_change": False}]
    assert "Final (supervised, step 12): test_accuracy=0.5000" in capsys.readouterr().out


def test_allow_config_change_reaches_the_trainer(parsed, trainer, tmp_path):
    _main(parsed, f"--config={TINY}", f"--workdir={tmp_path}", "--allow_config_change")
    assert trainer.calls[0]["allow_config_change"] is True


def test_preempted_run_exits_75_without_the_final_summary(parsed, trainer, tmp_path, capsys, caplog):
    from skipless_jax.trainers.outcome import EXIT_PREEMPTED
    from skipless_jax.trainers.run import Preempted

    trainer.outcome = Preempted(7)
    with pytest.raises(SystemExit) as exit_:
        _main(parsed, f"--config={TINY}", f"--workdir={tmp_path}")
    assert exit_.value.code == EXIT_PREEMPTED == 75
    out, err = capsys.readouterr()
    assert "Final (" not in out and "Done." not in caplog.text
    [line] = err.strip().splitlines()
    assert "Preempted at step 7" in line and "checkpoint saved" in line and "rerun" in line


def test_checkpoint_of_another_config_is_one_line_status_1(parsed, trainer, tmp_path, capsys):
    from skipless_jax import checkpoint

    trainer.outcome = checkpoint.IncompatibleCheckpointError("the checkpoint of step 4 was written by another config")
    with pytest.raises(SystemExit) as exit_:
        _main(parsed, f"--config={TINY}", f"--workdir={tmp_path}")
    assert exit_.value.code == "error: the checkpoint of step 4 was written by another config"  # printed, status 1
    assert "Final (" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Launchers: 75 is "preempted, rerun", 0 is finished.

LAUNCH = ROOT / "launch"


def _executable(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_trainer(tmp_path: Path) -> Path:
    """Exits with FAKE_EXIT_<process id> (default 0) after FAKE_SLEEP_<process id> seconds;
    on SIGTERM it exits 75 like the trainer after saving."""
    return _executable(
        tmp_path / "fake_python",
        f"""
        #!{sys.executable}
        import os, signal, sys, time
        pid = os.environ.get("JAX_PROCESS_ID", "0")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
        print("started", pid, flush=True)
        time.sleep(float(os.environ.get("FAKE_SLEEP_" + pid, "0")))
        sys.exit(int(os.environ.get("FAKE_EXIT_" + pid, "0")))
        """,
    )


def _launcher_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "TPU_", "XLA_"))}
    env.update(extra)
    return env


def _gpu_node(tmp_path: Path, fake: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH / "gpu_node.sh"), "--config", TINY, "--workdir", str(tmp_path / "w"), "--platform", "cpu",
         "--num-processes", "2", "--grace", "5", "--python", str(fake)],
        capture_output=True, text=True, timeout=120, env=_launcher_env(**env), cwd=ROOT,
    )


def test_gpu_node_passes_on_preemption_as_75(tmp_path, fake_trainer):
    # Process 1 is preempted (exits 75 at once); process 0 gets SIGTERM from the launcher and saves too.
    result = _gpu_node(tmp_path, fake_trainer, FAKE_EXIT_1="75", FAKE_SLEEP_0="60")
    assert result.returncode == 75, result.stderr
    assert "process 1 was preempted" in result.stderr
    assert "rerun the same command to resume" in result.stderr
    assert "exited with status" not in result.stderr  # not reported as a failure


@pytest.mark.slow
def test_gpu_node_finished_run_is_0_and_failure_wins_over_preemption(tmp_path, fake_trainer):
    assert _gpu_node(tmp_path, fake_trainer).returncode == 0
    failed = _gpu_node(tmp_path, fake_trainer, FAKE_EXIT_0="3", FAKE_SLEEP_1="60")
    assert failed.returncode == 3, failed.stderr  # process 1 then stops with 75 on SIGTERM


def test_gpu_node_sigterm_to_the_launcher_is_a_preemption(tmp_path, fake_trainer):
    import signal
    import time

    proc = subprocess.Popen(
        ["bash", str(LAUNCH / "gpu_node.sh"), "--config", TINY, "--workdir", str(tmp_path), "--platform", "cpu",
         "--num-processes", "2", "--python", str(fake_trainer)],
        env=_launcher_env(FAKE_SLEEP_0="60", FAKE_SLEEP_1="60"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    logs = [tmp_path / "launch_logs" / f"process-{i}.log" for i in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in logs) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err


@pytest.fixture
def slurm(tmp_path: Path) -> Path:
    """Fake scontrol (node list; `requeue` is recorded) and srun (runs --ntasks local copies)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(
        bin_dir / "scontrol",
        f"""
        #!/usr/bin/env bash
        if [[ $1 == requeue ]]; then echo "$@" >> {tmp_path}/requeued; exit "${{FAKE_REQUEUE_EXIT:-0}}"; fi
        printf "node1\\nnode2\\n"
        """,
    )
    _executable(
        bin_dir / "srun",
        """
        #!/usr/bin/env bash
        ntasks=1
        while [[ $1 == -* ]]; do [[ $1 == --ntasks=* ]] && ntasks=${1#*=}; shift; done
        pids=()
        for ((i = 0; i < ntasks; i++)); do SLURM_PROCID=$i "$@" & pids+=($!); done
        status=0
        for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
        exit $status
        """,
    )
    return bin_dir


def _slurm_job(tmp_path: Path, bin_dir: Path, fake: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = _launcher_env(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[1-2]", **env)
    environ["PATH"] = f"{bin_dir}:{environ['PATH']}"
    return subprocess.run(
        ["bash", str(LAUNCH / "slurm_multinode.sh"), "--config", TINY, "--workdir", str(tmp_path / "w"),
         "--python", str(fake), *args],
        capture_output=True, text=True, timeout=120, env=environ, cwd=ROOT,
    )


def test_slurm_preempted_job_requeues_itself_and_exits_75(tmp_path, slurm, fake_trainer):
    result = _slurm_job(tmp_path, slurm, fake_trainer, FAKE_EXIT_0="75", FAKE_EXIT_1="75")
    assert result.returncode == 75, result.stderr
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    assert "requeued (restart 1 of at most 10)" in result.stderr
    statuses = sorted((tmp_path / "w" / "launch_logs").glob("process-*.status"))
    assert [p.read_text().strip() for p in statuses] == ["75", "75"]


def test_slurm_preemption_seen_through_the_task_statuses(tmp_path, slurm, fake_trainer):
    # srun reports another status (e.g. of a task it killed), but the tasks' own statuses are 75.
    (slurm / "srun").rename(slurm / "srun_real")
    _executable(slurm / "srun", f"#!/usr/bin/env bash\n{slurm}/srun_real \"$@\"\nexit 137\n")
    result = _slurm_job(tmp_path, slurm, fake_trainer, FAKE_EXIT_0="75", FAKE_EXIT_1="75")
    assert result.returncode == 75, result.stderr


def test_slurm_requeue_limit_and_finished_and_failed_jobs(tmp_path, slurm, fake_trainer):
    capped = _slurm_job(tmp_path, slurm, fake_trainer, "--max-requeues", "2", FAKE_EXIT_0="75", SLURM_RESTART_COUNT="2")
    assert capped.returncode == 75 and "not requeued after 2" in capped.stderr, capped.stderr
    assert not (tmp_path / "requeued").exists()
    interactive = _slurm_job(tmp_path, slurm, fake_trainer, FAKE_EXIT_1="75", FAKE_REQUEUE_EXIT="1")
    assert interactive.returncode == 75 and "submit the same command again" in interactive.stderr
    (tmp_path / "requeued").unlink()
    assert _slurm_job(tmp_path, slurm, fake_trainer).returncode == 0
    failed = _slurm_job(tmp_path, slurm, fake_trainer, FAKE_EXIT_0="75", FAKE_EXIT_1="5")
    assert failed.returncode == 5, failed.stderr  # a real failure is not a preemption
    assert not (tmp_path / "requeued").exists()


def test_slurm_submission_can_requeue(tmp_path):
    result = subprocess.run(
        ["bash", str(LAUNCH / "slurm_multinode.sh"), "--nodes", "2", "--config", TINY, "--workdir", str(tmp_path),
         "--max-requeues", "3", "--dry-run"],
        capture_output=True, text=True, timeout=60, env=_launcher_env(), cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    [sbatch] = [line for line in result.stdout.splitlines() if line.startswith("sbatch")]
    assert "--requeue" in sbatch and "--open-mode=append" in sbatch and "--max-requeues 3" in sbatch
    bad = subprocess.run(
        ["bash", str(LAUNCH / "slurm_multinode.sh"), "--nodes", "2", "--config", TINY, "--workdir", str(tmp_path),
         "--max-requeues", "-1", "--dry-run"],
        capture_output=True, text=True, timeout=60, env=_launcher_env(), cwd=ROOT,
    )
    assert bad.returncode == 2 and "--max-requeues must be a non-negative integer" in bad.stderr
