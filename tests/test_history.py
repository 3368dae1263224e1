"""Run's history.jsonl: appended (a record never rewrites what is already in the file), and a
resumed run keeps the records up to its checkpoint, once, at start."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_collections

from skipless_jax.trainers.outcome import HISTORY
from skipless_jax.trainers.run import Run


class _Manager:  # what Run asks of an orbax CheckpointManager before it saves
    def all_steps(self):
        return []

    def reached_preemption(self, step):
        return False


def _run(workdir: str, first_step: int) -> Run:
    config = ml_collections.ConfigDict(dict(log_every_steps=1, seed=0))
    return Run(config, workdir, _Manager(), total_steps=100, first_step=first_step, guarded={})


def test_records_are_appended(tmp_path):
    run = _run(str(tmp_path), 0)
    path = os.path.join(tmp_path, HISTORY)
    run.record(1, {"loss": 2.0}, "train")
    # A line the run does not know of: a writer that rewrote the file from memory would drop it.
    with open(path, "a") as f:
        f.write('{"step": 1, "marker": 1.0}\n')
    sizes = [os.path.getsize(path)]
    for step in range(2, 40):
        run.record(step, {"loss": 1.0 / step}, "train")
        sizes.append(os.path.getsize(path))
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert lines[:2] == [{"step": 1, "train_loss": 2.0}, {"step": 1, "marker": 1.0}]
    assert lines[2:] == [{"step": s, "train_loss": 1.0 / s} for s in range(2, 40)]
    # Each record adds its own line's bytes and nothing else.
    added = [b - a for a, b in zip(sizes, sizes[1:])]
    assert added == [len(json.dumps(rec)) + 1 for rec in lines[2:]]
    run.writer.close()


def test_resume_truncates_to_the_checkpoint_once(tmp_path):
    path = os.path.join(tmp_path, HISTORY)
    with open(path, "w") as f:
        f.write("".join(json.dumps({"step": s, "train_loss": float(s)}) + "\n" for s in (4, 8, 12)) + '{"step": 1')
    run = _run(str(tmp_path), 8)  # resumed from the step-8 checkpoint; the last line was cut short
    assert [json.loads(line)["step"] for line in Path(path).read_text().splitlines()] == [4, 8]
    run.record(12, {"loss": 0.5}, "train")
    assert [json.loads(line) for line in Path(path).read_text().splitlines()][-1] == {"step": 12, "train_loss": 0.5}
    run.writer.close()
