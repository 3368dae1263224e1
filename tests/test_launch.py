"""Launchers in launch/: generated commands (--dry-run), bad input, shell lint, and real runs.

The dry-run output is one shell command per line (comments start with '#'), so the tests read
it back with shlex exactly as a shell would. Cluster tools (sbatch, srun, scontrol, gcloud) and
the trainer are replaced by small fakes on PATH where a test runs a launcher for real; the one
test that runs the real trainer (2 processes on 127.0.0.1, CPU backend) is marked
`multiprocess` so it can be deselected with -m "not multiprocess".
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))

# A config argument with a comma list and a space, and overrides with a space, a quote and "".
CONFIG = "configs/quickstart.py:skip_sab=False,depth=8"
OVERRIDES = ["--config.name=it's a run", "--config.model.depth=2", "--config.note=a  b", ""]


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without anything that would make a launcher see a cluster."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "TPU_", "XLA_"))}
    env.update(extra)
    return env


def _test_compilation() -> dict[str, str]:
    """The tests' XLA flags and compilation cache (tests/conftest.py), for the trainer processes a
    launcher starts on the CPU backend; neither makes a launcher see a cluster."""
    from subprocess_runs import XLA_TEST_FLAGS

    cache = {k: v for k, v in os.environ.items() if k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    return dict(cache, XLA_FLAGS=XLA_TEST_FLAGS)


def _default_sigint() -> None:
    """In the child: Ctrl-C as a terminal delivers it. A job started in the background of a
    non-interactive shell (`pytest ... &`) inherits SIGINT ignored, and bash cannot trap a signal
    ignored on entry."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 30):
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(),
        cwd=REPO,
    )


def commands(stdout: str) -> list[list[str]]:
    """Each printed command as the words a shell would see."""
    return [w for w in (shlex.split(line, comments=True) for line in stdout.splitlines()) if w]


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """`env A=1 B=2 cmd ...` -> ({'A': '1', 'B': '2'}, ['cmd', ...])."""
    assert words[0] == "env", words
    env, i = {}, 1
    while re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        key, value = words[i].split("=", 1)
        env[key] = value
        i += 1
    return env, words[i:]


def trainer_argv(words: list[str]) -> list[str]:
    """Everything after `python -m skipless_jax.main`."""
    i = words.index("skipless_jax.main")
    assert words[i - 1] == "-m"
    return words[i + 1 :]


