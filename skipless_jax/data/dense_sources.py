"""Dense-evaluation datasets (docs/data.md, "Dense evaluation data"): segmentation masks and boxes.

Random-access sources with records {'image': uint8 (H, W, 3) at the file's resolution,
'segmentation': uint8 (H, W) training ids with 255 ignored} or {'image', 'boxes': float32
(k, 4) [x0, y0, x1, y1] pixels, x1/y1 exclusive}, read by the dense evaluators
(evaluators/segmentation.py, evaluators/tokencut.py). Each split takes tfds-style slices
('val[:100]'). Folder layouts (`data_dir` = the folder named below, or its parent):

    voc12_seg     VOCdevkit/VOC2012/JPEGImages/<id>.jpg, SegmentationClass/<id>.png (palette
                  indices: 0 background, 1..20, 255 border), ImageSets/Segmentation/{train,val}.txt;
                  split 'train_aug': train.txt + ImageSets/Segmentation/aug.txt with masks from
                  SegmentationClassAug/<id>.png (SBD, mmseg's converted layout) where present
    voc07_boxes / voc12_boxes
                  VOCdevkit/VOC20xx/JPEGImages/<id>.jpg, Annotations/<id>.xml,
                  ImageSets/Main/{trainval,train,val,test}.txt; every object, difficult ones
                  included, as (xmin − 1, ymin − 1, xmax, ymax)
    ade20k        ADEChallengeData2016/images/{training,validation}/*.jpg and
                  annotations/{training,validation}/*.png (0 "other" → 255, c → c − 1);
                  splits 'train', 'val'
    coco_stuff, coco_stuff27, coco_stuff15
                  images/{train2017,val2017}/*.jpg and stuffthingmaps_trainval2017/{train2017,
                  val2017}/*.png (value = COCO-Stuff id − 1, 255 unlabelled) mapped to the 171
                  used ids (`COCO_STUFF_171`, mmseg's converter), the 27 coarse classes
                  (`COCO_STUFF_27`, IIC / STEGO) or the 15 coarse stuff classes (things ignored)
    coco20k       train2014/COCO_train2014_<id>.jpg, annotations/instances_train2014.json and
                  coco_20k_filenames.txt (the standard 19,817-image list, one file name per
                  line, e.g. train2014/COCO_train2014_000000560992.jpg); boxes [x, y, x + w,
                  y + h] of the non-crowd annotations, rounded to integers (LOST / TokenCut)

VOC07/VOC12 boxes also come from the tfds catalog (`voc/2007`, `voc/2012`) when data_dir has no
VOC folder: tfds stores (ymin, xmin, ymax, xmax) / size of the 1-based annotation, mapped
back to (xmin − 1, ymin − 1, xmax, ymax) with the size, rounded; 'trainval' is tfds's
'train+validation'. The tfds catalog has no VOC masks, and its `scene_parse150` holds ADE's
instance maps, not the 150-class maps, so the masks come from the folders only.
"""

from __future__ import annotations

import functools
import json
import os
import xml.etree.ElementTree as ET
from typing import Any

import numpy as np
from PIL import Image

from skipless_jax.data import record_sources
from skipless_jax.data.dense import IGNORE_INDEX

DOCS = "docs/data.md"

