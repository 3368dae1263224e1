"""From a config to the train and eval iterators (sources + transforms + pipeline)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from skipless_jax.data import pipeline, sources


def image_size(config: Any) -> int:
    """The model's input resolution: `config.input.image_size`, else the dataset's own."""
    size = config.input.get("image_size")
    return int(size) if size else sources.dataset_info(config.dataset.name).image_shape[0]


@dataclasses.dataclass(frozen=True)
class _IgnoreRng:
    """A deterministic transform called as a train transform (picklable, for worker processes)."""

    transform: Callable[[np.ndarray], np.ndarray]

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        del rng
        return self.transform(image)


def image_transforms(config: Any, on_device: bool = False) -> tuple[Any, Any]:
    """(train, eval) per-example transforms of the config; `on_device`: they stop at uint8 (the train one also
    returns its erasing box), normalization and erasing happen in the step (data/device_images.py)."""
    from skipless_jax.data import augment

    info = sources.dataset_info(config.dataset.name)
    size = image_size(config)
    aug = config.input.get("aug")
    crop_pct = config.input.get("crop_pct", 0.875)
    # Stored at the model's size: only normalized, unless an augmented config asks for a centre crop
    # (crop_pct < 1 resizes up and crops). Another size is resized (bicubic; RGB or one channel).
    if info.fixed_size and size == info.image_shape[0] and (aug is None or crop_pct == 1.0):
        evaluate = np.asarray if on_device else functools.partial(pipeline.normalize, mean=info.mean, std=info.std)
        if aug is None:
            return _IgnoreRng(evaluate), evaluate
    else:
        evaluate = dataclasses.replace(augment.eval_transform(size, crop_pct, info.mean, info.std), uint8=on_device)
    if aug is None:  # no augmentation: train images go through the eval transform
        train = _IgnoreRng(evaluate)
    else:
        train = dataclasses.replace(augment.train_transform(aug, size, info.mean, info.std), uint8=on_device)
    return train, evaluate


def train_iterator(
    config: Any,
    start_step: int,
    process_index: int,
    process_count: int,
    transform: Callable[[np.ndarray, np.random.Generator], Any] | None = None,
    batch_transform: Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]] | None = None,
    on_device: bool = False,
    shards: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """Process-local train batches from `start_step` on; `transform` (per example) and
    `batch_transform` replace the config's augmentation (e.g. DINO's multi-crop). `on_device`:
    uint8 images (+ `erase` boxes) for `device_images.prepare` in the step; else float32, normalized.
    `shards`: the mesh's data-parallel devices (repeated augmentation places copies on different ones)."""
    source = sources.get_source(config.dataset.name, config.dataset.train_split, config.dataset.get("data_dir"))
    return pipeline.train_batches(
        source, **_train_batches_args(config, transform, batch_transform, on_device),
        start_step=start_step, process_index=process_index, process_count=process_count, shards=shards,
    )


def _train_batches_args(config: Any, transform: Any, batch_transform: Any, on_device: bool) -> dict[str, Any]:
    """`pipeline.train_batches`' arguments of the config, but the source and the process's place
    (one home for `train_iterator` and `train_batch_spec`, so their batches cannot differ)."""
    info = sources.dataset_info(config.dataset.name)
    if transform is None:
        transform, _ = image_transforms(config, on_device)
    return dict(
        transform=transform,
        num_classes=info.num_classes,
        global_batch_size=config.input.batch_size,
        seed=config.seed,
        batch_transform=batch_transform,
        num_workers=config.input.get("num_workers") or 0,
        targets=info.targets if info.fixed_size else (),
        repeats=repeats(config),
        drop_last=bool(config.input.get("drop_last")),
    )


class _ZeroRecords:
    """A source of `length` copies of one record: what `train_batch_spec` feeds the pipeline."""

    def __init__(self, record: dict[str, Any], length: int):
        self.record, self.length = record, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.record


