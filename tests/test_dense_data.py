"""Dense-evaluation data (docs/method/dense.md §7-8, docs/data.md): the resizes, crops, windows and
photometric distortion of data/dense.py against closed forms and independent readings, and the
VOC / ADE20K / COCO-Stuff / COCO20k sources on tiny generated folders and tfds mock data."""

from __future__ import annotations

import colorsys
import json
import os

import numpy as np
import pytest
from dense_folders import VOC_XML, voc_seg_folder
from dense_folders import jpeg as _jpeg
from dense_folders import lines as _lines
from dense_folders import png as _png

from skipless_jax.data import dense, dense_sources, sources

# ---------------------------------------------------------------------------------------------
# Resizes (half-pixel centres, no antialiasing; OpenCV nearest)
# ---------------------------------------------------------------------------------------------


def test_bilinear_closed_forms():
    x = np.array([1.0, 5.0, 2.0])
    # ×2 upsampling: edges clamped, interior 3/4-1/4 mixes.
    up = dense.bilinear_matrix(6, 3) @ x
    np.testing.assert_allclose(up, [1.0, 0.75 * 1 + 0.25 * 5, 0.25 * 1 + 0.75 * 5, 0.75 * 5 + 0.25 * 2,
                                    0.25 * 5 + 0.75 * 2, 2.0])
    # ÷2 downsampling samples between pixel pairs: their mean (no antialiasing kernel).
    y = np.arange(8.0) ** 2
    np.testing.assert_allclose(dense.bilinear_matrix(4, 8) @ y, (y[0::2] + y[1::2]) / 2)
    image = np.random.default_rng(0).integers(0, 256, (5, 7, 3)).astype(np.uint8)
    np.testing.assert_array_equal(dense.resize_image(image, (5, 7)), image)
    two, f = dense.resize_bilinear(image, (10, 14)), image.astype(np.float64)
    np.testing.assert_allclose(two[1::2, 1::2][:-1, :-1], 0.75 * 0.75 * f[:-1, :-1] + 0.75 * 0.25 * (
        f[1:, :-1] + f[:-1, 1:]) + 0.25 * 0.25 * f[1:, 1:])


def test_nearest_is_opencv_floor():
    label = np.arange(12).reshape(3, 4).astype(np.uint8)
    np.testing.assert_array_equal(dense.resize_nearest(label, (6, 8)), np.repeat(np.repeat(label, 2, 0), 2, 1))
    np.testing.assert_array_equal(dense.resize_nearest(label, (3, 2)), label[:, ::2])


def test_rescale_is_mmsegs_keep_ratio():
    assert dense.rescale_hw((375, 500), 2048, 512) == (512, 683)
    assert dense.rescale_hw((375, 500), 1024, 256) == (256, 341)
    assert dense.rescale_hw((100, 1000), 2048, 512) == (205, 2048)  # the long side binds
    assert dense.rescale_hw((375, 500), np.inf, 640 * 3) == (1920, 2560)


