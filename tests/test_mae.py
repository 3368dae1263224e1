"""MAE (docs/method/ssl.md §9) against an independent numpy reading of facebookresearch/mae `models_mae.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax import losses
from skipless_jax.models import mae, vit
from skipless_jax.models.common import patchify

# --------------------------------------------------------------------------------------------
# Independent numpy reference (torch ops written out: argsort, gather, einsum, unbiased .var).


def np_random_masking(x, mask_ratio, noise):
    n, length, d = x.shape
    len_keep = int(length * (1 - mask_ratio))
    ids_shuffle = np.argsort(noise, axis=1, kind="stable")
    ids_restore = np.argsort(ids_shuffle, axis=1, kind="stable")
    ids_keep = ids_shuffle[:, :len_keep]
    x_masked = np.take_along_axis(x, np.repeat(ids_keep[:, :, None], d, axis=2), axis=1)
    mask = np.ones((n, length))
    mask[:, :len_keep] = 0
    mask = np.take_along_axis(mask, ids_restore, axis=1)
    return x_masked, mask, ids_restore


def np_restore(x, mask_token, ids_restore):
    n, k, d = x.shape
    mask_tokens = np.broadcast_to(mask_token, (n, ids_restore.shape[1] - k, d))
    x_ = np.concatenate([x, mask_tokens], axis=1)
    return np.take_along_axis(x_, np.repeat(ids_restore[:, :, None], d, axis=2), axis=1)


def np_patchify(imgs_nchw, p):
    n, c, hh, ww = imgs_nchw.shape
    h, w = hh // p, ww // p
    x = imgs_nchw.reshape(n, c, h, p, w, p)
    x = np.einsum("nchpwq->nhwpqc", x)
    return x.reshape(n, h * w, p * p * c)


def np_loss(imgs_nchw, pred, mask, p, norm_pix_loss):
    target = np_patchify(imgs_nchw, p)
    if norm_pix_loss:
        mean = target.mean(axis=-1, keepdims=True)
        var = target.var(axis=-1, keepdims=True, ddof=1)  # torch .var: unbiased
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    loss = ((pred - target) ** 2).mean(axis=-1)
    return (loss * mask).sum() / mask.sum()


def _data(seed, b=3, hw=16, c=3, p=4):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(b, hw, hw, c)).astype(np.float32)
    length = (hw // p) ** 2
    pred = rng.normal(size=(b, length, p * p * c)).astype(np.float32)
    noise = rng.uniform(size=(b, length)).astype(np.float32)
    return images, pred, noise


# --------------------------------------------------------------------------------------------
# random_masking / restore_tokens


@pytest.mark.parametrize(
    "length, ratio, kept",
    [(16, 0.75, 4), (49, 0.75, 12), (196, 0.75, 49), (50, 0.75, 12), (10, 0.5, 5), (7, 0.3, 4), (16, 0.0, 16)],
)
@pytest.mark.slow
def test_kept_count(length, ratio, kept):
    tokens = jnp.zeros((2, length, 4))
    noise = jax.random.uniform(jax.random.PRNGKey(length), (2, length))
    x, mask, ids_restore = mae.random_masking(tokens, ratio, noise)
    assert mae.num_kept(length, ratio) == kept
    assert x.shape == (2, kept, 4)
    assert mask.shape == ids_restore.shape == (2, length)
    np.testing.assert_array_equal(np.asarray(mask).sum(axis=1), [length - kept] * 2)


@pytest.mark.parametrize("length, ratio", [(16, 0.75), (49, 0.75), (10, 0.5)])
def test_random_masking_matches_reference(length, ratio):
    rng = np.random.default_rng(length)
    tokens = rng.normal(size=(4, length, 5)).astype(np.float32)
    noise = rng.uniform(size=(4, length)).astype(np.float32)
    noise[0, :3] = noise[0, 3]  # ties: the stable order keeps the earlier index first
    x, mask, ids_restore = mae.random_masking(jnp.asarray(tokens), ratio, jnp.asarray(noise))
    rx, rmask, rids = np_random_masking(tokens, ratio, noise)
    np.testing.assert_array_equal(np.asarray(ids_restore), rids)
    np.testing.assert_array_equal(np.asarray(mask), rmask)
    np.testing.assert_array_equal(np.asarray(x), rx)
    # kept = the tokens of smallest noise, in ascending noise order; mask 0 exactly there
    k = rx.shape[1]
    for i in range(4):
        order = np.argsort(noise[i], kind="stable")[:k]
        np.testing.assert_array_equal(np.asarray(x[i]), tokens[i, order])
        np.testing.assert_array_equal(np.flatnonzero(rmask[i] == 0), np.sort(order))


def test_restore_tokens_puts_kept_back_and_mask_tokens_elsewhere():
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(3, 16, 6)).astype(np.float32)
    noise = rng.uniform(size=(3, 16)).astype(np.float32)
    mask_token = rng.normal(size=(6,)).astype(np.float32)
    x, mask, ids_restore = mae.random_masking(jnp.asarray(tokens), 0.75, jnp.asarray(noise))
    full = np.asarray(mae.restore_tokens(x, jnp.asarray(mask_token), ids_restore))
    assert full.shape == tokens.shape
    np.testing.assert_array_equal(full, np_restore(np.asarray(x), mask_token, np.asarray(ids_restore)))
    mask = np.asarray(mask).astype(bool)
    np.testing.assert_array_equal(full[~mask], tokens[~mask])  # each kept token at its original index
    np.testing.assert_array_equal(full[mask], np.broadcast_to(mask_token, (mask.sum(), 6)))


# --------------------------------------------------------------------------------------------
# patchify order and the loss


def test_patchify_order_is_maes():
    images, _, _ = _data(1)
    nchw = images.transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(np.asarray(patchify(jnp.asarray(images), 4)), np_patchify(nchw, 4))


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_loss_matches_reference(norm_pix_loss):
    images, pred, noise = _data(2)
    _, mask, _ = np_random_masking(np.zeros((3, 16, 1)), 0.75, noise)
    got = losses.reconstruction_loss(jnp.asarray(images), jnp.asarray(pred), jnp.asarray(mask), 4, norm_pix_loss)
    want = np_loss(images.transpose(0, 3, 1, 2).astype(np.float64), pred, mask, 4, norm_pix_loss)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_norm_pix_loss_uses_unbiased_variance():
    images, pred, noise = _data(3, p=2, hw=4, c=1)  # 4 values per patch: ddof matters (factor 4/3)
    _, mask, _ = np_random_masking(np.zeros((3, 4, 1)), 0.5, noise)
    got = float(losses.reconstruction_loss(jnp.asarray(images), jnp.asarray(pred), jnp.asarray(mask), 2, True))
    nchw = images.transpose(0, 3, 1, 2).astype(np.float64)
    np.testing.assert_allclose(got, np_loss(nchw, pred, mask, 2, True), rtol=1e-5)
    target = np_patchify(nchw, 2)
    biased = (target - target.mean(-1, keepdims=True)) / np.sqrt(target.var(-1, keepdims=True) + 1e-6)
    biased_loss = (((pred - biased) ** 2).mean(-1) * mask).sum() / mask.sum()
    assert abs(got - biased_loss) > 1e-3


def test_loss_only_on_masked_patches():
    images, pred, noise = _data(4)
    _, mask, _ = np_random_masking(np.zeros((3, 16, 1)), 0.75, noise)
    loss = lambda pr: float(
        losses.reconstruction_loss(jnp.asarray(images), jnp.asarray(pr), jnp.asarray(mask), 4, True))
    base = loss(pred)
    kept_i, masked_i = np.flatnonzero(mask[0] == 0)[0], np.flatnonzero(mask[0] == 1)[0]
    changed = pred.copy()
    changed[0, kept_i] += 10.0
    assert loss(changed) == base
    changed = pred.copy()
    changed[0, masked_i] += 10.0
    assert loss(changed) > base + 1.0


# --------------------------------------------------------------------------------------------
# Decoder and the full model

SMALL = dict(patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=4)
DECODER = dict(decoder_width=16, decoder_depth=2, decoder_num_heads=2)


@pytest.mark.slow
def test_decoder_output_shape():
    dec = mae.MAEDecoder(grid_hw=(4, 4), patch_dim=48, width=16, depth=1, num_heads=2)
    latent = jnp.ones((2, 1 + 4, 32))
    ids_restore = jnp.tile(jnp.arange(16)[None], (2, 1))
    out, _ = dec.init_with_output(jax.random.PRNGKey(0), latent, ids_restore)
    assert out.shape == (2, 16, 48)


@pytest.mark.slow
@pytest.mark.parametrize("token_graying", [None, "dct"])
def test_mae_forward_and_finite_gradient(token_graying):
    model = mae.MAE(**SMALL, **DECODER, token_graying=token_graying, norm_pix_loss=True)
    images = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16, 3))
    variables = jax.jit(model.init)({"params": jax.random.PRNGKey(1), "masking": jax.random.PRNGKey(2)}, images)

    def loss_fn(params):
        loss, pred, mask = model.apply({"params": params}, images, train=True, rngs={"masking": jax.random.PRNGKey(3)})
        return loss, (pred, mask)

    (loss, (pred, mask)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(variables["params"])
    assert pred.shape == (2, 16, 48) and mask.shape == (2, 16)
    np.testing.assert_array_equal(np.asarray(mask).sum(axis=1), [12, 12])
    assert np.isfinite(float(loss))
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in leaves)
    # the loss is reconstruction_loss of the returned prediction and mask
    np.testing.assert_allclose(float(loss), float(losses.reconstruction_loss(images, pred, mask, 4, True)), rtol=1e-6)


def _flat_shapes(tree):
    return {"/".join(str(k.key) for k in p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.slow
def test_encoder_parameters_are_the_vits_and_compute_the_same():
    images = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16, 3))
    model = mae.MAE(**SMALL, **DECODER, mask_ratio=0.0)
    params = model.init({"params": jax.random.PRNGKey(1), "masking": jax.random.PRNGKey(2)}, images)["params"]
    classifier = vit.ViT(num_classes=10, posemb="sincos2d", **SMALL)
    vit_params = classifier.init(jax.random.PRNGKey(0), images)["params"]
    encoder = {k: v for k, v in params.items() if k != "decoder"}
    assert _flat_shapes(encoder) == _flat_shapes({k: v for k, v in vit_params.items() if k != "head"})

    # With nothing masked and the identity order, the encoder is the classifier's backbone.
    noise = jnp.tile(jnp.arange(16.0)[None], (2, 1))
    (_, _, mask), state = model.apply({"params": params}, images, noise=noise, mutable=["intermediates"])
    latent, ids_restore = state["intermediates"]["latent"][0], state["intermediates"]["ids_restore"][0]
    assert float(mask.sum()) == 0.0
    np.testing.assert_array_equal(np.asarray(ids_restore), np.tile(np.arange(16), (2, 1)))
    _, out = classifier.apply({"params": {**encoder, "head": vit_params["head"]}}, images)
    np.testing.assert_allclose(np.asarray(latent), np.asarray(out["encoded"]), rtol=1e-5, atol=1e-5)
