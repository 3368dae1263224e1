"""Semantic segmentation metrics: confusion matrix and mIoU (docs/method/dense.md §8).

numpy only. mIoU is computed from one confusion matrix summed over the whole evaluation set
(the caller adds the per-image / per-batch confusions, at the label's resolution):
IoU_c = I_c / U_c with I = diag(M), U = row sum + column sum − diag, and mIoU = the mean
over the classes with a non-zero union (classes absent from both labels and predictions are
NaN and left out; a class that is only predicted has IoU 0 and counts).

Class sets (docs/method/dense.md §8): PASCAL VOC 21 classes (20 objects + background 0, 255
ignored); ADE20K 150 classes (the stored label 0, "other", is ignored:
`data/dense_sources.ade20k_labels`);
COCO-Stuff 171 classes (80 things + 91 stuff), with the 27-class (coarse) and 15-class
variants as options.

`LinearSegmentation` at the end is the evaluator (`config.evals.<name> =
dict(type='linear_segmentation', ...)`): DINOv2's `lin` / `ms` probe trained on frozen
features, with the train crops and test windows of data/dense.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skipless_jax import rng_streams
from skipless_jax.checks import is_finite, is_positive_int
from skipless_jax.data.dense import IGNORE_INDEX
from skipless_jax.evaluators.common import FitEvaluator

METHOD_REF = "docs/method/dense.md §8"


def _as_int(name: str, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_):
        raise ValueError(f"segmentation: {name} must be an integer array, got dtype {x.dtype}")
    return x.astype(np.int64, copy=False)


def confusion_matrix(
    pred: np.ndarray, label: np.ndarray, num_classes: int, ignore_index: int | None = IGNORE_INDEX
) -> np.ndarray:
    """(C, C) int64 confusion, rows = ground truth, columns = prediction. docs/method/dense.md §8.

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
    """(C, C) confusion summed over the set → (mIoU, per-class IoU (C,) float64). docs/method/dense.md §8.

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


# ---------------------------------------------------------------------------------------------
# The linear probe (DINOv2 `lin`, docs/method/dense.md §8).
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


LOSS_NORMS = ("all", "labelled")
SCHEDULES = ("poly_warmup", "warmup_linear")
WARMUP_RATIO = 1e-6  # mmcv's warmup_ratio in DINOv2's configs


def probe_loss(
    params: dict[str, jax.Array], stats: dict[str, jax.Array], feats: jax.Array, labels: jax.Array, weights: jax.Array,
    loss_norm: str = "all",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Pixel cross-entropy of the upsampled logits, 0 where label = 255 or on padding rows
    (weights 0), summed and divided (`loss_norm`, docs/method/dense.md §8) by every pixel of the real
    examples' crops ('all': mmseg's avg_non_ignore=False) or by their labelled pixels
    ('labelled'); (loss, new running statistics). labels (B, c, c) int, weights (B,)."""
    logits, new_stats = head_logits(params, stats, feats, weights, train=True)
    logits = upsample(logits, labels.shape[1:3])
    real = weights[:, None, None] > 0
    valid = (labels != IGNORE_INDEX) & real
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    pixels = valid.sum() if loss_norm == "labelled" else real.sum() * labels.shape[1] * labels.shape[2]
    return (ce * valid).sum() / jnp.maximum(pixels, 1), new_stats


