"""Segmentation confusion matrix and mIoU (docs/method/dense.md §8) on hand-made examples."""

from __future__ import annotations

import numpy as np
import pytest

from skipless_jax.data import dense_sources, sources
from skipless_jax.evaluators import segmentation as seg


def ref_miou(preds, labels, num_classes, ignore=255):
    """Independent float64 computation: per-class I and U summed over all pixels of all images."""
    inter = np.zeros(num_classes)
    union = np.zeros(num_classes)
    for p, lab in zip(preds, labels):
        p, lab = np.asarray(p).ravel(), np.asarray(lab).ravel()
        keep = lab != ignore
        p, lab = p[keep], lab[keep]
        for c in range(num_classes):
            inter[c] += float(np.sum((p == c) & (lab == c)))
            union[c] += float(np.sum((p == c) | (lab == c)))
    iou = np.where(union > 0, inter / np.where(union > 0, union, 1), np.nan)
    return float(np.nanmean(iou)), iou


def test_confusion_rows_are_ground_truth():
    label = np.array([[0, 0, 1], [1, 2, 2]])
    pred = np.array([[0, 1, 1], [1, 2, 0]])
    m = seg.confusion_matrix(pred, label, 3)
    assert m.dtype == np.int64 and m.shape == (3, 3)
    np.testing.assert_array_equal(m, [[1, 1, 0], [0, 2, 0], [1, 0, 1]])
    miou, iou = seg.mean_iou(m)
    np.testing.assert_allclose(iou, [1 / 3, 2 / 3, 1 / 2])
    assert miou == pytest.approx((1 / 3 + 2 / 3 + 1 / 2) / 3)


def test_absent_class_nan_and_only_predicted_class_zero():
    # Class 2 absent from labels and predictions: NaN, left out of the mean.
    # Class 3 only predicted: IoU 0, counted.
    label = np.array([0, 0, 1, 1, 1, 0])
    pred = np.array([0, 0, 1, 1, 3, 3])
    m = seg.confusion_matrix(pred, label, 4)
    miou, iou = seg.mean_iou(m)
    assert np.isnan(iou[2])
    np.testing.assert_allclose(iou[[0, 1, 3]], [2 / 3, 2 / 3, 0.0])
    assert miou == pytest.approx((2 / 3 + 2 / 3 + 0.0) / 3)
    rm, riou = ref_miou([pred], [label], 4)
    assert miou == pytest.approx(rm)
    np.testing.assert_allclose(iou, riou)


def test_ignore_label_excluded():
    label = np.array([0, 255, 1, 255])
    pred = np.array([0, 1, 1, 7])  # predictions on ignored pixels are not counted or checked
    m = seg.confusion_matrix(pred, label, 2)
    np.testing.assert_array_equal(m, [[1, 0], [0, 1]])
    assert seg.mean_iou(m)[0] == 1.0
    m = seg.confusion_matrix(np.array([0, 1]), np.array([0, 0]), 2, ignore_index=0)
    assert m.sum() == 0
    m = seg.confusion_matrix(np.array([0, 1]), np.array([0, 1]), 2, ignore_index=None)
    assert m.sum() == 2


def test_value_errors():
    with pytest.raises(ValueError, match="prediction value 5"):
        seg.confusion_matrix(np.array([0, 5]), np.array([0, 1]), 3)
    with pytest.raises(ValueError, match="prediction value -1"):
        seg.confusion_matrix(np.array([0, -1]), np.array([0, 1]), 3)
    with pytest.raises(ValueError, match="label value 3"):
        seg.confusion_matrix(np.array([0, 1]), np.array([0, 3]), 3)
    with pytest.raises(ValueError, match="label value 254"):
        seg.confusion_matrix(np.array([0, 1]), np.array([0, 254]), 3)
    with pytest.raises(ValueError, match="shape"):
        seg.confusion_matrix(np.zeros(3, int), np.zeros(4, int), 3)
    with pytest.raises(ValueError, match="integer"):
        seg.confusion_matrix(np.zeros(3), np.zeros(3, int), 3)
    for f in (lambda: seg.confusion_matrix(np.array([9]), np.array([0]), 3),):
        with pytest.raises(ValueError) as e:
            f()
        assert "\n" not in str(e.value)


