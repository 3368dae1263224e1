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


@functools.cache
def digits_split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
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
