"""Few-shot linear evaluation (docs/method/evals.md §17) against plain readings of big_vision's fewshot_lsr."""

import jax
import ml_collections
import numpy as np
import pytest
from sklearn.linear_model import Ridge

from skipless_jax import evaluators, sharding
from skipless_jax.data import sources
from skipless_jax.evaluators import fewshot

from util import tiny_config


def _plain_indices(labels, num_classes, shots, seed):
    """big_vision: rng = default_rng(seed); class_indices = [rng.permutation(where(y == c)) for c];
    the selection concatenates indices[:shots] of each class."""
    rng = np.random.default_rng(seed)
    class_indices = [rng.permutation(np.where(labels == c)[0]) for c in range(num_classes)]
    return np.concatenate([idx[:shots] for idx in class_indices])


def _plain_ridge_accuracy(train_x, train_y, test_x, test_y, num_classes, l2):
    """The ridge solution of the whitened, bias-padded features by sklearn (no eigh)."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-5
    pad = lambda f: np.concatenate([(f - mean) / std, np.full((len(f), 1), 100.0)], 1)
    targets = 2.0 * (train_y[:, None] == np.arange(num_classes)) - 1.0
    ridge = Ridge(alpha=l2, fit_intercept=False, solver="cholesky").fit(pad(train_x), targets)
    return float(np.mean(ridge.predict(pad(test_x)).argmax(1) == test_y))


def test_indices_equal_the_plain_reading():
    labels = np.random.default_rng(3).integers(0, 7, size=200)
    labels[labels == 6] = 5  # a class with no example: it contributes nothing
    for seed in (0, 1, 2):
        for shots in (1, 5, 25, 100):
            got = fewshot.fewshot_indices(labels, 7, shots, seed)
            np.testing.assert_array_equal(got, _plain_indices(labels, 7, shots, seed))
            counts = np.bincount(labels[got], minlength=7)
            np.testing.assert_array_equal(counts, np.minimum(shots, np.bincount(labels, minlength=7)))
    one, five = fewshot.fewshot_indices(labels, 7, 1, 0), fewshot.fewshot_indices(labels, 7, 5, 0)
    assert set(one) <= set(five)  # one seed's permutations serve every shot count
    assert not np.array_equal(five, fewshot.fewshot_indices(labels, 7, 5, 1))


@pytest.mark.parametrize("n, d", [(60, 8), (12, 40)])  # XᵀX (n ≥ d+1) and XXᵀ (n < d+1)
def test_ridge_accuracy_equals_the_direct_solve(n, d):
    rng = np.random.default_rng(n)
    centers = rng.normal(size=(4, d)) * 0.8
    train_y, test_y = rng.integers(0, 4, n), rng.integers(0, 4, 300)
    train_x = (centers[train_y] + rng.normal(size=(n, d))).astype(np.float32)
    test_x = (centers[test_y] + rng.normal(size=(300, d))).astype(np.float32)
    for l2 in (2.0**10, 1.0, 1e-3):
        got = fewshot.ridge_accuracy(train_x, train_y, test_x, test_y, 4, l2)
        assert got == _plain_ridge_accuracy(train_x.astype(np.float64), train_y, test_x.astype(np.float64),
                                            test_y, 4, l2)
    assert fewshot.ridge_accuracy(train_x, train_y, test_x, test_y, 4, 1.0) > 0.4  # above chance 0.25


def _pixel_context(mesh):
    """A context whose features are the normalized pixels: the evaluator's numbers are then a
    plain numpy computation on the digits arrays."""
    config = tiny_config()
    return evaluators.Context(config, mesh, 10, features=lambda p, images: images.reshape(images.shape[0], -1))


def _pixels(split):
    source = sources.get_source("digits", split)
    x = np.stack([source[i]["image"] for i in range(len(source))]).reshape(len(source), -1)
    return (x / 255.0 - 0.5) / 0.5, np.array([source[i]["label"] for i in range(len(source))])


def test_evaluator_on_digits_equals_the_numpy_computation():
    mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(data=-1, fsdp=1)))
    ctx = _pixel_context(mesh)
    entry = ml_collections.ConfigDict(dict(type="fewshot", shots=(1, 5, 25), seeds=2))
    ev = fewshot.FewShot.from_config("few", entry, ctx, prefix="few", every_steps=None, split="test")
    with jax.set_mesh(mesh):
        got = {m: v for _, m, v in evaluators.run_all([ev], ctx, params={})}
    (train_x, train_y), (test_x, test_y) = _pixels("train"), _pixels("test")
    for shots in (1, 5, 25):
        want = np.mean([_plain_ridge_accuracy(train_x[i], train_y[i], test_x, test_y, 10, 2.0**10)
                        for i in (_plain_indices(train_y, 10, shots, s) for s in (0, 1))])
        np.testing.assert_allclose(got[f"digits_{shots}shot"], want, atol=1e-12)
    assert got["digits_25shot"] > 0.8 > got["digits_1shot"] > 0.3  # pixels: chance is 0.1


def test_bad_fields_are_one_line_errors():
    check = lambda **f: fewshot.FewShot.check("few", ml_collections.ConfigDict(dict(type="fewshot", **f)))
    with pytest.raises(ValueError, match=r"^config\.evals\.few\.shots=\(0, 5\) must be a non-empty tuple"):
        check(shots=(0, 5))
    with pytest.raises(ValueError, match=r"^config\.evals\.few\.datasets: 'voc07_boxes' is not a classification"):
        check(datasets=("voc07_boxes",))
    with pytest.raises(ValueError, match=r"^config\.evals\.few\.datasets='digits' must be a non-empty tuple"):
        check(datasets="digits")
    with pytest.raises(ValueError, match=r"^config\.evals\.few\.seeds=0 must be a positive integer"):
        check(seeds=0)
    with pytest.raises(ValueError, match=r"^config\.evals\.few\.l2_reg=-1\.0 must be a finite number > 0"):
        check(l2_reg=-1.0)
    config = tiny_config()
    config.evals = ml_collections.ConfigDict(dict(few=dict(type="fewshot", datasets=("cifar10",))))
    mesh = sharding.make_mesh(config.mesh)
    with pytest.raises(ValueError, match=r"^config\.evals\.few: dataset 'cifar10' has 3-channel images, the model "
                                         r"reads 1-channel ones"):
        evaluators.build(config, _pixel_context(mesh))


def test_per_dataset_splits_and_big_visions_imagenet_default():
    assert fewshot.default_splits("imagenet2012") == ("train[:65000]", "validation")  # big_vision's
    assert fewshot.default_splits("cifar100") == ("train", "test")
    entry = ml_collections.ConfigDict(dict(type="fewshot", datasets=dict(imagenet2012=dict(), cifar100=dict(
        test_split="test[:1000]"))))
    assert fewshot.dataset_splits(entry) == {"imagenet2012": ("train[:65000]", "validation"),
                                             "cifar100": ("train", "test[:1000]")}
    config = tiny_config()
    config.evals = ml_collections.ConfigDict(dict(few=dict(type="fewshot", datasets=dict(
        digits=dict(train_split="train[:700]")))))
    assert ("digits", "train[:700]", None) in evaluators.data_needed(config)
    # The evaluator reads the named splits: the first 700 train digits, the whole test split.
    mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(data=-1, fsdp=1)))
    ctx = _pixel_context(mesh)
    ev = fewshot.FewShot.from_config("few", ml_collections.ConfigDict(dict(type="fewshot", shots=(5,), seeds=2,
                                     datasets=dict(digits=dict(train_split="train[:700]")))),
                                     ctx, prefix="few", every_steps=None, split="test")
    with jax.set_mesh(mesh):
        got = {m: v for _, m, v in evaluators.run_all([ev], ctx, params={})}
    (train_x, train_y), (test_x, test_y) = _pixels("train"), _pixels("test")
    train_x, train_y = train_x[:700], train_y[:700]
    want = np.mean([_plain_ridge_accuracy(train_x[i], train_y[i], test_x, test_y, 10, 2.0**10)
                    for i in (_plain_indices(train_y, 10, 5, s) for s in (0, 1))])
    np.testing.assert_allclose(got["digits_5shot"], want, atol=1e-12)


def test_bad_splits_and_channels_are_one_line_errors():
    check = lambda **f: fewshot.FewShot.check("few", ml_collections.ConfigDict(dict(type="fewshot", **f)))
    with pytest.raises(ValueError, match=r"^config\.evals\.few\.datasets\.digits\.test_split='val' is not a split "
                                         r"of 'digits'; allowed: \['test', 'train'\], optionally sliced"):
        check(datasets=dict(digits=dict(test_split="val")))
    with pytest.raises(ValueError, match=r"^config\.evals\.few\.datasets\.digits has the fields \['split'\]; "
                                         r"allowed: a dict with the fields train_split, test_split \(each optional\)$"):
        check(datasets=dict(digits=dict(split="test")))
    # Before anything compiles (the trainer's check_config), naming the dataset.
    from skipless_jax.trainers import supervised

    config = tiny_config()
    config.evals = ml_collections.ConfigDict(dict(few=dict(type="fewshot", datasets=dict(
        digits=dict(), cifar100=dict(train_split="train[:5000]")))))
    with pytest.raises(ValueError, match=r"^config\.evals\.few\.datasets: 'cifar100' has 3-channel images, the model "
                                         r"reads 1-channel ones \(config\.dataset\.name='digits'\)$"):
        supervised.check_config(config)
