"""Classification accuracy and loss over a split (docs/method.md §12).

Every example counts exactly once: the eval pipeline pads the last global batch and its
`mask` excludes the padding from the sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

from skipless_jax import sharding
from skipless_jax.evaluators.common import Context


def cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float = 0.0) -> jax.Array:
    """Per-example softmax cross-entropy against (soft) labels smoothed by `smoothing`."""
    labels = labels * (1.0 - smoothing) + smoothing / labels.shape[-1]
    return optax.softmax_cross_entropy(logits, labels)


@dataclasses.dataclass
class Classification:
    """Yields ('accuracy', top-1 accuracy) and ('loss', mean cross-entropy) on `split`."""

    name: str
    prefix: str
    every_steps: int | None
    split: str
    ctx: Context

    def __post_init__(self):
        if self.ctx.logits is None:
            raise ValueError(f"config.evals.{self.name}: type 'classification' needs a model with a classifier head")

        def sums(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
            logits = self.ctx.logits(params, batch["image"])
            mask = batch["mask"]
            correct = (logits.argmax(-1) == batch["label"].argmax(-1)) * mask
            loss = (cross_entropy(logits, batch["label"]) * mask).sum()
            return {"correct": correct.sum(), "loss": loss, "count": mask.sum()}

        self._sums = jax.jit(sums, out_shardings=sharding.replicated(self.ctx.mesh))

    def run(self, params: Any) -> Iterator[tuple[str, float]]:
        batches, n = self.ctx.batches(self.split)
        totals = None
        for batch in batches:
            s = self._sums(params, batch)
            totals = s if totals is None else jax.tree.map(jnp.add, totals, s)
        totals = jax.device_get(totals)
        if int(totals["count"]) != n:  # every example exactly once
            raise AssertionError(f"evaluation counted {totals['count']} of {n} examples of {self.split!r}")
        yield "accuracy", float(totals["correct"] / totals["count"])
        yield "loss", float(totals["loss"] / totals["count"])

    @staticmethod
    def check(name: str, entry: Any) -> None:
        del name, entry  # no fields of its own

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Context, **common: Any) -> Classification:
        return cls(name=name, ctx=ctx, **common)
