"""Segmentation confusion matrix and mIoU (docs/method.md §8) on hand-made examples."""

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
