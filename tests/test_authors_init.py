"""The skipless init as the authors' fork draws it (docs/method/authors_init.md): the per-head
W^Q_h W^K_hᵀ and the W^V W^O of `init.attention_kernels` against a float64 numpy restatement of
yipingji/mae `get_ortho_like` / `get_ortho` given the same draws; the MLP under `init_mlp`; the
one-line errors of the new fields."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import models
from skipless_jax.models import init as init_lib

D, HEADS, ALPHA, BETA, C = 16, 4, 2.0, 0.6, 1.5


def draws(key, dist):
    """The raw per-head draws (h, d, d) and the V/O Gaussian (d, d) that `attention_kernels` reads
    from `key` (its split into a Q/K key and a V/O key, head h from split(qk_key, h)[h])."""
    k_qk, k_vo = jax.random.split(key)
    keys = jax.random.split(k_qk, HEADS)
    sample = jax.random.normal if dist == "normal" else jax.random.uniform
    raw = np.stack([np.asarray(sample(k, (D, D), jnp.float32), np.float64) for k in keys])
    return raw, np.asarray(jax.random.normal(k_vo, (D, D), jnp.float32), np.float64)


def get_ortho_like(raw, dist):
    """The fork's get_ortho_like in float64 on a given draw: A = α·Z + βI (Z: N(0,1)/√d, or
    low + (high − low)·U with U ~ U[0, 1), high = −low = √3/√d); A = U S Vᵀ, L = U√S, R = √S Vᵀ."""
    if dist == "normal":
        z = raw / math.sqrt(D)
    else:
        low, high = -math.sqrt(3) / math.sqrt(D), math.sqrt(3) / math.sqrt(D)
        z = low + (high - low) * raw
    u, s, vh = np.linalg.svd(ALPHA * z + BETA * np.eye(D))
    return u * np.sqrt(s), np.sqrt(s)[:, None] * vh


def get_ortho(g, vo):
    """W^V W^O (× 1/c²) from the fork's get_ortho on G (vo='fork': W^V = U, W^O = Vh.T, pairs signed
    so that each column of U has its largest-magnitude entry positive) or the text's (U Vh)."""
    u, _, vh = np.linalg.svd(g)
    if vo == "polar":
        return u @ vh
    sign = np.sign(u[np.argmax(np.abs(u), axis=0), np.arange(D)])
    return (u * sign) @ (vh * sign[:, None]).T


@pytest.mark.parametrize("dist", init_lib.QK_DISTS)
@pytest.mark.parametrize("vo", init_lib.VO_FORMS)
def test_attention_kernels_equal_the_forks_restatement(dist, vo):
    key = jax.random.PRNGKey(3)
    w = init_lib.attention_kernels(key, "skipless", D, HEADS, ALPHA, BETA, C, qk_dist=dist, vo=vo)
    raw, g = draws(key, dist)
    dh = D // HEADS
    for h in range(HEADS):
        left, right = get_ortho_like(raw[h], dist)
        cols = slice(h * dh, (h + 1) * dh)
        q, k = left[:, :dh], right.T[:, :dh]  # the fork's Q = L[:, :d_h], K = Rᵀ[:, :d_h]
        got = np.asarray(w["query"][:, cols], np.float64) @ np.asarray(w["key"][:, cols], np.float64).T
        np.testing.assert_allclose(got, q @ k.T, atol=2e-5)
        # the spectra too: the rank-d_h truncation of A_h
        np.testing.assert_allclose(np.linalg.svd(got, compute_uv=False)[:dh],
                                   np.linalg.svd(q @ k.T, compute_uv=False)[:dh], rtol=1e-5)
    vo_product = np.asarray(w["value"], np.float64) @ np.asarray(w["out"], np.float64)
    np.testing.assert_allclose(vo_product, C**2 * get_ortho(g, vo), atol=2e-5)
    np.testing.assert_allclose(np.linalg.svd(vo_product, compute_uv=False), C**2, rtol=1e-5)


