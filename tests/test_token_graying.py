"""Token Graying (docs/method/papers.md §4) against float64 numpy/scipy references, on real photo patches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.fft
from sklearn.datasets import load_sample_images

from skipless_jax import token_graying as tg
from skipless_jax.models import vit

F32_EPS = float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------------------------------------
# Data: scikit-learn's two bundled photos (china.jpg, flower.jpg), values in [-1, 1].


@functools.cache
def _photos() -> tuple[np.ndarray, ...]:
    return tuple(im.astype(np.float64) / 127.5 - 1.0 for im in load_sample_images().images)


def _patchify(image: np.ndarray, p: int) -> np.ndarray:
    return np.asarray(vit.patchify(jnp.asarray(image[None], jnp.float32), p)[0], np.float64)


def _downsample(image: np.ndarray, f: int) -> np.ndarray:
    h, w, c = image.shape
    return image[: h // f * f, : w // f * f].reshape(h // f, f, w // f, f, c).mean((1, 3))


@functools.cache
def photo_patches(p: int) -> np.ndarray:
    """(6, n, p²·3) patch matrices: p=16 → 224² crops (196×768), p=4 → CIFAR-scale 32² crops."""
    if p == 16:
        images, size = _photos(), 224
    else:  # 4× area-downsampled photos, so a 32² crop holds a scene like a CIFAR image
        images, size = tuple(_downsample(im, 4) for im in _photos()), 32
    corners = [(0, 0), (0.5, 0.5), (1, 1)]
    crops = []
    for im in images:
        for fy, fx in corners:
            y, x = int(fy * (im.shape[0] - size)), int(fx * (im.shape[1] - size))
            crops.append(_patchify(im[y : y + size, x : x + size], p))
    return np.stack(crops)


@functools.cache
def rank_deficient_patches() -> tuple[np.ndarray, ...]:
    """Real patches with exact rank loss: black borders and a flat band (repeated rows)."""
    china, flower = _photos()
    a = china[100:324, 200:424].copy()
    a[:, :56] = -1.0  # black left border: 56 identical zero-signal patches
    a[:56] = 0.2  # flat gray top band
    b = flower[:32, :32].copy()
    b[:, :8] = -1.0
    c = np.full((32, 32, 3), 0.3)  # flat image: rank 1
    return (_patchify(a, 16), _patchify(b, 4), _patchify(c, 4), np.zeros((16, 12)))


def spectrum_matrix(rng: np.random.Generator, n: int, m: int, log_kappa: float) -> np.ndarray:
    """A random n×m matrix with log-spaced singular values from 1 down to e^-log_kappa."""
    k = min(n, m)
    u, _ = np.linalg.qr(rng.normal(size=(n, k)))
    v, _ = np.linalg.qr(rng.normal(size=(m, k)))
    return (u * np.exp(-np.linspace(0, log_kappa, k))) @ v.T


# ---------------------------------------------------------------------------------------------
# Independent float64 references of docs/method/papers.md §4 (with this project's noise floor r₀).


def _ratio_map(r: np.ndarray, eps: float, r0: float) -> np.ndarray:
    return np.where(r >= r0, np.maximum(r, r0) ** eps, r0**eps * (r / r0) ** 3)


def svd_tg_reference(x: np.ndarray, eps: float) -> np.ndarray:
    u, s, vt = np.linalg.svd(x.astype(np.float64), full_matrices=False)
    r0 = max(x.shape[-2:]) * F32_EPS
    smax = s[..., :1]
    r = s / np.where(smax > 0, smax, 1)
    return (u * (smax * _ratio_map(r, eps, r0))[..., None, :]) @ vt


def dct_tg_reference(x: np.ndarray, eps: float) -> np.ndarray:
    c = scipy.fft.dctn(x.astype(np.float64), axes=(-2, -1), norm="ortho")
    cmax = np.abs(c).max(axis=(-2, -1), keepdims=True)
    c = np.sign(c) * cmax * (np.abs(c) / cmax) ** eps  # exactly docs/method/papers.md §4, no floor
    return scipy.fft.idctn(c, axes=(-2, -1), norm="ortho")


def log_kappa(x: np.ndarray) -> np.ndarray:
    s = np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)
    return np.log(s[..., 0] / s[..., -1])


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.cache
def jitted(name: str):
    return jax.jit(tg.TOKEN_GRAYING[name])


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["svd", "svd_fast", "dct"])
@pytest.mark.parametrize("shape", [(3, 20, 12), (3, 12, 20)])
def test_eps_one_is_identity(name, shape):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    assert rel_err(jitted(name)(x, 1.0), x) < 1e-5
    assert rel_err(jitted(name)(photo_patches(16)[:2], 1.0), photo_patches(16)[:2]) < 1e-5


@pytest.mark.parametrize("eps", [0.9, 0.7, 0.5])
def test_svd_kappa_is_kappa_to_the_eps_on_random_matrices(eps):
    rng = np.random.default_rng(1)
    for n, m in [(40, 24), (24, 40)]:
        x = np.stack([spectrum_matrix(rng, n, m, 7.0) for _ in range(3)]).astype(np.float32)
        lk = log_kappa(x)
        for name in ("svd", "svd_fast"):
            out = jitted(name)(x, eps)
            # κ(X̃) = κ(X)^ε ⇔ log κ(X̃) = ε log κ(X); relative error of κ ≤ 1e-3.
            np.testing.assert_allclose(np.exp(log_kappa(out) - eps * lk), 1.0, atol=1e-3)


@pytest.mark.parametrize("p", [16, 4])
def test_svd_kappa_is_kappa_to_the_eps_on_photo_patches(p):
    x = photo_patches(p).astype(np.float32)
    lk = log_kappa(x)
    assert lk.min() > 5.0 and np.exp(lk.max()) < 1 / (max(x.shape[-2:]) * F32_EPS)  # above floor
    for eps in (0.9, 0.6):
        for name in ("svd", "svd_fast"):
            out = jitted(name)(x, eps)
            np.testing.assert_allclose(np.exp(log_kappa(out) - eps * lk), 1.0, atol=1e-3)


@pytest.mark.parametrize("p", [16, 4])
@pytest.mark.parametrize("eps", [0.95, 0.7, 0.5])
def test_svd_matches_float64_reference(p, eps):
    x = photo_patches(p)
    ref = svd_tg_reference(x, eps)
    assert rel_err(jitted("svd")(x.astype(np.float32), eps), ref) < 2e-5


@pytest.mark.parametrize("p", [16, 4])
@pytest.mark.parametrize("eps", [1.0, 0.95, 0.7, 0.5])
def test_dct_matches_scipy_reference(p, eps):
    x = photo_patches(p)
    out = jitted("dct")(x.astype(np.float32), eps)
    assert out.dtype == jnp.float32
    assert rel_err(out, dct_tg_reference(x, eps)) < 1e-5
    # The DCT-TG output is close to, but not the same as, the SVD-TG output.
    if eps < 1:
        assert rel_err(out, svd_tg_reference(x, eps)) > 1e-3


def test_fast_svd_runs_no_svd():
    for shape in [(2, 196, 768), (2, 64, 48)]:
        jaxpr = str(jax.make_jaxpr(tg.fast_svd_token_graying)(jnp.zeros(shape), 0.7))
        assert "svd" not in jaxpr and "eigh" in jaxpr
    assert "svd" in str(jax.make_jaxpr(tg.svd_token_graying)(jnp.zeros((2, 64, 48)), 0.7))


@pytest.mark.parametrize("eps", [0.95, 0.7, 0.5])
def test_fast_svd_equals_svd_on_photo_patches(eps):
    for p in (16, 4):
        x = photo_patches(p).astype(np.float32)
        fast = jitted("svd_fast")(x, eps)
        assert rel_err(fast, jitted("svd")(x, eps)) < 1e-4
        assert rel_err(fast, svd_tg_reference(x, eps)) < 1e-4


@pytest.mark.parametrize("eps", [0.95, 0.7, 0.5])
def test_fast_svd_equals_svd_on_rank_deficient_patches(eps):
    for x in rank_deficient_patches():
        x = x.astype(np.float32)
        svd, fast = jitted("svd")(x, eps), jitted("svd_fast")(x, eps)
        assert np.all(np.isfinite(fast)) and np.all(np.isfinite(svd))
        if not np.any(x):
            assert not np.any(fast) and not np.any(svd)  # zero stays zero
            continue
        ref = svd_tg_reference(x, eps)
        assert rel_err(fast, ref) < 1e-4 and rel_err(svd, ref) < 1e-4
        assert rel_err(fast, svd) < 1e-4


@pytest.mark.parametrize("name", ["svd", "svd_fast", "dct"])
def test_rank_one_is_a_fixed_point(name):
    # One nonzero singular value (= σ_max) or one nonzero DCT coefficient (= c_max): unchanged.
    x = np.full((1, 16, 12), 0.3, np.float32)
    np.testing.assert_allclose(jitted(name)(x, 0.5), x, rtol=1e-5)


def _naive_svd_tg(x, eps):
    u, s, vt = jnp.linalg.svd(x, full_matrices=False)
    return (u * (s[..., :1] * (s / s[..., :1]) ** eps)[..., None, :]) @ vt


@pytest.mark.parametrize("name", ["svd", "svd_fast"])
def test_svd_gradient_matches_autodiff_where_svd_is_differentiable(name):
    # Distinct, well-separated singular values: JAX's own SVD derivative is an independent check.
    rng = np.random.default_rng(2)
    grads = jax.jit(
        jax.vmap(jax.grad(lambda x, e, w, f: jnp.sum(f(x, e) * w), (0, 1)), (0, 0, 0, None)), static_argnums=3
    )
    for n, m in [(12, 8), (8, 12)]:
        x = jnp.asarray(np.stack([spectrum_matrix(rng, n, m, 3.0) for _ in range(2)]), jnp.float32)
        w = jnp.asarray(rng.normal(size=(2, n, m)), jnp.float32)
        eps = jnp.asarray([0.9, 0.6])
        got, got_eps = grads(x, eps, w, tg.TOKEN_GRAYING[name])
        want, want_eps = grads(x, eps, w, _naive_svd_tg)
        assert rel_err(got, want) < 1e-3
        np.testing.assert_allclose(got_eps, want_eps, rtol=1e-3)


@pytest.mark.parametrize("name", ["svd", "svd_fast", "dct"])
def test_gradients_match_central_differences_in_float64(name):
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        for shape in [(7, 5), (5, 7)]:
            x, w, d = (jnp.asarray(rng.normal(size=shape)) for _ in range(3))
            loss = jax.jit(lambda x, e, w=w: jnp.sum(tg.TOKEN_GRAYING[name](x, e) * w))
            gx, ge = jax.jit(jax.grad(loss, (0, 1)))(x, 0.6)
            h = 1e-6
            fd_x = (loss(x + h * d, 0.6) - loss(x - h * d, 0.6)) / (2 * h)
            fd_e = (loss(x, 0.6 + h) - loss(x, 0.6 - h)) / (2 * h)
            np.testing.assert_allclose(jnp.sum(gx * d), fd_x, rtol=1e-6)
            np.testing.assert_allclose(ge, fd_e, rtol=1e-6)


@pytest.mark.parametrize("name", ["svd", "svd_fast", "dct"])
def test_gradients_finite_on_repeated_and_zero_singular_values(name):
    x = np.zeros((2, 10, 6), np.float32)
    x[0, :3, :3] = np.eye(3)  # σ = 1, 1, 1, 0, 0, 0
    x[1] = rank_deficient_patches()[1][:10, :6]
    def loss(x):
        return jnp.sum(tg.TOKEN_GRAYING[name](x, 0.7) ** 2)

    g = jax.jit(jax.grad(loss))(jnp.asarray(x))
    assert np.all(np.isfinite(g)) and np.any(g != 0)
    # Differentiating jnp.linalg.svd directly gives NaN here: the case the custom JVP handles.
    assert not np.all(np.isfinite(jax.grad(lambda x: jnp.sum(_naive_svd_tg(x, 0.7) ** 2))(x[:1])))
    # A whole photo batch (224² crops, p = 16), jitted.
    g = jax.jit(jax.grad(loss))(jnp.asarray(photo_patches(16)[:2], jnp.float32))
    assert np.all(np.isfinite(g))


@pytest.mark.parametrize("name", ["svd", "svd_fast", "dct"])
def test_batched_shapes_dtypes_jit_and_vmap(name):
    x = np.random.default_rng(4).normal(size=(2, 3, 16, 12)).astype(np.float32)
    eps = np.asarray([[0.9, 0.7, 0.5]] * 2)
    out = jitted(name)(x, 0.7)
    assert out.shape == x.shape and out.dtype == jnp.float32
    one = jitted(name)
    for i, j in np.ndindex(2, 3):
        assert rel_err(out[i, j], one(x[i, j], 0.7)) < 1e-5
    assert rel_err(jax.vmap(jax.vmap(one, (0, None)), (0, None))(x, 0.7), out) < 1e-5
    # A per-matrix ε broadcast over the batch equals separate calls.
    per_eps = jitted(name)(x, jnp.asarray(eps))
    for i, j in np.ndindex(2, 3):
        assert rel_err(per_eps[i, j], one(x[i, j], eps[i, j])) < 1e-5


@pytest.mark.parametrize("name", ["svd", "svd_fast", "dct"])
def test_bf16_in_bf16_out_computed_in_float32(name):
    x = photo_patches(16)[:2].astype(jnp.bfloat16)
    out = jitted(name)(x, 0.7)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    # Same input in float32: the only extra error is rounding the output to bf16 (2^-8 relative).
    want = jitted(name)(np.asarray(x, np.float32), 0.7)
    assert rel_err(out, want) < 2**-8
    # Against float32 photo patches (input rounding included); docs/token_graying.md reports it.
    assert rel_err(out, jitted(name)(photo_patches(16)[:2].astype(np.float32), 0.7)) < 1e-2


@pytest.mark.slow
def test_vit_applies_token_graying_to_the_patch_matrix_identically_at_train_and_eval():
    images = jnp.asarray(_downsample(_photos()[0], 8)[:32, :32][None], jnp.float32)
    model = vit.ViT(
        num_classes=3, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=16, token_graying="dct", tg_eps=0.6
    )

    @jax.jit
    def both(images):  # one compile: init, a train-mode and an eval-mode forward
        params = model.init(jax.random.key(0), images)
        train = model.apply(params, images, train=True, rngs={"dropout": jax.random.key(1)})[1]
        return model.apply(params, images, train=False)[1], train

    out_eval, out_train = both(images)
    want = tg.dct_token_graying(vit.patchify(images, 4), 0.6)
    np.testing.assert_allclose(out_eval["patches"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out_train["patches"], want, rtol=1e-6, atol=1e-6)
    assert log_kappa(out_eval["patches"]).item() < log_kappa(vit.patchify(images, 4)).item()


@pytest.mark.parametrize(
    "name, eps, match",
    [
        ("svd", 0.0, r"model.tg_eps=0.0 must be in \(0, 1\]"),
        ("dct", 1.5, r"model.tg_eps=1.5 must be in \(0, 1\]"),
        ("svd_fast", -0.1, r"model.tg_eps=-0.1 must be in \(0, 1\]"),
        ("dct", float("nan"), r"model.tg_eps=nan must be in \(0, 1\]"),
        ("dct", "high", r"model.tg_eps='high' must be a number in \(0, 1\]"),
        ("svdd", 0.9, r"model.token_graying='svdd' is unknown; allowed: None, 'svd', 'svd_fast', 'dct'"),
    ],
)
def test_validate_token_graying_errors(name, eps, match):
    with pytest.raises(ValueError, match=match) as info:
        tg.validate_token_graying(name, eps)
    assert "\n" not in str(info.value)


def test_validate_token_graying_accepts_valid_settings():
    for name in (None, "svd", "svd_fast", "dct"):
        for eps in (1.0, 0.95, 0.5, 1e-3):
            tg.validate_token_graying(name, eps)
