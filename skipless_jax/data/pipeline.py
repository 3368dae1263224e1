"""One deterministic, resumable input pipeline (grain over a random-access source).

Train: the global example stream is `shuffle(seed) → repeat → random_map(transform)`, so the
example at global position i (and its augmentation randomness) depends only on (seed, i);
step s holds positions [s·B, (s+1)·B). With repeated augmentation (r > 1, DeiT's RASampler) or
whole batches per epoch (`drop_last`), position i of epoch length L reads image
order_e[(i mod L) // r] of epoch e = i // L (`epoch_length`, docs/method/recipes.md §21), and with r > 1
the step's positions are strided over the S data shards (position s·B + k at row
(k mod S)·B/S + ⌊k/S⌋), so an image's copies are on different devices. Process p
of P reads only its contiguous slice of each global batch, and a resumed run starts at
`start_step` with no iterator state to restore: the examples from step s on are the same
whatever the number of processes or workers.

Eval: the split in order, cut into global batches of B; the last one is padded and every
example carries `mask` (1 real, 0 padding), so every example counts exactly once.

Workers (`num_workers` > 0): each example is read, decoded and transformed in one of
`num_workers` worker processes (grain's `mp_prefetch`: worker w makes this process's chunks of
WORKER_CHUNK consecutive examples c = w, w + W, ...; the main process takes them back in order
and stacks the batches), so the batches are the same with 0 or W workers. Host memory held by
the pipeline: about `num_workers · (WORKER_BUFFER + 1) · WORKER_CHUNK` examples in flight plus
one batch being stacked.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from skipless_jax import rng_streams
from skipless_jax.data import record_sources

Transform = Callable[[np.ndarray, np.random.Generator], np.ndarray]
BatchTransform = Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]]
WORKER_CHUNK = 8  # consecutive examples a worker makes and ships at once
WORKER_BUFFER = 2  # chunks each worker process keeps ready
RA_MULTIPLE = 256  # DeiT's RASampler: an epoch of ⌊N/256⌋·256 samples (its num_selected_samples)


def epoch_length(num_examples: int, repeats: int = 1, global_batch_size: int | None = None) -> int:
    """Stream positions in one epoch (docs/method/recipes.md §21): N; ⌊N/256⌋·256 with repeated
    augmentation (`repeats` r > 1, about N/r distinct images); rounded down to whole global
    batches when `global_batch_size` is given (a loader that drops the last partial batch)."""
    if not isinstance(repeats, (int, np.integer)) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"config.input.repeated_augmentation={repeats!r}; must be an int >= 1 (1: off)")
    length = num_examples // RA_MULTIPLE * RA_MULTIPLE if repeats > 1 else num_examples
    if global_batch_size:
        length = length // global_batch_size * global_batch_size
    if length <= 0:
        raise ValueError(
            f"an epoch of {num_examples} examples with repeated_augmentation={repeats} and drop_last batches of "
            f"{global_batch_size} holds no sample; allowed: >= {RA_MULTIPLE if repeats > 1 else 1} examples and "
            "at least one whole batch")
    return length


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


def check_num_workers(num_workers: Any) -> int:
    if not isinstance(num_workers, (int, np.integer)) or isinstance(num_workers, bool) or num_workers < 0:
        raise ValueError(f"config.input.num_workers={num_workers!r}; must be an int >= 0 (worker processes)")
    return int(num_workers)


def _grain_flags() -> None:
    """grain's workers read absl flags; outside an absl app (tests, notebooks) nobody parsed them."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


