"""The MNIST-format reader (data/idx.py) and the `fashion_mnist` source: tiny IDX folders written
here for every malformed-file case (each one line naming the file and how to install it), the
real Debian files' counts and pixel sums where installed, the validation split, the missing-data
error before anything compiles, and one train step of the study's ConvMixer control."""

from __future__ import annotations

import gzip
import math
import os
import pickle

import ml_collections
import numpy as np
import pytest
from idx_folders import idx_bytes, write_folder, write_gz

from skipless_jax import trainers
from skipless_jax.data import idx, inputs, sources

from util import load_config, one_device, tiny_model

REAL = idx.FASHION_MNIST.default_dir
HAS_REAL = all(os.path.exists(os.path.join(REAL, f)) for pair in idx.FILES.values() for f in pair)
INSTALL = "apt-get install -y dataset-fashion-mnist"


def test_a_folder_reads_as_written_sliced_and_pickles_without_its_arrays(tmp_path):
    written = write_folder(str(tmp_path), train=12, test=6)
    for split in ("train", "test"):
        source = sources.get_source("fashion_mnist", split, str(tmp_path))
        images, labels = written[split]
        assert len(source) == len(labels)
        np.testing.assert_array_equal(np.stack([source[i]["image"] for i in range(len(source))]), images[..., None])
        assert [source[i]["label"] for i in range(len(source))] == labels.tolist()
    held_out = sources.get_source("fashion_mnist", "train[8:]", str(tmp_path))
    assert len(held_out) == 4 and held_out[0]["label"] == 8
    source = sources.get_source("fashion_mnist", "train", str(tmp_path))
    blob = pickle.dumps(source)  # what a worker process receives: the folder and split, not the images
    assert len(blob) < 1000
    np.testing.assert_array_equal(pickle.loads(blob)[5]["image"], source[5]["image"])


