"""One run's bookkeeping, the helpers the one training loop (trainers/loop.py) calls: `Run`
(TensorBoard and `history.jsonl` records, checkpoints — never a non-finite one —, final metrics
written only by a run that reached its last step). The loop decides when each is called. Whether
the workdir already holds a finished run is trainers/workdir.py's; the preemption/SIGTERM rule,
trainers/signals.py's.

    mngr, finished = open_workdir(config, workdir, total_steps, allow_config_change)
    run = Run(config, workdir, mngr, total_steps, first_step, guarded_parts(abstract_state))
    for step in ...:  run.step_done(step, metrics, state); run.log_train(step); run.save(step, state); ...
    run.finish()
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from etils import epath

from skipless_jax import checkpoint
from skipless_jax.nested import flatten
from skipless_jax.trainers import perf, wandb_writer, writers
from skipless_jax.trainers.nonfinite import NonFiniteError, all_finite, inexact_names, nonfinite_error
from skipless_jax.trainers.outcome import FINAL_METRICS, HISTORY
from skipless_jax.trainers.profiler import Profiler
from skipless_jax.trainers.signals import SignalFlag, stop_rule
from skipless_jax.trainers.workdir import resumed_core_hours, truncate_history


class Preempted(Exception):
    """Raised by a trainer after it saved the step it stopped at on a preemption/SIGTERM, or on a
    first Ctrl-C (`interrupted`)."""

    def __init__(self, step: int, interrupted: bool = False):
        what = "interrupted" if interrupted else "preempted"
        super().__init__(f"{what} at step {step}; checkpoint saved, rerun the same command to resume")
        self.step, self.interrupted = step, interrupted


def stack_metrics(metrics: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """Per-step metric dicts -> one dict of stacked arrays (one device_get for a log period)."""
    return {k: jnp.stack([m[k] for m in metrics]) for k in metrics[0]}


def every(step: int, period: int | None, total_steps: int) -> bool:
    """True on multiples of `period` (0/None: never) and on the last step."""
    return step == total_steps or bool(period and step % period == 0)


class Run:
    """One run's bookkeeping, which the one training loop (trainers/loop.py) calls.

    Writes TensorBoard scalars and `history.jsonl` (one JSON line per logged record; a resumed
    run keeps the records up to its checkpoint), checks the non-finite counters before logging
    and saving, saves checkpoints (never a non-finite one), and writes `final_metrics.json` only
    when the run reaches its last step.
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        workdir: str,
        mngr: Any,
        total_steps: int,
        first_step: int,
        guarded: Mapping[str, Any],
        cost: perf.StepCost | None = None,
        images_per_step: int | None = None,
    ):
        """`guarded`: the abstract trees the step's non-finite guard checks, in its order.
        `cost` (of the compiled step, `perf.compile_step`) and `images_per_step` (each image once):
        the train records' perf/* fields (none without them)."""
        self.config, self.workdir, self.mngr = config, workdir, mngr
        self.total_steps, self.step = total_steps, first_step
        self.guarded = inexact_names(guarded)
        self.is_chief = jax.process_index() == 0
        self.skip_nonfinite = bool(config.get("skip_nonfinite_steps", False))
        # Process 0 writes the absl log, TensorBoard (writers.py: no TensorFlow for a local
        # workdir) and wandb when configured; the other processes write nothing.
        self.writer = writers.create_default_writer(workdir) if self.is_chief else writers.MultiWriter([])
        if self.is_chief and wandb_writer.enabled(config):
            self.writer.writers.append(wandb_writer.WandbWriter(config, workdir))
        if first_step == 0:
            self.writer.write_hparams({k: str(v) for k, v in flatten(config.to_dict(), ".").items()})
        self.progress = writers.ReportProgress(
            num_train_steps=total_steps, writer=self.writer, every_steps=config.log_every_steps
        )
        self.signals = SignalFlag() if jax.process_count() == 1 else None
        self.should_stop = stop_rule(mngr, self.signals)
        self.pending: list[dict[str, jax.Array]] = []
        self.last_saved = max(mngr.all_steps(), default=None)
        self.metrics: dict[str, float] = {}
        self._history_path = epath.Path(workdir, HISTORY)
        if self.is_chief:
            truncate_history(self._history_path, first_step)
        self.meter = (
            perf.Meter(cost, images_per_step, config, first_step,
                       *(resumed_core_hours(self._history_path, k) if self.is_chief else 0.0
                         for k in ("perf/core_hours", "perf/core_hours_total")))
            if cost and images_per_step else None
        )
        self.profiler = Profiler(config, workdir, first_step, total_steps, settle=self.wait_for_saves,
                                 excluded=self.excluded)

    def record(
        self, step: int, values: Mapping[str, float], prefix: str, named: Mapping[str, float] | None = None
    ) -> None:
        """Scalars `prefix/name` to TensorBoard, `prefix_name` to the final metrics and history;
        `named` (e.g. perf/img_per_sec) under their own names to TensorBoard and history only."""
        named = {k: float(v) for k, v in (named or {}).items()}
        self.writer.write_scalars(step, {**{f"{prefix}/{k}": v for k, v in values.items()}, **named})
        flat = {f"{prefix}_{k}": float(v) for k, v in values.items()}
        self.metrics.update(flat)
        if self.is_chief:  # appended: O(1) bytes per record, not the whole history again
            with self._history_path.open("a") as f:
                f.write(json.dumps({"step": step, **flat, **named}) + "\n")

    def check_finite(self, state: Any, step: int) -> None:
        """Raises the NonFiniteError of a state whose guard skipped an update (unless
        `config.skip_nonfinite_steps`)."""
        error = nonfinite_error(jax.device_get(state.nonfinite), self.guarded, step, self.last_saved)
        if error is not None and not self.skip_nonfinite:
            raise error

    def step_done(self, step: int, metrics: dict[str, jax.Array], state: Any) -> None:
        """After each step: its metrics kept for the period's means, the progress line, the meter
        and the profiler's window."""
        self.step = step
        self.pending.append(metrics)
        self.progress(step)
        if self.meter is not None:
            self.meter.step_done(step, state)
        self.profiler.after_step(step, state)

    def log_train(self, step: int) -> None:
        """The train record of `step`: the means of the period's metrics (skipped steps: the
        count at its end) and the meter's perf/* fields."""
        means = {k: float(np.mean(v)) for k, v in jax.device_get(stack_metrics(self.pending)).items()}
        means["nonfinite_steps"] = float(self.pending[-1]["nonfinite_steps"])
        self.pending = []
        # The device_get above waited for the period's steps: the wall-clock is theirs.
        self.record(step, means, "train", self.meter.fields(step) if self.meter is not None else None)

    @contextlib.contextmanager
    def excluded(self, state: Any = None) -> Iterator[None]:
        """Work inside is not training time (the meter's window excludes it); `state`: the steps
        that made it finish first, so that their device time stays training time."""
        if state is not None:
            jax.block_until_ready(state)
        with self.meter.excluded() if self.meter is not None else contextlib.nullcontext():
            yield

    def evaluate(self, step: int, results: Iterable[tuple[str, str, float]], prefix: str = "") -> None:
        """Records `(evaluator prefix, metric, value)` triples (an evaluator run) at `step`."""
        by_prefix: dict[str, dict[str, float]] = {}
        with self.excluded():  # the evaluators run as `results` is read
            for eval_prefix, name, value in results:
                by_prefix.setdefault(prefix + eval_prefix, {})[name] = value
        for p, values in by_prefix.items():
            self.record(step, values, p)
            logging.info("Step %d: %s", step, ", ".join(f"{p}_{k}={v:.4f}" for k, v in values.items()))

    def save(self, step: int, state: Any) -> None:
        """Saves `state` at `step` (asynchronously), after checking that it is finite."""
        self.check_finite(state, step)
        if not bool(all_finite(state)):  # belt and braces: never a non-finite checkpoint
            raise NonFiniteError(
                f"the state at step {step} is not finite; not saved (last good checkpoint: {self.last_saved})"
            )
        meta = {"step": step, "data_position": step * self.config.input.batch_size, "config": self.config.to_json()}
        with self.excluded():  # the finite check above waited for the step
            checkpoint.save(self.mngr, step, state, meta)
        self.last_saved = step

    def last_step_saved(self) -> None:
        """The last step's checkpoint is on disk before its final evaluation starts: a crash,
        SIGKILL or second Ctrl-C during it loses no step (the rerun evaluates that checkpoint
        again, `final_evaluation`); a signal now lets the evaluation finish."""
        with self.excluded():
            self.wait_for_saves()
        if self.signals is not None:
            self.signals.final = True

    def preempted(self, step: int) -> Preempted:
        """The exception that stops the run at `step`, saved (a preemption, SIGTERM or Ctrl-C)."""
        logging.warning("Stopping at step %d on a preemption/termination signal; checkpoint saved.", step)
        return Preempted(step, interrupted=self.signals is not None and self.signals.interrupted)

    def wait_for_saves(self) -> None:
        """Blocks until the pending async saves are written (a full disk: one DiskFullError)."""
        with checkpoint.disk_full_as_one_error(self.mngr, self.last_saved):
            self.mngr.wait_until_finished()

    def close(self) -> None:
        """Completes pending saves and metric writes (called whatever stopped the loop)."""
        try:
            self.wait_for_saves()
            self.profiler.close()
        finally:
            if self.signals is not None:
                self.signals.close()
            with checkpoint.disk_full_as_one_error(self.mngr, self.last_saved):
                self.mngr.close()
            self.writer.close()  # the event file, and the wandb run when there is one

    def final_evaluation(self, results: Iterable[tuple[str, str, float]]) -> None:
        """A run resumed at its last step, whose final metrics were lost (a stop after its final
        evaluation, a deleted or damaged final_metrics.json): its final metrics again, as the
        uninterrupted run's, from the records of history.jsonl and the final evaluation of the
        checkpoint (`results`, which replace the recorded ones); nothing is recorded twice."""
        logging.warning("%s: the checkpoint of step %d has no valid %s; running its final evaluation again.",
                        self.workdir, self.step, FINAL_METRICS)
        if self._history_path.exists():
            for line in self._history_path.read_text().splitlines():
                record = json.loads(line)  # truncated to this step, lines cut short dropped, at start
                # `named` fields (perf/...) are history-only, as in `record`
                self.metrics.update({k: v for k, v in record.items() if k != "step" and "/" not in k})
        for prefix, name, value in results:
            self.metrics[f"{prefix}_{name}"] = float(value)

    def finish(self) -> dict[str, Any]:
        """Final metrics of a run that reached its last step, written to `final_metrics.json`."""
        final = {**self.metrics, "step": self.step}
        if self.is_chief and self.step == self.total_steps:
            epath.Path(self.workdir, FINAL_METRICS).write_text(json.dumps(final, indent=2))
        return final

