"""Every command at its edges (issue 40): the last step saved before the final evaluation, one
run per workdir (main and sweep), report's unknown metrics, the smaller command-line faults."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_report import make_runs

from skipless_jax import evaluators, report, sweep, workdir_lock
from skipless_jax.trainers import supervised

import subprocess_runs as sr
from util import load_config, tiny_config


@pytest.mark.slow
def test_the_last_step_is_on_disk_before_the_final_evaluation(tmp_path, monkeypatch):
    """A crash during the final evaluation (here an error raised by it; SIGKILL or a second Ctrl-C
    likewise) loses no step: the checkpoint of the last step is already written when the
    evaluation starts, and the rerun only evaluates it again."""
    workdir = str(tmp_path / "run")
    config = tiny_config(total_steps=6, log_every_steps=3)
    run_all, on_disk = evaluators.run_all, []

    def crashing(evals, ctx, params, step=None, total_steps=None):
        if step is not None and step == total_steps:
            on_disk.append(sr.steps_on_disk(workdir))
            raise RuntimeError("killed during the final evaluation")
        yield from run_all(evals, ctx, params, step, total_steps)

    monkeypatch.setattr(evaluators, "run_all", crashing)
    with pytest.raises(RuntimeError, match="killed during the final evaluation"):
        supervised.train_and_evaluate(config, workdir)
    assert on_disk == [[6]], on_disk  # the last step (6), finished, as evaluation began
    assert not os.path.exists(os.path.join(workdir, "final_metrics.json"))
    monkeypatch.setattr(evaluators, "run_all", run_all)
    final = supervised.train_and_evaluate(config, workdir)  # resumed at its last step: evaluates only
    assert final["step"] == 6 and "test_accuracy" in final
    records = _history_records(workdir)
    assert len(records) == len(set(records)), records  # no step trained twice


# ---- 1. One run per workdir, one sweep per root.

TIMEOUT = 300


@pytest.fixture(scope="module")
def environ(tmp_path_factory):
    return sr.env(1, cache_dir=os.path.join(sr.session_dir(tmp_path_factory), "jax_cache"))


def _history_records(workdir: str) -> list[tuple[int, tuple[str, ...]]]:
    """(step, its fields) of each record of history.jsonl (a train and an eval record may share a step)."""
    with open(os.path.join(workdir, "history.jsonl")) as f:
        return [(r["step"], tuple(sorted(r))) for r in map(json.loads, f)]


@pytest.mark.slow
def test_a_second_main_on_a_workdir_is_refused_and_a_killed_ones_lock_is_taken_over(tmp_path, environ):
    workdir, progress, log = str(tmp_path / "run"), str(tmp_path / "progress"), str(tmp_path / "first.log")
    # 24 steps of ≥ 1 s: the first run outlives the second's start on a loaded machine (it is
    # killed once the second is refused); the rerun resumes from its last checkpoint, undelayed.
    overrides = ["--config.total_steps=24", "--config.checkpoint_every_steps=4"]
    first = sr.start(sr.command(workdir, overrides), dict(environ, SKIPLESS_STEP_DELAY="1.0",
                                                          SKIPLESS_PROGRESS=progress), log)
    try:
        sr.wait_until(lambda: sr.read_progress(progress) >= 2, [first], log, TIMEOUT)
        second = subprocess.run(sr.command(workdir, overrides), env=environ, cwd=sr.ROOT, capture_output=True,
                                text=True, timeout=TIMEOUT)
        lines = [line for line in (second.stdout + second.stderr).splitlines() if line.strip()]
        assert second.returncode == 1, second.stderr[-3000:]
        assert len(lines) == 1, lines
        assert re.fullmatch(
            rf"error: --workdir={re.escape(workdir)} is in use by another run \(host {re.escape(socket.gethostname())}"
            rf", pid {first.pid}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC; lock {re.escape(workdir)}/\.lock\): "
            "wait for it to end, or use another folder", lines[0]), lines[0]
        assert first.poll() is None  # the first run goes on
        first.send_signal(signal.SIGKILL)  # its lock stays behind, stale
        assert sr.finish(first, log, TIMEOUT) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    assert os.path.exists(os.path.join(workdir, ".lock"))
    out = sr.run(sr.command(workdir, overrides), environ, str(tmp_path / "rerun.log"), TIMEOUT)
    taken = [line for line in out.splitlines() if "taking over the lock" in line]
    assert len(taken) == 1 and f"pid {first.pid}," in taken[0], out[-3000:]
    records = _history_records(workdir)
    assert len(records) == len(set(records)) and records[-1][0] == 24, records  # every record once
    assert not os.path.exists(os.path.join(workdir, ".lock"))  # released at the end


def test_a_lock_is_stale_when_its_holder_is_gone_not_while_it_runs(tmp_path):
    folder = str(tmp_path / "w")
    me = workdir_lock.holder_record()
    assert not workdir_lock.is_stale(me, time.time())
    assert workdir_lock.is_stale({**me, "process_start": me["process_start"] + 1}, time.time())  # a reused pid
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert workdir_lock.is_stale({**me, "pid": child.pid}, time.time())
    elsewhere = {**me, "host": "another-host"}  # judged by the heartbeat (mtime)
    assert not workdir_lock.is_stale(elsewhere, time.time() - workdir_lock.STALE_S / 2)
    assert workdir_lock.is_stale(elsewhere, time.time() - workdir_lock.STALE_S - 1)
    os.makedirs(folder)
    path = os.path.join(folder, workdir_lock.LOCK)
    with open(path, "w") as f:
        json.dump(elsewhere, f)
    with pytest.raises(workdir_lock.WorkdirBusy, match=r"in use by another run \(host another-host, pid"):
        workdir_lock.acquire(folder)
    old = time.time() - workdir_lock.STALE_S - 5
    os.utime(path, (old, old))
    with workdir_lock.held(folder), open(path) as f:
        assert json.load(f)["token"] == workdir_lock._held[path]
    assert not os.path.exists(path)


@pytest.mark.slow
def test_a_second_sweep_on_a_root_is_refused(tmp_path, environ):
    root = str(tmp_path / "root")
    cmd = [sys.executable, "-m", "skipless_jax.sweep", f"--config={sr.TINY}", "--grid=seed=0", f"--root={root}",
           "--config.total_steps=100000"]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=environ, cwd=sr.ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        sr.wait_until(lambda: os.path.exists(os.path.join(root, "seed=0", "sweep_run.json")), [first],
                      str(tmp_path / "first.log"), TIMEOUT)
        second = subprocess.run(cmd, env=environ, cwd=sr.ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    lines = [line for line in (second.stdout + second.stderr).splitlines() if line.strip()]
    assert second.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: --root={root} is in use by another run (host {socket.gethostname()}, "
                               f"pid {first.pid}, started "), lines[0]


# ---- 8. report --metrics names metrics the runs have.


def test_report_metrics_that_no_run_has_is_one_line_listing_theirs(tmp_path, capsys):
    make_runs(str(tmp_path))
    assert report.main([str(tmp_path), "--metrics=test_acuracy,train_loss"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == ["error: --metrics: 'test_acuracy' is in no run's final_metrics.json; "
                                    "the runs have: step, test_accuracy, train_loss"], out.err
    assert report.main([str(tmp_path), "--metrics=train_loss"]) == 0


# ---- 10. The smaller ones.


def test_grid_with_an_empty_value_or_two_values_in_one_folder_is_one_line(tmp_path):
    config = str(tmp_path / "cfg.py")
    with open(config, "w") as f:
        f.write("import ml_collections\nfrom skipless_jax import config_args\n\n"
                "def get_config(arg=None):\n"
                "    return ml_collections.ConfigDict(config_args.parse(arg, depth=4, tag='x'))\n")
    for grid in ("depth=8,,12", "depth=8,12,", "depth=,8"):
        with pytest.raises(ValueError, match=re.escape(f"grid axis {grid!r} has an empty value")):
            sweep.expand(config, grid)
    with pytest.raises(ValueError, match=r"runs 'tag=a/b' and 'tag=a:b' would share the folder 'tag=a_b'"):
        sweep.expand(config, "tag=a/b,a:b")
    assert [r.name for r in sweep.expand(config, "depth=8,12")] == ["depth=8", "depth=12"]


def test_report_plot_says_where_it_wrote(tmp_path, capsys):
    make_runs(str(tmp_path / "runs"))
    png = str(tmp_path / "curves.png")
    assert report.main([str(tmp_path / "runs"), "--format=csv", f"--plot={png}"]) == 0
    out = capsys.readouterr()
    assert out.err.splitlines() == [f"report: wrote {png}"] and os.path.getsize(png) > 0
    assert out.out.startswith("run,")  # the table alone on stdout


def test_warmup_longer_than_the_run_names_the_arg_to_add():
    with pytest.raises(ValueError, match=re.escape(
            "config.schedule.warmup_epochs=5 is a warm-up of 113 steps, longer than the run's 68 steps "
            "(config.total_epochs=3); allowed: at most 68 steps, e.g. add --config.schedule.warmup_epochs=1 "
            "(whole epochs; about an eighth of the run)")):
        supervised.check_config(load_config("quickstart", "epochs=3"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_final_evaluation_says_what_happens(signum, caplog):
    from skipless_jax.trainers.signals import SignalFlag

    flag = SignalFlag()
    try:
        flag.final = True
        with caplog.at_level("WARNING"):
            os.kill(os.getpid(), signum)
            time.sleep(0.05)
    finally:
        flag.close()
    (message,) = [r.getMessage() for r in caplog.records]
    assert "during the final evaluation: the last step is saved; the evaluation finishes, then the run ends " \
        "(exit status 0)" in message, message
    assert "will checkpoint and stop" not in message


# ---- 4. Ctrl-C on a sweep is a preemption.


def _sweep_in_its_loop(tmp_path, environ) -> tuple[subprocess.Popen, str, str]:
    """A real sweep of two tiny runs, one at a time, in its own process group (as a terminal
    starts it), once its first run is training (its first history record is written)."""
    root, log = str(tmp_path / "root"), str(tmp_path / "sweep.log")
    cmd = [sys.executable, "-m", "skipless_jax.sweep", f"--config={sr.TINY}", "--grid=seed=0,1", f"--root={root}",
           "--config.total_steps=100000"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=environ, cwd=sr.ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sr.wait_until(lambda: os.path.exists(os.path.join(root, "seed=0", "history.jsonl")), [proc], log, TIMEOUT)
    return proc, root, log


@pytest.mark.slow
def test_ctrl_c_on_a_sweep_saves_its_runs_summarizes_and_exits_130(tmp_path, environ):
    proc, root, log = _sweep_in_its_loop(tmp_path, environ)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    assert sr.finish(proc, log, TIMEOUT) == 130, sr.tail(log)
    lines = [line for line in sr.tail(log, 10**6).splitlines() if line.strip()]
    assert "Traceback" not in "\n".join(lines) and "KeyboardInterrupt" not in "\n".join(lines), lines
    assert "sweep: 2 runs: 0 trained, 0 already finished, 2 preempted, 0 failed" in lines, lines
    assert "sweep: preempted seed=0: rerun the same command to resume" in lines
    assert lines[-1] == "sweep: interrupted (Ctrl-C): rerun the same command to resume (exit status 130)"
    assert sr.steps_on_disk(os.path.join(root, "seed=0")), "the run saved its step"
    with open(os.path.join(root, "seed=0", "train.log")) as f:
        assert "rerun the same command to resume (exit status 130)." in f.read()
    assert not os.path.exists(os.path.join(root, "seed=1"))  # never started


@pytest.mark.slow
def test_a_second_ctrl_c_stops_a_sweep_at_once(tmp_path, environ):
    proc, root, log = _sweep_in_its_loop(tmp_path, environ)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    assert sr.finish(proc, log, 30) == 130, sr.tail(log)
    assert "sweep: interrupted again: stopping the runs now, without saving (exit status 130)" in sr.tail(log)
    with pytest.raises(ProcessLookupError):  # no run of the group is left, nor a zombie
        os.killpg(proc.pid, 0)


# ---- 7. Quiet tools: main's console for every command.


def _tool(*args: str, module: str) -> tuple[int, list[str]]:
    """(exit status, the non-empty lines of stdout and stderr together) of `python -m module args`."""
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=sr.ROOT, env=sr.env(1))
    return done.returncode, [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    workdir = str(tmp_path_factory.mktemp("quiet") / "run")
    supervised.train_and_evaluate(tiny_config(total_steps=2, log_every_steps=2), workdir)
    return workdir


@pytest.mark.slow
def test_export_and_timm_convert_print_their_one_line(trained, tmp_path):
    code, lines = _tool(f"--workdir={trained}", module="skipless_jax.export")
    assert code == 0 and len(lines) == 1 and lines[0].startswith(f"wrote {trained}/export: step 2, logits"), lines
    code, lines = _tool(f"--workdir={trained}", "--verbosity=1", module="skipless_jax.export")
    assert code == 0 and len(lines) > 1 and lines[0].startswith("wrote "), lines  # the libraries' lines are back
    code, lines = _tool("--reverse", f"--input={trained}", f"--output={tmp_path / 'back.safetensors'}",
                        module="skipless_jax.timm_convert")
    assert code == 1 and lines == ["error: config.model.gelu='tanh': timm's vit cannot express it (it needs "
                                   "gelu='exact')"], lines


@pytest.mark.slow
def test_timm_convert_prints_its_one_line(tmp_path):
    """A timm ViT-Ti/16 state dict (zeros in timm's names and layouts, written by `to_timm`) in:
    the success line alone (it printed 61-66 lines of orbax's bookkeeping)."""
    import numpy as np

    from skipless_jax import timm_convert

    cfg = timm_convert.model_config("vit", "Ti/16")
    params: dict = {}
    for path, shape in timm_convert.abstract_params(cfg, 1000, 224).items():
        *parents, leaf = path.split("/")
        node = params
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = np.zeros(shape, np.float32)
    npz = str(tmp_path / "vit_ti.npz")
    np.savez(npz, **timm_convert.to_timm("vit", params, cfg))
    code, lines = _tool("--family=vit", "--variant=Ti/16", f"--input={npz}", f"--output={tmp_path / 'out'}",
                        module="skipless_jax.timm_convert")
    assert code == 0 and len(lines) == 1 and str(tmp_path / "out") in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("module", ["skipless_jax.sweep", "skipless_jax.report", "skipless_jax.export",
                                    "skipless_jax.timm_convert"])
def test_no_tool_prints_orbaxs_type_handler_warning(module):
    code, lines = _tool("--help", module=module)
    assert code == 0 and not [line for line in lines if "Type handler registry" in line or "WARNING" in line], lines


# ---- 2. The default trace: small, once per run (the full-disk lines: tests/test_lifecycle.py).


def test_the_trace_is_taken_once_per_run_without_python_events_or_hlo(tmp_path):
    import ml_collections

    from skipless_jax.trainers import profiler

    config = ml_collections.ConfigDict(dict(profile_steps=None))
    first = profiler.Profiler(config, str(tmp_path), first_step=0, total_steps=100)
    assert first.enabled and (first.start, first.stop) == (3, 6)  # 3 steps after 2 of warm-up
    assert first.options.python_tracer_level == 0 and not first.options.enable_hlo_proto
    os.makedirs(tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00")
    assert not profiler.Profiler(config, str(tmp_path), first_step=40, total_steps=100).enabled  # a resume
    config.profile_hlo = True
    assert profiler.Profiler(config, str(tmp_path / "other"), 0, 100).options.enable_hlo_proto


# ---- 6. The converters' bad inputs: one line each.


@pytest.mark.slow
def test_truncated_or_unreadable_converter_inputs_are_one_line(tmp_path):
    import numpy as np

    from skipless_jax import timm_convert

    npz = str(tmp_path / "sd.npz")
    np.savez(npz, **{"cls_token": np.zeros((1, 1, 8), np.float32), "pos_embed": np.zeros((1, 5, 8), np.float32)})
    os.truncate(npz, os.path.getsize(npz) // 2)
    with pytest.raises(ValueError, match=rf"^--input='{re.escape(npz)}' is not a readable \.npz \(BadZipFile: .*\); "
                       r"is the file complete\? Write it again with numpy\.savez$"):
        timm_convert.load_state_dict(npz)
    code, lines = _tool("--family=vit", "--variant=Ti/16", f"--input={npz}", f"--output={tmp_path / 'out'}",
                        module="skipless_jax.timm_convert")
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"error: --input='{npz}' is not a readable"), lines

    st = str(tmp_path / "sd.safetensors")
    with open(st, "wb") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"cls_token\"")  # a header cut short
    try:
        import safetensors  # noqa: F401
    except ImportError:
        pass
    else:
        with pytest.raises(ValueError, match=r"is not a readable \.safetensors file .*Download it again$"):
            timm_convert.load_state_dict(st)


def test_a_safetensors_input_without_the_package_is_one_line(tmp_path, monkeypatch):
    """The reader missing (a None entry in sys.modules makes its import fail, installed or not):
    one line naming the package and the extra."""
    from skipless_jax import timm_convert

    st = str(tmp_path / "sd.safetensors")
    with open(st, "wb") as f:
        f.write(b"\x00" * 16)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ValueError, match=rf"^--input='{re.escape(st)}' is a \.safetensors file; reading it needs the "
                       r"safetensors package \(pip install safetensors, or 'skipless_jax\[timm\]'\)"):
        timm_convert.load_state_dict(st)


def test_reverse_of_a_dino_workdir_says_it_is_not_supported(tmp_path):
    import numpy as np

    from skipless_jax import timm_convert

    folder = str(tmp_path / "dino")
    timm_convert.save_state(folder, {"params": {"w": np.zeros((2,), np.float32)}},
                            json.dumps({"trainer": "dino", "model": {"name": "vit", "depth": 2}}))
    with pytest.raises(ValueError, match=r"is a dino workdir: its backbone .* has no timm counterpart that --reverse "
                       r"writes; reverse a supervised run, or fine-tune this one first"):
        timm_convert.read_checkpoint(folder)


# ---- 5. evaluate on a timm-converted checkpoint.


def test_evaluate_runs_on_a_converted_checkpoint_with_the_dataset_of_config(tmp_path):
    import numpy as np
    from test_timm_convert import VIT_CFG, vit_state_dict

    from skipless_jax import evaluate, timm_convert

    sd = vit_state_dict(channels=1)  # digits: 8×8 grey images, 10 classes
    rng = np.random.default_rng(0)
    sd["head.weight"], sd["head.bias"] = rng.normal(size=(10, 8)).astype(np.float32), np.zeros(10, np.float32)
    folder = str(tmp_path / "converted")
    result = timm_convert.convert("vit", sd, VIT_CFG, num_classes=10, image_size=8)
    timm_convert.write_checkpoint(result["params"], folder, VIT_CFG, "synthetic.npz")
    with pytest.raises(ValueError, match=r"holds a converted checkpoint \(from synthetic\.npz\), whose saved config "
                       r"is its model only and names no dataset; pass --config=configs/X\.py"):
        evaluate.evaluate(folder)
    metrics = evaluate.evaluate(folder, tiny_config())
    assert metrics["step"] == 0 and 0.0 <= metrics["test_accuracy"] <= 1.0, metrics
    with open(os.path.join(folder, "evaluation.json")) as f:
        assert json.load(f) == metrics


# ---- 9. No library code sets matplotlib's backend.

_DRAW_EVERYTHING = """
import os, sys
import matplotlib
matplotlib.use("svg")  # stands for a notebook's inline backend: whatever the user chose
import numpy as np
from skipless_jax import analyze, pictures, report
out = sys.argv[1]
analyze.plot_log_kappa({"sab": [1.0, 2.0], "sab_skip": [0.5, 1.0]}, f"{out}/k.png", "t", {"ref": 1.0}, ("sab_skip",))
analyze.plot_jacobian([{"log_kappa_K": 1.0, "log_kappa_B": 1.1, "log_kappa_block": 2.0, "rel_diff_K_B": 0.1}] * 2,
                      f"{out}/j.png", "t")
pictures.image_grid(f"{out}/g.png", [("a", np.zeros((2, 4, 4, 1)))], "t")
table = [{"run": "seed=0", "seed": "0", "depth": "8", "test_accuracy": 0.5}]
report.plot_final(table, f"{out}/f.png", "test_accuracy", "depth", ["seed", "depth"])
print(matplotlib.get_backend(), "pyplot" in " ".join(sys.modules))
"""


@pytest.mark.slow
def test_the_figures_are_saved_and_the_callers_backend_is_left_alone(tmp_path):
    done = subprocess.run([sys.executable, "-c", _DRAW_EVERYTHING, str(tmp_path)], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=sr.ROOT, env=sr.env(1))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["svg", "False"], done.stdout  # backend unchanged, pyplot never imported
    for name in "kjgf":
        with open(tmp_path / f"{name}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.slow
def test_a_dino_export_describes_features_without_num_classes(tmp_path):
    from test_dino import tiny_dino_config

    from skipless_jax import export
    from skipless_jax.trainers import dino

    workdir = str(tmp_path / "dino")
    dino.train_and_evaluate(tiny_dino_config(total_steps=2, checkpoint_every_steps=0), workdir)
    _, meta = export.forward(workdir)
    assert meta["output"] == "features" and "num_classes" not in meta, sorted(meta)


def test_a_bucket_workdir_is_not_locked_and_says_so(caplog):
    import logging

    from skipless_jax import main

    with caplog.at_level(logging.WARNING, logger="absl"):
        main.lock_workdir("gs://bucket/run")
    assert [r.getMessage() for r in caplog.records] == [
        "--workdir=gs://bucket/run is a bucket: it is not locked against a second run; start one run per workdir."]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["events", "history", "final_metrics"])
def test_a_full_disk_under_the_runs_own_writes_is_one_line_naming_the_file(tmp_path, monkeypatch, where):
    """ENOSPC from the event file, history.jsonl or final_metrics.json (the tmpfs runs of
    test_lifecycle fill the disk at the checkpoint or the trace first) reaches main's handler with
    its file, and `disk_full_write` makes it the one line main prints."""
    import errno

    from etils import epath

    from skipless_jax import checkpoint
    from skipless_jax.trainers import writers

    workdir = str(tmp_path / "run")
    named = {"events": None, "history": os.path.join(workdir, "history.jsonl"),
             "final_metrics": os.path.join(workdir, "final_metrics.json")}[where]

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    if where == "events":
        def write(self, event):
            full(self.path)
        monkeypatch.setattr(writers.EventFileWriter, "_write", write)
    else:
        path_type = type(epath.Path(workdir))  # the concrete class (a local path's)
        opened, written = path_type.open, path_type.write_text
        monkeypatch.setattr(path_type, "open", lambda self, mode="r", *a, **k: full(self) if str(self) == named
                            and "a" in mode else opened(self, mode, *a, **k))
        monkeypatch.setattr(path_type, "write_text", lambda self, *a, **k: full(self) if str(self) == named
                            else written(self, *a, **k))
    with pytest.raises(Exception) as caught:
        supervised.train_and_evaluate(tiny_config(total_steps=6, log_every_steps=3), workdir)
    line = str(checkpoint.disk_full_write(caught.value, workdir))
    if where == "events":
        assert re.fullmatch(rf"the disk is full: writing {re.escape(workdir)}/\S*events\.out\.tfevents\.\S+ failed "
                            r"\(No space left on device\); no checkpoint was saved yet; free space and rerun the "
                            "same command to resume", line), line
    else:
        good = "the last good checkpoint is step 6, kept" if where == "final_metrics" else "no checkpoint was saved yet"
        assert line == (f"the disk is full: writing {named} failed (No space left on device); {good}; free space "
                        "and rerun the same command to resume"), line
