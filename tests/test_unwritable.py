"""Every command meets a folder it cannot write with one line (issue 57): a file where its folder
goes, a read-only workdir and a full disk, through the command lines. Exit status 2 for a folder
that cannot be written (as main's --workdir), 1 for a full disk (as main's failed save);
`evaluate` prints its metrics before it writes them; `export --output=DIR` writes elsewhere;
`generate`, which writes nothing, reads a read-only workdir."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from test_lifecycle import _namespace_tmpfs
from test_lm import environ, reference  # noqa: F401 (the LM run of tests/test_lm.py, trained once a session)

from skipless_jax import cli
from skipless_jax.trainers import supervised

import subprocess_runs as sr
from util import tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A finished tiny run (2 steps), in its own root (`<root>/run`: a sweep root for report)."""
    workdir = str(tmp_path_factory.mktemp("unwritable") / "run")
    supervised.train_and_evaluate(tiny_config(total_steps=2, log_every_steps=2), workdir)
    return workdir


def _lines(done) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


def _is_a_file(flag: str, value: str, file: str) -> str:
    return f"error: {flag}={value}: {file} is a file, not a directory"


# module, its args (FILE: a plain file where the command's output folder goes), the flag named.
TOOLS = {
    "export": ("skipless_jax.export", ["--workdir=RUN", "--output=FILE"], "--output=FILE"),
    "analyze": ("skipless_jax.analyze", ["--workdir=RUN", "--output_dir=FILE/analysis"], "--output_dir=FILE/analysis"),
    "sweep": ("skipless_jax.sweep", ["--config=tests/configs/tiny.py", "--grid=seed=0", "--root=FILE"], "--root=FILE"),
    "report": ("skipless_jax.report", ["ROOT", "--plot=FILE/curves.png"], "--plot=FILE/curves.png"),
    "timm_convert": ("skipless_jax.timm_convert", ["--reverse", "--input=RUN", "--output=FILE/vit.safetensors"],
                     "--output=FILE/vit.safetensors"),
    "official_convert": ("skipless_jax.official_convert", ["--source=dino", "--input=RUN/x.pth",
                                                           "--config=configs/quickstart.py", "--workdir=FILE"],
                         "--workdir=FILE"),
}


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_file_where_the_output_folder_goes_is_one_line_status_2(tool, trained, tmp_path):
    module, args, named = TOOLS[tool]
    file = tmp_path / "a_file"
    file.write_text("x")
    fill = lambda text: text.replace("FILE", str(file)).replace("RUN", trained).replace(
        "ROOT", os.path.dirname(trained))
    done = sr.run_cli(module, *map(fill, args))
    flag, _, value = fill(named).partition("=")
    assert (done.returncode, _lines(done)) == (2, [_is_a_file(flag, value, str(file))]), done.stderr[-3000:]


@pytest.mark.slow
def test_evaluate_prints_its_metrics_then_one_line_when_they_cannot_be_written(trained, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(trained, workdir)
    with open(os.path.join(workdir, "eval"), "w") as f:  # where the per-evaluator files go
        f.write("x")
    done = sr.run_cli("skipless_jax.evaluate", f"--workdir={workdir}")
    lines = _lines(done)
    assert done.returncode == 2 and len(lines) == 2, done.stderr[-3000:]
    assert lines[0].startswith("Evaluated step 2: test_accuracy=") and "test_loss=" in lines[0]
    assert lines[1] == _is_a_file("--workdir", workdir, os.path.join(workdir, "eval"))


@pytest.mark.slow
def test_export_of_a_read_only_workdir_goes_elsewhere_and_a_full_disk_is_one_line(trained, tmp_path):
    """In a private mount namespace: the run bound read-only at $MNT/ro (a tmpfs of 16 KiB, too
    small for the artifact): its default export folder cannot be made (status 2, nothing is
    lowered), `--output` elsewhere writes it, `--output` on the full tmpfs is one line (status 1)."""
    out = tmp_path / "elsewhere"
    export = f"{sys.executable} -m skipless_jax.export --workdir=$MNT/ro --platforms=cpu"
    script = (f'mkdir "$MNT/ro" && mount --bind {trained} "$MNT/ro" && mount -o remount,bind,ro "$MNT/ro" || exit 98\n'
              f'{export} 2>&1; echo "rc=$?"\n{export} --output={out} 2>&1; echo "rc=$?"\n'
              f'{export} --output="$MNT/full" 2>&1; echo "rc=$?"')
    result = _namespace_tmpfs("size=16k", script, tmp_path)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    mnt = tmp_path / "mnt"
    assert lines[:2] == [f"error: --output={mnt}/ro/export: {mnt}/ro is not writable (a read-only file system)",
                         "rc=2"], result.stdout + result.stderr
    assert lines[2].startswith(f"wrote {out}: step 2, logits [None, 10]") and lines[3] == "rc=0", lines
    assert lines[4:] == [f"error: --output={mnt}/full: the disk is full: writing a file in {mnt}/full failed "
                         "(No space left on device)", "rc=1"], lines
    assert sorted(os.listdir(out)) == ["model.jax", "model.json"]


@pytest.mark.slow
def test_generate_reads_a_read_only_lm_workdir(reference, tmp_path):  # noqa: F811
    """generate writes nothing: a read-only workdir gives its text as a writable one does."""
    command = f'{sys.executable} -m skipless_jax.generate --workdir="$MNT/ro" --prompt="def " --max_new_tokens=5'
    script = (f'mkdir "$MNT/ro" && mount --bind {reference} "$MNT/ro" && mount -o remount,bind,ro "$MNT/ro" || '
              f'exit 98\n{command} --temperature=0 2>&1; echo "rc=$?"')
    result = _namespace_tmpfs("size=64k", script, tmp_path)
    lines = result.stdout.splitlines()
    assert lines[-1] == "rc=0" and lines[0].startswith("def "), result.stdout + result.stderr


def test_write_errors_name_the_flag_and_why(tmp_path):
    import errno

    file = tmp_path / "a_file"
    file.write_text("x")
    assert cli.write_error(OSError(errno.ENOTDIR, "Not a directory", f"{file}/x.json"), "--output", str(file)) == (
        f"--output={file}: {file} is a file, not a directory", 2)
    denied = OSError(errno.EACCES, "Permission denied", f"{tmp_path}/x.json")  # e.g. root's chmod does not stop
    assert cli.write_error(denied, "--output", str(tmp_path)) == (
        f"--output={tmp_path}: writing {tmp_path}/x.json failed (Permission denied)", 2)
    full = OSError(errno.ENOSPC, "No space left on device", "/tmp/x/model.jax")
    assert cli.write_error(full, "--output", "/tmp/x") == (
        "--output=/tmp/x: the disk is full: writing /tmp/x/model.jax failed (No space left on device)", 1)
    assert cli.unwritable("gs://bucket/run") is None and cli.unwritable(os.getcwd()) is None
