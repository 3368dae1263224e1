"""kNN and linear-probe evaluators against independent float64 numpy / scipy references."""

import jax
import numpy as np
import pytest
import scipy.optimize
import scipy.special
from jax.sharding import AxisType

from skipless_jax.evaluators import knn, linear_probe


def clustered(rng, n, d, num_classes, spread):
    """Gaussian blobs around random class means: (features, labels)."""
    means = rng.normal(size=(num_classes, d))
    labels = rng.integers(0, num_classes, size=n)
    return means[labels] + spread * rng.normal(size=(n, d)), labels


def ref_knn_votes(train_x, train_y, test_x, num_classes, k, t):
    """DINO's knn_classifier, one test example at a time, in float64."""
    tr = train_x / np.linalg.norm(train_x, axis=1, keepdims=True)
    te = test_x / np.linalg.norm(test_x, axis=1, keepdims=True)
    votes = np.zeros((len(te), num_classes))
    for i, q in enumerate(te):
        sims = tr @ q
        top = np.argsort(-sims, kind="stable")[:k]
        for j in top:
            votes[i, train_y[j]] += np.exp(sims[j] / t)
    return votes


@pytest.mark.parametrize("k, t, chunk", [(1, 0.07, 256), (5, 0.07, 7), (20, 0.5, 64)])
def test_knn_votes_match_reference(k, t, chunk):
    rng = np.random.default_rng(k)
    train_x, train_y = clustered(rng, 300, 12, 5, 1.5)
    test_x, _ = clustered(rng, 50, 12, 5, 1.5)
    votes = knn.knn_votes(train_x, train_y, test_x, 5, k, t, chunk=chunk)
    expected = ref_knn_votes(train_x, train_y, test_x, 5, k, t)
    assert votes.shape == (50, 5)
    np.testing.assert_allclose(votes, expected, rtol=2e-4)
    np.testing.assert_array_equal(votes.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_knn_accuracy_separates_informative_from_random_features():
    rng = np.random.default_rng(0)
    train_x, train_y = clustered(rng, 400, 16, 4, 0.5)
    test_x, test_y = clustered(np.random.default_rng(0), 400, 16, 4, 0.5)  # same class means
    assert knn.knn_accuracy(train_x, train_y, test_x, test_y, 4) > 0.95
    noise = rng.normal(size=test_x.shape)
    assert knn.knn_accuracy(rng.normal(size=train_x.shape), train_y, noise, test_y, 4) < 0.45


@pytest.mark.parametrize(
    "k, t, match",
    [(0, 0.07, r"config\.evals\.knn\.k=0 must be a positive integer"), (2.5, 0.07, r"knn\.k=2\.5"),
     (5, 0.0, r"knn\.temperature=0\.0 must be"), (500, 0.07, r"knn\.k=500 exceeds the 300 train examples")],
)
def test_knn_bad_input_is_one_line(k, t, match):
    with pytest.raises(ValueError, match=match):
        knn.knn_votes(np.ones((300, 4)), np.zeros(300, int), np.ones((2, 4)), 2, k, t)


@pytest.mark.slow
@pytest.mark.parametrize("devices, n", [(1, 240), (8, 243)])  # 8: rows split over the mesh, 5 padding rows
def test_linear_probe_reaches_the_scipy_optimum(devices, n):
    rng = np.random.default_rng(3)
    num_classes, l2 = 4, 1e-2
    train_x, train_y = clustered(rng, n, 10, num_classes, 2.0)
    test_x, _ = clustered(np.random.default_rng(3), 100, 10, num_classes, 2.0)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices], axis_types=(AxisType.Auto,))
    probe = linear_probe.fit(train_x, train_y, num_classes, l2=l2, max_steps=500, mesh=mesh)
    xs = (train_x - probe["mean"]) / probe["std"]
    d = xs.shape[1]

    def objective(theta):
        w, b = theta[: d * num_classes].reshape(d, num_classes), theta[d * num_classes :]
        logits = xs @ w + b
        ce = scipy.special.logsumexp(logits, axis=1) - logits[np.arange(len(train_y)), train_y]
        return ce.mean() + 0.5 * l2 * np.sum(w * w)

    ref = scipy.optimize.minimize(objective, np.zeros(d * num_classes + num_classes), method="L-BFGS-B",
                                  options=dict(maxiter=5000, gtol=1e-10, ftol=1e-14))
    ours = objective(np.concatenate([probe["w"].ravel(), probe["b"]]).astype(np.float64))
    np.testing.assert_allclose(ours, ref.fun, rtol=1e-5)
    w_ref = ref.x[: d * num_classes].reshape(d, num_classes)
    np.testing.assert_allclose(probe["w"], w_ref, atol=2e-3)  # unique: the objective is strictly convex in W
    ref_logits = ((test_x - probe["mean"]) / probe["std"]) @ w_ref + ref.x[d * num_classes :]
    np.testing.assert_array_equal(linear_probe.predict_logits(probe, test_x).argmax(-1), ref_logits.argmax(-1))


