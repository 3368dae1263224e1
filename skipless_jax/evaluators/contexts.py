"""An evaluator's view of the trainer's `Context` with other data settings: another dataset
(ImageNet-ReaL, ImageNet-v2, a few-shot set) or another eval transform (DINO's linear
evaluation), read through the same eval pipeline at the model's input size."""

from __future__ import annotations

from typing import Any

import ml_collections

from skipless_jax.data import inputs, sources
from skipless_jax.evaluators.common import Context


def derived(ctx: Context, where: str, dataset: str | None = None, data_dir: str | None = None,
            train_split: str | None = None, **input_fields: Any) -> Context:
    """A new `Context` (own caches) with the model functions of `ctx`, reading `dataset` (default
    the run's; `data_dir` default the run's when it is the run's dataset) with `config.input`
    fields replaced by `input_fields` and the train split by `train_split`. Images are brought
    to the run's input size; a dataset whose images have another number of channels than the
    run's is a one-line error naming `where` (the config entry)."""
    config = ml_collections.ConfigDict(ctx.config.to_dict())
    run = sources.dataset_info(ctx.config.dataset.name)
    if dataset is not None and dataset != ctx.config.dataset.name:
        info = sources.dataset_info(dataset)
        if info.image_shape[-1] != run.image_shape[-1]:
            raise ValueError(f"{where}: dataset {dataset!r} has {info.image_shape[-1]}-channel images, the model "
                             f"reads {run.image_shape[-1]}-channel ones "
                             f"(config.dataset.name={ctx.config.dataset.name!r})")
        config.dataset.name = dataset
        config.dataset.data_dir = data_dir
    elif data_dir is not None:
        config.dataset.data_dir = data_dir
    if train_split is not None:
        config.dataset.train_split = train_split
    config.input.image_size = inputs.image_size(ctx.config)
    for key, value in input_fields.items():
        config.input[key] = value
    num_classes = sources.dataset_info(config.dataset.name).num_classes
    return Context(config, ctx.mesh, num_classes, logits=ctx.logits, features=ctx.features, outputs=ctx.outputs,
                   picture_dir=ctx.picture_dir)

