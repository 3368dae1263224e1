"""ImageNet-ReaL records (tfds `imagenet2012_real`, Beyer et al. 2020; docs/method/evals.md §16).

tfds stores each validation image with its `original_label` and `real_label`, the (possibly
empty) set of reassessed labels. The pipeline stacks fixed shapes, so a record here carries
the set padded with −1 to one entry per class (a set holds at most every class once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from skipless_jax.data import record_sources

TFDS_NAME = "imagenet2012_real"
NUM_CLASSES = 1000
PAD = -1


def pad_labels(labels: Any, width: int = NUM_CLASSES) -> np.ndarray:
    """A label set (any length ≤ width) -> (width,) int32, padded with −1."""
    labels = np.asarray(labels, np.int64).reshape(-1)
    if len(labels) > width:
        raise ValueError(f"a ReaL label set of {len(labels)} labels exceeds the {width} classes")
    out = np.full((width,), PAD, np.int32)
    out[: len(labels)] = labels
    return out


class RealSource:
    """{'image', 'label': the original label, 'real_label': (NUM_CLASSES,) int32 padded with −1}."""

    def __init__(self, source: record_sources.Source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.source[index]
        return {"image": record["image"], "label": int(record["original_label"]),
                "real_label": pad_labels(record["real_label"])}


def reader(split: str, data_dir: str | None) -> RealSource:
    """The ReaL source of `split` (tfds has 'validation' only)."""
    return RealSource(record_sources.tfds_source(TFDS_NAME, split, data_dir))
