"""The one training loop every trainer runs, read top to bottom in `train`.

Each step: the update (its batch already on the devices, under `jax.transfer_guard("disallow")`),
the train record, the hooks (the live κ probe, MAE's picture), the checkpoint, the evaluations
due, the preemption stop. Before the loop: the evaluation at start. After it: the final
evaluation of a run resumed at its end. Whatever stops it, the data pipeline, the writers and
the saves are closed. `Run` (trainers/run.py) holds the bookkeeping it calls: writers, history,
checkpoints, the meter, the signal flag.

A trainer supplies only its compiled step, its state and its evaluation with its schedule:

    return loop.train(config, workdir, mesh, mngr, state, train_step, cost, total_steps=...,
                      guarded=nonfinite.guarded_parts(abstract_state), train_iterator=inputs.train_iterator,
                      results_at=lambda step, state: evaluators.run_all(evals, ctx, state.params, step, total),
                      eval_every=[e.every_steps for e in evals])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import ml_collections

from skipless_jax.trainers import common, perf
from skipless_jax.trainers.run import Run, every

Results = Iterable[tuple[str, str, float]]  # (evaluator prefix, metric, value) triples


class Hook(NamedTuple):
    """`fn(step, state)` after the step's train record at multiples of `every_steps` (0/None:
    only the last step), outside training time (`Run.excluded`); the scalars it returns, if any,
    go to the writer at that step."""

    every_steps: int | None
    fn: Callable[[int, Any], Mapping[str, float] | None]


def train(
    config: ml_collections.ConfigDict,
    workdir: str,
    mesh: jax.sharding.Mesh,
    mngr: Any,
    state: Any,
    train_step: Callable[[Any, Any], tuple[Any, Any]],
    cost: perf.StepCost | None,
    *,
    total_steps: int,
    guarded: Mapping[str, Any],
    train_iterator: Callable[..., Any],
    results_at: Callable[[int, Any], Results],
    eval_every: Iterable[int | None],
    results_at_start: Callable[[Any], Results] | None = None,
    hooks: Iterable[Hook] = (),
    metrics: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Trains `state` (restored or initialized, at its step s) from step s + 1 to `total_steps`
    in `workdir` and returns the final metrics (`Run.finish`).

    `train_step` (state, batch) -> (state, metrics) is compiled (`perf.compile_for`, of `cost`)
    and donates its state; `guarded` the trees its non-finite guard checks, in its order
    (`Run`'s leaf names); `train_iterator` the trainer's train stream
    (`common.device_batches`); `results_at(step, state)` the evaluations due at `step`, read as
    they run (also the final evaluation of a run resumed at its last step), and `eval_every`
    their periods (0/None: the last step only), the trainer's schedule: before an evaluation
    due, the steps in flight finish, so that the meter's excluded time is the evaluation's own
    (docs/method/runs.md §25); `results_at_start(state)`, when given, the evaluations at step 0
    of a fresh run, recorded as 'init_<prefix>'; `metrics` extra entries of the final metrics
    (e.g. the chosen β). The perf records count `config.input.batch_size` examples a step (each
    once, however many crops). Raises `Preempted` after saving on SIGTERM, a preemption notice or
    a first Ctrl-C.
    """
    first_step = int(jax.device_get(state.step))
    run = Run(config, workdir, mngr, total_steps, first_step, guarded, cost, config.input.batch_size)
    run.metrics.update(metrics or {})
    eval_every = set(eval_every)
    log_every, save_every = config.log_every_steps, config.get("checkpoint_every_steps")
    data = common.device_batches(config, mesh, train_iterator, first_step)
    try:  # whatever stops the loop, saves already started are completed
        with jax.set_mesh(mesh):
            if first_step == 0 and results_at_start is not None:
                run.evaluate(0, results_at_start(state), prefix="init_")
            for step in range(first_step + 1, total_steps + 1):
                # Step: the batch was copied to the devices ahead (device_input.device_batches).
                batch = next(data)
                with jax.profiler.StepTraceAnnotation("train", step_num=step), jax.transfer_guard("disallow"):
                    state, step_metrics = train_step(state, batch)
                run.step_done(step, step_metrics, state)  # progress, meter, profiler
                # Log: the period's means, once its non-finite counters are checked.
                if every(step, log_every, total_steps):
                    run.check_finite(state, step)
                    run.log_train(step)
                for hook in hooks:
                    if every(step, hook.every_steps, total_steps):
                        with run.excluded(state):  # not training time (docs/method/runs.md §25)
                            scalars = hook.fn(step, state)
                            if scalars:
                                run.writer.write_scalars(step, scalars)
                # Save: the last step's checkpoint is on disk before its final evaluation.
                if every(step, save_every, total_steps):
                    run.save(step, state)
                if step == total_steps:
                    run.last_step_saved()
                # Evaluate: what is due at this step (evaluated as `results_at`'s triples are read).
                due = any(every(step, period, total_steps) for period in eval_every)
                with run.excluded(state if due else None):
                    run.evaluate(step, results_at(step, state))
                # Stop: on a preemption notice, SIGTERM or a first Ctrl-C, save this step and raise
                # Preempted; at the last step the run has finished and keeps its final metrics.
                if step < total_steps and run.should_stop(step):
                    run.save(step, state)
                    raise run.preempted(step)
            if first_step == total_steps:  # resumed at its end: the final metrics were lost, evaluate again
                run.final_evaluation(results_at(total_steps, state))
    finally:
        data.close()  # the pipeline's worker processes stop here, whatever ended the loop
        run.close()
    return run.finish()
