"""Every command at its edges (issue 40): the last step saved before the final evaluation, one
run per workdir (main and sweep), report's unknown metrics, the smaller command-line faults."""

from __future__ import annotations

import json
import os

import pytest

from skipless_jax import evaluators
from skipless_jax.trainers import supervised

import subprocess_runs as sr
from util import tiny_config


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


def _history_records(workdir: str) -> list[tuple[int, tuple[str, ...]]]:
    """(step, its fields) of each record of history.jsonl (a train and an eval record may share a step)."""
    with open(os.path.join(workdir, "history.jsonl")) as f:
        return [(r["step"], tuple(sorted(r))) for r in map(json.loads, f)]
