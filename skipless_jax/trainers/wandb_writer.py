"""Hosted tracking as an option: a MetricWriter (trainers/writers.py) that logs to Weights &
Biases, next to TensorBoard, when `config.wandb.project` is set (off by default;
`pip install -e .[wandb]`).

    --config.wandb.project=skipless [--config.wandb.entity=TEAM] [--config.wandb.mode=offline]

The wandb run's id is derived from the workdir, so a resumed run continues the same wandb run;
`mode` is wandb's (online, offline: files under <workdir>/wandb to `wandb sync` later, disabled).
Scalars and hyperparameters are logged (all that a run writes).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import ml_collections

from skipless_jax.trainers.writers import MetricWriter


def enabled(config: ml_collections.ConfigDict) -> bool:
    return bool(config.get("wandb") and config.wandb.get("project"))


def _missing(config: ml_collections.ConfigDict) -> ValueError:
    return ValueError(
        f"config.wandb.project={config.wandb.project!r} needs the wandb package, which does not import: "
        "pip install -e .[wandb] (or unset config.wandb.project)"
    )


def check_config(config: ml_collections.ConfigDict) -> None:
    """With `config.wandb.project` set, the wandb package must import: a one-line ValueError at
    config check time, before anything compiles (not at the first record)."""
    if not enabled(config):
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise _missing(config) from None


def run_id(workdir: str) -> str:
    """A wandb run id that names the workdir: the same for every resumption of it."""
    return hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:16]


class WandbWriter(MetricWriter):
    """Scalars to `wandb.log(step=...)`, hyperparameters to the wandb run's config."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        try:
            import wandb
        except ImportError:
            raise _missing(config) from None
        w = config.wandb
        self.run = wandb.init(
            project=w.project, entity=w.get("entity"), name=w.get("name") or os.path.basename(os.path.abspath(workdir)),
            id=run_id(workdir), resume="allow", dir=workdir, mode=w.get("mode"),
        )

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        self.run.log({k: float(v) for k, v in scalars.items()}, step=int(step))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self.run.config.update(dict(hparams), allow_val_change=True)

    def close(self) -> None:
        self.run.finish()