def test_uniform_draw_has_the_gaussians_variance():
    z = init_lib.mimetic_qk_targets(jax.random.PRNGKey(0), 256, 2, 1.0, 0.0, "uniform")
    bound = math.sqrt(3 / 256)
    assert float(jnp.abs(z).max()) <= bound
    assert abs(float(jnp.var(z)) * 256 - 1.0) < 0.02


def vit_config(**init):
    return ml_collections.ConfigDict(dict(name="vit", width=D, depth=1, mlp_dim=2 * D, num_heads=HEADS, patch_size=4,
                                          init="skipless", init_alpha=ALPHA, init_beta=BETA, init_c=C, **init))


def mlp_kernels(config):
    variables = models.build(config, 3).init(jax.random.PRNGKey(1), jnp.zeros((1, 8, 8, 1)))
    mlp = variables["params"]["block_0"]["MlpBlock_0"]
    return [(np.asarray(mlp[n]["kernel"]), np.asarray(mlp[n]["bias"])) for n in ("Dense_0", "Dense_1")]


def test_init_mlp_default_is_xavier_uniform_suo_is_orthogonal():
    for kernel, bias in mlp_kernels(vit_config(init_mlp="default")):
        bound = math.sqrt(6 / sum(kernel.shape))
        assert np.abs(kernel).max() <= bound and np.abs(kernel).max() > 0.8 * bound  # U(±bound), not SUO
        assert not np.allclose(np.linalg.svd(kernel, compute_uv=False), np.linalg.svd(kernel, compute_uv=False)[0])
        np.testing.assert_array_equal(bias, 0.0)
    (up, _), (down, _) = mlp_kernels(vit_config())  # 'suo', the default: singular values √2 and 1
    np.testing.assert_allclose(np.linalg.svd(up, compute_uv=False), math.sqrt(2), rtol=1e-5)
    np.testing.assert_allclose(np.linalg.svd(down, compute_uv=False), 1.0, rtol=1e-5)


def test_model_reads_the_fields():
    """A ViT built with the fork's fields draws its attention as `attention_kernels` does with them."""
    variables = models.build(vit_config(init_qk_dist="uniform", init_vo="fork"), 3).init(
        jax.random.PRNGKey(1), jnp.zeros((1, 8, 8, 1)))
    attention = variables["params"]["block_0"]["MultiHeadAttention_0"]
    vo = np.asarray(attention["value"]) @ np.asarray(attention["out"])
    np.testing.assert_allclose(np.linalg.svd(vo, compute_uv=False), C**2, rtol=1e-5)
    default = models.build(vit_config(), 3).init(jax.random.PRNGKey(1), jnp.zeros((1, 8, 8, 1)))
    assert not np.allclose(attention["query"], default["params"]["block_0"]["MultiHeadAttention_0"]["query"])


@pytest.mark.parametrize("field,value", [("init_qk_dist", "gauss"), ("init_vo", "uv"), ("init_mlp", "xavier")])
def test_bad_values_are_one_line(field, value):
    with pytest.raises(ValueError) as err:
        init_lib.validate_init_config(vit_config(**{field: value}))
    message = str(err.value)
    assert "\n" not in message and f"config.model.{field}={value!r}" in message and "allowed" in message


@pytest.mark.slow
@pytest.mark.parametrize("family", ["pvt_v2", "convmixer"])  # their own MLPs; CaiT's and Swin's are MlpBlock's
def test_the_families_with_their_own_mlp_take_the_forks_fields(family):
    """The same tree under the fork's fields; its MLP kernels (ConvMixer: pointwise) drawn otherwise."""
    from util import tiny_model

    def params(**fields):
        config = ml_collections.ConfigDict(dict(tiny_model(dict(name=family), 8), init="skipless", **fields))
        models.check_config(config, 8)
        variables = jax.jit(models.build(config, 3).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
        return jax.tree_util.tree_leaves_with_path(variables["params"])

    text, fork = params(), params(init_qk_dist="uniform", init_vo="fork", init_mlp="default")
    assert [p for p, _ in text] == [p for p, _ in fork]
    changed = {jax.tree_util.keystr(p) for (p, a), (_, b) in zip(text, fork) if not np.array_equal(a, b)}
    assert any(("mlp" in p.lower() or "pointwise" in p) and "kernel" in p for p in changed), sorted(changed)
