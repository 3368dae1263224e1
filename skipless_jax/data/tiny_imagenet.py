"""Tiny-ImageNet-200 read from its unpacked folder, as a random-access source.

The folder is the official `tiny-imagenet-200.zip` unpacked (docs/data.md):

    tiny-imagenet-200/wnids.txt                              200 class ids (WordNet)
    tiny-imagenet-200/train/<wnid>/images/<wnid>_<k>.JPEG    500 per class, 64×64
    tiny-imagenet-200/val/images/val_<k>.JPEG                10,000, 50 per class
    tiny-imagenet-200/val/val_annotations.txt                file<TAB>wnid<TAB>box…

Labels are the positions of the wnids in sorted order (what an ImageFolder over the same
classes gives). The test split has no public labels and is not offered. A source maps
`index -> {'image': uint8 (64, 64, 3), 'label': int}`, like `tfds.data_source`, so the
pipeline treats it as any other dataset; grayscale files are converted to RGB.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
from PIL import Image

NUM_CLASSES = 200
IMAGE_SHAPE = (64, 64, 3)
SPLITS = {"train": 100_000, "val": 10_000}
SPLIT_ALIASES = {"validation": "val"}
DOCS = "docs/data.md"


class TinyImageNetSource:
    """Random access to one split (or a tfds-style slice of it, e.g. 'train[:90%]')."""

    def __init__(self, root: str | None, split: str = "train"):
        name = parse_split(split)[0]
        files, labels = list_split(root, name)
        _, start, stop = parse_split(split, len(files))
        self.root, self.split = root, split
        self.files, self.labels = files[start:stop], labels[start:stop]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        with Image.open(self.files[index]) as image:
            pixels = np.asarray(image.convert("RGB"))
        return {"image": pixels, "label": int(self.labels[index])}

    def __repr__(self) -> str:
        return f"TinyImageNetSource(root={self.root!r}, split={self.split!r}, len={len(self)})"


def parse_split(split: str, total: int | None = None) -> tuple[str, int | None, int | None]:
    """'train' | 'val' | 'validation', optionally sliced '[a:b]' in examples or percent.

    Args:
        split: e.g. 'train', 'val', 'train[:90%]', 'train[90%:]', 'val[:1000]'.
        total: examples in the whole split (for percent bounds); default its official size.

    Returns:
        (split name, start, stop) with start/stop indices into the split (None = open end).
    """
    match = re.fullmatch(r"(\w+)(?:\[(-?\d*)(%?):(-?\d*)(%?)\])?", split.strip())
    name = SPLIT_ALIASES.get(match.group(1), match.group(1)) if match else None
    if match is None or name not in SPLITS:
        raise ValueError(f"tiny_imagenet split {split!r} is unknown; allowed: 'train', 'val' "
                         "(alias 'validation'), optionally sliced like 'train[:90%]' or 'val[:1000]'")
    total = SPLITS[name] if total is None else total

    def bound(value: str, percent: str) -> int | None:
        if value == "":
            return None
        return round(total * int(value) / 100) if percent else int(value)

    return name, bound(match.group(2) or "", match.group(3)), bound(match.group(4) or "", match.group(5))


def _natural_key(name: str) -> tuple[str, int]:
    """'n01443537_12.JPEG' -> ('n01443537_', 12): numbered files in numeric order."""
    match = re.search(r"(\d+)\.\w+$", name)
    return (name[:match.start(1)], int(match.group(1))) if match else (name, -1)


def _class_ids(root: str | None) -> list[str]:
    if not root:
        raise FileNotFoundError("config.dataset.data_dir is not set; it must point to the unpacked "
                                f"tiny-imagenet-200 folder; see {DOCS}")
    wnids_file = os.path.join(root, "wnids.txt")
    if not os.path.isfile(wnids_file):
        raise FileNotFoundError(
            f"config.dataset.data_dir={root!r}: no Tiny-ImageNet-200 folder there (wnids.txt "
            f"missing); see {DOCS} to prepare it")
    with open(wnids_file) as f:
        wnids = sorted(line.strip() for line in f if line.strip())
    if len(wnids) != NUM_CLASSES:
        raise ValueError(f"{wnids_file}: {len(wnids)} class ids, expected {NUM_CLASSES}")
    return wnids


def list_split(root: str | None, split: str) -> tuple[list[str], np.ndarray]:
    """All (file path, label) pairs of a split, in a fixed order.

    Train: classes interleaved (image k of each class in sorted-wnid order, k = 0, 1, ...);
    val: by image number. Labels index the sorted wnids.
    """
    wnids = _class_ids(root)
    label_of = {wnid: i for i, wnid in enumerate(wnids)}
    files: list[str] = []
    labels: list[int] = []
    if split == "train":
        per_class = []
        for wnid in wnids:
            folder = os.path.join(root, "train", wnid, "images")
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"tiny_imagenet: {folder} missing; see {DOCS}")
            names = sorted((n for n in os.listdir(folder) if n.lower().endswith((".jpeg", ".jpg"))),
                           key=_natural_key)
            per_class.append([os.path.join(folder, n) for n in names])
        # Interleave the classes (image 0 of every class, then image 1, ...) so that any
        # prefix slice such as 'train[:90%]' stays class-balanced.
        for j in range(max(map(len, per_class))):
            for label, paths in enumerate(per_class):
                if j < len(paths):
                    files.append(paths[j])
                    labels.append(label)
    else:
        annotations = os.path.join(root, "val", "val_annotations.txt")
        if not os.path.isfile(annotations):
            raise FileNotFoundError(f"tiny_imagenet: {annotations} missing; see {DOCS}")
        with open(annotations) as f:
            rows = sorted((line.split("\t")[:2] for line in f if line.strip()),
                          key=lambda row: _natural_key(row[0]))
        for name, wnid in rows:
            if wnid not in label_of:
                raise ValueError(f"{annotations}: class {wnid!r} of {name} is not in wnids.txt")
            files.append(os.path.join(root, "val", "images", name))
            labels.append(label_of[wnid])
    if not files:
        raise FileNotFoundError(f"tiny_imagenet: no images found for split {split!r} under {root}")
    return files, np.asarray(labels, np.int32)
