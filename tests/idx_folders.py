"""Tiny MNIST-format folders (the four gzip IDX files of data/idx.py), written by the tests."""

from __future__ import annotations

import gzip
import os

import numpy as np

from skipless_jax.data import idx


def idx_bytes(magic: int, dims: tuple[int, ...], payload: np.ndarray) -> bytes:
    """An IDX file's bytes: the big-endian int32 magic and sizes, then the uint8 payload."""
    header = b"".join(int(v).to_bytes(4, "big") for v in (magic, *dims))
    return header + np.asarray(payload, np.uint8).tobytes()


def write_gz(path: str, data: bytes) -> None:
    with gzip.open(path, "wb") as f:
        f.write(data)


def write_folder(root: str, train: int = 12, test: int = 6, seed: int = 0,
                 shape: tuple[int, int] = (28, 28)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A folder of the four files with `train` / `test` random images (labels i mod 10);
    returns {split: (images (N, rows, cols), labels (N,))}."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", train), ("test", test)):
        images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        images_file, labels_file = idx.FILES[split]
        write_gz(os.path.join(root, images_file), idx_bytes(idx.IMAGES_MAGIC, (n, *shape), images))
        write_gz(os.path.join(root, labels_file), idx_bytes(idx.LABELS_MAGIC, (n,), labels))
        out[split] = (images, labels)
    return out