def test_windows_follow_mmseg_and_cover_the_image():
    assert dense.windows((512, 683), 512, 341) == [(0, 512, 0, 512), (0, 512, 171, 683)]
    assert dense.windows((300, 400), 512, 341) == [(0, 300, 0, 400)]
    for hw, crop, stride in [((1000, 777), 512, 341), ((1920, 2560), 640, 320), ((33, 70), 32, 21)]:
        wins = dense.windows(hw, crop, stride)
        rows = -(-max(hw[0] - crop, 0) // stride) + 1
        cols = -(-max(hw[1] - crop, 0) // stride) + 1
        assert len(wins) == rows * cols
        cover = np.zeros(hw, int)
        for y0, y1, x0, x1 in wins:
            assert (y1 - y0, x1 - x0) == (min(crop, hw[0]), min(crop, hw[1])) and y0 >= 0 and x0 >= 0
            cover[y0:y1, x0:x1] += 1
        assert cover.min() >= 1


def test_protocols_and_scaling():
    lin, ms = dense.PROTOCOLS["lin"], dense.PROTOCOLS["ms"]
    assert (lin.blocks, lin.crop, lin.stride, lin.ratio, lin.test_scales, lin.test_flip) == (
        1, 512, 341, (0.5, 2.0), (1.0,), False)
    assert (ms.blocks, ms.crop, ms.stride, ms.ratio, ms.test_scales, ms.test_flip) == (
        4, 640, 320, (1.0, 3.0), (1.0, 1.32, 1.73, 2.28, 3.0), True)
    small = lin.scaled(32, flip=False)
    assert (small.crop, small.short, small.stride, small.flip) == (32, 32, 21, False)
    views = dense.test_views(np.zeros((20, 30, 3), np.uint8), ms.scaled(32))
    assert [(s, f, v.shape[:2]) for s, f, v in views][:3] == [(1.0, False, (32, 48)), (1.0, True, (32, 48)),
                                                               (1.32, False, (42, 63))]


# ---------------------------------------------------------------------------------------------
# Train crops
# ---------------------------------------------------------------------------------------------


def test_train_example_geometry_padding_and_determinism():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (24, 40, 3)).astype(np.uint8)
    label = rng.integers(0, 5, (24, 40)).astype(np.uint8)
    plain = dense.Protocol(blocks=1, crop=32, short=24, ratio=(1.0, 1.0), stride=21, test_scales=(1.0,),
                           test_flip=False, cat_max_ratio=1.0, flip=False, photometric=False)
    out, lab, valid = dense.train_example(image, label, plain, np.random.default_rng(3))
    assert out.shape == (32, 32, 3) and lab.shape == (32, 32) and valid.shape == (32, 32)
    # Short side 24 → the image is kept; the crop is 24 rows (all) × 32 columns at some offset.
    assert valid[:24].all() and not valid[24:].any() and (lab[24:] == 255).all() and (out[24:] == 0).all()
    x0 = [x for x in range(9) if np.array_equal(out[:24], image[:, x : x + 32])]
    assert len(x0) == 1 and np.array_equal(lab[:24], label[:, x0[0] : x0[0] + 32])
    again = dense.train_example(image, label, dense.PROTOCOLS["lin"].scaled(32), np.random.default_rng(7))
    same = dense.train_example(image, label, dense.PROTOCOLS["lin"].scaled(32), np.random.default_rng(7))
    for a, b in zip(again, same, strict=True):
        np.testing.assert_array_equal(a, b)
    # Flipping mirrors the same crop (the same draws come before the flip's).
    flipped = [dense.train_example(image, label, plain.scaled(32, short=24, flip=True), np.random.default_rng(s))
               for s in range(8)]
    mirrored = [f for f in flipped if not any(np.array_equal(f[0][:24], image[:, x : x + 32]) for x in range(9))]
    assert mirrored and all(any(np.array_equal(f[0][:24, ::-1], image[:, x : x + 32]) for x in range(9))
                            for f in mirrored)


def test_cat_max_ratio_retries_until_no_class_dominates():
    label = np.zeros((64, 64), np.uint8)
    label[:, 48:] = 1  # class 0 dominates every crop that misses the right quarter
    for seed in range(20):
        y0, y1, x0, x1 = dense.random_crop_box(label, 32, np.random.default_rng(seed), 0.75)
        crop = label[y0:y1, x0:x1]
        counts = np.bincount(crop.ravel(), minlength=2)
        # Either the retry found a balanced crop, or all 10 draws failed (then the last is kept).
        assert counts.max() / counts.sum() < 0.75 or x1 <= 48 + 8
    always = [dense.random_crop_box(label, 32, np.random.default_rng(s), 1.0) for s in range(20)]
    assert any(b[3] <= 48 for b in always)  # without the retry, dominated crops occur


def test_photometric_hsv_matches_colorsys_and_distortion_stays_in_range():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (200, 3)).astype(np.uint8)
    hsv = dense._rgb_to_hsv(pixels)
    for p, (h, s, v) in zip(pixels, hsv):
        rh, rs, rv = colorsys.rgb_to_hsv(*(p / 255.0))
        assert h == pytest.approx((rh * 180.0) % 180.0, abs=1e-3)
        assert s == pytest.approx(rs * 255.0, abs=1e-3) and v == pytest.approx(rv * 255.0, abs=1e-3)
    np.testing.assert_allclose(dense._hsv_to_rgb(hsv), pixels, atol=1e-3)
    image = rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)
    outs = [dense.photometric_distortion(image, np.random.default_rng(s)) for s in range(16)]
    assert all(o.dtype == np.uint8 and o.shape == image.shape for o in outs)
    assert sum(not np.array_equal(o, image) for o in outs) >= 12  # 1/16 of draws change nothing
    np.testing.assert_array_equal(dense.photometric_distortion(image, np.random.default_rng(5)), outs[5])
    gray = dense.photometric_distortion(image[..., :1], np.random.default_rng(1))
    assert gray.shape == (16, 16, 1)