@pytest.mark.slow
def test_linear_probe_accuracy_and_bad_input():
    rng = np.random.default_rng(5)
    train_x, train_y = clustered(rng, 300, 8, 3, 0.3)
    test_x, test_y = clustered(np.random.default_rng(5), 300, 8, 3, 0.3)
    assert linear_probe.linear_probe_accuracy(train_x, train_y, test_x, test_y, 3, l2=1e-3) > 0.95
    with pytest.raises(ValueError, match=r"config\.evals\.linear\.l2=-1\.0 must be a finite number >= 0"):
        linear_probe.fit(train_x, train_y, 3, l2=-1.0)
    with pytest.raises(ValueError, match=r"config\.evals\.linear\.steps=0 must be a positive integer"):
        linear_probe.fit(train_x, train_y, 3, max_steps=0)


@pytest.mark.parametrize("k, n", [(1, 300), (5, 301), (20, 37)])
def test_knn_votes_with_the_bank_split_over_8_devices_match_reference(k, n):
    rng = np.random.default_rng(k)
    train_x, train_y = clustered(rng, n, 12, 5, 1.5)
    test_x, _ = clustered(rng, 50, 12, 5, 1.5)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))  # as sharding.make_mesh builds it
    votes = knn.knn_votes(train_x, train_y, test_x, 5, k, 0.07, chunk=16, mesh=mesh)
    expected = ref_knn_votes(train_x, train_y, test_x, 5, k, 0.07)
    np.testing.assert_allclose(votes, expected, rtol=2e-4)
    np.testing.assert_array_equal(votes.argmax(-1), expected.argmax(-1))


def _rows_on_devices(x, y, pad):
    """Global arrays with rows split over 8 devices, `pad` padding rows labelled −1 (as
    Context.extract_rows makes them)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = np.concatenate([x, np.full((pad, x.shape[1]), 7.0)]).astype(np.float32)
    y = np.concatenate([y, np.full(pad, -1)]).astype(np.int32)
    return jax.device_put(x, rows), jax.device_put(y, rows)


def test_knn_votes_from_a_bank_on_the_devices_match_reference():
    rng = np.random.default_rng(4)
    train_x, train_y = clustered(rng, 301, 12, 5, 1.5)
    test_x, _ = clustered(rng, 50, 12, 5, 1.5)
    bank, labels = _rows_on_devices(train_x, train_y, pad=3)
    votes = knn.knn_votes(bank, labels, test_x, 5, 20, 0.07, chunk=16)
    np.testing.assert_allclose(votes, ref_knn_votes(train_x, train_y, test_x, 5, 20, 0.07), rtol=2e-4)


@pytest.mark.slow
def test_linear_probe_fitted_from_rows_on_the_devices_equals_the_host_fit():
    rng = np.random.default_rng(3)
    train_x, train_y = clustered(rng, 243, 10, 4, 2.0)
    test_x, _ = clustered(np.random.default_rng(3), 100, 10, 4, 2.0)
    host = linear_probe.fit(train_x, train_y, 4, l2=1e-2)
    x, y = _rows_on_devices(train_x, train_y, pad=5)
    device = linear_probe.fit(x, y, 4, l2=1e-2)
    np.testing.assert_allclose(device["mean"], host["mean"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(device["std"], host["std"], rtol=1e-5)
    np.testing.assert_allclose(device["w"], host["w"], atol=2e-3)
    np.testing.assert_array_equal(linear_probe.predict_logits(device, test_x).argmax(-1),
                                  linear_probe.predict_logits(host, test_x).argmax(-1))


@pytest.mark.slow
def test_knn_and_probe_evaluators_on_digits_equal_the_host_computation():
    """The evaluators (bank / fit rows kept on the devices) against knn_accuracy and
    linear_probe_accuracy on host-extracted features, through a Context on the quickstart data."""
    import ml_collections

    from skipless_jax import sharding
    from skipless_jax.evaluators import common

    from util import load_config

    config = load_config("quickstart")
    proj = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    ctx = common.Context(config, sharding.make_mesh(config.mesh), num_classes=10,
                         features=lambda p, images: images.reshape(images.shape[0], -1) @ p)
    entry = ml_collections.ConfigDict(dict(type="knn", split="test", train_split="train[:1000]", k=20))
    knn_eval = knn.KNN.from_config("knn", entry, ctx, prefix="knn", every_steps=None, split="test")
    probe = linear_probe.LinearProbe.from_config(
        "lin", ml_collections.ConfigDict(dict(type="linear_probe", train_split="train[:1000]", steps=100)), ctx,
        prefix="lin", every_steps=None, split="test")
    got = dict(knn_eval.run(proj)) | dict(probe.run(proj))
    train_x, train_y = ctx.extract(proj, "train[:1000]")
    test_x, test_y = ctx.extract(proj, "test")
    assert len(train_y) == 1000 and ctx.extract_rows(proj, "train[:1000]")[0].shape[0] == 1024
    assert got["knn_accuracy"] == knn.knn_accuracy(train_x, train_y, test_x, test_y, 10, 20)
    assert got["knn_accuracy"] > 0.8
    host = linear_probe.linear_probe_accuracy(train_x, train_y, test_x, test_y, 10, max_steps=100)
    assert abs(got["linear_accuracy"] - host) <= 2 / 360  # float32 vs float64 statistics
