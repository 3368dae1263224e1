"""The run lifecycle at its edges (issue 31): final metrics recovered from a finished checkpoint,
Ctrl-C that saves, one-line filesystem errors (a file or read-only workdir, a missing init_from,
a full disk), a quiet console, and the command lines' --help and :arg errors."""

from __future__ import annotations

import json
import logging as std_logging
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from skipless_jax import checkpoint, cli, config_args
from skipless_jax.checkpoint import orbax_io

import subprocess_runs as sr

STEPS, EVERY = 12, 4
# The same run as test_preemption.py's reference (the session computes it once for both).
OVERRIDES = [f"--config.total_steps={STEPS}", f"--config.checkpoint_every_steps={EVERY}", "--config.keep_checkpoints=2"]
DELAY = "0.3"  # seconds per step in the runs that get a signal
TIMEOUT = 300


def _cli(*args: str, module: str = "skipless_jax.main", timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=sr.ROOT, env=sr.env(1))


def _one_error_line(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, result.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for word in words:
        assert word in lines[-1], lines[-1]
    return lines[-1]


def _namespace_tmpfs(options: str, script: str, tmp_path) -> subprocess.CompletedProcess:
    """`script` (sh) in a private mount namespace where $MNT is a fresh tmpfs mounted with
    `options`; skips the test where this machine allows no such namespace."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here (unshare -rm: {probe.stderr.strip()[:200]})")
    full = f"mount -t tmpfs -o {options} tmpfs {mnt} || exit 99\nMNT={mnt}\n{script}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", full], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=sr.ROOT, env=sr.env(1))


# ---- Fast: no training.


def test_workdir_that_is_a_file_is_one_line_before_anything_loads(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    line = _one_error_line(_cli(f"--config={sr.TINY}", f"--workdir={path}"), 2, str(path), "is a file")
    assert line == f"error: --workdir={path}: {path} is a file, not a directory"
    nested = path / "run"  # a workdir to be created inside a file
    _one_error_line(_cli(f"--config={sr.TINY}", f"--workdir={nested}"), 2, str(path), "is a file")


def test_unwritable_workdir_is_one_line(tmp_path):
    script = (f'{sys.executable} -m skipless_jax.main --config={sr.TINY} --workdir="$MNT/run" 2>&1; echo "rc=$?"')
    result = _namespace_tmpfs("ro,size=64k", script, tmp_path)
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "rc=2", result.stdout
    assert lines[:-1] == [f"error: --workdir={tmp_path / 'mnt'}/run: {tmp_path / 'mnt'} is not writable "
                          "(a read-only file system)"], result.stdout


@pytest.mark.slow
def test_missing_init_from_is_one_line_and_leaves_no_workdir(tmp_path):
    workdir, missing = tmp_path / "run", tmp_path / "no_such_pretraining"
    result = _cli(f"--config=configs/mae_digits_finetune.py:init_from={missing}", f"--workdir={workdir}")
    _one_error_line(result, 2, f"config.init_from='{missing}'", "no such file or directory")
    assert not workdir.exists()
    empty = tmp_path / "empty"  # a folder without a checkpoint
    empty.mkdir()
    result = _cli(f"--config=configs/mae_digits_finetune.py:init_from={empty}", f"--workdir={workdir}")
    _one_error_line(result, 2, f"config.init_from='{empty}'", "no checkpoint")
    assert not workdir.exists()


@pytest.mark.parametrize("module", ["skipless_jax.evaluate", "skipless_jax.analyze",
                                    "skipless_jax.timm_convert"])
@pytest.mark.slow
def test_help_exits_0(module):
    result = _cli("--help", module=module)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--workdir" in result.stdout or "--input" in result.stdout


def test_evaluate_help_answers_before_jax_and_tensorflow_load():
    code = ("import runpy, sys\nsys.argv = ['evaluate', '--help']\n"
            "try:\n    runpy.run_module('skipless_jax.evaluate', run_name='__main__')\n"
            "except SystemExit as e:\n    print('EXIT', e.code, 'jax' in sys.modules, 'tensorflow' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=sr.ROOT, env=sr.env(1))
    assert result.stdout.splitlines()[-1] == "EXIT 0 False False", result.stdout[-500:] + result.stderr[-2000:]


@pytest.mark.parametrize("arg, words", [("depth=x", ["depth='x'", "int"]), ("foo=1", ["'foo=1' is unknown"]),
                                        ("opt=sgd", ["opt='sgd' is not allowed", "adamw | soap"]),
                                        ("init=skiples", ["config arg init='skiples' is not allowed", "skipless"])])
@pytest.mark.slow
def test_bad_config_arg_is_status_2_in_analyze_and_main(tmp_path, arg, words):
    _one_error_line(_cli(f"--config=configs/quickstart.py:{arg}", module="skipless_jax.analyze"), 2, *words)
    _one_error_line(_cli(f"--config=configs/quickstart.py:{arg}", f"--workdir={tmp_path}/run"), 2, *words)


def test_opt_arg_takes_the_documented_optimizers_only():
    assert config_args.parse("opt=soap", opt="adamw") == {"opt": "soap"}
    allowed = r"adamw \| soap \| muon \| shampoo_ec"
    with pytest.raises(ValueError, match=rf"^config arg opt='sgd' is not allowed; allowed: {allowed}$"):
        config_args.parse("opt=sgd", opt="adamw")


def test_orbax_private_path_is_where_the_checked_versions_keep_it():
    """Fails loudly when orbax moves its array-metadata store: update checkpoint/orbax_io.py's shim."""
    import orbax.checkpoint as ocp

    assert ocp.__version__ in orbax_io.ORBAX_PRIVATE_PATH_CHECKED, (
        f"orbax {ocp.__version__}: check checkpoint/orbax_io.py's _array_metadata_store and add the version")
    from orbax.checkpoint._src.metadata import array_metadata_store

    handler = ocp.type_handlers.get_type_handler(jax.Array)
    assert isinstance(orbax_io._array_metadata_store(), array_metadata_store.Store)
    assert isinstance(handler._array_metadata_store, array_metadata_store.Store)
    assert handler._min_slice_bytes_for_replica_parallel == orbax_io.REPLICA_PARALLEL_MIN_BYTES


def _record(path: str, level: int, msg: str, exc: bool = False) -> std_logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("RESOURCE_EXHAUSTED")
        except ValueError:
            exc_info = sys.exc_info()
    return std_logging.LogRecord("absl", level, path, 1, msg, (), exc_info)


def test_console_filter_keeps_the_project_settings_progress_and_warnings_that_matter():
    site = "/venv/lib/python3.11/site-packages"
    keep = cli.ConsoleFilter().filter
    assert keep(_record("/work/skipless_jax/trainers/run.py", 20, "Step 12: test_accuracy=0.1"))
    writers = "/work/skipless_jax/trainers/writers.py"  # the logging writer and the progress line
    assert keep(_record(writers, 20, "[Hyperparameters] %s"))
    assert not keep(_record(writers, 20, "[%d] %s"))  # every scalar again
    assert keep(_record(writers, 20, "Progress: %s"))
    assert not keep(_record(f"{site}/clu/platform/local.py", 20, "Setting work unit notes: %s"))
    assert not keep(_record(f"{site}/orbax/checkpoint/_src/x.py", 30, "Closing _NonBlockingMetadataStore"))
    assert not keep(_record(f"{site}/orbax/checkpoint/_src/x.py", 20, "Finished saving"))
    error = _record(f"{site}/orbax/checkpoint/_src/x.py", 40, "save failed", exc=True)
    assert keep(error) and error.exc_info is None  # one line; the exception is reported by the project
    assert keep(_record(f"{site}/jax/_src/xla_bridge.py", 30, "An NVIDIA GPU may be present"))
    assert not keep(_record(f"{site}/jax/_src/dispatch.py", 20, "Finished tracing"))


@pytest.mark.slow
def test_quiet_console_mutes_tensorflows_notices_when_something_imports_it():
    """No command imports TensorFlow up front; a tfds dataset (or clu's remote writer) may, and
    then its C++ notices at import stay off the quiet console (not off --verbosity=1's)."""
    code = ("import sys\nfrom absl import flags, logging\nflags.FLAGS(sys.argv[:1] + sys.argv[1:])\n"
            "from skipless_jax import cli\ncli.quiet_console()\nprint('imported', 'tensorflow' in sys.modules)\n"
            "import tensorflow.compat.v2 as tf\nimport tensorflow\n"
            "print(float(tf.constant(2.0) * 3), tensorflow.__spec__.origin.endswith('tensorflow/__init__.py'))\n")

    def run(*args):
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=240,
                              cwd=sr.ROOT, env=sr.env(1))

    quiet, verbose = run(), run("--verbosity=1")
    for result in (quiet, verbose):
        assert result.stdout.split() == ["imported", "False", "6.0", "True"], result.stdout + result.stderr[-2000:]
    if "oneDNN" not in verbose.stderr and "InitializeLog" not in verbose.stderr:
        pytest.skip("this TensorFlow prints no notices at import")
    assert "oneDNN" not in quiet.stderr and "InitializeLog" not in quiet.stderr, quiet.stderr[-2000:]


