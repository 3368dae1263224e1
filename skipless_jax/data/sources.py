"""The dataset catalog: what each dataset is (`DatasetInfo`) and its random-access source by name.

A source (data/record_sources.py) is anything with `__len__` and `__getitem__(i) -> {'image':
uint8 HWC, 'label': int, ...targets}` (the protocol of `tfds.data_source` and grain), so the
pipeline treats every dataset alike. A record carries the image plus the task's targets: the
class label, and for dense tasks the fields named in `DatasetInfo.targets` (e.g. a per-pixel
`segmentation`, padded `boxes`), which the pipeline batches alongside. The embedded sets take
split slices like tfds: 'train[:10%]', 'train[10%:]', 'test[:100]' (a minival carved from
train, next to the test split). `get_source` dispatches through `READERS` (name -> reader);
the readers' modules import the record sources, never this catalog.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from skipless_jax.data import dense_sources, digit_scenes, idx, imagenet_real, record_sources, tiny_imagenet
from skipless_jax.data.record_sources import Source


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
    # Record fields batched whatever the transform (no geometry: ImageNet-ReaL's label sets).
    label_targets: tuple[str, ...] = ()


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
    # Zalando's Fashion-MNIST: 70,000 real 28×28 grayscale images, 10 classes, from its four IDX
    # files (data/idx.py; Debian's dataset-fashion-mnist, or tfds); mean/std of the train split.
    "fashion_mnist": DatasetInfo(
        10, (28, 28, 1), {"train": 60_000, "test": 10_000}, (0.2860,), (0.3530,), tfds_name="fashion_mnist",
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
# ImageNet's other test sets (docs/method/evals.md §16), read by classification evaluators: ReaL's
# label sets (data/imagenet_real.py) and ImageNet-v2 matched-frequency.
DATASETS.update({
    "imagenet2012_real": DatasetInfo(1000, (224, 224, 3), {"validation": 50_000}, *_IMAGENET,
                                     tfds_name="imagenet2012_real", fixed_size=False, label_targets=("real_label",)),
    "imagenet_v2": DatasetInfo(1000, (224, 224, 3), {"test": 10_000}, *_IMAGENET,
                               tfds_name="imagenet_v2/matched-frequency", fixed_size=False),
})


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ValueError(f"config.dataset.name={name!r} is unknown; allowed: {sorted(DATASETS)}")
    return DATASETS[name]


def _embedded(make: Callable[[str], Source], name: str) -> Callable[[str, str | None], Source]:
    """The reader of an embedded set: `make(base split)`, then the split's slice if any."""

    def read(split: str, data_dir: str | None) -> Source:
        base, rows = record_sources.parse_split(split, name)
        source = make(base)
        return source if rows is None else record_sources.SliceSource(source, *rows(len(source)))

    return read


# name -> reader(split, data_dir); one per entry of DATASETS.
READERS: dict[str, Callable[[str, str | None], Source]] = {
    "digits": _embedded(lambda base: record_sources.ArraySource(*record_sources.digits_split()[base]), "digits"),
    "digit_scenes": _embedded(digit_scenes.DigitScenesSource, "digit_scenes"),
    "tiny_imagenet": lambda split, data_dir: tiny_imagenet.TinyImageNetSource(data_dir, split),
    **{name: functools.partial(dense_sources.get_source, name) for name in DENSE},
    **{name: functools.partial(record_sources.tfds_source, info.tfds_name)
       for name, info in DATASETS.items() if info.tfds_name is not None},
    "imagenet2012_real": imagenet_real.reader,
    "fashion_mnist": idx.reader(idx.FASHION_MNIST),  # the IDX folder, else its tfds copy
}


def get_source(name: str, split: str, data_dir: str | None = None) -> Source:
    """The random-access source of `split` (a tfds split string, e.g. 'train[:99%]')."""
    dataset_info(name)  # the one-line unknown-name error
    return READERS[name](split, data_dir)


def check_dense_dataset(name: str, kind: str, dataset: str, target: str) -> None:
    """One-line ValueError unless the records of `dataset` carry `target` ('segmentation' or
    'boxes'; the padded boxes of digit_scenes count); `name`, `kind`: the evaluator entry."""
    info = dataset_info(dataset)
    available = set(info.targets) | ({"boxes"} if "boxes_padded" in info.targets else set())
    if target not in available:
        dense = sorted(n for n, i in DATASETS.items() if target in i.targets or
                       (target == "boxes" and "boxes_padded" in i.targets))
        raise ValueError(
            f"config.evals.{name}: type {kind!r} needs a dataset with {target!r} targets; "
            f"{dataset!r} has {sorted(available) or 'none'} (set config.evals.{name}.dataset; with {target!r}: {dense})"
        )


def check_available(name: str, splits: list[str], data_dir: str | None = None) -> None:
    """Raises the one-line missing-dataset error at start, before anything compiles."""
    for split in splits:
        get_source(name, split, data_dir)
