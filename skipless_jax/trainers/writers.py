"""A run's metric writers without TensorFlow: TensorBoard event files, the absl log, the progress
line, all behind one small interface (`MetricWriter`) that `Run` and the wandb writer share.

    writer = create_default_writer(workdir)      # LoggingWriter + TensorBoard events in workdir
    writer.write_hparams({"model.depth": "12"}); writer.write_scalars(step, {"train/loss": 0.5})
    progress = ReportProgress(num_train_steps=N, writer=writer, every_steps=100)
    progress(step)                               # after every step: 'Progress: ...' + steps_per_sec
    writer.close()

The event files are TensorBoard's standard ones, `<workdir>/events.out.tfevents.<time>.<host>.
<pid>.<n>.v2`, holding what TensorFlow's summary writer (clu's SummaryWriter) wrote: a float32
scalar tensor per value with the scalars plugin's metadata, and the hparams plugin's
session-start record. They are built from the `tensorboard` package's protos and written with
its RecordWriter over a plain buffered file, flushed after each `write_*` call (a log period's
or an evaluation's records) and at `flush()`/`close()`; nothing here imports TensorFlow. A
workdir that is not a local path (it contains '://', e.g. gs:// on Cloud TPU) is written by
clu's SummaryWriter instead (TensorFlow's gfile, asynchronously), which imports TensorFlow.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import textwrap
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

HPARAMS_TAG = "_hparams_/session_start_info"  # the hparams plugin's SESSION_START_INFO_TAG
_FILE_COUNTER = itertools.count()  # TensorFlow's per-process suffix: two files of one second differ


class MetricWriter:
    """What a run writes: scalars at a step, the hyperparameters once; `flush`, `close`."""

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


class MultiWriter(MetricWriter):
    """Every call to each of `writers`, in order."""

    def __init__(self, writers: Sequence[Any]):
        self.writers = list(writers)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        for w in self.writers:
            w.write_scalars(step, scalars)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        for w in self.writers:
            w.write_hparams(hparams)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()


class LoggingWriter(MetricWriter):
    """Scalars and hyperparameters to absl's INFO log, as clu's LoggingWriter: '[step] a=1, b=2'
    (the quiet console hides these, cli.ConsoleFilter) and '[Hyperparameters] {...}' (kept, wrapped)."""

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        values = [f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(scalars.items())]
        logging.info("[%d] %s", step, ", ".join(values))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """The settings once, wrapped at 100 columns: a Python dict literal over several lines, each
        next one indented (joined with single spaces, they are the literal again)."""
        lines = textwrap.wrap(repr(dict(hparams)), width=100, subsequent_indent="    ", break_long_words=False,
                              break_on_hyphens=False)
        logging.info("[Hyperparameters] %s", "\n".join(lines))

    def flush(self) -> None:
        logging.flush()


def _scalar_metadata() -> summary_pb2.SummaryMetadata:
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    )


def hparams_summary(hparams: Mapping[str, Any], start_time_secs: float | None = None) -> summary_pb2.Summary:
    """The hparams plugin's session-start summary of `hparams` (bool, number or string values;
    others as str), as tensorboard.plugins.hparams.summary_v2.hparams_pb builds it."""
    values = {str(k): v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
    group = hashlib.sha256(json.dumps(values, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    info = plugin_data_pb2.SessionStartInfo(
        group_name=group, start_time_secs=time.time() if start_time_secs is None else start_time_secs
    )
    for name in sorted(values):
        value = values[name]
        if isinstance(value, bool):
            info.hparams[name].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[name].number_value = value
        else:
            info.hparams[name].string_value = value
    content = plugin_data_pb2.HParamsPluginData(version=0, session_start_info=info)
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="hparams", content=content.SerializeToString())
    )
    empty = tensor_pb2.TensorProto(  # the plugin's NULL_TENSOR: a float vector of length 0
        dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=0)])
    )
    summary = summary_pb2.Summary()
    summary.value.add(tag=HPARAMS_TAG, metadata=metadata, tensor=empty)
    return summary


class EventFileWriter(MetricWriter):
    """TensorBoard scalars and hparams to a new event file in the local folder `logdir`."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_COUNTER)}.v2"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "ab")  # noqa: SIM115 (closed by close()); buffered, flushed per write_*
        self._records = RecordWriter(self._file)
        self._write(event_pb2.Event(
            wall_time=now, file_version="brain.Event:2",
            source_metadata=event_pb2.SourceMetadata(writer="skipless_jax.trainers.writers"),
        ))

    def _write(self, event: event_pb2.Event) -> None:
        self._records.write(event.SerializeToString())
        self._records.flush()

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        """One event at `step` holding a float32 scalar tensor per value (TensorFlow's
        tf.summary.scalar casts to float32 too)."""
        if not scalars:
            return
        with np.errstate(over="ignore"):  # beyond float32's range: ±inf, as TensorFlow's cast
            values = np.array([float(v) for v in scalars.values()]).astype(np.float32)
        summary = summary_pb2.Summary()
        scalar_shape, metadata = tensor_shape_pb2.TensorShapeProto(), _scalar_metadata()
        for tag, value in zip(scalars, values):
            tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=scalar_shape,
                                            tensor_content=value.astype("<f4").tobytes())
            summary.value.add(tag=tag, tensor=tensor, metadata=metadata)
        self._write(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """The hparams plugin's session-start record (at step 0, as the plugin writes it)."""
        self._write(event_pb2.Event(wall_time=time.time(), step=0, summary=hparams_summary(hparams)))

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def is_remote(path: str) -> bool:
    """A path that is not local: a URL such as gs://bucket/run (TensorFlow's gfile writes it)."""
    return "://" in str(path)


def event_writer(logdir: str) -> MetricWriter:
    """The TensorBoard writer of `logdir`: EventFileWriter for a local folder; for a remote one,
    clu's SummaryWriter (TensorFlow's gfile, which imports TensorFlow), asynchronously."""
    if is_remote(logdir):
        from clu.metric_writers import AsyncWriter, SummaryWriter

        return AsyncWriter(SummaryWriter(str(logdir)))
    return EventFileWriter(str(logdir))


def create_default_writer(workdir: str) -> MultiWriter:
    """The absl log and the TensorBoard event files of `workdir` (clu's create_default_writer's pair)."""
    return MultiWriter([LoggingWriter(), event_writer(workdir)])


def format_secs(secs: float) -> str:
    """123456.7 -> '1d10h17m' (clu's ETA format: days and hours when not 0, minutes always)."""
    days = int(secs / 86400)
    secs -= days * 86400
    hours = int(secs / 3600)
    secs -= hours * 3600
    return (f"{days}d" if days else "") + (f"{hours}h" if hours else "") + f"{int(secs / 60)}m"


class ReportProgress:
    """Called after every step; at multiples of `every_steps`, at `num_train_steps` and when
    `every_secs` passed since the last report (the first call only starts the clock), logs
    'Progress: 2.5 steps/s, 77.9% (700/899), ETA: 1m' and writes the scalars `steps_per_sec`
    (over the steps since the last report) and `uptime` (seconds since this object was made)
    to `writer` (clu's ReportProgress, whose line was 'Setting work unit notes: ...')."""

    def __init__(self, *, num_train_steps: int | None = None, writer: MetricWriter | None = None,
                 every_steps: int | None = None, every_secs: float | None = 60.0):
        self.num_train_steps = num_train_steps if num_train_steps is not None and num_train_steps > 0 else None
        self.writer, self.every_steps, self.every_secs = writer, every_steps, every_secs
        self.t0 = time.monotonic()
        self.previous_step: int | None = None
        self.previous_time = 0.0

    def _due(self, step: int, t: float) -> bool:
        return step != self.previous_step and (
            bool(self.every_steps and step % self.every_steps == 0)
            or (self.every_secs is not None and t - self.previous_time > self.every_secs)
            or step == self.num_train_steps
        )

    def __call__(self, step: int, t: float | None = None) -> bool:
        """Whether it reported at `step` (`t`: time.monotonic() unless given)."""
        t = time.monotonic() if t is None else t
        if self.previous_step is None:
            self.previous_step, self.previous_time = step, t
            return False
        if not self._due(step, t):
            return False
        steps_per_sec = (step - self.previous_step) / max(t - self.previous_time, 1e-9)
        message = f"{steps_per_sec:.1f} steps/s"
        if self.num_train_steps:
            eta = (self.num_train_steps - step) / steps_per_sec if steps_per_sec > 0 else 0.0
            message += (f", {100 * step / self.num_train_steps:.1f}% ({step}/{self.num_train_steps}), "
                        f"ETA: {format_secs(eta)}")
        logging.info("Progress: %s", message)
        if self.writer is not None:
            self.writer.write_scalars(step, {"steps_per_sec": steps_per_sec, "uptime": time.monotonic() - self.t0})
        self.previous_step, self.previous_time = step, t
        return True