def test_accumulation_equals_concatenation_and_reference():
    rng = np.random.default_rng(0)
    c = 6
    preds, labels = [], []
    for _ in range(5):
        shape = tuple(rng.integers(3, 20, 2))
        label = rng.integers(0, c - 1, shape)  # class 5 never in labels
        label[rng.random(shape) < 0.1] = 255
        pred = np.where(rng.random(shape) < 0.6, label, rng.integers(0, c, shape))
        pred = np.where(pred == 255, 0, pred)
        preds.append(pred.astype(np.int32))
        labels.append(label.astype(np.uint8))
    total = sum(seg.confusion_matrix(p, lab, c) for p, lab in zip(preds, labels))
    cat = seg.confusion_matrix(
        np.concatenate([p.ravel() for p in preds]), np.concatenate([lab.ravel() for lab in labels]), c
    )
    np.testing.assert_array_equal(total, cat)
    miou, iou = seg.mean_iou(total)
    rm, riou = ref_miou(preds, labels, c)
    assert miou == pytest.approx(rm, abs=1e-12)
    np.testing.assert_allclose(iou, riou, atol=1e-12)
    # The mean over the set is not the mean of per-image mIoUs.
    per_image = np.nanmean([seg.mean_iou(seg.confusion_matrix(p, lab, c))[0] for p, lab in zip(preds, labels)])
    assert per_image != pytest.approx(miou, abs=1e-9)


def test_all_empty_gives_nan():
    miou, iou = seg.mean_iou(np.zeros((3, 3), np.int64))
    assert np.isnan(miou) and np.isnan(iou).all()


def test_ade20k_labels():
    label = np.array([[0, 1, 150], [2, 0, 75]], np.uint8)
    out = dense_sources.ade20k_labels(label)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, [[255, 0, 149], [1, 255, 74]])
    assert dense_sources.ade20k_labels(label.astype(np.int32)).dtype == np.int64
    with pytest.raises(ValueError, match="ADE20K"):
        dense_sources.ade20k_labels(np.array([151]))
    m = seg.confusion_matrix(np.array([0, 149, 3]), out.ravel()[:3], sources.dataset_info("ade20k").num_classes)
    assert m.sum() == 2


# ---------------------------------------------------------------------------------------------
# The probe's loss normalization and schedule (docs/method/dense.md §8) vs plain numpy readings of
# mmseg's CrossEntropyLoss and mmcv's PolyLrUpdaterHook.
# ---------------------------------------------------------------------------------------------


def mmcv_poly_warmup_lr(base_lr, cur_iter, max_iters, warmup_iters, warmup_ratio=1e-6, power=1.0, min_lr=0.0):
    """mmcv LrUpdaterHook.before_train_iter (by_epoch=False) with PolyLrUpdaterHook and warmup='linear'."""
    coeff = (1 - cur_iter / max_iters) ** power
    regular = (base_lr - min_lr) * coeff + min_lr
    if warmup_iters == 0 or cur_iter >= warmup_iters:
        return regular
    k = (1 - cur_iter / warmup_iters) * (1 - warmup_ratio)
    return regular * (1 - k)


