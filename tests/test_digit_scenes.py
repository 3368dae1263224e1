"""Digit scenes (skipless_jax/data/digit_scenes.py): determinism, masks vs boxes, splits."""

from __future__ import annotations

import numpy as np
import pytest

from skipless_jax.data import digit_scenes as ds
from skipless_jax.data.record_sources import digits_split


def _build_uncached(*args, **kwargs):
    return ds.build_digit_scenes.__wrapped__(*args, **kwargs)


@pytest.fixture(scope="module")
def train():
    return ds.DigitScenesSource("train")


@pytest.fixture(scope="module")
def test48():
    return ds.DigitScenesSource("test", image_size=48, channels=3, seed=1)


def test_sizes_fields_and_dtypes(train, test48):
    assert len(train) == 2 * 1437 and len(test48) == 2 * 360
    x = train[5]
    assert x["image"].shape == (32, 32, 1) and x["image"].dtype == np.uint8
    assert x["segmentation"].shape == (32, 32) and x["segmentation"].dtype == np.uint8
    k = x["num_boxes"]
    assert isinstance(k, int) and 1 <= k <= ds.MAX_OBJECTS
    assert x["boxes"].shape == (k, 4) and x["boxes"].dtype == np.float32
    assert x["box_labels"].shape == (k,) and x["box_labels"].dtype == np.int32
    assert x["boxes_padded"].shape == (ds.MAX_OBJECTS, 4) and x["boxes_padded"].dtype == np.float32
    assert x["box_labels_padded"].shape == (ds.MAX_OBJECTS,)
    assert isinstance(x["label"], int) and 0 <= x["label"] < 10
    y = test48[0]
    assert y["image"].shape == (48, 48, 3) and y["segmentation"].shape == (48, 48)
    assert len(ds.DigitScenesSource("test", num_scenes=7)) == 7
    assert train[-1]["label"] == train[len(train) - 1]["label"]
    with pytest.raises(IndexError):
        train[len(train)]
    # Returned arrays are fresh copies: editing one leaves the source intact.
    x["image"][:] = 0
    assert train[5]["image"].any()


def test_every_count_of_digits_occurs(train, test48):
    for src in (train, test48):
        counts = np.bincount(src.arrays["num_boxes"], minlength=4)
        assert counts[0] == 0 and (counts[1:] > 0).all()


def test_determinism():
    a = _build_uncached("test", 32, 1, 0, 40)
    b = _build_uncached("test", 32, 1, 0, 40)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    c = _build_uncached("test", 32, 1, 1, 40)
    assert not np.array_equal(a["image"], c["image"])
    assert not np.array_equal(a["boxes_padded"], c["boxes_padded"])
    # A scene depends on its index, not on how many scenes are built.
    d = _build_uncached("test", 32, 1, 0, 15)
    for key in a:
        np.testing.assert_array_equal(a[key][:15], d[key])
    # Three channels: same layout, masks and boxes.
    e = _build_uncached("test", 32, 3, 0, 40)
    for key in ("mask", "boxes_padded", "box_labels_padded", "label", "num_boxes"):
        np.testing.assert_array_equal(a[key], e[key])
    # The cached build is the same as an uncached one.
    f = ds.build_digit_scenes("test", 32, 1, 0, 40)
    np.testing.assert_array_equal(f["image"], a["image"])