# COCO-Stuff's 182 stored ids (category id − 1) of which 11 thing ids are unused; the other
# 171 in order are the training ids (mmseg's coco_stuff164k converter).
COCO_STUFF_UNUSED = (11, 25, 28, 29, 44, 65, 67, 68, 70, 82, 90)
COCO_STUFF_171 = np.full(256, 255, np.uint8)
COCO_STUFF_171[[v for v in range(182) if v not in COCO_STUFF_UNUSED]] = np.arange(171)
# The 27 coarse classes (12 things, 15 stuff) of IIC / PiCIE / STEGO: stored id (0..181) → coarse id.
_FINE_TO_COARSE = (
    9, 11, 11, 11, 11, 11, 11, 11, 11, 8, 8, 8, 8, 8, 8, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6,
    10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 5, 5, 5, 5, 5, 5, 5, 5, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
    3, 3, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4, 17, 17, 22, 20, 20, 22, 15,
    25, 16, 13, 12, 12, 17, 17, 23, 15, 15, 17, 15, 21, 15, 25, 13, 13, 13, 13, 13, 22, 26, 14, 14, 15, 22,
    21, 21, 24, 20, 22, 15, 17, 16, 15, 22, 24, 21, 17, 25, 16, 21, 17, 22, 16, 21, 21, 25, 21, 26, 21, 24,
    20, 17, 14, 21, 26, 15, 23, 20, 21, 24, 15, 24, 22, 25, 15, 20, 17, 17, 22, 14, 18, 18, 18, 18, 18, 18,
    18, 26, 26, 19, 19, 24,
)
COCO_STUFF_27 = np.full(256, 255, np.uint8)
COCO_STUFF_27[:182] = _FINE_TO_COARSE
# The 15 coarse stuff classes (coarse ids 12..26 → 0..14; things ignored), IIC's / STEGO's "cocostuff15".
COCO_STUFF_15 = np.where((COCO_STUFF_27 >= 12) & (COCO_STUFF_27 != 255), COCO_STUFF_27 - 12, 255).astype(np.uint8)
COCO_STUFF_TABLES = {171: COCO_STUFF_171, 27: COCO_STUFF_27, 15: COCO_STUFF_15}


def ade20k_labels(label: np.ndarray) -> np.ndarray:
    """ADE20K stored labels 0..150 → training labels: 0 ("other") → 255, c → c − 1 (150 classes).

    Same shape; uint8 input stays uint8, other integer types become int64. docs/method/dense.md §8.
    """
    label = np.asarray(label)
    if not (np.issubdtype(label.dtype, np.integer) or label.dtype == np.bool_):
        raise ValueError(f"segmentation: label must be an integer array, got dtype {label.dtype}")
    x = label.astype(np.int64, copy=False)
    if x.size and (x.min() < 0 or x.max() > 150):
        raise ValueError(f"segmentation: ADE20K labels must lie in [0, 150], got [{x.min()}, {x.max()}]")
    out = np.where(x == 0, IGNORE_INDEX, x - 1)
    return out.astype(np.uint8) if label.dtype == np.uint8 else out


def voc_gt_box(xmin: float, ymin: float, xmax: float, ymax: float) -> tuple[float, float, float, float]:
    """VOC's 1-based inclusive (xmin, ymin, xmax, ymax) → (xmin − 1, ymin − 1, xmax, ymax). docs/method/dense.md §7."""
    return xmin - 1, ymin - 1, xmax, ymax


def _read_image(path: str) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _read_label(path: str) -> np.ndarray:
    with Image.open(path) as im:  # palette PNGs read as their indices
        return np.asarray(im)


def _find_root(data_dir: str | None, name: str, marker: str, *subdirs: str) -> str:
    """The first of data_dir/<subdir> (and data_dir itself) that holds `marker`; else a one-line error."""
    if not data_dir:
        raise FileNotFoundError(
            f"dataset {name!r} needs its folder: set data_dir (config.dataset.data_dir or the evaluator's "
            f"data_dir); see {DOCS}"
        )
    for sub in (*subdirs, ""):
        root = os.path.join(os.path.expanduser(data_dir), sub)
        if os.path.exists(os.path.join(root, marker)):
            return root
    raise FileNotFoundError(
        f"dataset {name!r}: {marker!r} not found under data_dir {data_dir!r} "
        f"(looked in {[os.path.join(data_dir, s) for s in (*subdirs, '')]}); see {DOCS}"
    )


def _ids(path: str, name: str) -> list[str]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {name!r}: the split list {path!r} is missing; see {DOCS}")
    with open(path) as f:
        return [line.split()[0] for line in f if line.strip()]


class _ListSource:
    """A list of per-example arguments and a reader; sliceable like every source."""

    def __init__(self, items: list[Any], read):
        self.items, self.read = items, read

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.items):
            raise IndexError(index)
        return self.read(self.items[index])


# ------------------------------------------------------------------------------- PASCAL VOC