@pytest.mark.parametrize("warmup, steps", [(1500, 40_000), (3, 10), (0, 7)])
def test_poly_warmup_schedule_is_mmcvs(warmup, steps):
    f = seg.schedule(1e-3, warmup, steps)  # the default
    for s in sorted({0, 1, 2, warmup - 1, warmup, warmup + 1, steps // 2, steps - 1, steps} - {-1}):
        assert float(f(s)) == pytest.approx(mmcv_poly_warmup_lr(1e-3, s, steps, warmup), rel=1e-5, abs=1e-12), s
    if warmup:
        assert float(f(0)) == pytest.approx(1e-9, rel=1e-5)  # lr · warmup_ratio


def test_warmup_linear_schedule_is_the_former_rule():
    f = seg.schedule(1e-3, 4, 12, "warmup_linear")
    ref = [1e-3 * s / 4 if s < 4 else 1e-3 * (12 - s) / 8 for s in range(13)]
    np.testing.assert_allclose([float(f(s)) for s in range(13)], ref, rtol=1e-6, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("loss_norm", ["all", "labelled"])
def test_probe_loss_normalization_is_mmsegs(loss_norm):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    b, h, d, k, c = 3, 4, 5, 6, 16  # 4×4 token grid → 16×16 crop
    params, stats = seg.init_head(jax.random.PRNGKey(1), d, k)
    feats = rng.normal(size=(b, h, h, d)).astype(np.float32)
    labels = rng.integers(0, k, (b, c, c))
    labels[rng.random(labels.shape) < 0.3] = 255
    labels[:, 12:, :] = 255  # bottom padding of a smaller crop
    weights = np.array([1.0, 1.0, 0.0], np.float32)  # the last row a padding example
    loss, _ = seg.probe_loss(params, stats, jnp.asarray(feats), jnp.asarray(labels), jnp.asarray(weights), loss_norm)

    # numpy: torch F.cross_entropy(reduction='none', ignore_index=255) then .mean() (avg_non_ignore=False)
    # or .sum() / labelled count (avg_non_ignore=True), over the real examples.
    logits, _ = seg.head_logits(params, stats, jnp.asarray(feats), jnp.asarray(weights), train=True)
    logits = np.asarray(seg.upsample(logits, (c, c)), np.float64)[:2]
    lab = labels[:2]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.where(lab == 255, 0, lab)[..., None], -1)[..., 0]
    ce[lab == 255] = 0.0
    ref = ce.mean() if loss_norm == "all" else ce.sum() / (lab != 255).sum()
    assert float(loss) == pytest.approx(ref, rel=1e-5)


def test_loss_norm_and_schedule_values_checked():
    for k, allowed in (("loss_norm", "'all', 'labelled'"), ("schedule", "'poly_warmup', 'warmup_linear'")):
        with pytest.raises(ValueError, match=rf"^config\.evals\.e\.{k}='x' is unknown; allowed: \[{allowed}\]$"):
            seg.validate_linear_segmentation({k: "x"}, where="config.evals.e")
    f = seg.validate_linear_segmentation({})
    assert (f["loss_norm"], f["schedule"]) == ("all", "poly_warmup")


@pytest.mark.parametrize("out_hw, in_hw", [((32, 24), (8, 6)), ((17, 40), (45, 61)), ((50, 41), (50, 41))])
def test_device_resize_is_the_host_resize_and_jax_bilinear(out_hw, in_hw):
    """The device test pass's resize (taps padded to a bucket, flipped) = data.dense.resize_bilinear
    (the host path) = jax.image.resize bilinear without antialiasing (half-pixel centres)."""
    import jax
    import jax.numpy as jnp

    from skipless_jax.data import dense

    x = np.random.default_rng(0).normal(size=(*in_hw, 5)).astype(np.float32)
    host = dense.resize_bilinear(x, out_hw, dtype=np.float32)
    for flip in (False, True):
        ty = seg.taps_padded(out_hw[0], in_hw[0], out_hw[0] + 7)
        tx = seg.taps_padded(out_hw[1], in_hw[1], out_hw[1] + 3, flip=flip)
        dev = np.asarray(seg.resize_taps(jnp.asarray(x), ty, tx))
        assert dev.shape == (out_hw[0] + 7, out_hw[1] + 3, 5)
        np.testing.assert_array_equal(dev[: out_hw[0], : out_hw[1]], host[:, ::-1] if flip else host)
    ref = np.asarray(jax.image.resize(jnp.asarray(x), (*out_hw, 5), "bilinear", antialias=False))
    np.testing.assert_allclose(host, ref, rtol=1e-5, atol=1e-5)  # the same map, float32 rounding apart


def test_loss_norm_and_schedule_are_config_fields_checked_before_anything_compiles():
    import ml_collections

    from skipless_jax import evaluators

    from util import tiny_config

    config = tiny_config()
    config.evals = ml_collections.ConfigDict(dict(e=dict(type="linear_segmentation", loss_norm="labelled",
                                                         schedule="warmup_linear")))
    evaluators.check_config(config)
    config.evals.e.schedule = "cosine"
    with pytest.raises(ValueError, match=r"^config\.evals\.e\.schedule='cosine' is unknown; allowed: "):
        evaluators.check_config(config)
