"""DINO's linear evaluation (facebookresearch/dino `eval_linear.py`, docs/method/evals.md §18).

A linear layer on the frozen backbone's class tokens of its last n blocks (each through the
final norm), trained by SGD (momentum 0.9, no weight decay, lr 0.001·B/256 cosine to 0 over
`epochs`) on RandomResizedCrop (bilinear) + flip views of a plain stream (the run's
`drop_last` and repeated augmentation reset), tested at Resize(S/0.875) + CenterCrop(S).

    config.evals.linear_eval = dict(type='dino_linear', split='validation', train_split='train',
                                    n_last_blocks=4, avgpool=False, epochs=100)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skipless_jax import sharding
from skipless_jax.data import augment, device_images, device_input, inputs, sources
from skipless_jax.evaluators import contexts
from skipless_jax.evaluators.common import Context, field

# DINO's train views: RandomResizedCrop(S) (scale 0.08-1, ratio 3/4-4/3, torchvision's bilinear
# resampling) + horizontal flip only.
TRAIN_AUG = dict(randaug=None, scale=(0.08, 1.0), flip=True, reprob=0.0, mixup=0.0, cutmix=0.0,
                 mixup_switch_prob=0.5, interpolation="bilinear")
# The probe's stream: every image once an epoch, the last batch partial (DINO's train loader:
# shuffle, no drop_last, no repeated augmentation), so ⌈N/B⌉ steps are one data epoch.
STREAM = dict(drop_last=False, repeated_augmentation=1)
TEST_CROP_PCT = 224 / 256  # Resize(256) + CenterCrop(224), scaled to the model's input size
DEFAULTS = dict(epochs=100, batch_size=1024, lr=0.001)
WIDE = 768  # ViT-B and wider: n = 1 + avgpool (DINO's README); narrower (ViT-S): n = 4


@dataclasses.dataclass(frozen=True)
class AnyChannels:
    """A train transform of RGB images applied to an image of any channel count: a gray image
    is repeated to 3 channels and its first channel kept after (crop, resize and flip act on
    every channel alike, so that is the gray image's own crop). Picklable for worker processes."""

    transform: Any

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        channels = image.shape[-1]
        if channels == 3:
            return self.transform(image, rng)
        out = self.transform(np.repeat(image, 3, axis=-1), rng)
        return np.ascontiguousarray(out[..., :channels])


def dino_features(block_tokens: Sequence[jax.Array], avgpool: bool) -> jax.Array:
    """DINO's linear features from the last n blocks' final-norm outputs, each (B, 1+N, d) in
    block order: their class tokens concatenated (B, n·d); with `avgpool` (n = 1) the class
    token and the mean patch token stacked on a new last axis and flattened (B, 2d), so the
    entries interleave cls₀, avg₀, cls₁, avg₁, … as DINO's reshape does."""
    if avgpool and len(block_tokens) != 1:
        raise ValueError(f"dino_features: avgpool with n_last_blocks={len(block_tokens)}; DINO's eval_linear "
                         "builds the average-pooled feature for n_last_blocks=1 only")
    cls = jnp.concatenate([t[:, 0] for t in block_tokens], axis=-1)
    if not avgpool:
        return cls
    mean_patch = jnp.mean(block_tokens[-1][:, 1:], axis=1)
    return jnp.stack([cls, mean_patch], axis=-1).reshape(cls.shape[0], -1)


def epoch_cosine(base_lr: float, epochs: int, steps_per_epoch: int) -> optax.Schedule:
    """torch's CosineAnnealingLR(T_max=epochs, eta_min=0) stepped once per epoch: every step of
    epoch e = ⌊step / steps_per_epoch⌋ uses base_lr·(1 + cos(π e / epochs))/2."""
    return lambda step: base_lr * 0.5 * (1.0 + jnp.cos(jnp.pi * (step // steps_per_epoch) / epochs))


def blocks_of(entry: Any, width: int) -> tuple[int, bool]:
    """(n_last_blocks, avgpool) of an entry on a backbone of this width. Unset, DINO's defaults:
    ViT-S (width < 768) 4 blocks, no avgpool; ViT-B and wider 1 block + avgpool. `avgpool=True`
    alone means n = 1; `n_last_blocks` alone keeps the default avgpool only at the default n."""
    n_default, avgpool_default = (1, True) if width >= WIDE else (4, False)
    n, avgpool = entry.get("n_last_blocks"), entry.get("avgpool")
    if n is None:
        n = 1 if avgpool else n_default
    if avgpool is None:
        avgpool = avgpool_default and n == n_default
    return int(n), bool(avgpool)


@dataclasses.dataclass
class DinoLinear:
    """config.evals entry `type='dino_linear'`: trains the linear layer on `train_split`, yields
    ('top1', ·) and, with ≥ 5 classes, ('top5', ·) on `split` after the last epoch."""

    name: str
    prefix: str
    every_steps: int | None
    split: str
    ctx: Context
    view: Context  # the run's data with DINO's train and test transforms
    n_last_blocks: int
    avgpool: bool
    epochs: int
    batch_size: int
    lr: float

    def __post_init__(self):
        if self.ctx.outputs is None:
            raise ValueError(f"config.evals.{self.name}: type 'dino_linear' needs the backbone's per-block outputs")
        outputs, n, avgpool = self.ctx.outputs, self.n_last_blocks, self.avgpool

        def features(params: Any, images: jax.Array) -> jax.Array:
            blocks = outputs(params, images)["blocks"][-n:]
            return jax.lax.stop_gradient(dino_features([b["normed"] for b in blocks], avgpool)).astype(jnp.float32)

        self._features = features
        self._mean_std = device_images.dataset_stats(self.view.config)
        self._num_train = inputs.num_train_examples(self.view.config)
        self.steps_per_epoch = inputs.steps_per_epoch(  # ⌈N/B⌉: the last batch is partial
            self.view.config, self._num_train, batch_size=self.batch_size, repeated_augmentation=1, last_batch="pad")
        schedule = epoch_cosine(self.lr * self.batch_size / 256, self.epochs, self.steps_per_epoch)
        self._tx = optax.sgd(schedule, momentum=0.9)  # torch's SGD: v ← 0.9·v + g, p ← p − lr·v
        tx, mean, std = self._tx, *self._mean_std

        def step(state: dict[str, Any], params: Any, batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
            batch = device_images.prepare(batch, mean, std)
            x = features(params, batch["image"])

            def loss_fn(linear):
                logits = x @ linear["kernel"] + linear["bias"]
                return optax.softmax_cross_entropy(logits, batch["label"]).mean()

            loss, grads = jax.value_and_grad(loss_fn)(state["linear"])
            updates, opt = tx.update(grads, state["opt"], state["linear"])
            return {"linear": optax.apply_updates(state["linear"], updates), "opt": opt}, loss

        def sums(linear: dict[str, jax.Array], params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
            logits = features(params, batch["image"]) @ linear["kernel"] + linear["bias"]
            label, mask = batch["label"].argmax(-1), batch["mask"]
            top5 = jax.lax.top_k(logits, min(5, logits.shape[-1]))[1]
            return {"top1": ((logits.argmax(-1) == label) * mask).sum(),
                    "top5": ((top5 == label[:, None]).any(-1) * mask).sum(), "count": mask.sum()}

        replicated = sharding.replicated(self.ctx.mesh)
        self._step = jax.jit(step, donate_argnums=0, out_shardings=(replicated, replicated))  # one compile
        self._sums = jax.jit(sums, out_shardings=replicated)

    def init(self, dim: int) -> dict[str, Any]:
        """Weights N(0, 0.01²), bias 0, momentum 0; replicated on the mesh."""
        key = jax.random.PRNGKey(self.view.config.seed)
        linear = {"kernel": 0.01 * jax.random.normal(key, (dim, self.ctx.num_classes), jnp.float32),
                  "bias": jnp.zeros((self.ctx.num_classes,), jnp.float32)}
        return jax.device_put({"linear": linear, "opt": self._tx.init(linear)}, sharding.replicated(self.ctx.mesh))

    def train(self, params: Any) -> tuple[dict[str, jax.Array], list[float]]:
        """The trained linear layer and the loss of every step."""
        config = self.view.config
        size = inputs.image_size(config)
        channels = sources.dataset_info(config.dataset.name).image_shape[-1]
        probe = jax.ShapeDtypeStruct((1, size, size, channels), jnp.float32)
        dim = jax.eval_shape(self._features, params, probe).shape[-1]
        state = self.init(dim)
        local = inputs.train_iterator(config, 0, jax.process_index(), jax.process_count(), self.train_views(),
                                      on_device=True)
        batches = device_input.device_batches(local, sharding.batch_sharding(self.ctx.mesh),
                                              device_input.device_prefetch(config))
        losses = []
        try:
            for _, batch in zip(range(self.epochs * self.steps_per_epoch), batches):
                state, loss = self._step(state, params, batch)
                losses.append(loss)
        finally:
            batches.close()
        return state["linear"], [float(v) for v in jax.device_get(losses)]

    def train_views(self) -> AnyChannels:
        """DINO's train transform at the model's input size, as uint8 (normalized on the device)."""
        mean, std = self._mean_std
        size = inputs.image_size(self.view.config)
        return AnyChannels(dataclasses.replace(augment.train_transform(TRAIN_AUG, size, mean, std), uint8=True))

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        linear, _ = self.train(params)
        batches, n = self.view.batches(self.split)
        totals = None
        for batch in batches:
            s = self._sums(linear, params, batch)
            totals = s if totals is None else jax.tree.map(jnp.add, totals, s)
        totals = jax.device_get(totals)
        if int(totals["count"]) != n:  # every example exactly once
            raise AssertionError(f"evaluation counted {totals['count']} of {n} examples of {self.split!r}")
        yield "top1", float(totals["top1"] / n)
        if self.ctx.num_classes >= 5:
            yield "top5", float(totals["top5"] / n)

    @staticmethod
    def check(name: str, entry: Any) -> None:
        where = f"config.evals.{name}"
        n = entry.get("n_last_blocks")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"{where}.n_last_blocks={n!r} must be a positive integer (blocks whose class "
                             "tokens are concatenated)")
        avgpool = entry.get("avgpool")
        if avgpool is not None and not isinstance(avgpool, bool):
            raise ValueError(f"{where}.avgpool={avgpool!r} must be True or False")
        if avgpool and n is not None and n > 1:
            raise ValueError(f"{where}: avgpool=True with n_last_blocks={n}; DINO's eval_linear builds the "
                             "average-pooled feature for n_last_blocks=1 only")
        for key in ("epochs", "batch_size"):
            value = field(entry, key, DEFAULTS[key])
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}.{key}={value!r} must be a positive integer")
        lr = field(entry, "lr", DEFAULTS["lr"])
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or not math.isfinite(lr):
            raise ValueError(f"{where}.lr={lr!r} must be a finite number > 0 (the lr at batch 256)")

    @staticmethod
    def check_model(name: str, entry: Any, model: Any) -> None:
        """The last n blocks' final-norm outputs with a class token (a `models.ModelDescription`)."""
        if not model.normed_blocks or model.prefix_tokens < 1:
            raise ValueError(f"config.evals.{name}: type 'dino_linear' reads the class token of every block's "
                             f"final-norm output, which the {model.family} model does not have")
        n, _ = blocks_of(entry, model.width)
        if n > model.depth:
            raise ValueError(f"config.evals.{name}.n_last_blocks={n} exceeds the model's {model.depth} blocks")

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Context, **common: Any) -> DinoLinear:
        from skipless_jax import models

        cls.check(name, entry)
        model = models.describe(ctx.config.model)
        cls.check_model(name, entry, model)
        n, avgpool = blocks_of(entry, model.width)
        batch_size = field(entry, "batch_size", DEFAULTS["batch_size"])
        # Test views Resize(⌊S/0.875⌋) + CenterCrop(S): the eval transform under an augmentation
        # (the resize ops read RGB; a gray set stored at the model's size is tested as stored).
        rgb = sources.dataset_info(ctx.config.dataset.name).image_shape[-1] == 3
        view = contexts.derived(ctx, f"config.evals.{name}", train_split=entry.get("train_split"),
                                aug=dict(TRAIN_AUG) if rgb else None, crop_pct=TEST_CROP_PCT,
                                batch_size=batch_size, **STREAM)
        return cls(name=name, ctx=ctx, view=view, n_last_blocks=n, avgpool=avgpool,
                   epochs=field(entry, "epochs", DEFAULTS["epochs"]), batch_size=batch_size,
                   lr=float(field(entry, "lr", DEFAULTS["lr"])), **common)