def voc_seg(data_dir: str | None, split: str) -> _ListSource:
    """VOC 2012 segmentation: train.txt / val.txt with SegmentationClass masks; 'train_aug' adds
    aug.txt's SBD images with SegmentationClassAug masks (mmseg's voc_aug layout)."""
    root = _find_root(data_dir, "voc12_seg", "ImageSets/Segmentation", "VOCdevkit/VOC2012", "VOC2012")
    sets = os.path.join(root, "ImageSets", "Segmentation")
    lists = [("train.txt", "SegmentationClass"), ("aug.txt", "SegmentationClassAug")] if split == "train_aug" else [
        (f"{split}.txt", "SegmentationClass")]
    items: dict[str, str] = {}
    for name, folder in lists:
        if not os.path.isdir(os.path.join(root, folder)):
            raise FileNotFoundError(f"dataset 'voc12_seg' split {split!r}: {os.path.join(root, folder)!r} is missing; "
                                    f"see {DOCS}")
        for i in _ids(os.path.join(sets, name), "voc12_seg"):
            items.setdefault(i, folder)
    if not os.path.isdir(os.path.join(root, "JPEGImages")):
        raise FileNotFoundError(f"dataset 'voc12_seg': {os.path.join(root, 'JPEGImages')!r} is missing; see {DOCS}")

    def read(item: tuple[str, str]) -> dict[str, Any]:
        i, folder = item
        return {"image": _read_image(os.path.join(root, "JPEGImages", f"{i}.jpg")),
                "segmentation": _read_label(os.path.join(root, folder, f"{i}.png")), "label": 0}

    return _ListSource(list(items.items()), read)


def voc_xml_boxes(path: str) -> np.ndarray:
    """(k, 4) float32 boxes of every object of a VOC annotation XML, difficult ones included,
    as (xmin − 1, ymin − 1, xmax, ymax) (docs/method/dense.md §7)."""
    boxes = []
    for obj in ET.parse(path).getroot().iter("object"):
        b = obj.find("bndbox")
        boxes.append(voc_gt_box(*(float(b.find(k).text) for k in ("xmin", "ymin", "xmax", "ymax"))))
    return np.asarray(boxes, np.float32).reshape(-1, 4)


def voc_tfds_boxes(record: dict[str, Any]) -> np.ndarray:
    """tfds `voc` objects/bbox (normalized (ymin, xmin, ymax, xmax) of the 1-based boxes) →
    (k, 4) float32 (xmin − 1, ymin − 1, xmax, ymax) pixels, rounded."""
    h, w = record["image"].shape[:2]
    b = np.asarray(record["objects"]["bbox"], np.float64).reshape(-1, 4) * [h, w, h, w]
    return np.rint(np.stack([b[:, 1] - 1, b[:, 0] - 1, b[:, 3], b[:, 2]], 1)).astype(np.float32)