# ---- Runs of the tiny config (CLI in subprocesses, 1 CPU device).


@pytest.fixture(scope="module")
def environ(tmp_path_factory):
    return sr.env(1, cache_dir=os.path.join(sr.session_dir(tmp_path_factory), "jax_cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, environ):
    """(workdir, final metrics, final state, its log) of the uninterrupted run (shared with test_preemption.py)."""
    workdir = sr.run_once(tmp_path_factory, "preemption_uninterrupted", OVERRIDES, environ, TIMEOUT)
    with open(os.path.join(workdir, "final_metrics.json")) as f:
        final = json.load(f)
    return workdir, final, checkpoint.load_raw(workdir, STEPS)[1], sr.tail(workdir + ".log", 10**6)


@pytest.mark.slow
def test_the_console_of_a_run_is_its_own_lines(reference):
    log = reference[3]
    for chatter in ("oneDNN", "InitializeLog", "type_handler_registry", "_NonBlockingMetadataStore",
                    "Setting work unit notes"):
        assert chatter not in log, chatter
    assert not re.search(r"\] \[\d+\] ", log), "the logging writer's scalar dumps ('[12] test/accuracy=...')"
    assert log.count("[Hyperparameters] {") == 1
    for line in ("[Hyperparameters]", "Progress: ", f"({STEPS}/{STEPS}), ETA", f"Step {STEPS}: test_accuracy=",
                 f"Saving the checkpoint of step {EVERY} in", f"Final (supervised, step {STEPS}): "):
        assert line in log, line
    with open(os.path.join(reference[0], cli.CONSOLE_LOG)) as f:  # the workdir's copy: the same lines
        copy = f.read().splitlines()
    assert copy[-2].startswith(f"Final (supervised, step {STEPS}): test_accuracy=") and copy[-1].endswith("] Done.")
    assert [line for line in copy if line not in log] == []
    assert sum("[Hyperparameters]" in line for line in copy) == 1 and any("Progress: " in line for line in copy)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "truncated", "step-only"])
