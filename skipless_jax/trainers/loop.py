"""The one training loop every trainer runs: the train batches on the devices, the step under
`jax.transfer_guard("disallow")`, the train records, checkpoints, preemption and Ctrl-C, the
optional evaluation at start, periodic hooks (the live κ probe, MAE's picture), the final
evaluation of a run resumed at its end, and the data pipeline and `Run` closed whatever stops it.

A trainer supplies only its compiled step, its state and its evaluation:

    return loop.train(config, workdir, mesh, mngr, state, train_step, cost, total_steps=...,
                      guarded=nonfinite.guarded_parts(abstract_state), train_iterator=inputs.train_iterator,
                      results_at=lambda step, state: evaluators.run_all(evals, ctx, state["params"], step, total))
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
    they run (also the final evaluation of a run resumed at its last step);
    `results_at_start(state)`, when given, the evaluations at step 0 of a fresh run, recorded as
    'init_<prefix>'; `metrics` extra entries of the final metrics (e.g. the chosen β). The perf
    records count `config.input.batch_size` examples a step (each once, however many crops). Raises
    `Preempted` after saving on SIGTERM, a preemption notice or a first Ctrl-C.
    """
    first_step = int(jax.device_get(state["step"]))
    run = Run(config, workdir, mngr, total_steps, first_step, guarded, cost, config.input.batch_size)
    run.metrics.update(metrics or {})
    data = common.device_batches(config, mesh, train_iterator, first_step)
    try:  # whatever stops the loop, saves already started are completed
        with jax.set_mesh(mesh):
            if first_step == 0 and results_at_start is not None:
                run.evaluate(0, results_at_start(state), prefix="init_")
            for step in range(first_step + 1, total_steps + 1):
                batch = next(data)  # copied to the devices ahead (device_input.device_batches)
                with jax.profiler.StepTraceAnnotation("train", step_num=step), jax.transfer_guard("disallow"):
                    state, step_metrics = train_step(state, batch)
                run.train_step_done(step, step_metrics, state)
                for hook in hooks:
                    if every(step, hook.every_steps, total_steps):
                        with run.excluded(state):  # not training time (docs/method/runs.md §25)
                            scalars = hook.fn(step, state)
                            if scalars:
                                run.writer.write_scalars(step, scalars)
                run.end_of_step(step, state, results_at(step, state))
            if first_step == total_steps:  # resumed at its end: the final metrics were lost, evaluate again
                run.final_evaluation(results_at(total_steps, state))
    finally:
        data.close()  # the pipeline's worker processes stop here, whatever ended the loop
        run.close()
    return run.finish()
