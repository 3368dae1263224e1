"""The run's metric writers without TensorFlow (skipless_jax/trainers/writers.py): the event
files hold what TensorFlow's summary writer (clu's) wrote, read back by TensorBoard's own
loaders; the log and progress lines; a remote workdir falls back to clu's writer; a CLI run
writes TensorBoard's records of history.jsonl and never imports TensorFlow."""

from __future__ import annotations

import ast
import glob
import json
import logging as std_logging
import os
import re
import socket
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax import cli
from skipless_jax.trainers import writers

import subprocess_runs as sr
from util import read_scalars


def _accumulator(logdir: str):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def _scalars(acc) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the scalar-plugin tensors that EventAccumulator read."""
    from tensorboard.util import tensor_util

    return {tag: {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
            for tag in acc.PluginTagToContent("scalars")}


def _hparams(acc) -> dict[str, object]:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")[writers.HPARAMS_TAG]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def _write_some(writer: writers.MetricWriter, big: bool = True) -> None:
    writer.write_hparams({"model.depth": "12", "seed": "0", "mixed": True, "lr": 0.001})
    # `big` is beyond float32 (TensorFlow's writer raises on it; this one writes inf).
    writer.write_scalars(3, {"train/loss": 2.302585092994046, "count": np.float32(7), **({"big": 1e40} if big else {}),
                             "jax": jnp.asarray(0.25), "nan": float("nan")})
    writer.write_scalars(5, {"train/loss": 0.1})
    writer.close()


def _events(path: str) -> list:
    """The events of one file, read without TensorFlow: TFRecord framing (length 8 | masked
    crc32c of it 4 | data | masked crc32c of data 4), each crc checked."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    with open(path, "rb") as f:
        data = f.read()
    pos, out = 0, []
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
        payload = data[pos + 12:pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == masked_crc32c(payload)
        out.append(event_pb2.Event.FromString(payload))
        pos += 16 + length
    return out


def _values(folder) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the scalar tensors of the event files in `folder` (no TensorFlow)."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(os.path.join(str(folder), "events.out.tfevents.*"))):
        for event in _events(path):
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    assert v.tensor.dtype == 1 and not v.tensor.tensor_shape.dim  # DT_FLOAT, a scalar
                    out.setdefault(v.tag, {})[event.step] = float(np.frombuffer(v.tensor.tensor_content, "<f4")[0])
    return out


def test_event_file_holds_tensorflows_records_float32_scalars_and_hparams(tmp_path):
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    writer = writers.EventFileWriter(str(tmp_path / "run"))
    _write_some(writer)
    (path,) = glob.glob(str(tmp_path / "run" / "events.out.tfevents.*"))
    assert path == writer.path
    name = os.path.basename(path)
    assert re.fullmatch(rf"events\.out\.tfevents\.\d{{10}}\.{re.escape(socket.gethostname())}\.{os.getpid()}\.\d+\.v2",
                        name), name
    events = _events(path)
    assert events[0].file_version == "brain.Event:2"
    (hp,) = [v for e in events for v in e.summary.value if v.tag == writers.HPARAMS_TAG]
    assert hp.metadata.plugin_data.plugin_name == "hparams"
    info = plugin_data_pb2.HParamsPluginData.FromString(hp.metadata.plugin_data.content).session_start_info
    assert {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()} == {
        "model.depth": "12", "seed": "0", "mixed": True, "lr": 0.001}
    scalar_values = [v for e in events for v in e.summary.value if v.tag != writers.HPARAMS_TAG]
    assert all(v.metadata.data_class == summary_pb2.DATA_CLASS_SCALAR for v in scalar_values)
    scalars = _values(tmp_path / "run")
    assert sorted(scalars) == ["big", "count", "jax", "nan", "train/loss"]
    assert scalars["train/loss"] == {3: float(np.float32(2.302585092994046)), 5: float(np.float32(0.1))}
    assert scalars["count"] == {3: 7.0} and scalars["jax"] == {3: 0.25}
    assert scalars["big"] == {3: np.inf}
    assert np.isnan(scalars["nan"][3])


def test_each_write_reaches_the_file_before_close(tmp_path):
    """A watching TensorBoard sees a log period's records when they are written (no close needed)."""
    writer = writers.EventFileWriter(str(tmp_path))
    writer.write_scalars(4, {"train/loss": 1.5})
    assert _values(tmp_path) == {"train/loss": {4: 1.5}}
    writer.write_scalars(8, {"train/loss": 0.5})
    assert _values(tmp_path) == {"train/loss": {4: 1.5, 8: 0.5}}
    writer.close()
    writer.close()  # twice is harmless


def test_two_writers_of_one_second_write_two_files(tmp_path):
    a, b = writers.EventFileWriter(str(tmp_path)), writers.EventFileWriter(str(tmp_path))
    a.write_scalars(1, {"x": 1.0})
    b.write_scalars(2, {"x": 2.0})
    a.close()
    b.close()
    assert a.path != b.path and _values(tmp_path) == {"x": {1: 1.0, 2: 2.0}}


@pytest.mark.slow
def test_tensorboard_reads_the_event_file(tmp_path):
    """TensorBoard's EventAccumulator (and the tests' read_scalars) read what _values reads."""
    _write_some(writers.EventFileWriter(str(tmp_path)))
    acc = _accumulator(tmp_path)
    assert acc.file_version == 2.0
    scalars = _scalars(acc)
    assert scalars.keys() == _values(tmp_path).keys()
    for tag, values in _values(tmp_path).items():
        np.testing.assert_array_equal(list(scalars[tag].items()), list(values.items()))
    assert read_scalars(str(tmp_path))["train/loss"] == scalars["train/loss"]
    assert _hparams(acc) == {"model.depth": "12", "seed": "0", "mixed": True, "lr": 0.001}


@pytest.mark.slow
def test_same_records_as_clus_tensorflow_writer_which_a_remote_workdir_uses(tmp_path):
    """The same calls through clu's SummaryWriter (TensorFlow; what a 'scheme://' workdir gets,
    here file://) and through EventFileWriter: the same tags, steps, float32 bytes, metadata and
    hparams."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    remote = writers.event_writer(f"file://{tmp_path / 'clu'}")
    assert type(remote).__name__ == "AsyncWriter"
    local = writers.event_writer(str(tmp_path / "local"))
    assert isinstance(local, writers.EventFileWriter)
    _write_some(remote, big=False)
    _write_some(local, big=False)

    def values(folder):
        (path,) = glob.glob(str(tmp_path / folder / "events.out.tfevents.*"))
        out = []
        for event in EventFileLoader(path).Load():
            for v in event.summary.value:
                if v.tag == writers.HPARAMS_TAG:
                    continue
                out.append((event.step, v.tag, v.tensor.SerializeToString(), v.metadata.SerializeToString()))
        return sorted(out)

    assert values("local") == values("clu")
    assert _hparams(_accumulator(tmp_path / "local")) == _hparams(_accumulator(tmp_path / "clu"))


def test_logging_writer_lines_and_the_quiet_console(caplog):
    log = writers.LoggingWriter()
    with caplog.at_level(std_logging.INFO, logger="absl"):
        log.write_scalars(12, {"train/loss": 0.123456789, "count": 3, "a": np.float32(0.5)})
        log.write_hparams({"seed": "0"})
    scalars, hparams = caplog.records[-2:]
    assert scalars.getMessage() == "[12] a=0.5, count=3, train/loss=0.123457"  # clu's format
    assert hparams.getMessage() == "[Hyperparameters] {'seed': '0'}"
    keep = cli.ConsoleFilter().filter
    assert not keep(scalars) and keep(hparams)


def test_progress_reports_at_the_period_the_end_and_every_minute(caplog):
    class Recorder(writers.MetricWriter):
        def __init__(self):
            self.calls = []

        def write_scalars(self, step, scalars):
            self.calls.append((step, dict(scalars)))

    recorder = Recorder()
    progress = writers.ReportProgress(num_train_steps=10, writer=recorder, every_steps=4)
    with caplog.at_level(std_logging.INFO, logger="absl"):
        reported = [progress(step, t=0.5 * step) for step in range(1, 11)]
    assert [s for s, r in zip(range(1, 11), reported) if r] == [4, 8, 10]  # the first call starts the clock
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Progress: ")]
    assert lines == ["Progress: 2.0 steps/s, 40.0% (4/10), ETA: 0m", "Progress: 2.0 steps/s, 80.0% (8/10), ETA: 0m",
                     "Progress: 2.0 steps/s, 100.0% (10/10), ETA: 0m"]
    assert [step for step, _ in recorder.calls] == [4, 8, 10]
    assert all(set(s) == {"steps_per_sec", "uptime"} and s["steps_per_sec"] == 2.0 for _, s in recorder.calls)
    keep = cli.ConsoleFilter().filter
    assert all(keep(r) for r in caplog.records if r.getMessage().startswith("Progress: "))

    slow = writers.ReportProgress(num_train_steps=1000, writer=None, every_steps=500)
    assert not slow(1, t=0.0)
    assert not slow(2, t=30.0)
    with caplog.at_level(std_logging.INFO, logger="absl"):
        assert slow(3, t=62.0)  # over a minute since the clock started, between periods
    # 2 steps in 62 s; 997 steps left: 30,907 s
    assert caplog.records[-1].getMessage() == "Progress: 0.0 steps/s, 0.3% (3/1000), ETA: 8h35m"
    assert not slow(4, t=100.0) and slow(5, t=123.0)  # a minute since that report


def test_eta_format_is_clus():
    assert writers.format_secs(123456.7) == "1d10h17m"
    assert writers.format_secs(59.9) == "0m"
    assert writers.format_secs(2 * 3600 + 5 * 60 + 3) == "2h5m"
    assert writers.format_secs(86400 + 60) == "1d1m"


@pytest.mark.slow
def test_writers_import_no_tensorflow():
    code = ("import sys\nfrom skipless_jax.trainers import run, writers, wandb_writer\n"
            "import skipless_jax.cli\nprint('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=sr.ROOT, env=sr.env(1))
    assert result.stdout.strip() == "False", result.stdout + result.stderr[-2000:]


# ---- A CLI run (tiny config, 8 CPU devices).

# Runs the CLI as tests/subprocess_runs.py does and prints, at exit, whether TensorFlow was imported.
_WRAPPER = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('TENSORFLOW_IMPORTED', 'tensorflow' in sys.modules, flush=True))\n"
            "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")


@pytest.mark.slow
def test_cli_run_imports_no_tensorflow_and_its_tensorboard_holds_the_history_and_settings(tmp_path,
                                                                                          tmp_path_factory):
    workdir = str(tmp_path / "run")
    environ = sr.env(8, cache_dir=os.path.join(sr.session_dir(tmp_path_factory), "jax_cache"))
    log = sr.run([sys.executable, "-c", _WRAPPER, *sr.command(workdir)[1:]], environ, workdir + ".log", 300)
    assert "TENSORFLOW_IMPORTED False" in log, log[-3000:]
    with open(os.path.join(workdir, "history.jsonl")) as f:
        history = [json.loads(line) for line in f]
    expected: dict[str, dict[int, float]] = {}
    for record in history:  # history's 'prefix_name' is TensorBoard's 'prefix/name'; perf/* keep their names
        for key, value in record.items():
            if key != "step":
                tag = key if "/" in key else key.replace("_", "/", 1)
                expected.setdefault(tag, {})[record["step"]] = float(np.float32(value))
    assert {"train/loss", "test/accuracy", "perf/img_per_sec"} <= expected.keys()
    acc = _accumulator(workdir)
    scalars = _scalars(acc)
    progress = {tag: scalars.pop(tag) for tag in ("steps_per_sec", "uptime")}
    assert scalars == expected
    assert {tag: sorted(v) for tag, v in progress.items()} == {"steps_per_sec": [4, 8, 12], "uptime": [4, 8, 12]}
    assert all(v > 0 for v in progress["steps_per_sec"].values())
    lines = log.splitlines()
    (first,) = [i for i, line in enumerate(lines) if "] [Hyperparameters] " in line]
    end = next(i for i in range(first + 1, len(lines)) if not lines[i].startswith(" "))  # wrapped lines
    assert max(len(line) for line in lines[first + 1:end]) <= 100 and end - first > 1
    logged = ast.literal_eval(" ".join([lines[first].split("] [Hyperparameters] ", 1)[1],
                                        *(line.strip() for line in lines[first + 1:end])]))
    assert _hparams(acc) == logged
    assert logged["total_steps"] == "12" and logged["model.width"] == "32"
    assert not re.search(r"\] \[\d+\] ", log), "the scalar dumps stay off the quiet console"
    assert re.search(r"Progress: [\d.]+ steps/s, 100\.0% \(12/12\), ETA: 0m", log), log[-3000:]
