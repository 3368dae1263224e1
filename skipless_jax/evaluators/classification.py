"""Classification accuracy and loss over a split (docs/method/evals.md §12), on the run's dataset or
another one with the same classes (ImageNet-ReaL, ImageNet-v2: §16).

Every example counts exactly once: the eval pipeline pads the last global batch and its
`mask` excludes the padding from the sums.

    config.evals.real = dict(type='classification', dataset='imagenet2012_real', split='validation')
    config.evals.v2 = dict(type='classification', dataset='imagenet_v2', split='test')
    config.evals.minival = dict(type='classification', split='train[99%:]')
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from skipless_jax import losses, sharding
from skipless_jax.data import sources
from skipless_jax.evaluators import contexts
from skipless_jax.evaluators.common import Context


def real_accuracy_counts(logits: jax.Array, real_labels: jax.Array,
                         mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(correct, counted) of ImageNet-ReaL on a batch: logits (B, K), real_labels (B, K') int
    label sets padded with −1, mask (B,) (None: all real). counted = Σ mask·[the set is not
    empty], correct = Σ mask·[argmax logits ∈ the set]."""
    predicted = logits.argmax(-1)
    mask = jnp.ones(predicted.shape, jnp.int32) if mask is None else (mask > 0).astype(jnp.int32)
    counted = (real_labels >= 0).any(-1).astype(jnp.int32) * mask
    correct = (real_labels == predicted[:, None]).any(-1).astype(jnp.int32) * mask  # −1 never matches
    return correct.sum(), counted.sum()


def _sums(logits_of: Any, params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A batch's correct / loss / count sums (and ReaL's, where its records carry label sets)."""
    logits = logits_of(params, batch["image"])
    mask = batch["mask"]
    correct = (logits.argmax(-1) == batch["label"].argmax(-1)) * mask
    loss = (losses.cross_entropy(logits, batch["label"]) * mask).sum()
    out = {"correct": correct.sum(), "loss": loss, "count": mask.sum()}
    if "real_label" in batch:
        out["real_correct"], out["real_counted"] = real_accuracy_counts(logits, batch["real_label"], mask)
    return out


@dataclasses.dataclass
class Classification:
    """Yields ('accuracy', top-1 accuracy) and ('loss', mean cross-entropy) on `split`, and on a
    dataset whose records carry ReaL label sets ('real_accuracy', ReaL accuracy)."""

    name: str
    prefix: str
    every_steps: int | None
    split: str
    ctx: Context
    view: Context | None = None  # another dataset's reader (None: the run's)

    def __post_init__(self):
        if self.ctx.logits is None:
            raise ValueError(f"config.evals.{self.name}: type 'classification' needs a model with a classifier head")

        programs = self.ctx.cache.programs  # one jitted function for every classification on this model:
        if "classification_sums" not in programs:  # test, minival and v2 share a compile (ReaL's batches differ)
            programs["classification_sums"] = jax.jit(
                functools.partial(_sums, self.ctx.logits), out_shardings=sharding.replicated(self.ctx.mesh))
        self._sums = programs["classification_sums"]

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        batches, n = (self.view or self.ctx).batches(self.split)
        totals = None
        for batch in batches:
            s = self._sums(params, batch)
            totals = s if totals is None else jax.tree.map(jnp.add, totals, s)
        totals = jax.device_get(totals)
        if int(totals["count"]) != n:  # every example exactly once
            raise AssertionError(f"evaluation counted {totals['count']} of {n} examples of {self.split!r}")
        yield "accuracy", float(totals["correct"] / totals["count"])
        yield "loss", float(totals["loss"] / totals["count"])
        if "real_correct" in totals:
            yield "real_accuracy", float(totals["real_correct"] / max(int(totals["real_counted"]), 1))

    @staticmethod
    def check(name: str, entry: Any) -> None:
        del name, entry  # `dataset`, `data_dir`: checked with every evaluator's (evaluators.check_config)

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Context, **common: Any) -> Classification:
        view = None
        dataset = entry.get("dataset")
        if dataset is not None and dataset != ctx.config.dataset.name:
            classes = sources.dataset_info(dataset).num_classes
            if classes != ctx.num_classes:
                raise ValueError(f"config.evals.{name}.dataset={dataset!r} has {classes} classes, the model's head "
                                 f"{ctx.num_classes} (config.dataset.name={ctx.config.dataset.name!r})")
            view = contexts.derived(ctx, f"config.evals.{name}", dataset, entry.get("data_dir"))
        return cls(name=name, ctx=ctx, view=view, **common)