def _check_scene(x, h, w):
    k = x["num_boxes"]
    boxes, labels, mask = x["boxes"], x["box_labels"], x["segmentation"]
    # Inside the canvas, non-empty, integer pixel coordinates.
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
    assert (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
    assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
    assert np.array_equal(boxes, np.round(boxes))
    np.testing.assert_array_equal(x["boxes_padded"][:k], boxes)
    assert (x["boxes_padded"][k:] == -1).all() and (x["box_labels_padded"][k:] == -1).all()
    # Every mask pixel of value c > 0 lies in a box of label c − 1; boxes are tight and disjoint.
    covered = np.zeros(mask.shape, np.int32)
    for (x0, y0, x1, y1), lab in zip(boxes.astype(int), labels):
        inside = mask[y0:y1, x0:x1]
        assert (inside[inside > 0] == lab + 1).all()
        own = inside == lab + 1
        assert own[0].any() and own[-1].any() and own[:, 0].any() and own[:, -1].any()  # tight
        covered[y0:y1, x0:x1] += 1
    assert covered.max() <= 1
    assert (covered[mask > 0] == 1).all()
    # label = class of the largest box; boxes sorted by decreasing area.
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert (np.diff(area) <= 0).all()
    assert x["label"] == labels[int(np.argmax(area))]
    # Digits are bright on a dim background.
    img = x["image"].astype(float).mean(-1)
    assert img[mask > 0].mean() > img[mask == 0].mean() + 40


def test_masks_boxes_labels_consistent(train, test48):
    for src, (h, w) in ((train, (32, 32)), (test48, (48, 48))):
        for i in range(0, len(src), 7):
            _check_scene(src[i], h, w)


def test_train_test_use_disjoint_digits(train):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    target = load_digits().target
    tr_idx, te_idx = train_test_split(np.arange(len(target)), test_size=360, random_state=0, stratify=target)
    test = ds.DigitScenesSource("test")
    used = {}
    for name, src, idx in (("train", train, tr_idx), ("test", test, te_idx)):
        a = src.arrays["digit_indices_padded"]
        local = a[a >= 0]
        assert local.max() < len(idx)
        # Box labels are the classes of the split's digits that were used.
        _, classes = digits_split()[name]
        np.testing.assert_array_equal(classes[a[a >= 0]], src.arrays["box_labels_padded"][a >= 0])
        np.testing.assert_array_equal(target[idx[local]], classes[local])
        used[name] = set(idx[local].tolist())
    assert used["train"].isdisjoint(used["test"])
    assert len(used["train"]) == 1437 and len(used["test"]) == 360  # every digit is used


def test_the_digits_split_is_sklearns_without_importing_it():
    """record_sources.digits_split reads sklearn's bundled file and splits it with
    stratified_split: the arrays of load_digits + train_test_split, bit for bit; the same indices
    as train_test_split for other labels, sizes and seeds; and no sklearn import in the process."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from skipless_jax.data import record_sources

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    want = train_test_split(images, digits.target.astype(np.int32), test_size=360, random_state=0,
                            stratify=digits.target)
    got = digits_split()
    for a, b in zip((*got["train"], *got["test"]), (want[0], want[2], want[1], want[3]), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    for seed, (rows, classes, test_size) in enumerate([(300, 7, 10), (300, 7, 97), (1797, 10, 360), (50, 3, 25)]):
        labels = np.random.default_rng(seed).integers(0, classes, rows)
        for a, b in zip(record_sources.stratified_split(labels, test_size, seed),
                        train_test_split(np.arange(rows), test_size=test_size, random_state=seed, stratify=labels),
                        strict=True):
            np.testing.assert_array_equal(a, b)
    code = ("import sys\nfrom skipless_jax.data import record_sources\n"
            "record_sources.digits_split()\nprint('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False"], out.stdout + out.stderr


def _resize_bilinear(img8, s):
    # Independent bilinear resize with half-pixel centres (separable np.interp).
    src = (np.arange(s) + 0.5) * 8 / s - 0.5
    rows = np.stack([np.interp(src, np.arange(8), img8[:, j]) for j in range(8)], axis=1)
    return np.stack([np.interp(src, np.arange(8), rows[i]) for i in range(s)], axis=0)


def test_mask_is_the_thresholded_resized_source_digit(train):
    images, _ = digits_split()["train"]
    for i in range(0, 60, 3):
        x = train[i]
        for (x0, y0, x1, y1), lab, di in zip(x["boxes"].astype(int), x["box_labels"], x["digit_indices"]):
            crop = x["segmentation"][y0:y1, x0:x1] == lab + 1
            ok = False
            for s in range(ds.DIGIT_SIZE[0], ds.DIGIT_SIZE[1] + 1):
                ink = _resize_bilinear(images[di, :, :, 0].astype(float), s) > 255 * 4 / 16
                r, c = np.nonzero(ink)
                tight = ink[r.min() : r.max() + 1, c.min() : c.max() + 1]
                ok |= tight.shape == crop.shape and np.array_equal(tight, crop)
            assert ok, f"scene {i}: the mask in box {(x0, y0, x1, y1)} is not digit {di} resized"


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        ds.DigitScenesSource("val")
    with pytest.raises(ValueError, match="channels"):
        ds.DigitScenesSource("test", channels=2)
    with pytest.raises(ValueError, match="smaller"):
        ds.DigitScenesSource("test", image_size=10)
    small = ds.DigitScenesSource("test", image_size=16, num_scenes=20)  # digits capped at 16 px
    for i in range(len(small)):
        _check_scene(small[i], 16, 16)
