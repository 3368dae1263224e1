"""The optional wandb writer, in offline mode: Run's scalars reach the wandb run's history at
their steps, under a run id that the workdir names (skipped without the wandb extra)."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from pathlib import Path

import ml_collections
import pytest

from skipless_jax.trainers import wandb_writer
from skipless_jax.trainers.run import Run

wandb = pytest.importorskip("wandb", reason="needs the optional wandb package (pip install wandb)")


class _Manager:  # what Run asks of an orbax CheckpointManager before it saves
    def all_steps(self):
        return []

    def reached_preemption(self, step):
        return False

    def wait_until_finished(self):
        pass

    def close(self):
        pass


def _records(path: str) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header, then LevelDB's log format (32 KiB blocks of
    [crc32c 4 | length 2 | type 1 | data], types full 1 / first 2 / middle 3 / last 4)."""
    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B"
    pos, out, parts = 7, [], b""
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        if left < 7:  # a block's trailer
            pos += left
            continue
        length, kind = struct.unpack("<HB", raw[pos + 4:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        parts += data
        if kind in (1, 4):
            out.append(parts)
            parts = b""
    return out


def _history(path: str) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of the history records in an offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2

    out: dict[int, dict[str, float]] = {}
    for data in _records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            out[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def test_offline_run_logs_the_records(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir = str(tmp_path)
    config = ml_collections.ConfigDict(dict(
        log_every_steps=1, seed=0, profile_steps=0,
        wandb=dict(project="skipless-test", entity=None, name=None, mode="offline"),
    ))
    assert wandb_writer.enabled(config)
    run = Run(config, workdir, _Manager(), total_steps=10, first_step=0, guarded={})
    run.record(2, {"loss": 0.5}, "train", {"perf/img_per_sec": 100.0})
    run.record(4, {"loss": 0.25}, "train")
    run.close()
    files = glob.glob(os.path.join(workdir, "wandb", f"offline-run-*-{wandb_writer.run_id(workdir)}", "*.wandb"))
    assert len(files) == 1
    deadline = time.monotonic() + 60
    while not (history := _history(files[0])).get(4) and time.monotonic() < deadline:
        time.sleep(0.2)  # wandb's service may still be writing the file when finish() returns
    assert history == {2: {"train/loss": 0.5, "perf/img_per_sec": 100.0}, 4: {"train/loss": 0.25}}
    config.wandb.project = None
    assert not wandb_writer.enabled(config)
