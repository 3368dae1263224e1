"""Semantic segmentation metrics: confusion matrix and mIoU (docs/method.md §8).

numpy only. mIoU is computed from one confusion matrix summed over the whole evaluation set
(the caller adds the per-image / per-batch confusions, at the label's resolution):
IoU_c = I_c / U_c with I = diag(M), U = row sum + column sum − diag, and mIoU = the mean
over the classes with a non-zero union (classes absent from both labels and predictions are
NaN and left out; a class that is only predicted has IoU 0 and counts).

Class sets (docs/method.md §8): PASCAL VOC 21 classes (20 objects + background 0, 255
ignored); ADE20K 150 classes (the stored label 0, "other", is ignored: `ade20k_labels`);
COCO-Stuff 171 classes (80 things + 91 stuff), with the 27-class (coarse) and 15-class
variants as options.

`LinearSegmentation` at the end is the evaluator (`config.evals.<name> =
dict(type='linear_segmentation', ...)`): the DINOv2 `lin` probe trained on frozen features.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

METHOD_REF = "docs/method.md §8"
IGNORE_INDEX = 255
NUM_CLASSES = {"voc": 21, "ade20k": 150, "coco_stuff": 171, "coco_stuff27": 27, "coco_stuff15": 15}


def _as_int(name: str, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_):
        raise ValueError(f"segmentation: {name} must be an integer array, got dtype {x.dtype}")
    return x.astype(np.int64, copy=False)


def confusion_matrix(
    pred: np.ndarray, label: np.ndarray, num_classes: int, ignore_index: int | None = IGNORE_INDEX
) -> np.ndarray:
    """(C, C) int64 confusion, rows = ground truth, columns = prediction. docs/method.md §8.

    pred, label: integer arrays of the same (any) shape. Pixels whose label is ignore_index
    (None: none) are excluded, from the counts and from the checks; every other label and
    every prediction on an evaluated pixel must lie in [0, num_classes), else ValueError.
    """
    pred, label = _as_int("pred", pred), _as_int("label", label)
    if pred.shape != label.shape:
        raise ValueError(f"segmentation: pred {pred.shape} and label {label.shape} differ in shape")
    if num_classes < 1:
        raise ValueError(f"segmentation: num_classes={num_classes} must be >= 1")
    pred, label = pred.reshape(-1), label.reshape(-1)
    if ignore_index is not None:
        keep = label != ignore_index
        pred, label = pred[keep], label[keep]
    if label.size and (label.min() < 0 or label.max() >= num_classes):
        bad = label[(label < 0) | (label >= num_classes)][0]
        raise ValueError(
            f"segmentation: label value {bad} is outside [0, {num_classes}) and is not ignore_index={ignore_index}"
        )
    if pred.size and (pred.min() < 0 or pred.max() >= num_classes):
        bad = pred[(pred < 0) | (pred >= num_classes)][0]
        raise ValueError(f"segmentation: prediction value {bad} is outside [0, {num_classes})")
    counts = np.bincount(label * num_classes + pred, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).astype(np.int64)


def mean_iou(confusion: np.ndarray) -> tuple[float, np.ndarray]:
    """(C, C) confusion summed over the set → (mIoU, per-class IoU (C,) float64). docs/method.md §8.

    IoU_c = M_cc / (Σ_j M_cj + Σ_i M_ic − M_cc); NaN where that union is 0, and mIoU is the
    mean over the other classes (NaN when no class has a non-zero union).
    """
    m = np.asarray(confusion, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"segmentation: confusion must be (C, C), got shape {m.shape}")
    inter = np.diag(m)
    union = m.sum(axis=1) + m.sum(axis=0) - inter
    present = union > 0
    iou = np.full(m.shape[0], np.nan)
    iou[present] = inter[present] / union[present]
    miou = float(iou[present].mean()) if present.any() else float("nan")
    return miou, iou


def ade20k_labels(label: np.ndarray) -> np.ndarray:
    """ADE20K stored labels 0..150 → training labels: 0 ("other") → 255, c → c − 1 (150 classes).

    Same shape; uint8 input stays uint8, other integer types become int64. docs/method.md §8.
    """
    label = np.asarray(label)
    x = _as_int("label", label)
    if x.size and (x.min() < 0 or x.max() > 150):
        raise ValueError(f"segmentation: ADE20K labels must lie in [0, 150], got [{x.min()}, {x.max()}]")
    out = np.where(x == 0, IGNORE_INDEX, x - 1)
    return out.astype(np.uint8) if label.dtype == np.uint8 else out


# ---------------------------------------------------------------------------------------------
# The linear probe (DINOv2 `lin`, docs/method.md §8).
# ---------------------------------------------------------------------------------------------

PROTOCOLS = ("lin", "ms")
BN_MOMENTUM = 0.1  # torch's convention: running = (1 − m)·running + m·batch
BN_EPS = 1e-5
HEAD_INIT_STD = 0.01  # mmseg's conv_seg init
_HIGHEST = jax.lax.Precision.HIGHEST


def init_head(key: jax.Array, num_features: int, num_classes: int) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """(trainable params, BatchNorm running statistics) of the head BatchNorm → 1×1 linear."""
    params = {
        "scale": jnp.ones((num_features,), jnp.float32),
        "bias": jnp.zeros((num_features,), jnp.float32),
        "w": HEAD_INIT_STD * jax.random.normal(key, (num_features, num_classes), jnp.float32),
        "b": jnp.zeros((num_classes,), jnp.float32),
    }
    stats = {"mean": jnp.zeros((num_features,), jnp.float32), "var": jnp.ones((num_features,), jnp.float32)}
    return params, stats


def head_logits(
    params: dict[str, jax.Array],
    stats: dict[str, jax.Array],
    feats: jax.Array,
    weights: jax.Array | None = None,
    train: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(B, h, w, d) features → ((B, h, w, K) logits, updated running statistics).

    train: BatchNorm with the statistics of the (global) batch over (B, h, w), examples weighted
    by `weights` (B,) (0: an eval-pipeline padding row), and the running averages updated with
    the unbiased variance (torch's BatchNorm); else the running averages: an affine map.
    """
    x = feats.astype(jnp.float32)
    if train:
        w = jnp.ones(x.shape[:1], jnp.float32) if weights is None else weights.astype(jnp.float32)
        w = jnp.broadcast_to(w[:, None, None, None], x.shape[:3] + (1,))
        count = w.sum()
        mean = (w * x).sum((0, 1, 2)) / count
        var = (w * jnp.square(x - mean)).sum((0, 1, 2)) / count
        unbiased = var * count / jnp.maximum(count - 1.0, 1.0)
        new_stats = {
            "mean": (1 - BN_MOMENTUM) * stats["mean"] + BN_MOMENTUM * mean,
            "var": (1 - BN_MOMENTUM) * stats["var"] + BN_MOMENTUM * unbiased,
        }
    else:
        mean, var, new_stats = stats["mean"], stats["var"], stats
    xn = (x - mean) * jax.lax.rsqrt(var + BN_EPS) * params["scale"] + params["bias"]
    return jnp.einsum("bhwd,dk->bhwk", xn, params["w"], precision=_HIGHEST) + params["b"], new_stats