def schedule(lr: float, warmup: int, steps: int, kind: str = "poly_warmup") -> optax.Schedule:
    """The learning rate of (0-based) step s, docs/method/dense.md §8. 'poly_warmup' (mmcv's poly,
    power 1, times its linear warm-up factor): lr·(1 − s/steps)·(1 − (1 − s/warmup)(1 − 1e-6))
    for s < warmup, else lr·(1 − s/steps). 'warmup_linear': 0 → lr over `warmup` steps, then
    linear decay to 0 at `steps`."""
    if kind == "poly_warmup":
        def poly_warmup(s: jax.Array) -> jax.Array:
            s = jnp.asarray(s, jnp.float32)
            poly = lr * jnp.maximum(steps - s, 0.0) / steps  # (T − s) exact in float32: no cancellation
            if warmup == 0:
                return poly
            # = 1 − (1 − s/W)(1 − ρ), written without float32's cancellation near s = 0.
            factor = WARMUP_RATIO + (1.0 - WARMUP_RATIO) * s / warmup
            return jnp.where(s < warmup, poly * factor, poly)

        return poly_warmup
    decay = optax.linear_schedule(lr, 0.0, max(steps - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def optimizer(lr: float, weight_decay: float, warmup: int, steps: int,
              kind: str = "poly_warmup") -> optax.GradientTransformation:
    """AdamW (β = 0.9, 0.999; decay on every head parameter, as mmseg's default) on `schedule`."""
    return optax.adamw(schedule(lr, warmup, steps, kind), b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)


def taps_padded(out: int, inp: int, size: int, flip: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`data.dense.bilinear_taps(out, inp)` (reversed when `flip`: output j reads out − 1 − j)
    padded to `size` ≥ out entries (index 0, weight 0): one compiled resize per bucket of sizes."""
    from skipless_jax.data.dense import bilinear_taps

    i0, i1, frac = (np.asarray(a)[::-1] if flip else np.asarray(a) for a in bilinear_taps(out, inp))
    pad = size - out
    return (np.pad(i0, (0, pad)).astype(np.int32), np.pad(i1, (0, pad)).astype(np.int32),
            np.pad(frac, (0, pad)).astype(np.float32))


def resize_taps(x: jax.Array, ty: tuple[jax.Array, ...], tx: tuple[jax.Array, ...]) -> jax.Array:
    """(h, w, K) → (len(ty[0]), len(tx[0]), K): the host's two-tap bilinear (`data.dense.resize_bilinear`
    in float32: x[i0]·(1 − f) + x[i1]·f, rows then columns) from its tap arrays."""
    (y0, y1, fy), (x0, x1, fx) = ty, tx
    fy, fx = fy[:, None, None], fx[None, :, None]
    x = x[y0] * (1 - fy) + x[y1] * fy
    return x[:, x0] * (1 - fx) + x[:, x1] * fx


def bucket_up(n: int, step: int) -> int:
    return -(-n // step) * step


def process_local(*trees: Any) -> tuple[Any, list[Any]]:
    """(a mesh over this process's devices alone, the trees whole and replicated on it): for work
    that each process does on its own share of a split (dense test passes, TokenCut)."""
    from jax.experimental import multihost_utils

    from skipless_jax import sharding

    mesh = sharding.make_mesh({"data": -1, "fsdp": 1}, jax.local_devices())
    local = sharding.replicated(mesh)
    return mesh, [jax.device_put(multihost_utils.process_allgather(t, tiled=True), local) for t in trees]


DEFAULTS = dict(
    protocol="lin", steps=40_000, batch_size=16, lr=1e-3, weight_decay=1e-4, warmup=1500, num_classes=None,
    crop_size=None, blocks=None, flip=None, photometric=None, loss_norm="all", schedule="poly_warmup",
)


def validate_linear_segmentation(entry: Any, where: str = "config.evals.seg") -> dict[str, Any]:
    """The entry's fields with defaults; one-line ValueError for the first bad one."""
    f = {k: (entry.get(k) if entry.get(k) is not None else v) for k, v in DEFAULTS.items()}
    if f["protocol"] not in PROTOCOLS:
        raise ValueError(f"{where}.protocol={f['protocol']!r} is unknown; allowed: {list(PROTOCOLS)}")
    for k, allowed in (("loss_norm", LOSS_NORMS), ("schedule", SCHEDULES)):
        if f[k] not in allowed:
            raise ValueError(f"{where}.{k}={f[k]!r} is unknown; allowed: {list(allowed)}")
    for k in ("steps", "batch_size"):
        if not is_positive_int(f[k]):
            raise ValueError(f"{where}.{k}={f[k]!r} must be a positive integer")
    for k in ("crop_size", "blocks"):
        if f[k] is not None and not is_positive_int(f[k]):
            raise ValueError(f"{where}.{k}={f[k]!r} must be a positive integer (None: the protocol's)")
    for k in ("flip", "photometric"):
        if f[k] is not None and not isinstance(f[k], bool):
            raise ValueError(f"{where}.{k}={f[k]!r} must be True, False or None (the protocol's)")
    if (
        not isinstance(f["warmup"], (int, np.integer))
        or isinstance(f["warmup"], bool)
        or not 0 <= f["warmup"] <= f["steps"]
    ):
        raise ValueError(f"{where}.warmup={f['warmup']!r} must be an integer in [0, steps={f['steps']}]")
    if not is_finite(f["lr"]) or f["lr"] <= 0:
        raise ValueError(f"{where}.lr={f['lr']!r} must be a finite number > 0")
    if not is_finite(f["weight_decay"]) or f["weight_decay"] < 0:
        raise ValueError(f"{where}.weight_decay={f['weight_decay']!r} must be a finite number >= 0")
    if f["num_classes"] is not None and (not is_positive_int(f["num_classes"]) or f["num_classes"] < 2):
        raise ValueError(f"{where}.num_classes={f['num_classes']!r} must be an integer >= 2")
    return f


def protocol_of(fields: dict[str, Any], patch_size: int, stored_size: int | None = None) -> Any:
    """The `data.dense.Protocol` of validated fields: the named protocol at `crop_size` (default:
    `stored_size` for a dataset stored at one size, e.g. the 32×32 digit scenes, else the
    protocol's 512 / 640; short side and stride in proportion), with `blocks` / `flip` /
    `photometric` overrides."""
    from skipless_jax.data import dense

    base = dense.PROTOCOLS[fields["protocol"]]
    overrides = {k: fields[k] for k in ("blocks", "flip", "photometric") if fields[k] is not None}
    protocol = base.scaled(fields["crop_size"] or stored_size or base.crop, **overrides)
    if protocol.crop % patch_size:
        raise ValueError(f"crop_size={protocol.crop} is not a multiple of the patch size {patch_size}")
    return protocol


@dataclasses.dataclass
class LinearSegmentation(FitEvaluator):
    """config.evals entry `type='linear_segmentation'`: yields ('miou', mIoU) and
    ('pixel_accuracy', ·) on `split` of `dataset` (default the run's) of a linear head trained
    on `train_split` (DINOv2's `lin` / `ms`, docs/method/dense.md §8).

    Features: the last `protocol.blocks` blocks' outputs through the final LayerNorm
    (`out['blocks'][l]['normed']`; for 1 block that is `encoded`), CLS dropped, concatenated on
    the (h, w) patch grid, frozen (computed inside the head's jitted step, no gradient).
    Head: BatchNorm over the global batch (running averages at test time, so the head is affine
    there) + 1×1 linear to `num_classes`; logits upsampled bilinearly to the input size;
    pixel cross-entropy (0 on pixels labelled 255) over every crop pixel (`loss_norm='all'`,
    mmseg) or the labelled ones ('labelled'); AdamW (`lr`, `weight_decay`) on mmcv's poly ×
    linear warm-up (`schedule='poly_warmup'`, `warmup` steps) or warm-up then linear decay
    ('warmup_linear') to 0 at `steps`. The step runs with the batch
    sharded over the mesh's data axes and the head replicated.

    Train data: at step s, examples perm_e[(s·B + i) mod N] of the train split (perm_e a
    permutation drawn from (seed, epoch e)), each through `data.dense.train_example` with its own
    generator (seed, s, i): resize by a random ratio, crop with the class-ratio retry, flip,
    photometric distortion, padding (0 after normalization, label 255). Every process builds the
    whole global batch (the same on all) and places its shards. Test: every record of `split`
    exactly once at its own resolution: each test view (scales × flips) cut into sliding windows
    (padded to a multiple of the patch size, centred, as DINOv2's CenterPadding; logits resized
    to the window), window logits averaged where windows overlap, resized bilinearly to the
    label's (H, W) (flipped views flipped back); one view: argmax of the logits, several: of the
    mean (here: sum) softmax. mIoU: one confusion matrix summed over the split (`confusion_matrix`,
    `mean_iou`); pixel accuracy = its trace / its sum. By default (`device_test`) the resizes,
    accumulation, softmax and argmax run on the devices (`device_predictions`) with image i on
    process i mod P and the confusions summed once; `scores` is the host reference.
    """

    num_classes: int
    protocol: Any  # data.dense.Protocol
    dataset: str = ""
    data_dir: str | None = None
    steps: int = 40_000
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup: int = 1500
    loss_norm: str = "all"  # docs/method/dense.md §8: 'all' (mmseg) | 'labelled'
    schedule: str = "poly_warmup"  # docs/method/dense.md §8: 'poly_warmup' (mmcv) | 'warmup_linear'
    seed: int = 0
    chunk: int = 64  # test windows per device call
    buffer_bytes: int = 1 << 30  # view buffers held before the pending windows are sent
    workers: int = 0  # host threads making the train crops and the test views (0: min(16, cores))
    device_test: bool = True  # the test pass's resizes, accumulation and softmax on the devices (False: host)

    def __post_init__(self):
        if self.ctx.outputs is None:
            raise ValueError(
                f"config.evals.{self.name}: type 'linear_segmentation' needs a trainer whose context has `outputs`"
            )
        from skipless_jax import models, sharding
        from skipless_jax.data import sources

        self.model = models.describe(self.ctx.config.model)
        self.patch_size = self.model.token_stride  # pixels a token of the feature grid
        self.info = sources.dataset_info(self.dataset or self.ctx.config.dataset.name)
        self._replicated = sharding.replicated(self.ctx.mesh)
        self.tx = optimizer(self.lr, self.weight_decay, self.warmup, self.steps, self.schedule)

        def step(state: dict[str, Any], params: Any, batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
            feats = self.features(params, batch["image"])
            labels = batch["segmentation"].astype(jnp.int32)
            (loss, stats), grads = jax.value_and_grad(probe_loss, has_aux=True)(
                state["params"], state["stats"], feats, labels, batch["mask"], self.loss_norm
            )
            updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
            return {
                "params": optax.apply_updates(state["params"], updates),
                "stats": stats,
                "opt_state": opt_state,
            }, loss

        def window_logits(head: dict[str, Any], params: Any, batch: dict[str, jax.Array]) -> jax.Array:
            """(B, h, w, K) logits on each (padded) window's patch grid; the host resizes them."""
            logits, _ = head_logits(head["params"], head["stats"], self.features(params, batch["image"]))
            return logits

        def accumulate(total: jax.Array, grid: jax.Array, starts: jax.Array, lo: jax.Array, hi: jax.Array,
                       hw: tuple[int, int]) -> jax.Array:
            """Rows lo..hi−1 of grid (B, gh, gw, K) (window logits on their padded patch grid) resized
            to the window's hw (the host's taps) and added into the view buffer total (hb, wb, K) at
            starts[r] = (y0, x0); total is donated (updated in place)."""
            ty = tuple(jnp.asarray(a) for a in taps_padded(hw[0], grid.shape[1], hw[0]))
            tx = tuple(jnp.asarray(a) for a in taps_padded(hw[1], grid.shape[2], hw[1]))

            def body(r, total):
                win = resize_taps(grid[r].astype(jnp.float32), ty, tx)
                at = (starts[r, 0], starts[r, 1], 0)
                return jax.lax.dynamic_update_slice(total, jax.lax.dynamic_slice(total, at, win.shape) + win, at)

            return jax.lax.fori_loop(lo, hi, body, total)

        def view_scores(total: jax.Array, count: jax.Array, ty: tuple, tx: tuple, softmax: bool) -> jax.Array:
            """The view's mean window logits (total / count) resized to the image's (bucketed) size
            with the host's taps (a flipped view: reversed column taps), softmax when several views."""
            x = resize_taps(total / count, ty, tx)
            return jax.nn.softmax(x, axis=-1) if softmax else x

        self._accumulate = jax.jit(accumulate, static_argnums=5, donate_argnums=0)
        self._view_scores = jax.jit(view_scores, static_argnums=4)
        self._step = jax.jit(step, out_shardings=(self._replicated, self._replicated))
        # Replicated (patch-grid logits: small): every host reads all rows.
        self._window_logits = jax.jit(window_logits, out_shardings=self._replicated)
        # The device test pass: the grid stays where it is computed (any mesh, e.g. a process's own).
        self._window_grid = jax.jit(window_logits)

    def features(self, params: Any, images: jax.Array) -> jax.Array:
        """(B, H, W, C) → frozen (B, h, w, blocks·d) float32 patch tokens of the last `blocks` blocks
        through the final LayerNorm (1 block: `encoded`, the model's last grid, any family)."""
        from skipless_jax.evaluators.common import patch_tokens

        out = self.ctx.outputs(params, images)
        if self.protocol.blocks == 1:
            tokens = out["encoded"]
        else:
            tokens = jnp.concatenate([b["normed"] for b in out["blocks"][-self.protocol.blocks :]], axis=-1)
        return jax.lax.stop_gradient(patch_tokens(tokens, images.shape[1:3], self.model).astype(jnp.float32))

    def init(self, params: Any, image_shape: tuple[int, ...]) -> dict[str, Any]:
        """The initial head state (params, stats, opt_state), replicated on the mesh."""
        dummy = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
        d = jax.eval_shape(self.features, params, dummy).shape[-1]
        head, stats = init_head(jax.random.PRNGKey(self.seed), d, self.num_classes)
        state = {"params": head, "stats": stats, "opt_state": self.tx.init(head)}
        return jax.device_put(state, self._replicated)

    def source(self, split: str) -> Any:
        from skipless_jax.data import sources

        return sources.get_source(self.dataset or self.ctx.config.dataset.name, split, self.data_dir)

    def train_example(self, source: Any, step: int, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Example i of probe step `step` (0-based): (normalized image with 0 padding, label)."""
        from skipless_jax.data import dense, pipeline

        n = len(source)
        k = step * self.batch_size + i
        record = source[int(_permutation(self.seed, k // n, n)[k % n])]
        rng = np.random.default_rng([self.seed, step, i, rng_streams.SEGMENTATION_PROBE])
        image, label, valid = dense.train_example(record["image"], record["segmentation"], self.protocol, rng)
        return np.where(valid[..., None], pipeline.normalize(image, self.info.mean, self.info.std), 0.0), label

    def train_batch(self, source: Any, step: int, pool: Any = None) -> dict[str, np.ndarray]:
        """The host global batch of probe step `step`; `pool` (a thread pool) maps the examples."""
        run = map if pool is None else pool.map
        images, labels = zip(*run(lambda i: self.train_example(source, step, i), range(self.batch_size)))
        return {"image": np.stack(images).astype(np.float32), "segmentation": np.stack(labels)}

    def train(self, params: Any, steps: int | None = None) -> dict[str, Any]:
        """The head state after `steps` (default `self.steps`) steps from its initialization.

        The host crops of step s + 1 are made by a thread pool (numpy releases the GIL in its
        array work) while the device runs step s."""
        import concurrent.futures

        from skipless_jax.evaluators.common import global_rows

        steps = self.steps if steps is None else steps
        source = self.source(self.train_split)
        if len(source) == 0:
            raise ValueError(f"config.evals.{self.name}: train_split {self.train_split!r} is empty")
        shape = (self.protocol.crop, self.protocol.crop, self.info.image_shape[-1])
        state = self.init(params, shape)
        workers = self.workers or min(16, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool, \
                concurrent.futures.ThreadPoolExecutor(1) as ahead:
            upcoming = ahead.submit(self.train_batch, source, 0, pool) if steps else None
            for s in range(steps):
                batch = upcoming.result()
                if s + 1 < steps:
                    upcoming = ahead.submit(self.train_batch, source, s + 1, pool)
                state, _ = self._step(state, params, global_rows(self.ctx.mesh, batch))
        return state

    def scores(self, params: Any, head: dict[str, Any], images: list[np.ndarray]) -> Iterator[np.ndarray]:
        """(H, W, K) float32 test scores of each uint8 image, in order: its logits (one test view)
        or the sum of its views' softmax (same argmax as their mean).

        Windows of consecutive views (of one or more images) go to the device `chunk` at a time
        per window shape (rows padded to a power of two: few compiles); the device returns
        patch-grid logits, resized on the host to each window. A view's buffer ((h, w, K)
        float32, the largest allocation: ~2.9 GB for an ADE20K `ms` view at scale 3) lives until
        its last window is in, then is resized to the image's size and dropped; the pending
        windows are all sent once the views waiting for them hold more than `buffer_bytes`. An
        image's scores are yielded as soon as its views are done."""
        from skipless_jax.data import dense, pipeline
        from skipless_jax.evaluators.common import global_rows

        p, k = self.patch_size, self.num_classes
        pending: dict[tuple[int, int], list[tuple[Any, tuple[int, int, int, int], np.ndarray]]] = {}
        results: dict[int, np.ndarray] = {}
        views_left = {}

        class View:
            def __init__(self, image: int, flipped: bool, hw: tuple[int, int], windows: int):
                self.image, self.flipped, self.hw, self.left = image, flipped, hw, windows
                self.total, self.count = np.zeros((*hw, k), np.float32), np.zeros((*hw, 1), np.float32)

        def finish(view: View) -> None:
            logits = dense.resize_bilinear(view.total / view.count, images[view.image].shape[:2], dtype=np.float32)
            if view.flipped:
                logits = logits[:, ::-1]
            one_view = len(self.protocol.test_scales) == 1 and not self.protocol.test_flip
            score = logits if one_view else dense.softmax(logits)
            results[view.image] = score if view.image not in results else results[view.image] + score
            views_left[view.image] -= 1

        def flush(hw: tuple[int, int]) -> None:
            items = pending.pop(hw)
            padded_hw = dense.patch_multiple(hw, p)
            top, left = (padded_hw[0] - hw[0]) // 2, (padded_hw[1] - hw[1]) // 2
            crops = np.stack([np.pad(c, ((top, padded_hw[0] - hw[0] - top), (left, padded_hw[1] - hw[1] - left),
                                         (0, 0))) for _, _, c in items]).astype(np.float32)
            grid = jax.device_get(self._window_logits(head, params, global_rows(self.ctx.mesh, {"image": crops},
                                                                              bucket=True)))
            for row, (view, (y0, y1, x0, x1), _) in enumerate(items):
                # Logits of the padded window's grid resized to the window (DINOv2's CenterPadding).
                view.total[y0:y1, x0:x1] += dense.resize_bilinear(np.asarray(grid[row]), hw, dtype=np.float32)
                view.count[y0:y1, x0:x1] += 1
                view.left -= 1
                if view.left == 0:
                    finish(view)

        next_out = 0
        for i, image in enumerate(images):
            views = dense.test_views(image, self.protocol)
            views_left[i] = len(views)
            for _, flipped, resized in views:
                hw = resized.shape[:2]
                wins = dense.windows(hw, self.protocol.crop, self.protocol.stride)
                view = View(i, flipped, hw, len(wins))
                x = pipeline.normalize(resized, self.info.mean, self.info.std)
                for win in wins:
                    crop = x[win[0] : win[1], win[2] : win[3]]
                    pending.setdefault(crop.shape[:2], []).append((view, win, crop))
                    if len(pending[crop.shape[:2]]) >= self.chunk:
                        flush(crop.shape[:2])
            in_flight = {id(v): v.total.nbytes for items in pending.values() for v, _, _ in items}
            if i == len(images) - 1 or sum(in_flight.values()) > self.buffer_bytes:
                for hw in list(pending):
                    flush(hw)
            while next_out in results and views_left[next_out] == 0:
                yield results.pop(next_out)
                next_out += 1

    def host_views(self, image: np.ndarray, pool: Any = None) -> list[tuple[bool, tuple[int, int], np.ndarray, list]]:
        """The host's share of one uint8 image's device test pass (docs/method/dense.md §8): for each test
        view (flipped, its (h, w), its windows' overlap count on the bucketed buffer (hb, wb, 1),
        its window groups [(window hw, windows, normalized crops centre-padded to patch multiples)],
        at most `chunk` windows a group, one window shape a group). `pool` maps the test scales
        (each one resize, and its flip)."""
        from skipless_jax.data import dense, pipeline

        p, step = self.patch_size, max(self.protocol.crop // 4, 1)

        def one(view: tuple[float, bool, np.ndarray]) -> tuple[bool, tuple[int, int], np.ndarray, list]:
            _, flipped, resized = view
            hw = resized.shape[:2]
            wins = dense.windows(hw, self.protocol.crop, self.protocol.stride)
            count = np.ones((bucket_up(hw[0], step), bucket_up(hw[1], step), 1), np.float32)
            count[: hw[0], : hw[1]] = 0
            for y0, y1, x0, x1 in wins:
                count[y0:y1, x0:x1] += 1
            x = pipeline.normalize(resized, self.info.mean, self.info.std)
            by_shape: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
            for win in wins:
                by_shape.setdefault((win[1] - win[0], win[3] - win[2]), []).append(win)
            groups = []
            for whw, group in by_shape.items():
                padded_hw = dense.patch_multiple(whw, p)
                top, left = (padded_hw[0] - whw[0]) // 2, (padded_hw[1] - whw[1]) // 2
                for c in range(0, len(group), self.chunk):
                    part = group[c : c + self.chunk]
                    crops = np.zeros((len(part), *padded_hw, x.shape[-1]), np.float32)
                    for r, (y0, y1, x0, x1) in enumerate(part):  # DINOv2's CenterPadding
                        crops[r, top : top + whw[0], left : left + whw[1]] = x[y0:y1, x0:x1]
                    groups.append((whw, part, crops))
            return flipped, hw, count, groups

        def scale(s: float) -> list[tuple[bool, tuple[int, int], np.ndarray, list]]:  # one resize, its views
            return [one(view) for view in dense.scale_views(image, self.protocol, s)]

        per_scale = (map if pool is None else pool.map)(scale, self.protocol.test_scales)
        return [view for views in per_scale for view in views]  # test_views' order

    def device_predictions(self, params: Any, head: dict[str, Any], images: list[np.ndarray],
                           mesh: Any = None) -> Iterator[np.ndarray]:
        """(H, W) int predictions of each uint8 image, in order, the test pass on the devices of
        `mesh` (default the context's): the same views, windows and arithmetic as `scores` (the host
        reference, docs/method/dense.md §8), with each window's logits resized (the host's bilinear taps),
        accumulated into its view's buffer, the view resized to the image's size (flipped back), the
        softmax and the sum over views, and the argmax taken on the devices; only the argmax comes back.

        The host's share of image i + 1 (`host_views`: view resizes, normalization, window crops;
        its scales over a thread pool of `workers`) is made while the devices score image i.
        Shapes are bucketed so that few programs compile: a view's buffer is (h, w) rounded up to
        a multiple of `bucket` (a quarter of the window side), the image's scores (H, W) likewise;
        windows go `chunk` at a time per window shape (rows padded to a power of two)."""
        import concurrent.futures

        from skipless_jax.evaluators.common import global_rows

        mesh = self.ctx.mesh if mesh is None else mesh
        k, step = self.num_classes, max(self.protocol.crop // 4, 1)
        one_view = len(self.protocol.test_scales) == 1 and not self.protocol.test_flip
        workers = self.workers or min(16, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool, \
                concurrent.futures.ThreadPoolExecutor(1) as ahead:
            upcoming = ahead.submit(self.host_views, images[0], pool) if len(images) else None
            for i, image in enumerate(images):
                views = upcoming.result()
                if i + 1 < len(images):
                    upcoming = ahead.submit(self.host_views, images[i + 1], pool)
                H, W = image.shape[:2]
                score = None
                for flipped, hw, count, groups in views:
                    total = jnp.zeros((*count.shape[:2], k), jnp.float32)
                    for whw, part, crops in groups:
                        grid = self._window_grid(head, params, global_rows(mesh, {"image": crops}, bucket=True))
                        starts = np.zeros((grid.shape[0], 2), np.int32)
                        starts[: len(part)] = [(w[0], w[2]) for w in part]
                        total = self._accumulate(total, grid, starts, 0, len(part), whw)
                    ty = taps_padded(H, hw[0], bucket_up(H, step))
                    tx = taps_padded(W, hw[1], bucket_up(W, step), flip=flipped)
                    view = self._view_scores(total, count, ty, tx, not one_view)
                    score = view if score is None else score + view
                del views
                yield np.asarray(jax.device_get(jnp.argmax(score, axis=-1)))[:H, :W]

    def confusion(self, params: Any, head: dict[str, Any], device: bool | None = None) -> np.ndarray:
        """The (K, K) confusion over every record of `split`, exactly once. `device` (default
        `device_test`): the device test pass (`device_predictions`) with image i read, decoded and
        scored on process i mod P only (on its own devices) and the confusion matrices summed over
        the processes once; else the host reference (`scores`) on every process."""
        device = self.device_test if device is None else device
        source = self.source(self.split)
        total = np.zeros((self.num_classes, self.num_classes), np.int64)
        count = 0
        procs, rank = (jax.process_count(), jax.process_index()) if device else (1, 0)
        mesh = self.ctx.mesh
        if procs > 1:  # each process scores its own images alone: its devices, the head and backbone on them
            mesh, (params, head) = process_local(params, head)
        mine = list(range(rank, len(source), procs))
        for start in range(0, len(mine), self.chunk):
            records = [source[i] for i in mine[start : start + self.chunk]]
            images = [r["image"] for r in records]
            if device:
                preds = self.device_predictions(params, head, images, mesh)
            else:
                preds = (score.argmax(-1) for score in self.scores(params, head, images))
            for record, pred in zip(records, preds, strict=True):
                total += confusion_matrix(pred, record["segmentation"], self.num_classes)
                count += 1
                record.clear()  # the image and label, once scored
        if procs > 1:
            from jax.experimental import multihost_utils

            total = np.asarray(multihost_utils.process_allgather(total)).sum(0)
            count = int(np.asarray(multihost_utils.process_allgather(np.int64(count))).sum())
        if count != len(source):  # every example exactly once
            raise AssertionError(f"segmentation counted {count} of {len(source)} examples of {self.split!r}")
        return total

    def evaluate(self, params: Any, head: dict[str, Any]) -> dict[str, float]:
        conf = self.confusion(params, head)
        miou, _ = mean_iou(conf)
        return {"miou": miou, "pixel_accuracy": float(np.trace(conf) / max(conf.sum(), 1))}

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        metrics = self.evaluate(params, self.train(params))
        yield "miou", metrics["miou"]
        yield "pixel_accuracy", metrics["pixel_accuracy"]

    @staticmethod
    def check(name: str, entry: Any) -> None:
        validate_linear_segmentation(entry, where=f"config.evals.{name}")

    @staticmethod
    def check_model(name: str, entry: Any, model: Any) -> None:
        """One-line ValueError when the protocol reads more blocks than the model (a
        `models.ModelDescription`) has, or several blocks of a family that records no `normed`."""
        from skipless_jax.data import dense

        where = f"config.evals.{name}"
        f = validate_linear_segmentation(entry, where=where)
        blocks = f["blocks"] if f["blocks"] is not None else dense.PROTOCOLS[f["protocol"]].blocks
        if blocks > 1 and not model.normed_blocks:
            raise ValueError(f"{where}: type 'linear_segmentation' with blocks={blocks} is not available for the "
                             f"{model.family} family: it reads each block's output through the final norm "
                             f"(out['blocks'][i]['normed']), which this model does not record; set {where}.blocks=1")
        if blocks > model.depth:
            raise ValueError(f"{where}: protocol {f['protocol']!r} reads the last {blocks} blocks; "
                             f"the model has {model.depth} (set {where}.blocks)")

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Any, **common: Any) -> LinearSegmentation:
        from skipless_jax import models, sharding
        from skipless_jax.data import sources
        from skipless_jax.evaluators.common import dense_dataset

        where = f"config.evals.{name}"
        f = validate_linear_segmentation(entry, where=where)
        model = models.describe(ctx.config.model)
        cls.check_model(name, entry, model)
        dataset, data_dir = dense_dataset(name, entry, ctx.config)
        sources.check_dense_dataset(name, "linear_segmentation", dataset, "segmentation")
        num_classes = f.pop("num_classes")
        if num_classes is None:
            num_classes = sources.dataset_info(dataset).num_classes
            if dataset == "digit_scenes":
                from skipless_jax.data import digit_scenes

                num_classes = digit_scenes.NUM_CLASSES + 1  # background + 10 digits
        try:
            info = sources.dataset_info(dataset)
            protocol = protocol_of(f, model.token_stride, info.image_shape[0] if info.fixed_size else None)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        shards = sharding.num_data_shards(ctx.mesh)
        if f["batch_size"] % shards:
            raise ValueError(
                f"{where}.batch_size={f['batch_size']} does not divide over the mesh's {shards} data shards"
            )
        train_split = entry.get("train_split")
        if train_split is None:
            if dataset != ctx.config.dataset.name:
                raise ValueError(f"{where}.train_split is required for the dataset {dataset!r}")
            train_split = ctx.config.dataset.train_split
        for k in ("protocol", "crop_size", "blocks", "flip", "photometric"):
            f.pop(k)
        return cls(
            name=name,
            ctx=ctx,
            train_split=train_split,
            num_classes=int(num_classes),
            protocol=protocol,
            dataset=dataset,
            data_dir=data_dir,
            seed=int(ctx.config.get("seed", 0) or 0),
            **f,
            **common,
        )


@functools.cache
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, rng_streams.SEGMENTATION_PROBE]).permutation(n)
