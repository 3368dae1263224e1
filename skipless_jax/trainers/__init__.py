"""Trainers by `config.trainer`: each is one flat module on `trainers/common.py`.

A trainer module provides `check_config(config, num_devices=None)` (every one-line error,
before anything compiles) and `train_and_evaluate(config, workdir, devices=None,
allow_config_change=False) -> final metrics`. No trainer imports another.
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
