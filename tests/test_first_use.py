"""The smaller edges a new user met (issue 57): a bad `:init=` names the config arg and exits 2
as a bad `:opt=` does; a warm-up that covers the whole run is a warning; the final line prints
integers as integers; a second run into a busy workdir is refused before JAX loads. (The copy
of the console in the workdir: tests/test_lifecycle.py, on its reference run.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from skipless_jax import config_args, main, validate, workdir_lock
from skipless_jax.models import init

import subprocess_runs as sr
from util import load_config


def test_the_init_arg_takes_the_models_init_methods_only():
    assert config_args.CHOICES["init"] == init.INIT_METHODS
    assert config_args.parse("init=mimetic", init="skipless")["init"] == "mimetic"
    for arg in ("init", "opt"):
        try:
            config_args.parse(f"{arg}=skiples", init="skipless", opt="soap")
        except ValueError as err:
            allowed = " | ".join(config_args.CHOICES[arg])
            assert str(err) == f"config arg {arg}='skiples' is not allowed; allowed: {allowed}"
        else:
            raise AssertionError(f"{arg}=skiples was accepted")


def test_a_warm_up_that_covers_the_whole_run_is_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(validate, "_WARNED", set())  # once per process: not yet in this one
    with caplog.at_level(logging.WARNING, logger="absl"):
        validate.validate_config(load_config("quickstart", "epochs=6"))  # 135 steps, 113 of warm-up
        assert not caplog.records
        validate.validate_config(load_config("quickstart", "epochs=5"))  # 113 of 113
        validate.validate_config(load_config("quickstart", "epochs=5"))  # checked again: said once
    assert [r.getMessage() for r in caplog.records] == [
        "config.schedule.warmup_epochs=5 is a warm-up of 113 steps, the whole run (config.total_epochs=5): the "
        "learning rate never reaches its peak; e.g. add --config.schedule.warmup_epochs=1 (whole epochs; about an "
        "eighth of the run)."]


def test_the_final_line_prints_integers_as_integers():
    metrics = {"step": 200, "val_bits_per_byte": 3.7712345, "corpus_bytes": 31525224, "corpus_files": 1790,
               "corpus_sha256": "65199365", "train_loss": 2.5}
    assert main.final_summary(metrics) == "corpus_bytes=31525224, corpus_files=1790, val_bits_per_byte=3.7712"


# The command in a child that reports, when it exits, its status and whether JAX was imported.
_EXIT_BEFORE_JAX = """
import runpy, sys
sys.argv = ["main", *sys.argv[1:]]
try:
    runpy.run_module("skipless_jax.main", run_name="__main__")
except SystemExit as e:
    if isinstance(e.code, str):  # what sys.exit(message) prints as the interpreter exits
        print(e.code, file=sys.stderr)
    print("EXIT", 1 if isinstance(e.code, str) else e.code, "jax" in sys.modules, file=sys.stderr)
"""


def test_a_busy_workdir_is_refused_before_jax_loads(tmp_path):
    """The lock names a live holder (this test's process): one line, exit status 1, and no JAX
    import before it (it took 12.6 s on a loaded machine: JAX and the trainer first)."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / workdir_lock.LOCK).write_text(json.dumps(workdir_lock.holder_record()))  # this pid, alive
    done = subprocess.run([sys.executable, "-c", _EXIT_BEFORE_JAX, f"--config={sr.TINY}", f"--workdir={workdir}"],
                          capture_output=True, text=True, timeout=120, cwd=sr.ROOT, env=sr.env(1))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == "EXIT 1 False", done.stderr[-3000:]
    assert len(lines) == 2 and lines[0].startswith(f"error: --workdir={workdir} is in use by another run (host "), lines
    assert f"pid {os.getpid()}," in lines[0] and lines[0].endswith("wait for it to end, or use another folder")
