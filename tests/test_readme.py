"""README's commands as CI runs them, and the setting its numbers come from (issue 57): the test
command in README.md is the last line of `.ci/run`; every `python -m skipless_jax.X` runs with
one BLAS thread unless the user chose a count."""

from __future__ import annotations

import os
import subprocess
import sys

import subprocess_runs as sr


def _readme_commands() -> dict[str, str]:
    """README's first bash block: the comment before each command -> the command."""
    with open(os.path.join(sr.ROOT, "README.md")) as f:
        block = f.read().split("```bash\n", 1)[1].split("```", 1)[0]
    commands, comment = {}, None
    for line in block.splitlines():
        if line.startswith("#"):
            comment = line
        elif line.strip():
            commands[comment] = line
    return commands


def test_ci_runs_the_readme_test_command_as_written():
    commands = _readme_commands()
    test_command = [c for k, c in commands.items() if "run the tests" in k]
    assert len(commands) == 2 and len(test_command) == 1, commands
    assert "pytest tests" in test_command[0]
    with open(os.path.join(sr.ROOT, ".ci", "run")) as f:
        ci = [line for line in f.read().splitlines() if line.strip() and not line.startswith("#")]
    assert ci[-1] == test_command[0]  # the last thing CI does, word for word


# In a child: skipless_jax first (as `python -m skipless_jax.X` imports it), then numpy's BLAS.
_THREADS = """
import os, sys
import skipless_jax
import numpy, threadpoolctl
blas = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
print(os.environ.get("OPENBLAS_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS"), blas)
"""


def _child_threads(**env: str) -> str:
    environ = {k: v for k, v in sr.env(1).items() if k not in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True, timeout=120,
                          cwd=sr.ROOT, env={**environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_one_blas_thread_unless_the_user_set_a_count():
    assert _child_threads() == "1 1 [1]"  # set before numpy loaded its BLAS
    assert _child_threads(OPENBLAS_NUM_THREADS="2", MKL_NUM_THREADS="3") == "2 3 [2]"