class _TfdsVocBoxes:
    def __init__(self, source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        r = self.source[index]
        return {"image": np.asarray(r["image"]), "boxes": voc_tfds_boxes(r), "label": 0}


def voc_boxes(year: str, data_dir: str | None, split: str) -> Any:
    name = f"voc{year[2:]}_boxes"
    folder = [os.path.join(data_dir or "", s) for s in (f"VOCdevkit/VOC{year}", f"VOC{year}", "")]
    if not data_dir or not any(os.path.isdir(os.path.join(f, "Annotations")) for f in folder):
        tfds_split = {"trainval": "train+validation", "val": "validation"}.get(split, split)
        return _TfdsVocBoxes(record_sources.tfds_source(f"voc/{year}", tfds_split, data_dir))
    root = _find_root(data_dir, name, "Annotations", f"VOCdevkit/VOC{year}", f"VOC{year}")
    ids = _ids(os.path.join(root, "ImageSets", "Main", f"{split}.txt"), name)

    def read(i: str) -> dict[str, Any]:
        return {"image": _read_image(os.path.join(root, "JPEGImages", f"{i}.jpg")),
                "boxes": voc_xml_boxes(os.path.join(root, "Annotations", f"{i}.xml")), "label": 0}

    return _ListSource(ids, read)


# ------------------------------------------------------------------------------- ADE20K


def ade20k(data_dir: str | None, split: str) -> _ListSource:
    root = _find_root(data_dir, "ade20k", "annotations", "ADEChallengeData2016")
    folder = {"train": "training", "val": "validation"}[split]
    images = os.path.join(root, "images", folder)
    if not os.path.isdir(images):
        raise FileNotFoundError(f"dataset 'ade20k': {images!r} is missing; see {DOCS}")
    stems = sorted(f[:-4] for f in os.listdir(images) if f.endswith(".jpg"))

    def read(stem: str) -> dict[str, Any]:
        return {"image": _read_image(os.path.join(images, f"{stem}.jpg")),
                "segmentation": ade20k_labels(_read_label(os.path.join(root, "annotations", folder, f"{stem}.png"))),
                "label": 0}

    return _ListSource(stems, read)


# ------------------------------------------------------------------------------- COCO


def coco_stuff(classes: int, data_dir: str | None, split: str) -> _ListSource:
    name = "coco_stuff" if classes == 171 else f"coco_stuff{classes}"
    root = _find_root(data_dir, name, "stuffthingmaps_trainval2017", "coco_stuff164k", "cocostuff")
    folder = {"train": "train2017", "val": "val2017"}[split]
    labels = os.path.join(root, "stuffthingmaps_trainval2017", folder)
    if not os.path.isdir(labels):
        raise FileNotFoundError(f"dataset {name!r}: {labels!r} is missing; see {DOCS}")
    stems = sorted(f[:-4] for f in os.listdir(labels) if f.endswith(".png"))
    table = COCO_STUFF_TABLES[classes]

    def read(stem: str) -> dict[str, Any]:
        return {"image": _read_image(os.path.join(root, "images", folder, f"{stem}.jpg")),
                "segmentation": table[_read_label(os.path.join(labels, f"{stem}.png"))], "label": 0}

    return _ListSource(stems, read)


@functools.cache
def _coco_boxes(annotations: str) -> dict[str, np.ndarray]:
    """file name → (k, 4) float32 non-crowd boxes [x, y, x + w, y + h] of a COCO instances json."""
    with open(annotations) as f:
        data = json.load(f)
    names = {im["id"]: im["file_name"] for im in data["images"]}
    boxes: dict[str, list] = {n: [] for n in names.values()}
    for a in data["annotations"]:
        if a.get("iscrowd", 0):
            continue
        x, y, w, h = a["bbox"]
        boxes[names[a["image_id"]]].append(tuple(round(v) for v in (x, y, x + w, y + h)))  # LOST / TokenCut
    return {n: np.asarray(b, np.float32).reshape(-1, 4) for n, b in boxes.items()}


def coco20k(data_dir: str | None, split: str) -> _ListSource:
    root = _find_root(data_dir, "coco20k", "coco_20k_filenames.txt", "coco", "COCO")
    annotations = os.path.join(root, "annotations", "instances_train2014.json")
    if not os.path.exists(annotations):
        raise FileNotFoundError(f"dataset 'coco20k': {annotations!r} is missing; see {DOCS}")
    files = [os.path.basename(f) for f in _ids(os.path.join(root, "coco_20k_filenames.txt"), "coco20k")]

    def read(file: str) -> dict[str, Any]:
        return {"image": _read_image(os.path.join(root, "train2014", file)),
                "boxes": _coco_boxes(annotations).get(file, np.zeros((0, 4), np.float32)), "label": 0}

    return _ListSource(files, read)


# ------------------------------------------------------------------------------- registry

READERS = {  # name -> (reader(data_dir, split), split names)
    "voc12_seg": (voc_seg, ("train", "val", "train_aug")),
    "voc07_boxes": (functools.partial(voc_boxes, "2007"), ("trainval", "train", "val", "test")),
    "voc12_boxes": (functools.partial(voc_boxes, "2012"), ("trainval", "train", "val")),
    "ade20k": (ade20k, ("train", "val")),
    "coco_stuff": (functools.partial(coco_stuff, 171), ("train", "val")),
    "coco_stuff27": (functools.partial(coco_stuff, 27), ("train", "val")),
    "coco_stuff15": (functools.partial(coco_stuff, 15), ("train", "val")),
    "coco20k": (coco20k, ("train",)),
}


def get_source(name: str, split: str, data_dir: str | None) -> record_sources.Source:
    reader, allowed = READERS[name]
    base, rows = record_sources.parse_split(split, name, list(allowed))
    source = reader(data_dir, base)
    return source if rows is None else record_sources.SliceSource(source, *rows(len(source)))
