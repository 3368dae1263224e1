"""Few-shot linear evaluation (big_vision's `fewshot_lsr`, docs/method/evals.md §17).

For each configured dataset: frozen features of its train and test splits; per seed, `shots`
train examples of every class (`fewshot_indices`); a ridge regression onto ±1 one-hot targets
solved in closed form (`ridge_accuracy`); test accuracy, averaged over the seeds.

    config.evals.fewshot = dict(type='fewshot', datasets=('digits',), shots=(1, 5, 10, 25), seeds=3)
    config.evals.fewshot = dict(type='fewshot', shots=(1, 5, 10, 25), seeds=3, datasets=dict(
        imagenet2012=dict(train_split='train[:65000]', test_split='validation'), cifar100=dict()))

`datasets` is a tuple of names, or {name: dict(train_split=..., test_split=...)} with either
field optional: the default is big_vision's (`configs/common_fewshot.py`) where it names one
(ImageNet: 'train[:65000]', whose first 65,000 images hold at least 30 of every class, and
'validation'), else 'train' and the dataset's 'test' (or its other split).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from skipless_jax.data import record_sources, sources
from skipless_jax.evaluators import contexts
from skipless_jax.evaluators.common import Context, field

BIAS_CONSTANT = 100.0  # the bias feature: large, so the bias is almost unregularized
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_L2 = 2.0**10
# big_vision's few-shot splits (configs/common_fewshot.py) of the catalog's datasets that differ
# from ('train', 'test'): ImageNet's first 65,000 train images (at least 30 shots of every class).
DEFAULT_SPLITS = {"imagenet2012": ("train[:65000]", "validation")}
SPLIT_FIELDS = ("train_split", "test_split")


def fewshot_indices(labels: np.ndarray, num_classes: int, shots: int, seed: int) -> np.ndarray:
    """Indices into `labels` (n,): for each class c = 0 … num_classes−1 in order, the first
    `shots` of a permutation of c's indices, all permutations drawn from one
    `np.random.default_rng(seed)` (fewer for a class with fewer examples)."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    per_class = [rng.permutation(np.flatnonzero(labels == c))[:shots] for c in range(num_classes)]
    return np.concatenate(per_class).astype(np.int64)


def ridge_accuracy(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                   num_classes: int, l2_reg: float = DEFAULT_L2) -> float:
    """Top-1 accuracy on (test_x (m, d), test_y (m,)) of the ridge regression fitted on
    (train_x (n, d), train_y (n,)), float64: features whitened with the train mean and
    std + 1e-5, a constant feature 100 appended, targets 2·onehot − 1, W = (XᵀX + l2·I)⁻¹XᵀY
    through the eigendecomposition of XᵀX or XXᵀ, whichever is smaller."""
    x = np.asarray(train_x, np.float64)
    mean, std = x.mean(0, keepdims=True), x.std(0, keepdims=True) + 1e-5

    def prepare(f: np.ndarray) -> np.ndarray:
        f = (np.asarray(f, np.float64) - mean) / std
        return np.pad(f, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)

    x = prepare(x)
    y = 2.0 * np.eye(num_classes)[np.asarray(train_y)] - 1.0
    n, d = x.shape
    if n >= d:
        eigs, q = np.linalg.eigh(x.T @ x)
        lhs, rhs = q, q.T @ (x.T @ y)
    else:
        eigs, q = np.linalg.eigh(x @ x.T)
        lhs, rhs = x.T @ q, q.T @ y
    w = (lhs / (eigs + l2_reg)) @ rhs
    return float(np.mean((prepare(test_x) @ w).argmax(1) == np.asarray(test_y)))


def default_splits(dataset: str) -> tuple[str, str]:
    """(train, test) splits of a few-shot dataset: big_vision's (DEFAULT_SPLITS), else 'train'
    and its other split ('test', else the first other one)."""
    if dataset in DEFAULT_SPLITS:
        return DEFAULT_SPLITS[dataset]
    splits = list(sources.dataset_info(dataset).splits)
    others = [s for s in splits if s != "train"]
    return "train", "test" if "test" in others else others[0]


def _is_mapping(value: Any) -> bool:
    return isinstance(value, (Mapping, ml_collections.ConfigDict))


def dataset_splits(entry: Any) -> dict[str, tuple[str, str]]:
    """{dataset: (train split, test split)} of a fewshot entry: `datasets` a tuple of names (their
    `default_splits`) or {name: {train_split, test_split}} (each default where not given)."""
    datasets = field(entry, "datasets", ("digits",))
    if not _is_mapping(datasets):
        return {d: default_splits(d) for d in datasets}
    out = {}
    for d, splits in datasets.items():
        train, test = default_splits(d)
        splits = splits or {}
        out[d] = (splits.get("train_split") or train, splits.get("test_split") or test)
    return out