def upsample(logits: jax.Array, label_hw: tuple[int, int]) -> jax.Array:
    """(B, h, w, K) → (B, H, W, K) bilinear (half-pixel centres: torch align_corners=False)."""
    return jax.image.resize(logits, (logits.shape[0], *label_hw, logits.shape[-1]), "bilinear")


def probe_loss(
    params: dict[str, jax.Array], stats: dict[str, jax.Array], feats: jax.Array, labels: jax.Array, weights: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean pixel cross-entropy of the upsampled logits over the labelled pixels (label ≠ 255)
    of the real examples (weights > 0); (loss, new running statistics)."""
    logits, new_stats = head_logits(params, stats, feats, weights, train=True)
    logits = upsample(logits, labels.shape[1:3])
    valid = (labels != IGNORE_INDEX) & (weights[:, None, None] > 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    return (ce * valid).sum() / jnp.maximum(valid.sum(), 1), new_stats


def schedule(lr: float, warmup: int, steps: int) -> optax.Schedule:
    """Linear warm-up 0 → lr over `warmup` steps, then linear decay to 0 at `steps`."""
    decay = optax.linear_schedule(lr, 0.0, max(steps - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def optimizer(lr: float, weight_decay: float, warmup: int, steps: int) -> optax.GradientTransformation:
    """AdamW (β = 0.9, 0.999; decay on every head parameter, as mmseg's default) on `schedule`."""
    return optax.adamw(schedule(lr, warmup, steps), b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)


def _positive_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


DEFAULTS = dict(protocol="lin", steps=40_000, batch_size=16, lr=1e-3, weight_decay=1e-4, warmup=1500, num_classes=None)


def validate_linear_segmentation(entry: Any, where: str = "config.evals.seg") -> dict[str, Any]:
    """The entry's fields with defaults; one-line ValueError for the first bad one."""
    f = {k: (entry.get(k) if entry.get(k) is not None else v) for k, v in DEFAULTS.items()}
    if f["protocol"] == "ms":
        raise ValueError(f"{where}.protocol='ms' (multi-scale, last 4 blocks) is not implemented yet; use 'lin'")
    if f["protocol"] not in PROTOCOLS:
        raise ValueError(f"{where}.protocol={f['protocol']!r} is unknown; allowed: {list(PROTOCOLS)}")
    for k in ("steps", "batch_size"):
        if not _positive_int(f[k]):
            raise ValueError(f"{where}.{k}={f[k]!r} must be a positive integer")
    if (
        not isinstance(f["warmup"], (int, np.integer))
        or isinstance(f["warmup"], bool)
        or not 0 <= f["warmup"] <= f["steps"]
    ):
        raise ValueError(f"{where}.warmup={f['warmup']!r} must be an integer in [0, steps={f['steps']}]")
    if not _number(f["lr"]) or f["lr"] <= 0:
        raise ValueError(f"{where}.lr={f['lr']!r} must be a finite number > 0")
    if not _number(f["weight_decay"]) or f["weight_decay"] < 0:
        raise ValueError(f"{where}.weight_decay={f['weight_decay']!r} must be a finite number >= 0")
    if f["num_classes"] is not None and (not _positive_int(f["num_classes"]) or f["num_classes"] < 2):
        raise ValueError(f"{where}.num_classes={f['num_classes']!r} must be an integer >= 2")
    return f


@dataclasses.dataclass
class LinearSegmentation:
    """config.evals entry `type='linear_segmentation'`: yields ('miou', mIoU) and
    ('pixel_accuracy', ·) on `split` of a linear head trained on `train_split` (DINOv2 `lin`,
    docs/method.md §8).

    Features: `ctx.outputs(params, images)['encoded']` (after the final LayerNorm), CLS dropped,
    on the (h, w) patch grid, frozen (computed inside the head's jitted step, no gradient).
    Head: BatchNorm over the global batch (running averages at test time, so the head is affine
    there) + 1×1 linear to `num_classes`; logits upsampled bilinearly to the label size;
    cross-entropy over the pixels labelled ≠ 255; AdamW (`lr`, `weight_decay`) with `warmup`
    linear warm-up steps then linear decay to 0 at `steps`. The step runs with the batch
    sharded over the mesh's data axes and the head replicated.

    Train data: the train split's records in order through the eval pipeline (batches of
    `batch_size`, the last one of each pass padded and masked out of the loss and the BN
    statistics), cycled until `steps`; deterministic, no augmentation. The 512-crop / flip /
    photometric augmentation and sliding-window test of §8 are for VOC-size images and are not
    implemented yet (the images must be at the model's size, as the digit scenes are). mIoU:
    one confusion matrix summed over the whole eval split at the label's resolution
    (`confusion_matrix`, `mean_iou`); pixel accuracy = its trace / its sum.
    """

    name: str
    prefix: str
    every_steps: int | None
    split: str
    ctx: Any
    train_split: str
    num_classes: int
    steps: int = 40_000
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup: int = 1500
    protocol: str = "lin"
    seed: int = 0

    def __post_init__(self):
        if self.ctx.outputs is None:
            raise ValueError(
                f"config.evals.{self.name}: type 'linear_segmentation' needs a trainer whose context has `outputs`"
            )
        from skipless_jax import sharding
        from skipless_jax.evaluators.tokencut import patch_size_of

        self.patch_size = patch_size_of(self.ctx.config)
        self._replicated = sharding.replicated(self.ctx.mesh)
        self.tx = optimizer(self.lr, self.weight_decay, self.warmup, self.steps)

        def step(state: dict[str, Any], params: Any, batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
            feats = self.features(params, batch["image"])
            labels = batch["segmentation"].astype(jnp.int32)
            (loss, stats), grads = jax.value_and_grad(probe_loss, has_aux=True)(
                state["params"], state["stats"], feats, labels, batch["mask"]
            )
            updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
            return {
                "params": optax.apply_updates(state["params"], updates),
                "stats": stats,
                "opt_state": opt_state,
            }, loss

        def predict(head: dict[str, Any], params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
            logits, _ = head_logits(head["params"], head["stats"], self.features(params, batch["image"]))
            logits = upsample(logits, batch["segmentation"].shape[1:3])
            return {"pred": logits.argmax(-1).astype(jnp.int32), "label": batch["segmentation"], "mask": batch["mask"]}

        self._step = jax.jit(step, out_shardings=(self._replicated, self._replicated))
        self._predict = jax.jit(predict, out_shardings=self._replicated)  # every host reads all rows

    def features(self, params: Any, images: jax.Array) -> jax.Array:
        """(B, H, W, C) → frozen (B, h, w, d) float32 patch tokens of the final LayerNorm."""
        from skipless_jax.evaluators.tokencut import patch_tokens

        encoded = self.ctx.outputs(params, images)["encoded"]
        return jax.lax.stop_gradient(patch_tokens(encoded, images.shape[1:3], self.patch_size).astype(jnp.float32))

    def init(self, params: Any, image_shape: tuple[int, ...]) -> dict[str, Any]:
        """The initial head state (params, stats, opt_state), replicated on the mesh."""
        dummy = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
        d = jax.eval_shape(self.features, params, dummy).shape[-1]
        head, stats = init_head(jax.random.PRNGKey(self.seed), d, self.num_classes)
        state = {"params": head, "stats": stats, "opt_state": self.tx.init(head)}
        return jax.device_put(state, self._replicated)

    def train_batches(self) -> Iterator[dict[str, jax.Array]]:
        """The train split's global batches in order, cycled forever."""
        while True:
            batches, n = self.ctx.batches(self.train_split, self.batch_size)
            if n == 0:
                raise ValueError(f"config.evals.{self.name}: train_split {self.train_split!r} is empty")
            yield from batches

    def train(self, params: Any, steps: int | None = None) -> dict[str, Any]:
        """The head state after `steps` (default `self.steps`) steps from its initialization."""
        steps = self.steps if steps is None else steps
        state = None
        batches = self.train_batches()
        for _ in range(steps):
            batch = next(batches)
            if state is None:
                state = self.init(params, batch["image"].shape[1:])
            state, _ = self._step(state, params, batch)
        if state is None:  # 0 steps: the initial head
            batches, _ = self.ctx.batches(self.train_split, self.batch_size)
            state = self.init(params, next(iter(batches))["image"].shape[1:])
        return state

    def predictions(self, params: Any, head: dict[str, Any]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(predicted classes (b, H, W) int32, labels (b, H, W)) of the real rows, batch by batch."""
        batches, n = self.ctx.batches(self.split)
        count = 0
        for batch in batches:
            out = jax.device_get(self._predict(head, params, batch))
            keep = out["mask"] > 0
            count += int(keep.sum())
            yield out["pred"][keep], out["label"][keep]
        if count != n:  # every example exactly once
            raise AssertionError(f"segmentation counted {count} of {n} examples of {self.split!r}")

    def confusion(self, params: Any, head: dict[str, Any]) -> np.ndarray:
        total = np.zeros((self.num_classes, self.num_classes), np.int64)
        for pred, label in self.predictions(params, head):
            total += confusion_matrix(pred, label, self.num_classes)
        return total

    def evaluate(self, params: Any, head: dict[str, Any]) -> dict[str, float]:
        conf = self.confusion(params, head)
        miou, _ = mean_iou(conf)
        return {"miou": miou, "pixel_accuracy": float(np.trace(conf) / max(conf.sum(), 1))}

    def run(self, params: Any) -> Iterator[tuple[str, float]]:
        metrics = self.evaluate(params, self.train(params))
        yield "miou", metrics["miou"]
        yield "pixel_accuracy", metrics["pixel_accuracy"]

    @staticmethod
    def check(name: str, entry: Any) -> None:
        validate_linear_segmentation(entry, where=f"config.evals.{name}")

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Any, **common: Any) -> LinearSegmentation:
        from skipless_jax import sharding
        from skipless_jax.evaluators.tokencut import _check_dense_dataset

        f = validate_linear_segmentation(entry, where=f"config.evals.{name}")
        _check_dense_dataset(name, "linear_segmentation", ctx.config, ("segmentation",))
        num_classes = f.pop("num_classes")
        if num_classes is None:
            if ctx.config.dataset.name != "digit_scenes":
                raise ValueError(
                    f"config.evals.{name}.num_classes is required for the dataset {ctx.config.dataset.name!r}"
                )
            from skipless_jax.data import digit_scenes

            num_classes = digit_scenes.NUM_CLASSES + 1  # background + 10 digits
        shards = sharding.num_data_shards(ctx.mesh)
        if f["batch_size"] % shards:
            raise ValueError(
                f"config.evals.{name}.batch_size={f['batch_size']} does not divide over the mesh's {shards} data shards"
            )
        train_split = entry.get("train_split") or ctx.config.dataset.train_split
        return cls(
            name=name,
            ctx=ctx,
            train_split=train_split,
            num_classes=int(num_classes),
            seed=int(ctx.config.get("seed", 0) or 0),
            **f,
            **common,
        )