@dataclasses.dataclass(frozen=True)
class _Example:
    """record -> the example the batch holds (picklable, for worker processes)."""

    transform: Transform
    targets: tuple[str, ...]

    def __call__(self, record: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = self.transform(record["image"], rng)  # an image, or a dict {'image', ...} (uint8 + erase box)
        return {**(out if isinstance(out, dict) else {"image": out}), "label": np.int32(record["label"]),
                **{k: np.asarray(record[k]) for k in self.targets}}


class _EpochOrder:
    """Position i -> the image `images` (the per-epoch shuffled, repeated source) holds there:
    epoch e = i // length reads its order's entry (i mod length) // repeats (the r copies of an
    image are consecutive positions, each augmented from its own position)."""

    def __init__(self, images: Any, num_examples: int, length: int, repeats: int):
        self.images, self.num_examples, self.length, self.repeats = images, num_examples, length, repeats

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, i: int) -> Any:
        epoch, k = divmod(i, self.length)
        return self.images[epoch * self.num_examples + k // self.repeats]


class _TrainExamples:
    """This process's train examples from `start_step` on, as a random-access source: element j
    is global position (start_step + j // local)·B + offset + j % local of the seeded stream.
    Pickles without the stream (a worker process rebuilds it on first use)."""

    def __init__(self, source: record_sources.Source, example: _Example, seed: int, global_batch_size: int,
                 offset: int, local: int, start_step: int, repeats: int = 1, drop_last: bool = False,
                 shards: int = 1):
        self.source, self.example, self.seed = source, example, seed
        self.global_batch_size, self.offset, self.local, self.start_step = global_batch_size, offset, local, start_step
        self.repeats = repeats
        # r > 1: row j = d·B/S + m of the global batch holds the step's position m·S + d (docs/method/recipes.md
        # §21), so the r consecutive copies of an image land on r different data shards.
        self.shards = shards if repeats > 1 else 1
        if global_batch_size % self.shards:
            raise ValueError(f"config.input.batch_size={global_batch_size} is not divisible by the {shards} "
                             "data-parallel devices")
        self.length = epoch_length(len(source), repeats, global_batch_size if drop_last else None)
        self._stream = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_stream": None}

    def __len__(self) -> int:
        return 2**62

    def position(self, j: int) -> int:
        step, k = divmod(j, self.local)
        shard, m = divmod(self.offset + k, self.global_batch_size // self.shards)  # the global row's device
        return (self.start_step + step) * self.global_batch_size + m * self.shards + shard

    def __getitem__(self, j: int) -> dict[str, np.ndarray]:
        if self._stream is None:
            images = grain.MapDataset.source(self.source).shuffle(seed=self.seed).repeat(None)
            if (self.length, self.repeats) != (len(self.source), 1):  # else the plain stream, as before
                images = grain.MapDataset.source(_EpochOrder(images, len(self.source), self.length, self.repeats))
            self._stream = images.random_map(self.example, seed=self.seed)
        return self._stream[self.position(j)]


class _EvalExamples:
    """This process's eval examples in order, padded to whole global batches: element j is
    position (j // local)·B + offset + j % local of the split, `mask` 0 past its end (padding
    repeats example 0)."""

    def __init__(self, source: record_sources.Source, transform: Callable[[np.ndarray], np.ndarray],
                 global_batch_size: int, offset: int, local: int, targets: tuple[str, ...]):
        self.source, self.transform, self.targets = source, transform, targets
        self.global_batch_size, self.offset, self.local = global_batch_size, offset, local

    def __len__(self) -> int:
        return num_eval_batches(len(self.source), self.global_batch_size) * self.local

    def __getitem__(self, j: int) -> dict[str, np.ndarray]:
        b, k = divmod(j, self.local)
        position = b * self.global_batch_size + self.offset + k
        real = position < len(self.source)
        record = self.source[position if real else 0]
        return {"image": self.transform(record["image"]), "label": np.int32(record["label"]),
                "mask": np.float32(real), **{t: np.asarray(record[t]) for t in self.targets}}


class _Chunks:
    """Elements [c·size, (c+1)·size) of a random-access dataset, stacked: what a worker makes and
    ships at once (one transfer per chunk, not per example; the last chunk may be shorter)."""

    def __init__(self, dataset: Any, size: int):
        self.dataset, self.size = dataset, size

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.size)

    def __getitem__(self, c: int) -> dict[str, np.ndarray]:
        stop = min((c + 1) * self.size, len(self.dataset))
        return stack([self.dataset[j] for j in range(c * self.size, stop)])


def examples(dataset: Any, num_workers: int) -> Iterator[dict[str, np.ndarray]]:
    """The elements of a random-access `dataset` in order: read here (0 workers) or by
    `num_workers` worker processes, each making chunks of WORKER_CHUNK consecutive elements
    (chunk c by worker c mod W) with one thread (one core per worker)."""
    if not check_num_workers(num_workers):
        return (dataset[j] for j in range(len(dataset)))
    _grain_flags()
    stream = (grain.MapDataset.source(_Chunks(dataset, WORKER_CHUNK))
              .to_iter_dataset(grain.ReadOptions(num_threads=0))
              .mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                        per_worker_buffer_size=WORKER_BUFFER)))
    return _unchunked(iter(stream))


