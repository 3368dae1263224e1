"""Evaluators by `config.evals.<name>.type`; the protocol is in `evaluators/common.py`.

A new evaluator is one module with a dataclass that has `name`, `prefix`, `every_steps`,
`run(params, step=None) -> iterator of (metric, value)` (`step`: the step evaluated, for the
pictures' names), `check(name, entry)` (one-line errors, before
anything compiles), optionally `check_model(name, entry, models.describe(config.model))` (the
one-line refusal of a family that lacks what it reads) and `from_config(name, entry, ctx,
**common)`, registered below.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from skipless_jax.evaluators.classification import Classification
from skipless_jax.evaluators.common import Context, Evaluator, dense_dataset, due, run_all  # noqa: F401
from skipless_jax.evaluators.feature_pca import FeaturePCA
from skipless_jax.evaluators.fewshot import FewShot
from skipless_jax.evaluators.knn import KNN
from skipless_jax.evaluators.linear_eval import DinoLinear
from skipless_jax.evaluators.linear_probe import LinearProbe
from skipless_jax.evaluators.segmentation import LinearSegmentation
from skipless_jax.evaluators.tokencut import TokenCut

EVALUATORS = {
    "classification": Classification,
    "knn": KNN,
    "linear_probe": LinearProbe,
    "tokencut": TokenCut,
    "linear_segmentation": LinearSegmentation,
    "feature_pca": FeaturePCA,
    "fewshot": FewShot,
    "dino_linear": DinoLinear,
}
COMMON_FIELDS = ("type", "split", "every_steps", "prefix")
TRAIN_SPLIT_TYPES = ("knn", "linear_probe", "linear_segmentation", "dino_linear")  # they also read a train split
TYPE_FIELDS = {
    "classification": ("dataset", "data_dir"),
    "knn": ("train_split", "k", "temperature", "layers"),
    "linear_probe": ("train_split", "l2", "steps", "layers"),
    "tokencut": ("dataset", "data_dir", "block", "tau", "eps", "iou", "picture_images"),
    "feature_pca": ("images",),
    "fewshot": ("datasets", "data_dir", "shots", "seeds", "l2_reg"),
    "dino_linear": ("train_split", "n_last_blocks", "avgpool", "epochs", "batch_size", "lr"),
    "linear_segmentation": (
        "dataset", "data_dir", "protocol", "train_split", "steps", "batch_size", "lr", "weight_decay", "warmup",
        "num_classes", "crop_size", "blocks", "flip", "photometric", "loss_norm", "schedule",
    ),
}


def entries(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """`config.evals` (name -> entry); without it, classification on the eval split."""
    evals = config.get("evals")
    if evals is None:
        return {"test": ml_collections.ConfigDict(dict(type="classification"))}
    return dict(evals)


def check_config(config: ml_collections.ConfigDict, allowed_types: tuple[str, ...] = tuple(EVALUATORS),
                 required_by: str | None = None) -> None:
    """One-line ValueError for an unknown type or field, or a bad period, before anything compiles;
    `required_by` (a trainer without a default classification evaluation): also for no `config.evals`."""
    if required_by is not None and config.get("evals") is None:
        raise ValueError(f"config.evals must list the {required_by} trainer's evaluators "
                         "(knn, linear_probe); {} for none")
    for name, entry in entries(config).items():
        kind = entry.get("type")
        if kind not in allowed_types:
            raise ValueError(
                f"config.evals.{name}.type={kind!r} is unknown for the {config.get('trainer') or 'default'} trainer; "
                f"allowed: {list(allowed_types)}"
            )
        unknown = sorted(set(entry.keys()) - set(COMMON_FIELDS) - set(TYPE_FIELDS[kind]))
        if unknown:
            raise ValueError(
                f"config.evals.{name}.{unknown[0]} is not a field of a {kind!r} evaluator; "
                f"allowed: {sorted(COMMON_FIELDS + TYPE_FIELDS[kind])}"
            )
        period = entry.get("every_steps")
        if period is not None and (not isinstance(period, int) or isinstance(period, bool) or period < 0):
            raise ValueError(
                f"config.evals.{name}.every_steps={period!r} must be an integer >= 0 (0: only the last step)"
            )
        for f in ("split", "train_split", "prefix", "dataset", "data_dir"):
            value = entry.get(f)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"config.evals.{name}.{f}={value!r} must be a non-empty string")
        dataset = entry.get("dataset")
        if dataset is not None and dataset != config.dataset.name:
            from skipless_jax.data import sources

            if dataset not in sources.DATASETS:
                raise ValueError(
                    f"config.evals.{name}.dataset={dataset!r} is unknown; allowed: {sorted(sources.DATASETS)}"
                )
            needs = ("split", "train_split") if kind in TRAIN_SPLIT_TYPES else ("split",)
            for f in needs:
                if entry.get(f) is None:
                    raise ValueError(f"config.evals.{name}.{f} is required for its own dataset {dataset!r} "
                                     f"(splits: {sorted(sources.dataset_info(dataset).splits)})")
        EVALUATORS[kind].check(name, entry)
        if hasattr(EVALUATORS[kind], "check_run"):  # against the run's own data
            EVALUATORS[kind].check_run(name, entry, config)
        if hasattr(EVALUATORS[kind], "check_model"):  # what the evaluator reads of the model, per family
            from skipless_jax import models

            EVALUATORS[kind].check_model(name, entry, models.describe(config.model))


def data_needed(config: ml_collections.ConfigDict) -> list[tuple[str, str, str | None]]:
    """(dataset, split, data_dir) of everything the evaluators read (the missing-data check at start)."""
    out = []
    for name, entry in entries(config).items():
        dataset, data_dir = dense_dataset(name, entry, config)
        out.append((dataset, entry.get("split") or config.dataset.eval_split, data_dir))
        if entry.get("type") in TRAIN_SPLIT_TYPES:
            out.append((dataset, entry.get("train_split") or config.dataset.train_split, data_dir))
        if entry.get("type") == "fewshot":  # its own datasets, train and test
            from skipless_jax.evaluators import fewshot

            for d, splits in fewshot.dataset_splits(entry).items():
                own_dir = config.dataset.get("data_dir") if d == config.dataset.name else entry.get("data_dir")
                out += [(d, s, own_dir) for s in splits]
    return out


def check_data(config: ml_collections.ConfigDict) -> None:
    """The one-line missing-dataset error, before anything compiles, for the run's train and eval
    splits and every split an evaluator reads (of its own dataset where it names one)."""
    from skipless_jax.data import sources

    needed = [(config.dataset.name, s, config.dataset.get("data_dir"))
              for s in (config.dataset.train_split, config.dataset.eval_split)] + data_needed(config)
    for dataset, split, data_dir in dict.fromkeys(needed):
        sources.check_available(dataset, [split], data_dir)


def build(config: ml_collections.ConfigDict, ctx: Context) -> list[Evaluator]:
    """The evaluators of `config.evals`, in their order."""
    out = []
    for name, entry in entries(config).items():
        every_steps = entry.get("every_steps")
        common = dict(
            prefix=entry.get("prefix") or name,
            every_steps=every_steps if every_steps is not None else config.get("eval_every_steps"),
            split=entry.get("split") or config.dataset.eval_split,
        )
        out.append(EVALUATORS[entry.type].from_config(name, entry, ctx, **common))
    return out