def test_final_metrics_lost_after_the_last_checkpoint_are_evaluated_again(tmp_path, environ, reference, damage):
    workdir = str(tmp_path / "run")
    shutil.copytree(reference[0], workdir)
    path = os.path.join(workdir, "final_metrics.json")
    if damage == "missing":
        os.remove(path)
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    else:  # what the rerun of a run stopped at its end wrote before this fix
        with open(path, "w") as f:
            json.dump({"step": STEPS}, f)
    history_path = os.path.join(workdir, "history.jsonl")
    with open(history_path) as f:
        history = f.read()
    out = sr.run(sr.command(workdir, OVERRIDES), environ, str(tmp_path / "rerun.log"), TIMEOUT)
    assert f"the checkpoint of step {STEPS} has no valid final_metrics.json; running its final evaluation again" in out
    assert "Traceback" not in out and "JSONDecodeError" not in out
    with open(path) as f:
        assert json.load(f) == reference[1]  # exactly the uninterrupted run's
    summary = ", ".join(f"{k}={v:.4f}" for k, v in sorted(reference[1].items())
                        if not k.startswith("train_") and k != "step")
    assert f"Final (supervised, step {STEPS}): {summary}" in out
    with open(history_path) as f:
        assert f.read() == history  # nothing recorded twice