def assert_usage_error(result, pattern: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert re.search(pattern, lines[0]), lines[0]


def write_executable(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """A stand-in trainer: prints its argv and JAX_* environment as JSON, then exits with
    FAKE_EXIT_<process id> (default 0) after FAKE_SLEEP_<process id> seconds; with
    FAKE_DEAF_<process id> set it ignores SIGTERM (like a process blocked in a collective)."""
    return write_executable(
        tmp_path / "fake_python",
        f"""
        #!{sys.executable}
        import json, os, signal, sys, time
        pid = os.environ.get("JAX_PROCESS_ID", "0")
        if os.environ.get("FAKE_DEAF_" + pid):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(json.dumps({{"argv": sys.argv[1:],
                           "env": {{k: v for k, v in os.environ.items() if k.startswith("JAX_")}}}}),
              flush=True)
        time.sleep(float(os.environ.get("FAKE_SLEEP_" + pid, "0")))
        sys.exit(int(os.environ.get("FAKE_EXIT_" + pid, "0")))
        """,
    )


# ---------------------------------------------------------------------------------------------
# Lint


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax_and_mode(script: Path):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    assert os.access(script, os.X_OK), f"{script.name} is not executable"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path):
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage(script: Path):
    result = launch(script.name, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {script.name} ")


# ---------------------------------------------------------------------------------------------
# gpu_node.sh


def test_gpu_node_single_process_drives_all_gpus():
    result = launch("gpu_node.sh", "--config", CONFIG, "--workdir", "/runs/a b", "--dry-run", "--", *OVERRIDES)
    assert result.returncode == 0, result.stderr
    [cmd] = commands(result.stdout)
    env, rest = split_env(cmd)
    assert env["JAX_PLATFORMS"] == "cuda"
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]
    assert not {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"} & env.keys()
    assert trainer_argv(rest) == [f"--config={CONFIG}", "--workdir=/runs/a b", *OVERRIDES]


def test_gpu_node_keeps_user_xla_flags():
    env = clean_env(XLA_FLAGS="--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=false")
    result = launch("gpu_node.sh", "--config", CONFIG, "--workdir", "w", "--dry-run", env=env)
    [cmd] = commands(result.stdout)
    assert split_env(cmd)[0]["XLA_FLAGS"] == env["XLA_FLAGS"]


def test_gpu_node_processes_split_the_gpus_and_share_one_coordinator():
    result = launch(
        "gpu_node.sh", "--config", CONFIG, "--workdir", "/runs/a b", "--num-processes", "4", "--num-gpus", "8",
        "--port", "23456", "--dry-run", "--", *OVERRIDES,
    )
    assert result.returncode == 0, result.stderr
    cmds = commands(result.stdout)
    assert len(cmds) == 4
    envs = [split_env(c)[0] for c in cmds]
    assert [e["JAX_PROCESS_ID"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["JAX_NUM_PROCESSES"] for e in envs} == {"4"}
    assert {e["JAX_COORDINATOR_ADDRESS"] for e in envs} == {"127.0.0.1:23456"}
    device_ids = [[int(d) for d in e["JAX_LOCAL_DEVICE_IDS"].split(",")] for e in envs]
    assert device_ids == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {tuple(trainer_argv(split_env(c)[1])) for c in cmds} == {
        (f"--config={CONFIG}", "--workdir=/runs/a b", *OVERRIDES)
    }


def test_gpu_node_cpu_platform_and_equals_form():
    result = launch(
        "gpu_node.sh", f"--config={CONFIG}", "--workdir=/w", "--platform=cpu", "--num-processes=2",
        "--cpu-devices=3", "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    envs = [split_env(c)[0] for c in commands(result.stdout)]
    assert [e["JAX_PLATFORMS"] for e in envs] == ["cpu", "cpu"]
    assert [e["JAX_NUM_CPU_DEVICES"] for e in envs] == ["3", "3"]
    assert all("JAX_LOCAL_DEVICE_IDS" not in e and "XLA_FLAGS" not in e for e in envs)


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--workdir", "w"], r"missing required --config"),
        (["--config", CONFIG], r"missing required --workdir"),
        (["--config", CONFIG, "--workdir", "w", "--platform", "tpu"], r"unknown accelerator type .*tpu.*gpu, cpu"),
        (["--config", CONFIG, "--workdir", "w", "--num-processes", "0"], r"--num-processes must be a positive"),
        (["--config", CONFIG, "--workdir", "w", "--num-processes", "4", "--num-gpus", "6"], r"multiple of"),
        (["--config", CONFIG, "--workdir", "w", "--port", "70000"], r"--port must be in"),
        (["--config", CONFIG, "--workdir", "w", "--gpus", "8"], r"unknown option --gpus"),
        (["--config"], r"--config needs a value"),
    ],
)
def test_gpu_node_bad_input(args, pattern):
    assert_usage_error(launch("gpu_node.sh", *args, "--dry-run"), pattern)


def test_gpu_node_runs_what_it_prints(tmp_path: Path, fake_python: Path):
    args = ["--config", CONFIG, "--workdir", str(tmp_path / "w d"), "--platform", "cpu", "--num-processes", "3",
            "--port", "23457", "--python", str(fake_python)]
    printed = commands(launch("gpu_node.sh", *args, "--dry-run", "--", *OVERRIDES).stdout)
    result = launch("gpu_node.sh", *args, "--", *OVERRIDES)
    assert result.returncode == 0, result.stderr
    for i, words in enumerate(printed):
        env, rest = split_env(words)
        log = (tmp_path / "w d" / "launch_logs" / f"process-{i}.log").read_text()
        seen = json.loads(log)
        assert seen["argv"] == rest[1:]  # the fake sees what follows the interpreter
        assert seen["env"] == {k: v for k, v in env.items() if k.startswith("JAX_")}
        assert f"[p{i}] {log.strip()}" in result.stdout  # streamed with its prefix


@pytest.mark.slow
def test_gpu_node_stops_the_survivors_when_a_process_dies(tmp_path: Path, fake_python: Path):
    # Process 2 exits on SIGTERM; process 0 ignores it and must be killed after the grace period.
    # The peers would sleep 600 s: ending within the (hang-guard) timeout at all means they were
    # stopped, process 0 by SIGKILL after the 2 s grace period.
    env = clean_env(FAKE_EXIT_1="3", FAKE_SLEEP_0="600", FAKE_DEAF_0="1", FAKE_SLEEP_2="600")
    result = launch(
        "gpu_node.sh", "--config", CONFIG, "--workdir", str(tmp_path), "--platform", "cpu", "--num-processes", "3",
        "--grace", "2", "--python", str(fake_python), env=env, timeout=300,
    )
    assert result.returncode == 3, result.stderr
    assert "process 1 exited with status 3" in result.stderr


@pytest.mark.parametrize("started", [2, 1], ids=["running", "while-starting"])
def test_gpu_node_forwards_ctrl_c_as_sigterm(tmp_path: Path, fake_python: Path, started: int):
    """Ctrl-C once both processes run, or as soon as process 0 runs (process 1 may still be
    starting): SIGTERM to every started process, exit 130. The processes would sleep 600 s and
    the grace period before SIGKILL is 600 s, so ending within the (hang-guard) timeout at all
    means SIGTERM stopped them."""
    proc = subprocess.Popen(
        ["bash", str(LAUNCH / "gpu_node.sh"), "--config", CONFIG, "--workdir", str(tmp_path), "--platform", "cpu",
         "--num-processes", "2", "--grace", "600", "--python", str(fake_python)],
        env=clean_env(FAKE_SLEEP_0="600", FAKE_SLEEP_1="600"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=_default_sigint,
    )
    logs = [tmp_path / "launch_logs" / f"process-{i}.log" for i in range(2)]
    deadline = time.monotonic() + 300  # a hang guard only
    while not all(p.exists() and p.read_text() for p in logs[:started]) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted; sending SIGTERM" in err


# ---------------------------------------------------------------------------------------------
# slurm_multinode.sh


@pytest.fixture
def slurm_bin(tmp_path: Path, monkeypatch) -> Path:
    """Fake scontrol (expands the node list) and srun (runs --ntasks copies with SLURM_PROCID)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_executable(bin_dir / "scontrol", 'printf "gpu-node07\\ngpu-node08\\ngpu-node09\\n"\n')
    write_executable(
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


def slurm_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = clean_env(SLURM_JOB_ID="987654", SLURM_JOB_NUM_NODES="3", SLURM_JOB_NODELIST="gpu-node[07-09]", **extra)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


def test_slurm_submit_forwards_the_same_arguments(slurm_bin: Path):
    result = launch(
        "slurm_multinode.sh", "--nodes", "3", "--gpus-per-node", "8", "--partition", "gpu", "--time", "1:00:00",
        "--sbatch-arg=--qos=high", "--config", CONFIG, "--workdir", "/shared/a b", "--dry-run", "--", *OVERRIDES,
    )
    assert result.returncode == 0, result.stderr
    [sbatch] = commands(result.stdout)
    assert sbatch[0] == "sbatch"
    for flag in ["--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu", "--time=1:00:00",
                 "--qos=high", "--output=/shared/a b/launch_logs/%x-%j.out", f"--chdir={REPO}", "--signal=TERM@300"]:
        assert flag in sbatch, flag
    script = sbatch.index(str(LAUNCH / "slurm_multinode.sh"))
    forwarded = sbatch[script + 1 :]
    assert forwarded[forwarded.index("--") + 1 :] == OVERRIDES

    # The submitted job runs the same script inside the allocation: one srun, 3 tasks.
    inside = launch("slurm_multinode.sh", *forwarded[: forwarded.index("--")], "--dry-run", "--", *OVERRIDES,
                    env=slurm_env(slurm_bin, SLURM_CPUS_PER_TASK="12"))
    assert inside.returncode == 0, inside.stderr
    [step] = commands(inside.stdout)
    env, rest = split_env(step)
    assert env["JAX_COORDINATOR_ADDRESS"] == f"gpu-node07:{987654 % 4096 + 61440}"
    assert env["JAX_NUM_PROCESSES"] == "3"
    assert rest[0] == "srun"
    assert {"--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=12"} <= set(rest)
    assert trainer_argv(rest) == [f"--config={CONFIG}", "--workdir=/shared/a b", *OVERRIDES]


def test_slurm_tasks_get_one_coordinator_and_distinct_ids(tmp_path: Path, slurm_bin: Path, fake_python: Path):
    workdir = tmp_path / "shared run"
    result = launch(
        "slurm_multinode.sh", "--config", CONFIG, "--workdir", str(workdir), "--python", str(fake_python),
        "--port", "23458", "--", *OVERRIDES, env=slurm_env(slurm_bin),
    )
    assert result.returncode == 0, result.stderr
    seen = [json.loads((workdir / "launch_logs" / f"process-{i}.log").read_text()) for i in range(3)]
    assert [s["env"]["JAX_PROCESS_ID"] for s in seen] == ["0", "1", "2"]
    assert {s["env"]["JAX_COORDINATOR_ADDRESS"] for s in seen} == {"gpu-node07:23458"}
    assert {s["env"]["JAX_NUM_PROCESSES"] for s in seen} == {"3"}
    assert {s["env"]["JAX_PLATFORMS"] for s in seen} == {"cuda"}
    assert {tuple(s["argv"]) for s in seen} == {("-m", "skipless_jax.main", f"--config={CONFIG}",
                                                 f"--workdir={workdir}", *OVERRIDES)}


def test_slurm_task_failure_is_the_job_status(tmp_path: Path, slurm_bin: Path, fake_python: Path):
    result = launch(
        "slurm_multinode.sh", "--config", CONFIG, "--workdir", str(tmp_path), "--python", str(fake_python),
        env=slurm_env(slurm_bin, FAKE_EXIT_2="5"),
    )
    assert result.returncode == 5


@pytest.mark.parametrize(
    "args, in_allocation, pattern",
    [
        (["--config", CONFIG, "--workdir", "w"], False, r"missing required --nodes"),
        (["--nodes", "2", "--workdir", "w"], False, r"missing required --config"),
        (["--nodes", "2", "--config", CONFIG], False, r"missing required --workdir"),
        (["--nodes", "two", "--config", CONFIG, "--workdir", "w"], False, r"--nodes must be a positive integer"),
        (["--nodes", "2", "--config", CONFIG, "--workdir", "w"], True, r"--nodes 2 but the allocation has 3 nodes"),
        (["--nodes", "3", "--config", CONFIG, "--workdir", "w", "--gres", "gpu:8"], False, r"unknown option --gres"),
    ],
)
def test_slurm_bad_input(slurm_bin: Path, args, in_allocation, pattern):
    env = slurm_env(slurm_bin) if in_allocation else clean_env()
    assert_usage_error(launch("slurm_multinode.sh", *args, "--dry-run", env=env), pattern)


# ---------------------------------------------------------------------------------------------
# tpu_vm.sh and tpu_worker.sh

TPU = ["--name", "exp-1", "--zone", "us-central2-b"]


def gcloud_tpu(words: list[str]) -> str:
    assert words[:4] == ["gcloud", "compute", "tpus", "tpu-vm"], words
    return words[4]


def option(words: list[str], name: str) -> str:
    [value] = [w.split("=", 1)[1] for w in words if w.startswith(f"--{name}=")]
    return value


def test_tpu_lifecycle_dry_run():
    result = launch(
        "tpu_vm.sh", "create", "install", "run", "logs", "delete", *TPU, "--accelerator-type", "v4-32",
        "--project", "my-proj", "--spot", "--bucket", "my-bucket", "--config", CONFIG, "--dry-run", "--", *OVERRIDES,
    )
    assert result.returncode == 0, result.stderr
    assert "# v4-32: 4 worker(s)" in result.stdout
    cmds = commands(result.stdout)
    gcloud = [c for c in cmds if c[0] == "gcloud"]
    assert [gcloud_tpu(c) for c in gcloud] == ["create", "scp", "ssh", "ssh", "ssh", "delete"]
    for words in gcloud:
        assert "exp-1" in words or "exp-1:skipless_jax.tgz" in words  # the one VM, by name
        assert option(words, "zone") == "us-central2-b" and option(words, "project") == "my-proj"
        if gcloud_tpu(words) in ("scp", "ssh"):
            assert option(words, "worker") == "all"
    create, scp, install, run, logs, delete = gcloud
    assert option(create, "accelerator-type") == "v4-32" and option(create, "version") == "tpu-ubuntu2204-base"
    assert "--spot" in create and "--quiet" in delete
    assert scp[5].endswith("/skipless_jax-exp-1.tgz") and scp[6] == "exp-1:skipless_jax.tgz"

    remote = shlex.split(option(run, "command"))
    assert remote[:3] == ["cd", "~/skipless_jax", "&&"]
    worker = remote[3:]
    assert worker[:3] == ["bash", "launch/tpu_worker.sh", "run"]
    run_name = "quickstart-skip_sab=False_depth=8"
    assert option(worker, "config") == CONFIG
    assert option(worker, "workdir") == f"gs://my-bucket/skipless_jax/{run_name}"
    assert option(worker, "tfds-data-dir") == "gs://my-bucket/tensorflow_datasets"
    assert worker[worker.index("--") + 1 :] == OVERRIDES
    assert option(logs, "command") == f"cat ~/skipless_logs/{run_name}/worker-*.log"
    assert option(logs, "output-directory") == f"launch_logs/{run_name}"
    for words in (install, run, logs):  # each worker's login shell must parse the command
        subprocess.run(["sh", "-n", "-c", option(words, "command")], check=True)


def test_tpu_workers_run_the_same_job_with_one_coordinator(tmp_path: Path):
    result = launch("tpu_vm.sh", "run", *TPU, "--bucket", "gs://b", "--config", CONFIG,
                    "--env", "LIBTPU_INIT_ARGS=--a=1 --b=2", "--dry-run", "--", *OVERRIDES)
    [run] = commands(result.stdout)
    remote = shlex.split(option(run, "command"))
    env, worker = split_env(remote[3:])
    assert env == {"LIBTPU_INIT_ARGS": "--a=1 --b=2"}
    script_args = worker[3:]  # after: bash launch/tpu_worker.sh run
    hosts = ["exp-1-w-0", "exp-1-w-1", "exp-1-w-2", "exp-1-w-3"]
    seen = []
    for i in range(len(hosts)):
        out = launch("tpu_worker.sh", "run", "--dry-run", *script_args,
                     env=clean_env(TPU_WORKER_ID=str(i), TPU_WORKER_HOSTNAMES=",".join(hosts), HOME=str(tmp_path)))
        assert out.returncode == 0, out.stderr
        train = [c for c in commands(out.stdout) if c[0] == "env"]
        [train] = train
        train_env, rest = split_env(train)
        seen.append((train_env, trainer_argv(rest)))
        keep = commands(out.stdout)[-1]
        assert keep[:3] == ["gcloud", "storage", "cp"]
        assert keep[-1].endswith(f"/launch_logs/worker-{i}.log")
    assert [e["JAX_PROCESS_ID"] for e, _ in seen] == ["0", "1", "2", "3"]
    assert {e["JAX_NUM_PROCESSES"] for e, _ in seen} == {"4"}
    assert {e["JAX_COORDINATOR_ADDRESS"] for e, _ in seen} == {"exp-1-w-0:8482"}
    assert {e["JAX_PLATFORMS"] for e, _ in seen} == {"tpu"}
    assert {tuple(argv) for _, argv in seen} == {(
        f"--config={CONFIG}", "--workdir=gs://b/skipless_jax/quickstart-skip_sab=False_depth=8", *OVERRIDES)}


def test_tpu_worker_old_endpoint_format_and_single_host():
    triples = "n0:0:10.0.0.5,n1:1:10.0.0.6"
    out = launch("tpu_worker.sh", "run", "--config", CONFIG, "--workdir", "/tmp/w", "--dry-run",
                 env=clean_env(TPU_WORKER_ID="1", TPU_WORKER_HOSTNAMES=triples))
    [train] = [c for c in commands(out.stdout) if c[0] == "env"]
    assert split_env(train)[0]["JAX_COORDINATOR_ADDRESS"] == "10.0.0.5:8482"
    out = launch("tpu_worker.sh", "run", "--config", CONFIG, "--workdir", "/tmp/w", "--dry-run",
                 env=clean_env(TPU_WORKER_ID="0", TPU_WORKER_HOSTNAMES="solo"))
    [train] = [c for c in commands(out.stdout) if c[0] == "env"]
    assert "JAX_COORDINATOR_ADDRESS" not in split_env(train)[0]  # one host: no distributed set-up


@pytest.mark.parametrize(
    "accelerator, workers, version",
    [
        ("v2-8", 1, "tpu-ubuntu2204-base"),
        ("v3-32", 4, "tpu-ubuntu2204-base"),
        ("v4-8", 1, "tpu-ubuntu2204-base"),
        ("v4-128", 16, "tpu-ubuntu2204-base"),
        ("v5p-16", 2, "v2-alpha-tpuv5"),
        ("v5litepod-8", 1, "v2-alpha-tpuv5-lite"),
        ("v5litepod-16", 4, "v2-alpha-tpuv5-lite"),
        ("v6e-256", 64, "v2-alpha-tpuv6e"),
    ],
)
def test_tpu_create_workers_and_default_version(accelerator, workers, version):
    result = launch("tpu_vm.sh", "create", *TPU, "--accelerator-type", accelerator, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"# {accelerator}: {workers} worker(s)" in result.stdout
    [create] = commands(result.stdout)
    assert option(create, "version") == version and "--spot" not in create


def test_tpu_install_from_repo_and_detached_run():
    result = launch("tpu_vm.sh", "install", "run", "stop", *TPU, "--repo", "https://example.com/a b.git", "--ref", "v1",
                    "--workdir", "gs://b/runs/x", "--config", CONFIG, "--detach", "--dry-run")
    assert result.returncode == 0, result.stderr
    install, run, stop = commands(result.stdout)
    fetch = shlex.split(option(install, "command"))
    assert fetch[:10] == ["rm", "-rf", "~/skipless_jax", "&&", "git", "clone", "--quiet",
                          "https://example.com/a b.git", "~/skipless_jax", "&&"]
    assert "checkout" in fetch and fetch[fetch.index("checkout") + 2] == "v1"
    detached = shlex.split(option(run, "command"))
    assert detached[3] == "nohup" and detached[-1] == "&" and "--run-name=x" in detached
    assert shlex.split(option(stop, "command"))[3:] == ["bash", "launch/tpu_worker.sh", "stop"]


def test_tpu_install_ships_this_checkout(tmp_path: Path):
    """Non-dry install with a fake gcloud: the tarball holds the package and launchers, not the venv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_executable(bin_dir / "gcloud", f"""
        #!/usr/bin/env bash
        printf '%s\\n' "$*" >> {tmp_path}/gcloud.log
        [[ $4 == scp ]] && cp "$5" {tmp_path}/shipped.tgz
        exit 0
        """)
    env = clean_env(TMPDIR=str(tmp_path))
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    result = launch("tpu_vm.sh", "install", *TPU, env=env)
    assert result.returncode == 0, result.stderr
    with tarfile.open(tmp_path / "shipped.tgz") as tar:
        names = tar.getnames()
    assert {"launch/tpu_worker.sh", "launch/tpu_vm.sh", "tests/test_launch.py"} <= set(names)
    assert not [n for n in names if n.startswith((".venv/", ".git/")) or "__pycache__" in n]
    assert not (tmp_path / "skipless_jax-exp-1.tgz").exists()  # the local copy is removed
    assert len((tmp_path / "gcloud.log").read_text().splitlines()) == 2  # scp, then ssh


def test_tpu_failed_step_skips_the_rest_but_still_deletes(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_executable(bin_dir / "gcloud", f"""
        #!/usr/bin/env bash
        printf '%s\\n' "$4" >> {tmp_path}/gcloud.log
        [[ $4 != ssh ]] || exit 7
        exit 0
        """)
    env = clean_env()
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    result = launch("tpu_vm.sh", "create", "run", "logs", "delete", *TPU, "--accelerator-type", "v4-8",
                    "--bucket", "b", "--config", CONFIG, "--log-dir", str(tmp_path / "logs"), env=env)
    assert result.returncode == 7
    assert "step 'run' failed (status 7)" in result.stderr and "# skipped: logs" in result.stderr
    assert (tmp_path / "gcloud.log").read_text().split() == ["create", "ssh", "delete"]


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["create", "--zone", "z", "--accelerator-type", "v4-8"], r"missing required --name"),
        (["create", "--name", "n", "--accelerator-type", "v4-8"], r"missing required --zone"),
        (["create", *TPU], r"missing required --accelerator-type"),
        (["create", *TPU, "--accelerator-type", "v9-8"], r"unknown accelerator type 'v9-8'"),
        (["create", *TPU, "--accelerator-type", "v4"], r"unknown accelerator type 'v4'"),
        (["run", *TPU, "--bucket", "b"], r"missing required --config for run"),
        (["run", *TPU, "--config", CONFIG], r"missing required --bucket"),
        (["run", "delete", *TPU, "--bucket", "b", "--config", CONFIG, "--detach"], r"--detach with delete"),
        (["crate", *TPU], r"unknown step 'crate'"),
        ([*TPU], r"missing step"),
        (["run", *TPU, "--env", "no_equals"], r"--env needs VAR=VALUE"),
    ],
)
def test_tpu_bad_input(args, pattern):
    assert_usage_error(launch("tpu_vm.sh", *args, "--dry-run"), pattern)


@pytest.mark.parametrize(
    "args, env, pattern",
    [
        ([], {}, r"missing command"),
        (["start"], {}, r"unknown command 'start'"),
        (["run", "--workdir", "w"], {"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "h"}, r"missing required --config"),
        (["run", "--config", "c", "--workdir", "w"], {"TPU_WORKER_ID": "x", "TPU_WORKER_HOSTNAMES": "h"},
         r"worker id must be a non-negative integer"),
    ],
)
def test_tpu_worker_bad_input(args, env, pattern):
    assert_usage_error(launch("tpu_worker.sh", *args, env=clean_env(**env)), pattern)


# ---------------------------------------------------------------------------------------------
# The real trainer: 2 processes on 127.0.0.1, CPU backend (the code path of a 2-node job).


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_process_cpu_run_of_the_quickstart(tmp_path: Path):
    """gpu_node.sh --num-processes 2 on the CPU backend: jax.distributed over 127.0.0.1, gloo
    collectives, one global batch split across the processes, one checkpoint written by both."""
    workdir = tmp_path / "two procs"
    result = launch(
        "gpu_node.sh", "--platform", "cpu", "--num-processes", "2", "--port", str(free_port()), "--grace", "10",
        "--python", sys.executable, "--config", "configs/quickstart.py:depth=1,epochs=1,opt=adamw",
        "--workdir", str(workdir),
        "--", "--config.schedule.warmup_epochs=0", "--config.model.width=32", "--config.model.mlp_dim=64",
        "--config.input.batch_size=256",
        "--config.log_every_steps=2", "--config.profile_steps=0",
        env=clean_env(OPENBLAS_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", **_test_compilation()), timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logs = [(workdir / "launch_logs" / f"process-{i}.log").read_text() for i in range(2)]
    for i, log in enumerate(logs):
        pattern = rf"Process {i}/2, local devices \[\d+\], global devices 2, mesh {{'data': 2, 'fsdp': 1}}"
        assert re.search(pattern, log), log[-2000:]
    # Process 0 records the global metrics (ceil(1437 / 256) = 6 steps) and logs the progress;
    # process 1 only warnings.
    records = [json.loads(line) for line in (workdir / "history.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    assert [step for step, _ in steps] == [2, 4, 6]
    assert all(0.5 < loss < 3.0 for _, loss in steps), steps  # near ln(10) on 10 classes
    assert re.search(r"Progress: .*\(6/6\)", logs[0]) and "Progress:" not in logs[1]
    assert "Traceback" not in logs[1] and "Error" not in logs[1], logs[1][-2000:]
    assert json.loads((workdir / "final_metrics.json").read_text())["step"] == 6
    shards = {p.name for p in (workdir / "checkpoints" / "6" / "state").iterdir()}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards  # each process wrote its part
    finals = [line for line in result.stdout.splitlines() if "Final (supervised, step 6)" in line]
    assert len(finals) == 1 and finals[0].startswith("[p0] ")  # the summary comes from process 0 only