def train_batch_spec(
    config: Any,
    transform: Callable[[np.ndarray, np.random.Generator], Any] | None = None,
    batch_transform: Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]] | None = None,
    on_device: bool = False,
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The global train batch of `train_iterator(config, ..., same arguments)` as {name: (shape,
    dtype)}, without reading the dataset: the pipeline's own first batch of a one-example batch
    of a synthetic record (a zero uint8 image of the dataset's stored shape, label 0), its leading
    dimension then config.input.batch_size. Datasets whose records carry `DatasetInfo.targets`
    (the embedded digit_scenes) take those fields from the source's first record."""
    info = sources.dataset_info(config.dataset.name)
    record: dict[str, Any] = {"image": np.zeros(info.image_shape, np.uint8), "label": 0}
    args = _train_batches_args(config, transform, batch_transform, on_device)
    if args["targets"]:
        stored = sources.get_source(config.dataset.name, config.dataset.train_split, config.dataset.get("data_dir"))[0]
        record.update({k: np.zeros_like(np.asarray(stored[k])) for k in args["targets"]})
    # One example; the length only has to satisfy the epoch rules (repeated augmentation: >= 256).
    args.update(global_batch_size=1, num_workers=0)
    first = next(pipeline.train_batches(_ZeroRecords(record, 1 << 16), **args))
    return {k: ((config.input.batch_size, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in first.items()}


def repeats(config: Any) -> int:
    """`config.input.repeated_augmentation` r (None or absent: 1, off)."""
    r = config.input.get("repeated_augmentation")
    return 1 if r is None else r


def steps_per_epoch(
    config: Any, num_train: int | None = None, *, batch_size: int | None = None,
    repeated_augmentation: int | None = None, last_batch: str | None = None, at_least_one: bool = False,
) -> float:
    """Steps in one epoch (docs/method/recipes.md §21), as every count of them in the project is made.

    The epoch length L is `pipeline.epoch_length` of `num_train` (default: the train split's size)
    under `repeated_augmentation` r (default `repeats(config)`): N, or ⌊N/256⌋·256 under
    repeated augmentation. B is `batch_size` (default `config.input.batch_size`). `last_batch`
    says what becomes of the epoch's last partial batch: 'keep' L / B (the trainers' continuous
    stream: an epoch may end mid-batch), 'drop' ⌊L / B⌋ (whole batches, as the references'
    loaders; an epoch with none is a ValueError unless `at_least_one`, which counts it as one
    step: DINO's iterations), 'pad' ⌈L / B⌉ (a last, partial batch: the linear evaluation's
    loader). The default is 'drop' with `config.input.drop_last`, else 'keep'.
    """
    num_train = num_train_examples(config) if num_train is None else num_train
    batch = config.input.batch_size if batch_size is None else batch_size
    r = repeats(config) if repeated_augmentation is None else repeated_augmentation
    if last_batch is None:
        last_batch = "drop" if config.input.get("drop_last") else "keep"
    if last_batch == "keep":
        return pipeline.epoch_length(num_train, r) / batch
    if last_batch == "pad":
        return math.ceil(pipeline.epoch_length(num_train, r) / batch)
    if last_batch == "drop":
        if at_least_one:
            return max(pipeline.epoch_length(num_train, r) // batch, 1)
        return pipeline.epoch_length(num_train, r, batch) // batch
    raise ValueError(f"last_batch={last_batch!r} is unknown; allowed: 'keep', 'drop', 'pad'")


def eval_iterator(
    config: Any, process_index: int, process_count: int, split: str | None = None, batch_size: int | None = None,
    on_device: bool = False,
) -> tuple[Iterator[dict[str, np.ndarray]], int]:
    """(process-local masked eval batches of `split`, number of real examples in it).

    `split` defaults to config.dataset.eval_split, `batch_size` (global) to the eval batch size.
    Images stored at the model's size are only normalized; anything else is resized and
    centre-cropped (`crop_pct`). `on_device`: uint8 images, normalized on the devices.
    """
    info = sources.dataset_info(config.dataset.name)
    split = split or config.dataset.eval_split
    source = sources.get_source(config.dataset.name, split, config.dataset.get("data_dir"))
    _, evaluate = image_transforms(config, on_device)
    batches = pipeline.eval_batches(
        source,
        evaluate,
        num_classes=info.num_classes,
        global_batch_size=batch_size or config.input.get("eval_batch_size") or config.input.batch_size,
        process_index=process_index,
        process_count=process_count,
        targets=(info.targets if info.fixed_size else ()) + info.label_targets,
        num_workers=config.input.get("num_workers") or 0,
    )
    return batches, len(source)


def num_train_examples(config: Any) -> int:
    info = sources.dataset_info(config.dataset.name)
    split = config.dataset.train_split
    if split in info.splits:
        return info.splits[split]
    return len(sources.get_source(config.dataset.name, split, config.dataset.get("data_dir")))