# ---------------------------------------------------------------------------------------------
# Sources on tiny generated folders
# ---------------------------------------------------------------------------------------------


def test_voc_segmentation_folder(tmp_path):
    labels = voc_seg_folder(str(tmp_path))
    for data_dir in (str(tmp_path), os.path.join(tmp_path, "VOCdevkit", "VOC2012")):
        val = sources.get_source("voc12_seg", "val", data_dir)
        assert len(val) == 1 and val[0]["image"].shape == (24, 16, 3)
        np.testing.assert_array_equal(val[0]["segmentation"], labels["b"])  # palette indices, 255 kept
    aug = sources.get_source("voc12_seg", "train_aug", str(tmp_path))
    assert len(aug) == 2  # train ∪ aug, each once, in order
    np.testing.assert_array_equal(aug[1]["segmentation"], labels["c"])
    assert len(sources.get_source("voc12_seg", "train_aug[1:]", str(tmp_path))) == 1
    missing = r"^dataset 'voc12_seg': 'ImageSets/Segmentation' not found .*docs/data\.md"
    with pytest.raises(FileNotFoundError, match=missing):
        sources.get_source("voc12_seg", "val", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match=r"^dataset 'voc12_seg' needs its folder: set data_dir"):
        sources.get_source("voc12_seg", "val", None)
    unknown = r"split 'test' of 'voc12_seg' is unknown; allowed: \['train', 'train_aug', 'val'\]"
    with pytest.raises(ValueError, match=unknown):
        sources.get_source("voc12_seg", "test", str(tmp_path))


def test_voc_boxes_folder_keeps_difficult_objects_and_shifts_the_origin(tmp_path):
    voc = os.path.join(tmp_path, "VOC2007")
    _jpeg(os.path.join(voc, "JPEGImages", "000005.jpg"), (20, 30))
    os.makedirs(os.path.join(voc, "Annotations"))
    with open(os.path.join(voc, "Annotations", "000005.xml"), "w") as f:
        f.write(VOC_XML)
    _lines(os.path.join(voc, "ImageSets", "Main", "trainval.txt"), ["000005"])
    (record,) = [sources.get_source("voc07_boxes", "trainval", str(tmp_path))[0]]
    np.testing.assert_array_equal(record["boxes"], [[2, 1, 12, 18], [0, 0, 30, 20]])


def test_voc_boxes_from_tfds_mock_data(monkeypatch):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
        monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)  # as test_configs
        source = sources.get_source("voc07_boxes", "trainval", None)
        raw = tfds.data_source("voc/2007", split="train+validation")
        assert len(source) == len(raw)
        r, ref = source[0], raw[0]
    h, w = ref["image"].shape[:2]
    b = np.asarray(ref["objects"]["bbox"]).reshape(-1, 4)
    expected = np.rint(np.stack([b[:, 1] * w - 1, b[:, 0] * h - 1, b[:, 3] * w, b[:, 2] * h], 1))
    np.testing.assert_array_equal(r["boxes"], expected.astype(np.float32))


