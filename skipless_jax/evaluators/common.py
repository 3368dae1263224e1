"""The evaluator protocol: built from `config.evals.<name>`, run on the trainer's state,
yielding `(metric, value)` pairs.

    config.evals.val = dict(type='classification', split='test', every_steps=500, prefix='test')
    config.evals.knn = dict(type='knn', split='test', train_split='train', k=20, temperature=0.07)

Fields every entry has: `type` (a key of `evaluators.EVALUATORS`), `split` (default
`config.dataset.eval_split`), `every_steps` (default `config.eval_every_steps`; 0: only the
last step), `prefix` (default the entry's name; metrics are recorded as `prefix/metric` in
TensorBoard and `prefix_metric` in the final metrics). The rest are the type's own.

The trainer supplies a `Context`: how to turn the parameters it evaluates into logits or
features for a batch of images. Evaluation reads its split through the eval pipeline, whose
last batch is padded and masked, so every example counts exactly once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from skipless_jax import sharding
from skipless_jax.data import device_images, inputs


class Evaluator(Protocol):
    name: str
    prefix: str
    every_steps: int | None

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]: ...


@dataclasses.dataclass
class FitEvaluator:
    """The fields of an evaluator fitted on `train_split` and scored on `split` (kNN, linear
    probe, linear segmentation); subclasses add their own fields and `run`."""

    name: str
    prefix: str
    every_steps: int | None
    split: str
    ctx: Any
    train_split: str


@dataclasses.dataclass
class FeatureFitEvaluator(FitEvaluator):
    """A `FitEvaluator` on the pooled features of its splits' rows (kNN, linear probe); `layers`:
    the blocks it evaluates (docs/method/per_layer_eval.md), None for the last layer only."""

    layers: tuple[int, ...] | None = None

    def fit_and_test_rows(self, params: Any) -> tuple[Any, Any, int, np.ndarray, np.ndarray]:
        """(train features (on the devices), train labels, train count, test features, test labels);
        with `layers` the features are (rows, len(layers), d)."""
        train_x, train_y, n = self.ctx.extract_rows(params, self.train_split, self.layers)
        test_x, test_y = self.ctx.extract(params, self.split, self.layers)
        return train_x, train_y, n, test_x, test_y

    def scores(self, params: Any, score: Callable[..., tuple[str, float]]) -> Iterator[tuple[str, float]]:
        """`score(train_x, train_y, n, test_x, test_y) -> (metric, value)` on the last layer's
        features, or with `layers` on each block i's as `layer_<i>/<metric>`, then `best_layer`
        (the highest value's block, the first among ties); one forward pass for all blocks."""
        train_x, train_y, n, test_x, test_y = self.fit_and_test_rows(params)
        if self.layers is None:
            yield score(train_x, train_y, n, test_x, test_y)
            return
        best = None
        for j, block in enumerate(self.layers):
            metric, value = score(self.ctx.layer_rows(train_x, j), train_y, n, test_x[:, j], test_y)
            yield f"layer_{block}/{metric}", value
            if best is None or value > best[1]:
                best = (block, value)
        yield "best_layer", float(best[0])

    @staticmethod
    def train_split_of(entry: Any, ctx: Any) -> str:
        """The entry's `train_split`, default the dataset's train split."""
        return entry.get("train_split") or ctx.config.dataset.train_split

    @staticmethod
    def check_run(name: str, entry: Any, config: Any) -> None:
        """The entry's `layers` against the run's model (docs/method/per_layer_eval.md §1)."""
        from skipless_jax.evaluators import per_layer

        per_layer.blocks(f"config.evals.{name}", entry.get("layers"), config.model)

    @staticmethod
    def layers_of(name: str, entry: Any, ctx: Any) -> tuple[int, ...] | None:
        """The entry's `layers` as block indices (None: 'last'), checked against the run's model."""
        from skipless_jax.evaluators import per_layer

        return per_layer.blocks(f"config.evals.{name}", entry.get("layers"), ctx.config.model)


@dataclasses.dataclass
class EvalCache:
    """What the evaluators of one `Context` compute once and share, owned by that context.

    rows: (id(params), split[, 'rows']) -> extracted features and labels, for one evaluation round
    (`new_round` clears them: `run_all` calls it before and after a round); programs: the jitted
    functions of the context (compiled once); eval_batches: split -> (uint8 batches, n) of a
    whole-split read kept across rounds (`config.input.cache_eval`).
    """

    rows: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
    programs: dict[str, Any] = dataclasses.field(default_factory=dict)
    eval_batches: dict[str, tuple[list[dict[str, np.ndarray]], int]] = dataclasses.field(default_factory=dict)

    def new_round(self) -> None:
        self.rows.clear()


@dataclasses.dataclass(frozen=True)
class Context:
    """What evaluators may ask of the trainer, built whole (frozen).

    logits(params, images) -> (B, K), features(params, images) -> (B, d) and
    outputs(params, images) -> the backbone's `out` dict (patch tokens `encoded`, per-block
    `keys` and ①..④; dense evaluators read it) are pure functions (jitted by the evaluators);
    any may be None when the trainer has no such output. `picture_dir`: where evaluators that
    draw write their PNGs (`<picture_dir>/pictures/<prefix>_step<N>.png`, N the step `run_all`
    passes to `run`; None: no pictures). `cache`: what its evaluators share (`EvalCache`); a
    derived context (another dataset) gets its own.
    """

    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    num_classes: int
    logits: Callable[[Any, jax.Array], jax.Array] | None = None
    features: Callable[[Any, jax.Array], jax.Array] | None = None
    outputs: Callable[[Any, jax.Array], dict[str, Any]] | None = None
    picture_dir: str | None = None
    cache: EvalCache = dataclasses.field(default_factory=EvalCache)

    def batches(self, split: str, batch_size: int | None = None,
                workers: bool = True) -> tuple[Iterator[dict[str, jax.Array]], int]:
        """(global masked eval batches of `split`, number of real examples); the host ships uint8
        images, normalized here on the devices. `workers=False`: read in this process (callers
        that take one batch, where starting `config.input.num_workers` processes costs more)."""
        local, n = self._local_batches(split, batch_size, workers)
        batch_sharding = sharding.batch_sharding(self.mesh)
        programs = self.cache.programs
        if "normalize" not in programs:
            mean, std = device_images.dataset_stats(self.config)
            programs["normalize"] = jax.jit(lambda b: device_images.prepare(b, mean, std))

        def to_global(b: dict[str, np.ndarray]) -> dict[str, jax.Array]:
            arrays = jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding, x), b)
            return programs["normalize"](arrays)

        return (to_global(b) for b in local), n

    def _local_batches(self, split: str, batch_size: int | None, workers: bool) -> tuple[Any, int]:
        """This process's uint8 eval batches. With `config.input.cache_eval` a whole-split read
        at the eval batch size (batch_size None: the evaluators that count every example) is
        kept in host memory and replayed by later rounds (uint8: H·W·C bytes per example)."""
        config = self.config
        if not workers:
            config = ml_collections.ConfigDict(config.to_dict())
            config.input.num_workers = 0

        def read() -> tuple[Any, int]:
            return inputs.eval_iterator(config, jax.process_index(), jax.process_count(), split, batch_size,
                                        on_device=True)

        if not self.config.input.get("cache_eval") or batch_size is not None:
            return read()
        kept = self.cache.eval_batches
        if split not in kept:
            local, n = read()
            kept[split] = (list(local), n)
        batches, n = kept[split]
        return iter(batches), n

    def features_at(self, layers: tuple[int, ...] | None) -> Callable[[Any, jax.Array], jax.Array]:
        """(params, images) -> the features (B, d), or with `layers` (B, len(layers), d): each
        block's `pre_logits` from one forward pass (docs/method/per_layer_eval.md §1)."""
        if layers is None:
            if self.features is None:
                raise ValueError("this trainer's model has no features to evaluate")
            return self.features
        if self.outputs is None:
            raise ValueError("this trainer's model has no per-block outputs to evaluate")

        def blocks(params: Any, images: jax.Array) -> jax.Array:
            out = self.outputs(params, images)["blocks"]
            return jnp.stack([out[i]["pre_logits"] for i in layers], axis=1)

        return blocks

    def layer_rows(self, rows: jax.Array, j: int) -> jax.Array:
        """(N, d) rows of entry j of `extract_rows`' (N, L, d) features, still split over the mesh."""
        programs = self.cache.programs
        if "layer_rows" not in programs:
            programs["layer_rows"] = jax.jit(lambda x, j: x[:, j], static_argnums=1,
                                             out_shardings=sharding.batch_sharding(self.mesh))
        return programs["layer_rows"](rows, j)

    def extract_rows(self, params: Any, split: str,
                     layers: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array, int]:
        """(features (N, d) float32, int labels (N,), n): every example of `split` as global
        arrays whose rows stay split over the mesh's data axes (no host holds them all); the
        padding rows of the last batch have label −1 (N ≥ n, a multiple of the data devices).
        With `layers` the features are (N, len(layers), d) (`features_at`).
        Cached for one evaluation round (the kNN bank and the probe's fit share them)."""
        key = (id(params), split, "rows", layers)
        rows_cache, programs = self.cache.rows, self.cache.programs
        if key in rows_cache:
            return rows_cache[key]
        features = self.features_at(layers)
        rows = sharding.batch_sharding(self.mesh)
        program = ("rows", layers)
        if program not in programs:
            fn = lambda p, b: (features(p, b["image"]).astype(jnp.float32),
                               jnp.where(b["mask"] > 0, b["label"].argmax(-1), -1).astype(jnp.int32))
            programs[program] = jax.jit(fn, out_shardings=(rows, rows))
        if "concat" not in programs:
            programs["concat"] = jax.jit(lambda parts: jnp.concatenate(parts), out_shardings=rows)
        batches, n = self.batches(split)
        outs = [programs[program](params, batch) for batch in batches]
        feats = programs["concat"]([f for f, _ in outs])
        labels = programs["concat"]([y for _, y in outs])
        counted = int(jax.device_get(jnp.sum(labels >= 0)))
        if counted != n:  # every example exactly once
            raise AssertionError(f"feature extraction counted {counted} of {n} examples of {split!r}")
        rows_cache[key] = (feats, labels, n)
        return rows_cache[key]

    def extract(self, params: Any, split: str,
                layers: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(features (n, d) float32, int labels (n,)) of every example of `split`, cached for
        one evaluation round (kNN and the linear probe share them); with `layers` the features
        are (n, len(layers), d) (`features_at`)."""
        key = (id(params), split, layers)
        rows_cache, programs = self.cache.rows, self.cache.programs
        if key in rows_cache:
            return rows_cache[key]
        features = self.features_at(layers)
        program = ("features", layers)
        if program not in programs:
            fn = lambda p, b: {
                "features": features(p, b["image"]).astype(jnp.float32),
                "label": b["label"].argmax(-1),
                "mask": b["mask"],
            }
            # Replicated: every host reads all rows.
            programs[program] = jax.jit(fn, out_shardings=sharding.replicated(self.mesh))
        batches, n = self.batches(split)
        feats, labels = [], []
        for batch in batches:
            out = jax.device_get(programs[program](params, batch))
            keep = out["mask"] > 0  # padding rows of the last batch
            feats.append(out["features"][keep])
            labels.append(out["label"][keep])
        result = np.concatenate(feats), np.concatenate(labels)
        if len(result[1]) != n:  # every example exactly once
            raise AssertionError(f"feature extraction counted {len(result[1])} of {n} examples of {split!r}")
        rows_cache[key] = result
        return result

    def new_round(self) -> None:
        """Forget this round's extracted features (`EvalCache.new_round`)."""
        self.cache.new_round()

    def picture_path(self, prefix: str, step: int | None) -> str | None:
        """The PNG an evaluator draws at `step` (None: no step in the name), on the chief process
        only (else None)."""
        if self.picture_dir is None or jax.process_index() != 0:
            return None
        suffix = "" if step is None else f"_step{step:06d}"
        return os.path.join(self.picture_dir, "pictures", f"{prefix}{suffix}.png")


def patch_tokens(tokens: Any, image_hw: tuple[int, int], model: Any) -> Any:
    """(B, prefix + h·w, d) tokens of `out['encoded']` → (B, h, w, d), the prefix (class token)
    dropped; h, w = H // s, W // s for the model's (a `models.ModelDescription`) token stride s.
    Works on numpy and jax arrays."""
    s = model.token_stride
    h, w = int(image_hw[0]) // s, int(image_hw[1]) // s
    if tokens.shape[1] != model.prefix_tokens + h * w:
        raise ValueError(f"{tokens.shape[1]} tokens for {model.prefix_tokens} prefix tokens and a {h}x{w} grid "
                         f"of the {model.family} model (image {tuple(image_hw)}, stride {s})")
    return tokens[:, model.prefix_tokens:].reshape(tokens.shape[0], h, w, tokens.shape[-1])


def field(entry: ml_collections.ConfigDict, name: str, default: Any) -> Any:
    value = entry.get(name)
    return default if value is None else value


def due(evaluator: Evaluator, step: int, total_steps: int) -> bool:
    """On multiples of the evaluator's period and at the last step."""
    return step == total_steps or bool(evaluator.every_steps and step % evaluator.every_steps == 0)


def run_all(evaluators: list[Evaluator], ctx: Context, params: Any, step: int | None = None,
            total_steps: int | None = None) -> Iterator[tuple[str, str, float]]:
    """(prefix, metric, value) of every evaluator due at `step` (None: all of them, pictures
    without a step); `step` goes to each `run`."""
    ctx.new_round()
    for ev in evaluators:
        if step is None or due(ev, step, total_steps):
            for metric, value in ev.run(params, step):
                yield ev.prefix, metric, float(value)
    ctx.new_round()


# ---------------------------------------------------------------------------------------------
# Dense evaluators: records at their own resolution (data/dense.py), on the mesh.
# ---------------------------------------------------------------------------------------------


def dense_dataset(name: str, entry: Any, config: ml_collections.ConfigDict) -> tuple[str, str | None]:
    """(dataset name, data_dir) of a dense evaluator: its own `dataset` / `data_dir` fields, else
    the run's dataset (a DINO run on ImageNet evaluates on VOC: `dataset='voc12_seg'`)."""
    from skipless_jax.data import sources

    dataset = entry.get("dataset") or config.dataset.name
    sources.dataset_info(dataset)  # one-line error for an unknown name
    data_dir = entry.get("data_dir")
    if data_dir is None and dataset == config.dataset.name:
        data_dir = config.dataset.get("data_dir")
    return dataset, data_dir


def global_rows(mesh: jax.sharding.Mesh, rows: dict[str, np.ndarray], bucket: bool = False) -> dict[str, jax.Array]:
    """Host arrays with a leading row axis (the same on every process) → global arrays split over
    the mesh's data axes, padded with zero rows to a multiple of the data shards (`bucket`: to
    the next power of two of that, so that batches of varying size compile a few programs, not
    one per size); `mask` (rows,) is 1 on the real rows."""
    n = len(next(iter(rows.values())))
    shards = sharding.num_data_shards(mesh)
    total = -(-n // shards) * shards
    if bucket:
        total = shards * (1 << max(0, math.ceil(math.log2(max(total // shards, 1)))))
    rows = {**rows, "mask": np.ones((n,), np.float32)}
    padded = {k: np.concatenate([v, np.zeros((total - n, *v.shape[1:]), v.dtype)]) for k, v in rows.items()}
    batch = sharding.batch_sharding(mesh)
    return {k: jax.make_array_from_callback(v.shape, batch, lambda idx, v=v: v[idx]) for k, v in padded.items()}