@dataclasses.dataclass
class FewShot:
    """config.evals entry `type='fewshot'`: yields ('<dataset>_<shots>shot', mean accuracy over
    seeds 0 … seeds−1) for every configured dataset and shot count."""

    name: str
    prefix: str
    every_steps: int | None
    split: str
    ctx: Context
    views: dict[str, tuple[Context, str, str]]  # dataset -> (its context, train split, test split)
    shots: tuple[int, ...] = DEFAULT_SHOTS
    seeds: int = 3
    l2_reg: float = DEFAULT_L2

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        for dataset, (ctx, train_split, test_split) in self.views.items():
            train_x, train_y = ctx.extract(params, train_split)
            test_x, test_y = ctx.extract(params, test_split)
            if ctx is not self.ctx:
                ctx.new_round()  # its own cache, not cleared by run_all
            accuracies = np.zeros((len(self.shots), self.seeds))
            for seed in range(self.seeds):
                for i, shots in enumerate(self.shots):
                    chosen = fewshot_indices(train_y, ctx.num_classes, shots, seed)
                    accuracies[i, seed] = ridge_accuracy(train_x[chosen], train_y[chosen], test_x, test_y,
                                                         ctx.num_classes, self.l2_reg)
            for i, shots in enumerate(self.shots):
                yield f"{dataset}_{shots}shot", float(accuracies[i].mean())

    @staticmethod
    def check(name: str, entry: Any) -> None:
        where = f"config.evals.{name}"
        datasets = field(entry, "datasets", ("digits",))
        if (isinstance(datasets, str) or not (isinstance(datasets, Sequence) or _is_mapping(datasets)) or not datasets
                or (not _is_mapping(datasets) and not all(isinstance(d, str) for d in datasets))):
            raise ValueError(f"{where}.datasets={datasets!r} must be a non-empty tuple of dataset names, "
                             f"e.g. ('digits',), or {{name: dict(train_split=..., test_split=...)}}; "
                             f"allowed names: {sorted(sources.DATASETS)}")
        for d in datasets:
            if d not in sources.DATASETS or sources.dataset_info(d).num_classes < 2:
                raise ValueError(f"{where}.datasets: {d!r} is not a classification dataset; "
                                 f"allowed: {sorted(k for k, v in sources.DATASETS.items() if v.num_classes > 1)}")
            splits = datasets[d] if _is_mapping(datasets) else None
            if splits is not None and (not _is_mapping(splits) or set(splits) - set(SPLIT_FIELDS)):
                got = f"the fields {sorted(splits)}" if _is_mapping(splits) else f"{splits!r}"
                raise ValueError(f"{where}.datasets.{d} has {got}; allowed: a dict with the fields "
                                 f"{', '.join(SPLIT_FIELDS)} (each optional)")
            for f in SPLIT_FIELDS:
                value = (splits or {}).get(f)
                if value is not None and (not isinstance(value, str) or not value):
                    raise ValueError(f"{where}.datasets.{d}.{f}={value!r} must be a non-empty split string")
        for d, splits in dataset_splits(entry).items():
            for f, split in zip(SPLIT_FIELDS, splits):
                try:
                    record_sources.parse_split(split, d, list(sources.dataset_info(d).splits))
                except ValueError:
                    raise ValueError(f"{where}.datasets.{d}.{f}={split!r} is not a split of {d!r}; allowed: "
                                     f"{sorted(sources.dataset_info(d).splits)}, optionally sliced like "
                                     "'train[:65000]'") from None
        shots = field(entry, "shots", DEFAULT_SHOTS)
        if (isinstance(shots, str) or not isinstance(shots, Sequence) or not shots
                or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shots)):
            raise ValueError(f"{where}.shots={shots!r} must be a non-empty tuple of positive integers, e.g. (1, 5)")
        seeds = field(entry, "seeds", 3)
        if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
            raise ValueError(f"{where}.seeds={seeds!r} must be a positive integer (seeds 0 … seeds−1)")
        l2 = field(entry, "l2_reg", DEFAULT_L2)
        if isinstance(l2, bool) or not isinstance(l2, (int, float)) or not l2 > 0 or not np.isfinite(l2):
            raise ValueError(f"{where}.l2_reg={l2!r} must be a finite number > 0")

    @staticmethod
    def check_run(name: str, entry: Any, config: Any) -> None:
        """Every few-shot dataset has the run's number of image channels (the model reads those)."""
        run = sources.dataset_info(config.dataset.name).image_shape[-1]
        for d in dataset_splits(entry):
            channels = sources.dataset_info(d).image_shape[-1]
            if channels != run:
                raise ValueError(f"config.evals.{name}.datasets: {d!r} has {channels}-channel images, the model "
                                 f"reads {run}-channel ones (config.dataset.name={config.dataset.name!r})")

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Context, **common: Any) -> FewShot:
        cls.check(name, entry)
        views = {}
        for dataset, splits in dataset_splits(entry).items():
            view = ctx if dataset == ctx.config.dataset.name else contexts.derived(
                ctx, f"config.evals.{name}", dataset, entry.get("data_dir"))
            views[dataset] = (view, *splits)
        return cls(name=name, ctx=ctx, views=views, shots=tuple(field(entry, "shots", DEFAULT_SHOTS)),
                   seeds=field(entry, "seeds", 3), l2_reg=float(field(entry, "l2_reg", DEFAULT_L2)), **common)
