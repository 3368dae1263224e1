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
"""

from __future__ import annotations

import numpy as np

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
