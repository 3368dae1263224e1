"""One deterministic, resumable input pipeline (grain over a random-access source).

Train: the global example stream is `shuffle(seed) → repeat → random_map(transform)`, so the
example at global position i (and its augmentation randomness) depends only on (seed, i);
step s holds positions [s·B, (s+1)·B). Process p of P reads only its contiguous slice of each
global batch, and a resumed run starts at `start_step` with no iterator state to restore.

Eval: the split in order, cut into global batches of B; the last one is padded and every
example carries `mask` (1 real, 0 padding), so every example counts exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from skipless_jax.data import sources

Transform = Callable[[np.ndarray, np.random.Generator], np.ndarray]
BatchTransform = Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]]


def normalize(image: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """uint8 HWC -> float32 (x/255 − mean)/std per channel."""
    x = image.astype(np.float32) / 255.0
    return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def one_hot(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.eye(num_classes, dtype=np.float32)[labels]


def _local_slice(global_batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    if global_batch_size % process_count:
        raise ValueError(
            f"config.input.batch_size={global_batch_size} is not divisible by the "
            f"{process_count} processes"
        )
    local = global_batch_size // process_count
    return process_index * local, local


def _read_options(num_workers: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=max(num_workers, 1), prefetch_buffer_size=max(2 * num_workers, 2))


def train_batches(
    source: sources.Source,
    transform: Transform,
    *,
    num_classes: int,
    global_batch_size: int,
    seed: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    batch_transform: BatchTransform | None = None,
    num_workers: int = 0,
    targets: tuple[str, ...] = (),
) -> Iterator[dict[str, np.ndarray]]:
    """Process-local train batches {'image': (b, H, W, C) f32, 'label': (b, K) f32, *targets} from
    step `start_step` on; b = global_batch_size / process_count. `targets` are record fields
    (e.g. 'segmentation') stacked as they are stored."""
    offset, local = _local_slice(global_batch_size, process_index, process_count)

    def example(record: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"image": transform(record["image"], rng), "label": np.int32(record["label"]),
                **{k: np.asarray(record[k]) for k in targets}}

    stream = (
        grain.MapDataset.source(source)
        .shuffle(seed=seed)
        .repeat(None)
        .random_map(example, seed=seed)
    )

    def batch_at(step: int) -> list[int]:
        start = step * global_batch_size + offset
        return list(range(start, start + local))

    def collate(step: int) -> dict[str, np.ndarray]:
        records = [stream[i] for i in batch_at(step)]
        batch = {
            "image": np.stack([r["image"] for r in records]),
            "label": one_hot(np.array([r["label"] for r in records]), num_classes),
            **{k: np.stack([r[k] for r in records]) for k in targets},
        }
        if batch_transform is not None:  # batch-level ops (mixup/cutmix): rng from (seed, step, p)
            batch = batch_transform(batch, np.random.default_rng([seed, step, process_index, 1]))
        return batch

    steps = grain.MapDataset.range(start_step, 2**62).map(collate)
    if num_workers > 0:
        yield from steps.to_iter_dataset(_read_options(num_workers))
    else:
        for step in range(start_step, 2**62):
            yield collate(step)


def num_eval_batches(num_examples: int, global_batch_size: int) -> int:
    return math.ceil(num_examples / global_batch_size)


def eval_batches(
    source: sources.Source,
    transform: Callable[[np.ndarray], np.ndarray],
    *,
    num_classes: int,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    targets: tuple[str, ...] = (),
) -> Iterator[dict[str, np.ndarray]]:
    """Process-local eval batches with `mask`; padding repeats example 0 with mask 0. `targets`
    are record fields stacked as stored (images stored at the model's size keep them aligned)."""
    offset, local = _local_slice(global_batch_size, process_index, process_count)
    n = len(source)
    for b in range(num_eval_batches(n, global_batch_size)):
        positions = np.arange(b * global_batch_size + offset, b * global_batch_size + offset + local)
        mask = positions < n
        records = [source[int(i)] if m else source[0] for i, m in zip(positions, mask)]
        yield {
            "image": np.stack([transform(r["image"]) for r in records]),
            "label": one_hot(np.array([r["label"] for r in records]), num_classes),
            "mask": mask.astype(np.float32),
            **{k: np.stack([np.asarray(r[k]) for r in records]) for k in targets},
        }