def _break(root: str, case: str) -> str:
    """Damages a written folder as `case` says; returns the file the error must name."""
    images_file, labels_file = (os.path.join(root, f) for f in idx.FILES["train"])
    images = np.zeros((12, 28, 28), np.uint8)
    if case == "magic number":
        write_gz(images_file, idx_bytes(idx.LABELS_MAGIC, (12, 28, 28), images))
        return images_file
    if case == "truncated gzip":
        with open(images_file, "rb") as f:
            data = f.read()
        with open(images_file, "wb") as f:
            f.write(data[: len(data) // 2])
        return images_file
    if case == "count mismatch":
        write_gz(labels_file, idx_bytes(idx.LABELS_MAGIC, (11,), np.zeros(11)))
        return labels_file
    if case == "header against bytes":
        write_gz(images_file, idx_bytes(idx.IMAGES_MAGIC, (12, 28, 28), images[:11]))
        return images_file
    if case == "image size":
        write_gz(images_file, idx_bytes(idx.IMAGES_MAGIC, (12, 27, 27), images[:, :27, :27]))
        return images_file
    if case == "not gzip":
        with open(labels_file, "wb") as f:
            f.write(idx_bytes(idx.LABELS_MAGIC, (12,), np.zeros(12)))
        return labels_file
    assert case == "missing file"
    os.remove(labels_file)
    return labels_file


@pytest.mark.parametrize("case,words", [
    ("magic number", "magic number 2049, expected 2051"),
    ("truncated gzip", "damaged gzip"),
    ("count mismatch", "11 labels for the 12 images"),
    ("header against bytes", "announces 9408 bytes of 12 images, the file holds 8624"),
    ("image size", "images of 27×27, expected 28×28"),
    ("not gzip", "damaged gzip"),
    ("missing file", "no such file"),
])
def test_a_malformed_or_missing_file_is_one_line_naming_it_and_the_install(tmp_path, case, words):
    write_folder(str(tmp_path))
    path = _break(str(tmp_path), case)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        sources.get_source("fashion_mnist", "train", str(tmp_path))
    message = str(err.value)
    assert "\n" not in message and message.startswith(path) and words in message and INSTALL in message
    sources.get_source("fashion_mnist", "test", str(tmp_path))  # the other split's files are intact


def test_a_tfds_data_dir_without_the_idx_files_is_read_through_tfds(tmp_path, monkeypatch):
    """The other route: a data_dir with tfds's `fashion_mnist` folder and none of the IDX files."""
    from skipless_jax.data import record_sources

    calls = []
    monkeypatch.setattr(record_sources, "tfds_source", lambda *args: calls.append(args) or "tfds")
    (tmp_path / "fashion_mnist").mkdir()
    assert sources.get_source("fashion_mnist", "train[:55000]", str(tmp_path)) == "tfds"
    assert calls == [("fashion_mnist", "train[:55000]", str(tmp_path))]
    write_folder(str(tmp_path))  # the IDX files win where both are there
    assert len(sources.get_source("fashion_mnist", "train", str(tmp_path))) == 12 and len(calls) == 1


def test_missing_data_fails_in_check_config_before_anything_compiles(tmp_path):
    config = load_config("fashion_vit", "val=True")
    config.dataset.data_dir = str(tmp_path / "absent")
    missing = f"train-images-idx3-ubyte.gz: no such file; install it with `{INSTALL}`"
    with pytest.raises(FileNotFoundError, match=missing):
        trainers.get("supervised").check_config(config, num_devices=1)


def test_the_validation_split_is_the_train_splits_last_5000():
    config = load_config("fashion_vit", "val=True")
    assert (config.dataset.train_split, config.evals.val.split, config.evals.test.get("split")) == (
        "train[:55000]", "train[55000:]", None)
    plain = load_config("fashion_vit")
    assert plain.dataset.train_split == "train" and not plain.get("evals")
    if not HAS_REAL:
        pytest.skip(f"the Debian files are not in {REAL} ({INSTALL})")
    assert inputs.num_train_examples(config) == 55_000
    val = sources.get_source("fashion_mnist", config.evals.val.split, config.dataset.data_dir)
    whole = sources.get_source("fashion_mnist", "train", config.dataset.data_dir)
    assert len(val) == 5000 and val.start == 55_000
    np.testing.assert_array_equal(val[0]["image"], whole[55_000]["image"])


def _numpy_read(path: str, offset: int) -> np.ndarray:
    with gzip.open(path) as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


@pytest.mark.slow  # 1.5-3.3 s: two reads of 70,000 images
@pytest.mark.skipif(not HAS_REAL, reason=f"the Debian files are not in {REAL} ({INSTALL}; .ci/run installs them)")
def test_the_real_files_counts_classes_and_pixel_sums():
    for split, count in (("train", 60_000), ("test", 10_000)):
        images, labels = idx.read_split(REAL, split)
        assert images.shape == (count, 28, 28, 1) and images.dtype == np.uint8 and labels.shape == (count,)
        assert np.bincount(labels, minlength=10).tolist() == [count // 10] * 10
        images_file, labels_file = (os.path.join(REAL, f) for f in idx.FILES[split])
        plain = _numpy_read(images_file, 16)
        assert int(images.sum(dtype=np.int64)) == int(plain.sum(dtype=np.int64))
        np.testing.assert_array_equal(labels, _numpy_read(labels_file, 8))
        assert len(sources.get_source("fashion_mnist", split)) == count  # the catalog's default folder
    counts = np.bincount(idx.read_split(REAL, "train")[0].ravel(), minlength=256)  # exact moments, no float copy
    levels = np.arange(256) / 255.0
    mean = counts @ levels / counts.sum()
    std = math.sqrt(counts @ (levels - mean) ** 2 / counts.sum())
    info = sources.dataset_info("fashion_mnist")
    assert (round(mean, 4), round(std, 4)) == (info.mean[0], info.std[0])  # docs/data.md


@pytest.mark.slow
def test_convmixer_control_with_pad_crop_flip_trains_one_step(tmp_path):
    """The Table 1 control (`model=convmixer`, its skip off) with the augmentation options on, one
    step on a tiny folder: finite metrics, test loss near ln 10 (chance)."""
    config = load_config("fashion_vit", "model=convmixer,skip_sab=False,aug=pad_crop_flip")
    config.dataset.data_dir = str(tmp_path / "fashion")
    write_folder(config.dataset.data_dir, train=16, test=8)
    config.model = ml_collections.ConfigDict(tiny_model(config.model.to_dict(), 28))
    config.input.update(dict(batch_size=8, eval_batch_size=8))
    config.total_steps, config.schedule.warmup_steps = 1, 0
    config.checkpoint_every_steps, config.profile_steps = 0, 0
    batch = next(inputs.train_iterator(config, 0, 0, 1))
    assert batch["image"].shape == (8, 28, 28, 1) and np.all(np.isfinite(batch["image"]))
    metrics = trainers.get("supervised").train_and_evaluate(config, str(tmp_path / "workdir"), devices=one_device())
    assert metrics["step"] == 1 and all(np.isfinite(v) for v in metrics.values())
    assert abs(metrics["test_loss"] - math.log(10)) < 0.5 * math.log(10)
