"""ImageNet-ReaL, ImageNet-v2 and the minival (docs/method/evals.md §16), on tfds mock data and on a
constructed ReaL split whose predictions are known."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import evaluators, sharding
from skipless_jax.data import imagenet_real, inputs, record_sources, sources
from skipless_jax.evaluators import classification

from util import tiny_config


def _plain_real(logits, label_sets, mask):
    """big_vision / the paper: an image counts when it has a real label, and is correct when the
    argmax is one of them."""
    correct = counted = 0
    for row, labels, m in zip(logits, label_sets, mask):
        if m and len(labels):
            counted += 1
            correct += int(np.argmax(row) in set(labels))
    return correct, counted


def test_real_accuracy_counts_equals_the_plain_reading():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 12))
    sets = [list(rng.choice(12, size=rng.integers(0, 5), replace=False)) for _ in range(40)]
    sets[3] = [int(np.argmax(logits[3]))]  # a hit
    mask = (rng.random(40) > 0.2).astype(np.float32)
    padded = np.stack([imagenet_real.pad_labels(s, 12) for s in sets])
    got = classification.real_accuracy_counts(jnp.asarray(logits), jnp.asarray(padded), jnp.asarray(mask))
    assert tuple(int(v) for v in got) == _plain_real(logits, sets, mask)
    assert tuple(int(v) for v in classification.real_accuracy_counts(logits, padded)) == _plain_real(
        logits, sets, np.ones(40))
    with pytest.raises(ValueError, match="a ReaL label set of 13 labels exceeds the 12 classes"):
        imagenet_real.pad_labels(range(13), 12)


def _imagenet_config():
    config = tiny_config()
    config.dataset.name, config.dataset.eval_split = "imagenet2012", "validation"
    config.input.image_size, config.input.eval_batch_size = 8, 16
    return config


@pytest.fixture(scope="module")
def imagenet_model():
    from skipless_jax import models
    from skipless_jax.trainers import supervised

    config = _imagenet_config()
    mesh = sharding.make_mesh(config.mesh)
    ctx, _ = supervised.evaluation(config, mesh)
    params = jax.jit(models.build(config.model, 1000).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3)))["params"]
    return config, mesh, ctx, params


def _run(ctx, mesh, params, **entry):
    entry = ml_collections.ConfigDict(dict(type="classification", **entry))
    ev = classification.Classification.from_config("e", entry, ctx, prefix="e", every_steps=None, split=entry.split)
    with jax.set_mesh(mesh):
        return {m: v for _, m, v in evaluators.run_all([ev], ctx, params)}


@pytest.mark.slow
def test_real_and_v2_on_tfds_mock_data(imagenet_model, monkeypatch):
    import tensorflow_datasets as tfds

    config, mesh, ctx, params = imagenet_model
    with tfds.testing.mock_data(num_examples=21, policy=tfds.testing.MockPolicy.USE_CODE):
        monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
        raw = record_sources.tfds_source("imagenet2012_real", "validation", None)
        real = sources.get_source("imagenet2012_real", "validation")
        for i in range(len(raw)):
            padded, stored = real[i]["real_label"], raw[i]["real_label"]
            assert real[i]["label"] == raw[i]["original_label"] and padded.shape == (1000,)
            np.testing.assert_array_equal(padded[: len(stored)], stored)
            assert (padded[len(stored):] == -1).all()
        got = _run(ctx, mesh, params, dataset="imagenet2012_real", split="validation")
        # The plain reading on the pipeline's own batches (what the evaluator reads).
        view = ml_collections.ConfigDict(config.to_dict())
        view.dataset.name = "imagenet2012_real"
        batches, n = inputs.eval_iterator(view, 0, 1, "validation", on_device=True)
        logits, sets, mask, labels = [], [], [], []
        for b in batches:
            images = (b["image"] / 255.0 - np.array(sources.dataset_info("imagenet2012").mean)) / np.array(
                sources.dataset_info("imagenet2012").std)
            logits.append(np.asarray(jax.jit(ctx.logits)(params, jnp.asarray(images, jnp.float32))))
            sets += [[v for v in row if v >= 0] for row in b["real_label"]]
            mask.append(b["mask"])
            labels.append(b["label"].argmax(-1))
        logits, mask, labels = np.concatenate(logits), np.concatenate(mask), np.concatenate(labels)
        correct, counted = _plain_real(logits, sets, mask)
        assert n == 21 and counted > 0
        assert got["real_accuracy"] == pytest.approx(correct / counted, abs=1e-7)
        assert got["accuracy"] == pytest.approx(((logits.argmax(-1) == labels) * mask).sum() / 21, abs=1e-7)
        v2 = _run(ctx, mesh, params, dataset="imagenet_v2", split="test")
    assert sorted(v2) == ["accuracy", "loss"] and 0.0 <= v2["accuracy"] <= 1.0 and np.isfinite(v2["loss"])


class _Constant:
    """Images of one grey value each (the resize + crop keeps a constant image constant)."""

    def __init__(self, values, sets):
        self.values, self.sets = values, sets

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        return {"image": np.full((12, 10, 3), self.values[i], np.uint8), "original_label": 7,
                "real_label": np.asarray(self.sets[i], np.int64)}


def test_real_accuracy_of_known_predictions(imagenet_model, monkeypatch):
    """Logits = −|k − grey value|: image i predicts class values[i]; of 19 images, 5 have no real
    label, and 9 of the other 14 contain their prediction."""
    config, mesh, _, params = imagenet_model
    values = list(range(100, 119))
    sets = [[] if i % 4 == 0 else [v, 3] if i % 3 else [4, 5] for i, v in enumerate(values)]
    monkeypatch.setattr(record_sources, "tfds_source", lambda name, split, data_dir: _Constant(values, sets))
    info = sources.dataset_info("imagenet2012")
    grey = lambda images: (images[:, 0, 0, 0] * info.std[0] + info.mean[0]) * 255.0
    ctx = evaluators.Context(config, mesh, 1000,
                             logits=lambda p, images: -jnp.abs(jnp.arange(1000) - jnp.round(grey(images))[:, None]))
    got = _run(ctx, mesh, params, dataset="imagenet2012_real", split="validation")
    correct, counted = _plain_real(np.eye(1000)[values], sets, np.ones(19))
    assert (correct, counted) == (9, 14)
    assert got["real_accuracy"] == pytest.approx(9 / 14, abs=1e-7) and got["accuracy"] == 0.0  # original label 7


def test_dataset_with_other_classes_is_one_line(imagenet_model):
    _, _, ctx, _ = imagenet_model
    entry = ml_collections.ConfigDict(dict(type="classification", dataset="cifar10", split="test"))
    with pytest.raises(ValueError, match=r"^config\.evals\.e\.dataset='cifar10' has 10 classes, the model's head "
                                         r"1000 \(config\.dataset\.name='imagenet2012'\)$"):
        classification.Classification.from_config("e", entry, ctx, prefix="e", every_steps=None, split="test")
