r"""Evaluate a finished (or pretrained) checkpoint without training.

    python -m skipless_jax.evaluate --workdir=DIR [--config=configs/X.py[:args]] [--step=N]

The config is the one saved with the workdir's checkpoint (what its parameters are); a
`--config` adds or replaces the evaluators (`config.evals`) and data settings, and a config that
trains another model than the saved one is refused in one line. The trainer's evaluators run
on the state entry the trainer evaluates (a classifier's parameters, DINO's EMA teacher); the
metrics are printed and written to `DIR/evaluation[_step<N>].json`; evaluators that draw
(`feature_pca`, `tokencut`) write `DIR/pictures/<prefix>_step<N>.png`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections

from skipless_jax import checkpoint, evaluators, pretrained, sharding, trainers
from skipless_jax.trainers import common


def resolve_config(workdir: str, config: ml_collections.ConfigDict | None) -> ml_collections.ConfigDict:
    """The workdir's saved config, with `config`'s evaluators and data fields where given."""
    saved = checkpoint.saved_config(workdir)
    if saved is None:
        if config is None:
            raise ValueError(f"--workdir={workdir!r} has no checkpoint with a saved config; pass --config")
        return config
    resolved = ml_collections.ConfigDict(saved)
    if config is not None:
        diffs = pretrained.config_differences(saved, config.to_dict())
        trained = [d for d in diffs if not d.startswith(("dataset.", "input.eval_batch_size"))]
        if trained:
            raise ValueError(
                f"--config trains another model than the checkpoint in {workdir} ({', '.join(trained[:4])}); "
                "leave --config out to evaluate with the saved config"
            )
        for field in ("evals", "dataset"):
            if field in config:
                resolved[field] = config[field]
        resolved.input.eval_batch_size = config.input.get("eval_batch_size")
    return resolved


def evaluate(
    workdir: str, config: ml_collections.ConfigDict | None = None, step: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> dict[str, Any]:
    """Runs every evaluator of the (saved) config on the checkpoint; returns {prefix_metric: value, 'step'}."""
    config = resolve_config(workdir, config)
    trainer = trainers.get(config.get("trainer", "supervised"))
    evaluators.check_config(config, trainer.EVALUATOR_TYPES)
    mesh = sharding.make_mesh(config.mesh, devices)
    ctx, key = trainer.evaluation(config, mesh)
    ctx.picture_dir = workdir
    for entry in (key,) if isinstance(key, str) else key:
        checkpoint.param_shapes(workdir, entry)  # read first: a one-line error if the checkpoint lacks the entry
    found_step, state = checkpoint.load_raw(workdir, step)
    ctx.step = int(found_step)  # pictures: <workdir>/pictures/<prefix>_step<N>.png
    params = jax.device_put(common.entries(state, key), sharding.replicated(mesh))
    results: dict[str, Any] = {"step": int(found_step)}
    with jax.set_mesh(mesh):
        for prefix, metric, value in evaluators.run_all(evaluators.build(config, ctx), ctx, params):
            results[f"{prefix}_{metric}"] = value
    name = "evaluation.json" if step is None else f"evaluation_step{found_step}.json"
    if jax.process_index() == 0:
        with open(os.path.join(workdir, name), "w") as f:
            json.dump(results, f, indent=2)
    return results


def main(argv: Sequence[str]) -> None:
    del argv
    from absl import flags

    try:
        results = evaluate(flags.FLAGS.workdir, flags.FLAGS.config, flags.FLAGS.step)
    except (ValueError, FileNotFoundError) as err:  # one line for the user, not a traceback
        raise SystemExit(f"error: {err}") from None
    print(f"Evaluated step {results['step']}: " + ", ".join(
        f"{k}={v:.4f}" for k, v in sorted(results.items()) if k != "step"), flush=True)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Config file (default: the workdir's saved config).", lock_config=False
    )
    flags.DEFINE_string("workdir", None, "The run's workdir.")
    flags.DEFINE_integer("step", None, "The checkpoint step (default: the newest).")
    flags.mark_flags_as_required(["workdir"])
    app.run(main)
