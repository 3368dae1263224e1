"""Random-access record sources, the pieces every dataset's reader is built from.

A source is anything with `__len__` and `__getitem__(i) -> {'image': uint8 HWC, 'label': int,
...targets}` (the protocol of `tfds.data_source` and grain). Here: in-memory sources over arrays
or encoded files, a slice of a source, tfds-style split strings ('train[:10%]', 'test[:100]'),
the tfds reader with its one-line missing-dataset error, and the embedded digits split. The
catalog of datasets and the dispatch by name are `data/sources.py`.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Protocol

import numpy as np

DOCS_DATA = "docs/data.md"


class Source(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


class ArraySource:
    """In-memory source over (N, H, W, C) uint8 images and (N,) int labels."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "label": int(self.labels[index])}


class EncodedSource:
    """In-memory source over encoded image files (JPEG, PNG bytes) and int labels, decoded to
    uint8 RGB on access, as `tfds.data_source` decodes: the decode runs where the record is
    read (in a worker process when the pipeline has workers)."""

    def __init__(self, blobs: list[bytes], labels: np.ndarray):
        self.blobs, self.labels = blobs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import io

        from PIL import Image

        with Image.open(io.BytesIO(self.blobs[index])) as image:
            return {"image": np.asarray(image.convert("RGB")), "label": int(self.labels[index])}


def _digits_file() -> str:
    """scikit-learn's bundled `datasets/data/digits.csv.gz` (what `load_digits` reads), found
    without importing sklearn (its import takes about a second of every process's start)."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("sklearn")  # a top-level package's spec: nothing is executed
    if spec is None or spec.origin is None:
        raise ValueError("the embedded digits are scikit-learn's bundled copy: pip install scikit-learn")
    return os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Per-class draws of a stratified split: the floor of each class's share of `draws`, plus one
    for the classes of largest remainder, ties broken by `rng` (scikit-learn's rule and draws)."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    need = int(draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if need <= 0:
            break
        (indices,) = np.where(remainder == value)
        add = min(len(indices), need)
        floored[rng.choice(indices, size=add, replace=False)] += 1
        need -= add
    return floored.astype(int)


def stratified_split(labels: np.ndarray, test_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) row indices of `train_test_split(test_size=test_size, random_state=seed,
    stratify=labels)`: the same RandomState draws in the same order as scikit-learn's
    StratifiedShuffleSplit (tests/test_digit_scenes.py compares the two)."""
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_train = _approximate_mode(counts, len(labels) - test_size, rng)
    n_test = _approximate_mode(counts - n_train, test_size, rng)
    train: list[int] = []
    test: list[int] = []
    for rows, k_train, k_test, count in zip(by_class, n_train, n_test, counts, strict=True):
        shuffled = rows[rng.permutation(count)]
        train.extend(shuffled[:k_train])
        test.extend(shuffled[k_train:k_train + k_test])
    return rng.permutation(train), rng.permutation(test)


@functools.cache
def digits_split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The fixed digits split: 360 test images stratified by class, the other 1,437 train.

    scikit-learn's bundled digits, split as `train_test_split(test_size=360, random_state=0,
    stratify=labels)` splits them (`stratified_split`, without importing sklearn); pixel values
    0..16 are scaled to uint8 0..255 so digits look like any other image set.
    """
    import gzip

    with gzip.open(_digits_file(), "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    images = np.round(data[:, :-1].reshape(-1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)[..., None]
    labels = data[:, -1].astype(np.int32)
    train, test = stratified_split(labels, 360, seed=0)
    return {"train": (images[train], labels[train]), "test": (images[test], labels[test])}


def tfds_source(name: str, split: str, data_dir: str | None) -> Source:
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
        where = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
        raise FileNotFoundError(
            f"config.dataset.name={name!r}: dataset not found in data dir {where!r} "
            f"({builder.data_dir}); see {DOCS_DATA} to prepare it"
        )
    return builder.as_data_source(split=split)


def parse_split(split: str, name: str, allowed: list[str] | None = None) -> tuple[str, Any]:
    """'train[10%:]' -> ('train', len -> (start, stop)); a plain name -> (name, None).

    allowed: the split names (default the embedded digits' 'test', 'train')."""
    import re

    match = re.fullmatch(r"(\w+)(?:\[(-?\d+%?)?:(-?\d+%?)?\])?", split or "")
    allowed = sorted(allowed or digits_split())
    if match is None or match.group(1) not in allowed:
        raise ValueError(f"config.dataset split {split!r} of {name!r} is unknown; allowed: {allowed}, "
                         "optionally sliced like 'train[:10%]' or 'train[100:]'")
    if "[" not in split:
        return match.group(1), None

    def bound(text: str | None, n: int, default: int) -> int:
        if text is None:
            return default
        value = round(n * int(text[:-1]) / 100) if text.endswith("%") else int(text)
        return max(0, min(n, value + n if value < 0 else value))

    return match.group(1), lambda n: (bound(match.group(2), n, 0), bound(match.group(3), n, n))


class SliceSource:
    """Examples [start, stop) of another source, renumbered from 0."""

    def __init__(self, source: Source, start: int, stop: int):
        if stop <= start:
            raise ValueError(f"the split slice [{start}:{stop}] is empty")
        self.source, self.start, self.stop = source, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.source[self.start + index]
