"""Random-access data sources: the embedded digits set and tensorflow-datasets sets.

A source is anything with `__len__` and `__getitem__(i) -> {'image': uint8 HWC, 'label': int,
...targets}` (the protocol of `tfds.data_source` and grain), so the pipeline treats every dataset
alike. A record carries the image plus the task's targets: the class label, and for dense tasks
the fields named in `DatasetInfo.targets` (e.g. a per-pixel `segmentation`, padded `boxes`),
which the pipeline batches alongside. The embedded sets take split slices like tfds:
'train[:10%]', 'train[10%:]', 'test[:100]' (a minival carved from train, next to the test split).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Protocol

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
    tfds_name: str | None = None  # None: embedded, needs no files
    fixed_size: bool = True  # every stored image is image_shape (False: resize + crop always)
    targets: tuple[str, ...] = ()  # record fields batched with the image besides the label


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
    # Digit scenes (data/digit_scenes.py): 32×32 canvases of 1-3 bundled digits on a textured
    # background, with per-pixel classes (0 background, 1 + digit) and boxes; real-data miniature
    # of the dense evaluations. Its 'train'/'test' use the digits of the digits split of that name.
    "digit_scenes": DatasetInfo(
        10, (32, 32, 1), {"train": 2874, "test": 720}, (0.5,), (0.5,),
        targets=("segmentation", "boxes_padded", "box_labels_padded", "num_boxes"),
    ),
    "tiny_imagenet": DatasetInfo(
        200, (64, 64, 3), {"train": 100_000, "val": 10_000},
        (0.485, 0.456, 0.406), (0.229, 0.224, 0.225),
    ),
}
_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
# Dense-evaluation sets (data/dense_sources.py): images at their own sizes, read by the dense
# evaluators only (num_classes: the segmentation classes; box sets: 0).
DENSE = {
    "voc12_seg": (21, {"train": 1464, "val": 1449, "train_aug": 10_582}, ("segmentation",)),
    "ade20k": (150, {"train": 20_210, "val": 2000}, ("segmentation",)),
    "coco_stuff": (171, {"train": 118_287, "val": 5000}, ("segmentation",)),
    "coco_stuff27": (27, {"train": 118_287, "val": 5000}, ("segmentation",)),
    "coco_stuff15": (15, {"train": 118_287, "val": 5000}, ("segmentation",)),
    "voc07_boxes": (0, {"trainval": 5011, "test": 4952}, ("boxes",)),
    "voc12_boxes": (0, {"trainval": 11_540}, ("boxes",)),
    "coco20k": (0, {"train": 19_817}, ("boxes",)),
}
DATASETS.update({
    name: DatasetInfo(k, (512, 512, 3), splits, *_IMAGENET, fixed_size=False, targets=targets)
    for name, (k, splits, targets) in DENSE.items()
})


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


def _tfds_source(name: str, split: str, data_dir: str | None) -> Source:
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
        where = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
        raise FileNotFoundError(
            f"config.dataset.name={name!r}: dataset not found in data dir {where!r} "
            f"({builder.data_dir}); see {DOCS_DATA} to prepare it"
        )
    return builder.as_data_source(split=split)


def get_source(name: str, split: str, data_dir: str | None = None) -> Source:
    """The random-access source of `split` (a tfds split string, e.g. 'train[:99%]')."""
    info = dataset_info(name)
    if info.tfds_name is not None:
        return _tfds_source(info.tfds_name, split, data_dir)
    if name in DENSE:
        from skipless_jax.data import dense_sources

        return dense_sources.get_source(name, split, data_dir)
    if name == "tiny_imagenet":
        from skipless_jax.data import tiny_imagenet

        return tiny_imagenet.TinyImageNetSource(data_dir, split)
    base, rows = parse_split(split, name)
    if name == "digit_scenes":
        from skipless_jax.data import digit_scenes

        source: Source = digit_scenes.DigitScenesSource(base)
    else:
        source = ArraySource(*_digits_split()[base])
    return source if rows is None else SliceSource(source, *rows(len(source)))


def parse_split(split: str, name: str, allowed: list[str] | None = None) -> tuple[str, Any]:
    """'train[10%:]' -> ('train', len -> (start, stop)); a plain name -> (name, None).

    allowed: the split names (default the embedded digits' 'test', 'train')."""
    import re

    match = re.fullmatch(r"(\w+)(?:\[(-?\d+%?)?:(-?\d+%?)?\])?", split or "")
    allowed = sorted(allowed or _digits_split())
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


def check_available(name: str, splits: list[str], data_dir: str | None = None) -> None:
    """Raises the one-line missing-dataset error at start, before anything compiles."""
    for split in splits:
        get_source(name, split, data_dir)