def _slowed_run(tmp_path, environ, at_least: int, delay: str = DELAY):
    workdir, progress, log = str(tmp_path / "run"), str(tmp_path / "progress"), str(tmp_path / "run.log")
    proc = sr.start(sr.command(workdir, OVERRIDES), dict(environ, SKIPLESS_STEP_DELAY=delay,
                                                         SKIPLESS_PROGRESS=progress), log)
    # Past step EVERY, its checkpoint must be on disk too (a signal then has a save to compare with).
    sr.wait_until(lambda: sr.read_progress(progress) >= at_least
                  and (at_least <= EVERY or EVERY in sr.steps_on_disk(workdir)), [proc], log, TIMEOUT)
    return workdir, proc, log


@pytest.mark.slow
def test_first_ctrl_c_saves_exits_130_and_the_rerun_ends_bitwise_equal(tmp_path, environ, reference):
    workdir, proc, log = _slowed_run(tmp_path, environ, EVERY + 2)
    proc.send_signal(signal.SIGINT)
    assert sr.finish(proc, log, TIMEOUT) == 130, sr.tail(log)
    text = sr.tail(log, 10**6)
    saved = max(sr.steps_on_disk(workdir))
    assert EVERY < saved < STEPS, saved
    assert (f"Interrupted at step {saved}: checkpoint saved in {workdir}; rerun the same command to resume "
            "(exit status 130).") in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    out = sr.run(sr.command(workdir, OVERRIDES), environ, str(tmp_path / "rerun.log"), TIMEOUT)
    assert f"at step {saved}." in out
    step, state = checkpoint.load_raw(workdir, STEPS)
    for part in ("params", "opt_state", "rng", "nonfinite"):
        jax.tree.map(np.testing.assert_array_equal, state[part], reference[2][part])
    with open(os.path.join(workdir, "final_metrics.json")) as f:
        final = json.load(f)
    assert {k: v for k, v in final.items() if not k.startswith("train_")} == {
        k: v for k, v in reference[1].items() if not k.startswith("train_")}


@pytest.mark.slow
def test_second_ctrl_c_exits_at_once(tmp_path, environ):
    # 2 s a step: the second Ctrl-C comes while the first waits for the step's end (two signals
    # sent back to back could reach a process that a loaded machine has not scheduled as one).
    # From step 2 on: the first step (its compilation) is behind.
    workdir, proc, log = _slowed_run(tmp_path, environ, 2, delay="2")
    proc.send_signal(signal.SIGINT)
    sr.wait_until(lambda: "Ctrl-C: saving this step" in sr.tail(log, 10**6), [proc], log, TIMEOUT)
    proc.send_signal(signal.SIGINT)
    assert sr.finish(proc, log, 30) == 130, sr.tail(log)
    text = sr.tail(log, 10**6)
    assert "Interrupted again: exiting now, without saving (exit status 130)." in text
    assert "Traceback" not in text


@pytest.mark.slow
def test_full_disk_is_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    # 700 KiB holds the tiny run's first checkpoint (and its logs), not the second one.
    lines, err, last = _full_disk_run(tmp_path, "700k", [*OVERRIDES, "--config.profile_steps=0"],
                                      '; ls "$MNT/run/checkpoints"')
    run = f"{tmp_path / 'mnt'}/run"
    # The second save, or whatever the run writes beside it (its logs) while that save fills the disk.
    assert re.match(rf"error: the disk is full: (a checkpoint save in {run}/checkpoints|writing a file in {run}) "
                    r"failed", last), last
    good = int(last.split("the last good checkpoint is step ")[1].split(",")[0])
    assert good in [int(n) for n in lines[1:] if n.isdigit()], lines
    assert _fault_lines(err) == [last], err[-3000:]


def _full_disk_run(tmp_path, size: str, overrides: list[str], then: str = "") -> tuple[list[str], str, str]:
    """(the words the script printed: rc=1 first, its stderr, that stderr's last line) of the tiny
    run on a tmpfs of `size`, with `then` (sh) after it."""
    script = f'{" ".join(sr.command("$MNT/run", overrides))} 2> "$MNT/../err"; echo "rc=$?"{then}'
    result = _namespace_tmpfs(f"size={size}", script, tmp_path)
    err = (tmp_path / "err").read_text()
    words = result.stdout.split()
    assert words[0] == "rc=1", result.stdout + err[-3000:]
    return words, err, err.strip().splitlines()[-1]