def test_ade20k_folder_reduces_the_zero_label(tmp_path):
    root = os.path.join(tmp_path, "ADEChallengeData2016")
    _jpeg(os.path.join(root, "images", "validation", "ADE_val_00000001.jpg"), (10, 14))
    label = np.array([[0, 1, 150, 7]] * 10, np.uint8).repeat(4, 1)[:, :14]
    _png(os.path.join(root, "annotations", "validation", "ADE_val_00000001.png"), label)
    r = sources.get_source("ade20k", "val", str(tmp_path))[0]
    expected = np.where(label == 0, 255, label.astype(int) - 1)
    np.testing.assert_array_equal(r["segmentation"], expected)


def test_coco_stuff_class_sets(tmp_path):
    values = np.array([[0, 11, 12, 90, 91, 181, 255, 100]], np.uint8)
    _jpeg(os.path.join(tmp_path, "images", "val2017", "000000000139.jpg"), (1, 8))
    _png(os.path.join(tmp_path, "stuffthingmaps_trainval2017", "val2017", "000000000139.png"), values)
    full = sources.get_source("coco_stuff", "val", str(tmp_path))[0]["segmentation"]
    # 11 and 90 are unused thing ids; 12 → 11 (one unused id below it), 91 → 80, 181 → 170.
    np.testing.assert_array_equal(full, [[0, 255, 11, 255, 80, 170, 255, 89]])
    coarse = sources.get_source("coco_stuff27", "val", str(tmp_path))[0]["segmentation"]
    np.testing.assert_array_equal(coarse, [[9, 8, 8, 4, 17, 24, 255, 13]])  # person, outdoor, ..., banner
    stuff = sources.get_source("coco_stuff15", "val", str(tmp_path))[0]["segmentation"]
    np.testing.assert_array_equal(stuff, [[255, 255, 255, 255, 5, 12, 255, 1]])  # things ignored
    assert sorted(set(dense_sources.COCO_STUFF_171[:182]) - {255}) == list(range(171))
    assert sorted(set(dense_sources.COCO_STUFF_27[:182])) == list(range(27))


def test_coco20k_folder_drops_crowd_boxes_and_rounds(tmp_path):
    _jpeg(os.path.join(tmp_path, "train2014", "COCO_train2014_000000000009.jpg"), (20, 30))
    _jpeg(os.path.join(tmp_path, "train2014", "COCO_train2014_000000000025.jpg"), (10, 10))
    _lines(os.path.join(tmp_path, "coco_20k_filenames.txt"),
           ["train2014/COCO_train2014_000000000009.jpg", "train2014/COCO_train2014_000000000025.jpg"])
    os.makedirs(os.path.join(tmp_path, "annotations"))
    with open(os.path.join(tmp_path, "annotations", "instances_train2014.json"), "w") as f:
        json.dump({"images": [{"id": 9, "file_name": "COCO_train2014_000000000009.jpg"},
                              {"id": 25, "file_name": "COCO_train2014_000000000025.jpg"}],
                   "annotations": [{"image_id": 9, "bbox": [1.4, 2.6, 10.2, 5.0], "iscrowd": 0},
                                   {"image_id": 9, "bbox": [0, 0, 30, 20], "iscrowd": 1},
                                   {"image_id": 25, "bbox": [0, 0, 3, 3], "iscrowd": 1}]}, f)
    source = sources.get_source("coco20k", "train", str(tmp_path))
    np.testing.assert_array_equal(source[0]["boxes"], [[1, 3, 12, 8]])
    assert source[1]["boxes"].shape == (0, 4)  # only a crowd box: no ground truth (a miss in CorLoc)
