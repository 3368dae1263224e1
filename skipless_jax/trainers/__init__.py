"""Trainers by `config.trainer`: each is one flat module on `trainers/common.py`.

A trainer module provides `check_config(config, num_devices=None)` (every one-line error,
before anything compiles) and `train_and_evaluate(config, workdir, devices=None,
allow_config_change=False) -> final metrics`. No trainer imports another.

For the tools on a run (evaluate.py, export.py, analyze.py) a trainer provides
`evaluation(config, mesh, model=None, picture_dir=None) -> (context, state entries evaluated)`
and either `EVALUATOR_TYPES` (the image evaluators of `config.evals` it allows; evaluators/) or
its own `check_evaluators(config)` and `build_evaluators(config, context)` (the lm trainer: its
validation and `config.lm_evals`). A trainer whose inputs are not images also provides
`export_forward(config, context, params) -> (fn, model.json fields)`, `export_examples(config,
count)` and `analysis(config, workdir, weights, num_windows)` (trainers/lm.py); `has_own_inputs`
tells the tools which path a trainer takes.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TRAINERS = {
    "supervised": "skipless_jax.trainers.supervised",
    "dino": "skipless_jax.trainers.dino",
    "mae": "skipless_jax.trainers.mae",
    "lm": "skipless_jax.trainers.lm",
}


def get(name: str) -> ModuleType:
    """The trainer module for `config.trainer=name`; one-line ValueError for an unknown name."""
    if name not in TRAINERS:
        raise ValueError(f"config.trainer={name!r} is unknown; allowed: {sorted(TRAINERS)}")
    return importlib.import_module(TRAINERS[name])


def has_own_inputs(module: ModuleType) -> bool:
    """Whether the trainer's examples are not images (its own `export_forward`, `analysis`)."""
    return hasattr(module, "export_forward")


def check_evaluators(module: ModuleType, config) -> None:
    """The trainer's own check of what `evaluate` runs, else `config.evals` against its EVALUATOR_TYPES."""
    if hasattr(module, "check_evaluators"):
        module.check_evaluators(config)
    else:
        from skipless_jax import evaluators

        evaluators.check_config(config, module.EVALUATOR_TYPES)


def build_evaluators(module: ModuleType, config, ctx) -> list:
    """What `evaluate` runs on a checkpoint: the trainer's own evaluators, else those of `config.evals`."""
    if hasattr(module, "build_evaluators"):
        return module.build_evaluators(config, ctx)
    from skipless_jax import evaluators

    return evaluators.build(config, ctx)