def _fault_lines(err: str) -> list[str]:
    """The lines of `err` that are not the run's own progress (this project's INFO and WARNING
    records, and the settings' wrapped lines): orbax's errors, tracebacks (their first and last
    lines; tensorstore's late 'Event loop is closed' ones too), ours."""
    own = re.compile(r"[IW]\d{4} [\d:.]+ +\d+ \w+\.py:\d+\] ")
    return [line for line in err.splitlines() if line.strip() and not own.match(line) and not line.startswith(" ")]


@pytest.mark.slow
def test_a_full_disk_under_the_profiler_trace_is_one_line(tmp_path):
    # 128 KiB holds the logs and the first steps (about 10 KB), not the trace of steps 3-5: its
    # xplane.pb is about 250 KB, its trace.json.gz about 65 KB. Which of the two meets the full
    # disk depends on their order and sizes, so either may be the one named.
    _, err, last = _full_disk_run(tmp_path, "128k", [f"--config.total_steps={STEPS}", "--config.profile_steps=3"])
    assert re.fullmatch(rf"error: the disk is full: writing {tmp_path / 'mnt'}/run/plugins/profile/[\d_]+/"
                        r"\S+\.(?:xplane\.pb|trace\.json\.gz) "
                        r"failed \(No space left on device\); no checkpoint was saved yet; free space and rerun "
                        "the same command to resume", last), last
    assert _fault_lines(err) == [last], err[-3000:]


def test_analyze_does_not_report_a_field_the_trainer_derived(monkeypatch, capsys):
    from skipless_jax import analyze

    from util import load_config

    config = load_config("quickstart")
    assert config.schedule.get("warmup_steps") is None  # the trainer derives it from warmup_epochs
    saved = config.to_dict()
    saved["schedule"]["warmup_steps"] = 112
    monkeypatch.setattr(checkpoint, "saved_config", lambda workdir: saved)
    monkeypatch.setattr(os.path, "isdir", lambda path: True)
    assert analyze.config_of_workdir(config, "run").schedule.warmup_steps == 112
    assert "differs" not in capsys.readouterr().out
    config.model.depth = 8  # a real difference is still reported
    analyze.config_of_workdir(config, "run")
    assert "differs from the config saved in run (model.depth)" in capsys.readouterr().out


@pytest.mark.slow
def test_analyze_prints_what_it_wrote_and_draws_the_jacobian(tmp_path, capsys):
    from skipless_jax import analyze

    from util import tiny_config

    analyze.analyze(tiny_config("skip_sab=False,skip_ffn=False,init=skipless"), output_dir=str(tmp_path),
                    num_images=2, jacobian=True)
    written = [tmp_path / name for name in ("log_kappa.png", "log_kappa.json", "jacobian.png")]
    assert capsys.readouterr().out.splitlines()[-1] == f"Wrote {', '.join(map(str, written))}"
    with open(tmp_path / "jacobian.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_checkpoint_with_resolved_warmup_steps_resumes_as_the_same_config(monkeypatch):
    """Trainers once wrote schedule.warmup_steps (from warmup_epochs) into the config they saved;
    now they pass it to the optimizer and leave the config as it is. Such a checkpoint resumes
    without a config change while the warm-up it holds is the one the trainer derives."""
    from skipless_jax import pretrained

    from util import tiny_config

    config = tiny_config(**{"schedule.warmup_steps": None, "schedule.warmup_epochs": 1})
    config_before = config.to_json()
    old = json.loads(config.to_json())
    old["schedule"]["warmup_steps"] = 45
    monkeypatch.setattr(checkpoint, "saved_config", lambda workdir: old)
    assert not pretrained.check_saved_config(config, "w", False, derived={"schedule.warmup_steps": 45})
    with pytest.raises(pretrained.ConfigChangedError, match=r"schedule.warmup_steps: 45 -> None"):
        pretrained.check_saved_config(config, "w", False, derived={"schedule.warmup_steps": 46})
    with pytest.raises(pretrained.ConfigChangedError, match=r"schedule.warmup_steps"):
        pretrained.check_saved_config(config, "w", False)
    assert config.to_json() == config_before