def _unchunked(chunks: Any) -> Iterator[dict[str, np.ndarray]]:
    try:
        for chunk in chunks:
            chunk = {k: np.array(v) for k, v in chunk.items()}  # out of the worker's shared memory
            for i in range(len(next(iter(chunk.values())))):
                yield {k: v[i] for k, v in chunk.items()}
    finally:  # stops the worker processes when the consumer drops the batches
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def stack(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-example dicts -> one batch dict (copies out of the workers' shared memory)."""
    return {k: np.stack([np.asarray(r[k]) for r in records]) for k in records[0]}


def train_batches(
    source: record_sources.Source,
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
    repeats: int = 1,
    drop_last: bool = False,
    shards: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """Process-local train batches {'image': (b, H, W, C), 'label': (b, K) f32, *targets} from
    step `start_step` on; b = global_batch_size / process_count. `targets` are record fields
    (e.g. 'segmentation') stacked as they are stored. `repeats` r: r consecutive differently
    augmented copies of each image, epochs of ⌊N/256⌋·256 samples (DeiT's RASampler);
    `drop_last`: each epoch is whole global batches, the rest of its order unused. `shards` S
    (the mesh's data-parallel devices): with r > 1 the step's stream position k is global batch
    row (k mod S)·B/S + ⌊k/S⌋, so the copies of an image sit on different devices."""
    offset, local = _local_slice(global_batch_size, process_index, process_count)
    dataset = _TrainExamples(source, _Example(transform, targets), seed, global_batch_size, offset, local,
                             start_step, repeats, drop_last, shards)
    stream = examples(dataset, num_workers)
    for step in itertools.count(start_step):
        batch = stack([next(stream) for _ in range(local)])
        batch["label"] = one_hot(batch["label"], num_classes)
        if batch_transform is not None:  # batch-level ops (mixup/cutmix): rng from (seed, step, p)
            batch = batch_transform(batch, np.random.default_rng([seed, step, process_index, rng_streams.HOST_BATCH]))
        yield batch


def num_eval_batches(num_examples: int, global_batch_size: int) -> int:
    return math.ceil(num_examples / global_batch_size)


def eval_batches(
    source: record_sources.Source,
    transform: Callable[[np.ndarray], np.ndarray],
    *,
    num_classes: int,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    targets: tuple[str, ...] = (),
    num_workers: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Process-local eval batches with `mask`; padding repeats example 0 with mask 0. `targets`
    are record fields stacked as stored (images stored at the model's size keep them aligned)."""
    offset, local = _local_slice(global_batch_size, process_index, process_count)
    dataset = _EvalExamples(source, transform, global_batch_size, offset, local, targets)
    stream = examples(dataset, num_workers)
    for _ in range(num_eval_batches(len(source), global_batch_size)):
        batch = stack([next(stream) for _ in range(local)])
        batch["label"] = one_hot(batch["label"], num_classes)
        yield batch
