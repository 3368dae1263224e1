"""Tiny generated dataset folders in the standard layouts of the dense sets (data/dense_sources.py)."""

from __future__ import annotations

import json
import os

import numpy as np
from PIL import Image


def jpeg(path: str, hw: tuple[int, int], seed: int = 0) -> np.ndarray:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (*hw, 3)).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=95)
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def png(path: str, label: np.ndarray, palette: bool = False) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    im = Image.fromarray(label.astype(np.uint8), mode="P" if palette else "L")
    if palette:
        im.putpalette(list(np.random.default_rng(0).integers(0, 256, 768)))
    im.save(path)


def lines(path: str, lines: list[str]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def voc_seg_folder(root: str) -> dict[str, np.ndarray]:
    voc = os.path.join(root, "VOCdevkit", "VOC2012")
    labels = {}
    for i, (name, hw) in enumerate([("a", (20, 30)), ("b", (24, 16)), ("c", (12, 12))]):
        jpeg(os.path.join(voc, "JPEGImages", f"{name}.jpg"), hw, i)
        lab = np.random.default_rng(i).choice([0, 3, 15, 255], hw).astype(np.uint8)
        labels[name] = lab
        png(os.path.join(voc, "SegmentationClass" if name != "c" else "SegmentationClassAug", f"{name}.png"),
             lab, palette=True)
    lines(os.path.join(voc, "ImageSets", "Segmentation", "train.txt"), ["a"])
    lines(os.path.join(voc, "ImageSets", "Segmentation", "val.txt"), ["b"])
    lines(os.path.join(voc, "ImageSets", "Segmentation", "aug.txt"), ["a", "c"])
    return labels


VOC_XML = """<annotation><size><width>30</width><height>20</height></size>
<object><name>dog</name><difficult>0</difficult><bndbox><xmin>3</xmin><ymin>2</ymin><xmax>12</xmax><ymax>18</ymax></bndbox></object>
<object><name>cat</name><difficult>1</difficult><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>30</xmax><ymax>20</ymax></bndbox></object>
</annotation>"""


def voc_boxes_folder(root: str, year: str = "2007") -> list[np.ndarray]:
    """VOC20xx with 5 trainval images of 3 sizes (2 padded shapes at patch 4); their boxes."""
    voc = os.path.join(root, "VOCdevkit", f"VOC{year}")
    os.makedirs(os.path.join(voc, "Annotations"), exist_ok=True)
    ids, gts = [], []
    for i, hw in enumerate([(20, 30), (18, 29), (32, 24), (20, 30), (17, 32)]):
        name = f"{i:06d}"
        jpeg(os.path.join(voc, "JPEGImages", f"{name}.jpg"), hw, i)
        x1, y1 = hw[1] - i, hw[0] - 2
        with open(os.path.join(voc, "Annotations", f"{name}.xml"), "w") as f:
            f.write(f"<annotation><object><difficult>{i % 2}</difficult><bndbox><xmin>{1 + i}</xmin><ymin>2</ymin>"
                    f"<xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object></annotation>")
        ids.append(name)
        gts.append(np.array([[i, 1, x1, y1]], np.float64))
    lines(os.path.join(voc, "ImageSets", "Main", "trainval.txt"), ids)
    return gts


def _seg_pairs(images: str, labels: str, names: list[str], values: list[int], image_ext: str = ".jpg") -> None:
    for i, name in enumerate(names):
        hw = (16 + 4 * i, 24 - 2 * i)
        jpeg(os.path.join(images, name + image_ext), hw, i)
        png(os.path.join(labels, f"{name}.png"), np.random.default_rng(i).choice(values, hw))


def dense_root(root: str) -> str:
    """Every dense dataset (data/dense_sources.py) side by side under `root`, a few images each
    (the layout `configs/dino_vits_*.py:dense=all,dense_root=root` reads)."""
    voc_seg_folder(root)
    voc_boxes_folder(root, "2007")
    voc_boxes_folder(root, "2012")
    ade = os.path.join(root, "ADEChallengeData2016")
    for split in ("training", "validation"):
        _seg_pairs(os.path.join(ade, "images", split), os.path.join(ade, "annotations", split),
                   [f"ADE_{split[:5]}_{k:08d}" for k in range(2)], [0, 1, 7, 150])
    stuff = os.path.join(root, "coco_stuff164k")
    for split in ("train2017", "val2017"):
        _seg_pairs(os.path.join(stuff, "images", split), os.path.join(stuff, "stuffthingmaps_trainval2017", split),
                   [f"{k + (0 if split[0] == 't' else 100):012d}" for k in range(2)], [0, 11, 95, 181, 255])
    coco = os.path.join(root, "coco")
    files = [f"COCO_train2014_{k:012d}.jpg" for k in (9, 25)]
    for k, f in enumerate(files):
        jpeg(os.path.join(coco, "train2014", f), (20 + 4 * k, 28), k)
    lines(os.path.join(coco, "coco_20k_filenames.txt"), [f"train2014/{f}" for f in files])
    os.makedirs(os.path.join(coco, "annotations"), exist_ok=True)
    with open(os.path.join(coco, "annotations", "instances_train2014.json"), "w") as f:
        json.dump({"images": [{"id": k, "file_name": n} for k, n in enumerate(files)],
                   "annotations": [{"image_id": 0, "bbox": [2, 3, 10, 12], "iscrowd": 0},
                                   {"image_id": 1, "bbox": [0, 0, 5, 5], "iscrowd": 0}]}, f)
    return root
