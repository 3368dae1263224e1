"""The pictures of dense features (docs/method/dense.md §8): the PCA colouring against scikit-learn's
PCA, and the `feature_pca` / `tokencut` evaluators writing their PNGs."""

import dataclasses

import ml_collections
import numpy as np
import pytest
from PIL import Image
from sklearn.decomposition import PCA
from test_dense_evaluators import backbone, context, scene_config

from skipless_jax import evaluators, pictures


def _minmax(x):
    return (x - x.min(0)) / (x.max(0) - x.min(0))


def test_pca_rgb_equals_sklearns_pca_up_to_sign():
    tokens = np.random.default_rng(0).normal(size=(3, 4, 5, 16)) * np.linspace(3, 0.1, 16)
    rgb, share = pictures.pca_rgb(tokens)
    ref = PCA(n_components=3).fit(tokens.reshape(-1, 16))
    want = _minmax(ref.transform(tokens.reshape(-1, 16)))
    got = rgb.reshape(-1, 3)
    for c in range(3):  # a flipped axis maps t -> 1 - t after the min-max scaling
        assert np.allclose(got[:, c], want[:, c], atol=1e-9) or np.allclose(got[:, c], 1 - want[:, c], atol=1e-9)
    assert share == pytest.approx(ref.explained_variance_ratio_.sum(), rel=1e-9)
    assert rgb.min() == 0.0 and rgb.max() == 1.0


def test_pca_sign_rule_and_constant_features():
    tokens = np.zeros((1, 2, 2, 4))
    tokens[0, 0, 0, 0], tokens[0, 1, 1, 0] = 1.0, -1.0
    rgb, share = pictures.pca_rgb(tokens)
    assert share == pytest.approx(1.0)
    assert rgb[0, 0, 0, 0] == 1.0 and rgb[0, 1, 1, 0] == 0.0  # the largest entry of axis 1 is positive
    flat, zero = pictures.pca_rgb(np.ones((1, 2, 2, 4)))
    assert zero == 0.0 and np.all(flat == 0.0)


@pytest.mark.slow
def test_evaluators_write_their_pictures(tmp_path):
    ctx, params, model = context("tok")
    config = scene_config("tok")
    config.evals = ml_collections.ConfigDict(dict(
        objects=dict(type="tokencut", split="test[:8]", picture_images=4),
        pca=dict(type="feature_pca", split="test", images=5),
    ))
    evaluators.check_config(config)
    ctx = dataclasses.replace(ctx, config=config, picture_dir=str(tmp_path))
    results = {(p, m): v for p, m, v in evaluators.run_all(evaluators.build(config, ctx), ctx, params, 7, 7)}
    # The explained share equals the PCA of the model's own patch tokens of the first 5 test scenes.
    _, _, host_params = backbone("tok")
    batch = next(ctx.batches("test", 8)[0])
    encoded = np.asarray(model.apply({"params": host_params}, np.asarray(batch["image"])[:5])[1]["encoded"])
    _, share = pictures.pca_rgb(encoded[:, 1:].reshape(5, 8, 8, -1))
    assert results["pca", "explained_variance"] == pytest.approx(share, rel=1e-5)
    for name in ("objects_step000007.png", "pca_step000007.png"):
        picture = Image.open(tmp_path / "pictures" / name)
        assert picture.size[0] > 100 and picture.size[1] > 50



@pytest.mark.parametrize("entry, match", [
    (dict(type="feature_pca", images=0), r"^config\.evals\.e\.images=0 must be an integer in \[1, 64\]"),
    (dict(type="tokencut", picture_images=-1), r"^config\.evals\.e\.picture_images=-1 must be"),
])
def test_bad_picture_fields_are_one_line(entry, match):
    config = scene_config("tok")
    config.evals = ml_collections.ConfigDict(dict(e=entry))
    with pytest.raises(ValueError, match=match):
        evaluators.check_config(config)
