"""MNIST-format folders (MNIST, Fashion-MNIST, KMNIST) read from their four gzip IDX files.

A folder holds the four files of the original distributions (the same names for all three):

    train-images-idx3-ubyte.gz   magic 2051, N, rows, cols, then N·rows·cols uint8 pixels
    train-labels-idx1-ubyte.gz   magic 2049, N, then N uint8 labels
    t10k-images-idx3-ubyte.gz    the test split, the same layout
    t10k-labels-idx1-ubyte.gz

(big-endian int32 header fields; magic 0x0803 = unsigned bytes, 3 dimensions; 0x0801: 1
dimension). `read_split` checks each file (gzip intact, magic number, image shape, the header's
count against the bytes that follow, labels < the number of classes) and that the images and
labels agree in count; any failure is one line naming the file and how to get it again.
A source maps `index -> {'image': uint8 (rows, cols, 1), 'label': int}` like
`tfds.data_source`; the split strings take tfds slices ('train[:55000]', 'train[55000:]').
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from skipless_jax.data import record_sources

IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions (count, rows, cols)
LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension (count)
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


@dataclasses.dataclass(frozen=True)
class IdxDataset:
    """One MNIST-format dataset: its name, where its files are by default, how to get them."""

    name: str
    default_dir: str
    install: str  # the one-line hint that ends every missing-or-damaged-file error
    image_shape: tuple[int, int] = (28, 28)
    num_classes: int = 10
    tfds_name: str | None = None  # the other route: a tfds-prepared copy in a tfds data dir


FASHION_MNIST = IdxDataset(
    "fashion_mnist", "/usr/share/datasets/fashion-mnist",
    "install it with `apt-get install -y dataset-fashion-mnist` (Debian/Ubuntu), or prepare tfds "
    "'fashion_mnist' and set config.dataset.data_dir to that tfds data dir; see docs/data.md",
    tfds_name="fashion_mnist",
)


def _decompressed(path: str, hint: str) -> bytes:
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; {hint}") from None
    except (OSError, EOFError, zlib.error) as err:  # truncated, bad CRC, not gzip at all
        raise ValueError(f"{path}: a damaged gzip file ({err}); {hint}") from None


def _header(data: bytes, path: str, magic: int, fields: int, hint: str) -> list[int]:
    """The big-endian int32 header (magic, then `fields` sizes) after checking the magic number."""
    if len(data) < 4 * (1 + fields):
        raise ValueError(f"{path}: {len(data)} bytes, shorter than an IDX header; {hint}")
    values = [int.from_bytes(data[4 * i:4 * i + 4], "big") for i in range(1 + fields)]
    if values[0] != magic:
        raise ValueError(f"{path}: magic number {values[0]}, expected {magic}; not an IDX "
                         f"{'image' if magic == IMAGES_MAGIC else 'label'} file; {hint}")
    return values[1:]


def _payload(data: bytes, path: str, offset: int, expected: int, what: str, hint: str) -> np.ndarray:
    """The uint8 bytes after the header, which must be exactly `expected` (the header's count)."""
    if len(data) - offset != expected:
        raise ValueError(f"{path}: the header announces {expected} bytes of {what}, the file holds "
                         f"{len(data) - offset}; {hint}")
    return np.frombuffer(data, np.uint8, offset=offset)


def read_files(images_path: str, labels_path: str, spec: IdxDataset) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, rows, cols, 1), labels int32 (N,)) of one split's two files, checked."""
    hint = spec.install
    data = _decompressed(images_path, hint)
    count, rows, cols = _header(data, images_path, IMAGES_MAGIC, 3, hint)
    if (rows, cols) != spec.image_shape:
        raise ValueError(f"{images_path}: images of {rows}×{cols}, expected {spec.image_shape[0]}×"
                         f"{spec.image_shape[1]} ({spec.name}); {hint}")
    images = _payload(data, images_path, 16, count * rows * cols, f"{count} images", hint)
    data = _decompressed(labels_path, hint)
    (num_labels,) = _header(data, labels_path, LABELS_MAGIC, 1, hint)
    labels = _payload(data, labels_path, 8, num_labels, f"{num_labels} labels", hint)
    if num_labels != count:
        raise ValueError(f"{labels_path}: {num_labels} labels for the {count} images of "
                         f"{os.path.basename(images_path)}; {hint}")
    if count and labels.max() >= spec.num_classes:
        raise ValueError(f"{labels_path}: label {labels.max()}, expected 0..{spec.num_classes - 1}; {hint}")
    return images.reshape(count, rows, cols, 1), labels.astype(np.int32)


