"""Random-access data sources: the embedded digits set and tensorflow-datasets sets.

A source is anything with `__len__` and `__getitem__(i) -> {'image': uint8 HWC, 'label': int}`
(the protocol of `tfds.data_source` and grain), so the pipeline treats every dataset alike.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional, Protocol

import numpy as np

DOCS_DATA = "docs/data.md"


class Source(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the pipeline and the model need to know about a dataset."""

    num_classes: int
    image_shape: tuple[int, int, int]  # (H, W, C) after the eval transform
    splits: dict[str, int]  # split name -> number of examples
    mean: tuple[float, ...]  # per-channel, on the [0, 1] scale
    std: tuple[float, ...]
    tfds_name: Optional[str] = None  # None: embedded, needs no files
    fixed_size: bool = True  # every stored image is image_shape (False: resize + crop always)


DATASETS: dict[str, DatasetInfo] = {
    # scikit-learn's bundled handwritten digits: 1,797 real 8×8 images, 10 classes.
    "digits": DatasetInfo(10, (8, 8, 1), {"train": 1437, "test": 360}, (0.5,), (0.5,)),
    "imagenet2012": DatasetInfo(
        1000, (224, 224, 3), {"train": 1_281_167, "validation": 50_000},
        (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), tfds_name="imagenet2012", fixed_size=False,
    ),
    "cifar10": DatasetInfo(
        10, (32, 32, 3), {"train": 50_000, "test": 10_000},
        (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), tfds_name="cifar10",
    ),
    "cifar100": DatasetInfo(
        100, (32, 32, 3), {"train": 50_000, "test": 10_000},
        (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), tfds_name="cifar100",
    ),
    # The unpacked tiny-imagenet-200 folder (config.dataset.data_dir); a subset of ImageNet,
    # normalized with ImageNet's statistics.
    "tiny_imagenet": DatasetInfo(
        200, (64, 64, 3), {"train": 100_000, "val": 10_000},
        (0.485, 0.456, 0.406), (0.229, 0.224, 0.225),
    ),
}


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ValueError(f"config.dataset.name={name!r} is unknown; allowed: {sorted(DATASETS)}")
    return DATASETS[name]


class ArraySource:
    """In-memory source over (N, H, W, C) uint8 images and (N,) int labels."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "label": int(self.labels[index])}


@functools.cache
def _digits_split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The fixed digits split: 360 test images stratified by class, the other 1,437 train.

    `train_test_split(test_size=360, random_state=0, stratify=labels)` over sklearn's order;
    pixel values 0..16 are scaled to uint8 0..255 so digits look like any other image set.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    labels = digits.target.astype(np.int32)
    tr_x, te_x, tr_y, te_y = train_test_split(
        images, labels, test_size=360, random_state=0, stratify=labels
    )
    return {"train": (tr_x, tr_y), "test": (te_x, te_y)}


def _tfds_source(name: str, split: str, data_dir: Optional[str]) -> Source:
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
        where = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
        raise FileNotFoundError(
            f"config.dataset.name={name!r}: dataset not found in data dir {where!r} "
            f"({builder.data_dir}); see {DOCS_DATA} to prepare it"
        )
    return builder.as_data_source(split=split)


def get_source(name: str, split: str, data_dir: Optional[str] = None) -> Source:
    """The random-access source of `split` (a tfds split string, e.g. 'train[:99%]')."""
    info = dataset_info(name)
    if info.tfds_name is not None:
        return _tfds_source(info.tfds_name, split, data_dir)
    if name == "tiny_imagenet":
        from skipless_jax.data import tiny_imagenet

        return tiny_imagenet.TinyImageNetSource(data_dir, split)
    splits = _digits_split()
    if split not in splits:
        raise ValueError(f"config.dataset split {split!r} of {name!r} is unknown; allowed: {sorted(splits)}")
    return ArraySource(*splits[split])


def check_available(name: str, splits: list[str], data_dir: Optional[str] = None) -> None:
    """Raises the one-line missing-dataset error at start, before anything compiles."""
    for split in splits:
        get_source(name, split, data_dir)