def _stamp(path: str) -> tuple[int, int] | None:
    """(size, mtime) of a file, so that a file replaced in place is read again; None if absent."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _read_cached(images_path: str, labels_path: str, spec: IdxDataset, stamps: Any) -> tuple[np.ndarray, np.ndarray]:
    del stamps  # part of the cache key only
    return read_files(images_path, labels_path, spec)


def read_split(folder: str, split: str, spec: IdxDataset = FASHION_MNIST) -> tuple[np.ndarray, np.ndarray]:
    """The checked arrays of split 'train' or 'test' of the MNIST-format `folder` (read once per
    process and kept: a worker process that reads records reads the files once)."""
    paths = tuple(os.path.join(os.path.abspath(os.path.expanduser(folder)), f) for f in FILES[split])
    return _read_cached(*paths, spec, tuple(_stamp(p) for p in paths))


class IdxSource:
    """Random access to one split of an MNIST-format folder; pickles without its arrays, so a
    worker process reads the files itself instead of receiving them."""

    def __init__(self, folder: str, split: str, spec: IdxDataset = FASHION_MNIST):
        self.folder, self.split, self.spec = folder, split, spec
        self._arrays = read_split(folder, split, spec)  # reads and checks the files now
        self.length = len(self._arrays[1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._arrays is None:  # unpickled in a worker process
            self._arrays = read_split(self.folder, self.split, self.spec)
        images, labels = self._arrays
        return {"image": images[index], "label": int(labels[index])}

    def __repr__(self) -> str:
        return f"IdxSource(folder={self.folder!r}, split={self.split!r}, len={self.length})"


def has_files(folder: str) -> bool:
    """Whether `folder` holds any of the four IDX files (then it is read as an IDX folder, and a
    missing one of the four is an error, not a reason to look for tfds)."""
    return any(os.path.exists(os.path.join(os.path.expanduser(folder), f)) for pair in FILES.values() for f in pair)


def reader(spec: IdxDataset) -> Callable[[str, str | None], record_sources.Source]:
    """The catalog's reader(split, data_dir) of `spec`: the IDX folder `data_dir` (default
    `spec.default_dir`); where it holds none of the four files and the tfds data dir `data_dir`
    has a `spec.tfds_name` folder, tfds's copy instead (in tfds's own record order); else the
    one-line error naming the missing file and how to install it."""

    def read(split: str, data_dir: str | None) -> record_sources.Source:
        folder = data_dir or spec.default_dir
        base, rows = record_sources.parse_split(split, spec.name, allowed=list(FILES))
        if not has_files(folder) and spec.tfds_name is not None and _tfds_folder(spec.tfds_name, data_dir):
            return record_sources.tfds_source(spec.tfds_name, split, data_dir)
        source = IdxSource(folder, base, spec)
        return source if rows is None else record_sources.SliceSource(source, *rows(len(source)))

    return read


def _tfds_folder(name: str, data_dir: str | None) -> bool:
    """Whether the tfds data dir (`data_dir`, else TFDS_DATA_DIR, else ~/tensorflow_datasets) has
    a folder for `name` (then tfds reads it, with its own one-line error if it is not prepared);
    looked up without importing tensorflow_datasets (seconds of start-up)."""
    root = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    return os.path.isdir(os.path.join(os.path.expanduser(root), name))
