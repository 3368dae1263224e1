"""Spectra of the skipless initializations (docs/method/papers.md §3), against float64 numpy references.

Each spectral checker is also run on a known wrong variant, to show it can fail.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax.models import init

SHAPES = [(64, 1), (64, 4), (96, 3), (128, 8), (192, 3)]


def _np64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _singular_values(m) -> np.ndarray:
    return np.linalg.svd(_np64(m), compute_uv=False)


# ---------------------------------------------------------------- checkers


def assert_vo_isometry(w_v, w_o, c: float) -> None:
    """Every singular value of the full d×d product W^V W^O equals c² (so κ = 1 to 1e-5)."""
    s = _singular_values(_np64(w_v) @ _np64(w_o))
    np.testing.assert_allclose(s, c**2, rtol=1e-5)
    assert s.max() / s.min() - 1.0 < 1e-5


def assert_per_head_vo_identity(w_v, w_o, c: float, num_heads: int) -> None:
    """The per-head d_h×d_h check W^O_h W^V_h = c² I: necessary, but blind to cross-head mixing."""
    d = w_v.shape[0]
    dh = d // num_heads
    for h in range(num_heads):
        block = _np64(w_o)[h * dh:(h + 1) * dh, :] @ _np64(w_v)[:, h * dh:(h + 1) * dh]
        np.testing.assert_allclose(block, c**2 * np.eye(dh), atol=1e-4 * c**2)


def assert_mlp_kernel_spectrum(w) -> None:
    """All singular values of an (in, out) kernel equal max(√(out/in), 1)."""
    n_in, n_out = w.shape
    np.testing.assert_allclose(_singular_values(w), max(np.sqrt(n_out / n_in), 1.0), rtol=1e-5)


def assert_qk_truncation(key, w_q, w_k, num_heads: int, alpha: float, beta: float) -> None:
    """Each head's W^Q_h W^K_hᵀ is the rank-d_h truncation of α Z_h + β I, Z_h rebuilt from key."""
    d = w_q.shape[0]
    dh = d // num_heads
    for h, k in enumerate(jax.random.split(key, num_heads)):
        z = _np64(jax.random.normal(k, (d, d), jnp.float32)) / np.sqrt(d)
        u, s, vt = np.linalg.svd(alpha * z + beta * np.eye(d))
        target = (u[:, :dh] * s[:dh]) @ vt[:dh]
        cols = slice(h * dh, (h + 1) * dh)
        got = _np64(w_q)[:, cols] @ _np64(w_k)[:, cols].T
        np.testing.assert_allclose(got, target, atol=2e-5 * np.abs(target).max() * np.sqrt(d))


# ------------------------------------------------------------ wrong variants


def per_head_orthogonal_vo(key, d: int, num_heads: int, c: float):
    """Wrong: an independent orthonormal d×d_h frame Q_h per head, W^V_h = cQ_h, W^O_h = cQ_hᵀ.

    Per head W^O_h W^V_h = c² I, but W^V W^O = c² Σ_h Q_h Q_hᵀ is a sum of unrelated projections.
    """
    dh = d // num_heads
    frames = [np.linalg.qr(_np64(jax.random.normal(k, (d, dh))))[0]
              for k in jax.random.split(key, num_heads)]
    w_v = c * np.concatenate(frames, axis=1)
    return w_v, w_v.T.copy()


def max_over_min_mlp_kernel(key, shape):
    """Wrong: the scale √(max/min) on both MLP layers (×2 on 4d→d too)."""
    n_in, n_out = shape
    return np.sqrt(max(n_in, n_out) / min(n_in, n_out)) * _np64(init.haar_orthogonal(key, shape))


# ------------------------------------------------------------------- tests


@pytest.mark.parametrize("d,num_heads", SHAPES)
@pytest.mark.parametrize("c", [1.0, 3.0])
def test_scaled_orthogonal_vo_full_product_is_isometry(d, num_heads, c):
    w_v, w_o = init.scaled_orthogonal_vo(jax.random.key(d + num_heads), d, c)
    chex.assert_shape([w_v, w_o], (d, d))
    assert_vo_isometry(w_v, w_o, c)
    # Each factor is c times an orthogonal matrix.
    np.testing.assert_allclose(_singular_values(w_v), c, rtol=1e-5)
    np.testing.assert_allclose(_singular_values(w_o), c, rtol=1e-5)


@pytest.mark.parametrize("d,num_heads", [(64, 4), (128, 8)])
def test_per_head_orthogonal_vo_is_rejected(d, num_heads):
    w_v, w_o = per_head_orthogonal_vo(jax.random.key(0), d, num_heads, 3.0)
    assert_per_head_vo_identity(w_v, w_o, 3.0, num_heads)  # the per-head check is fooled
    with pytest.raises(AssertionError):
        assert_vo_isometry(w_v, w_o, 3.0)
    s = _singular_values(w_v @ w_o)
    assert s.max() / s.min() > 10.0


@pytest.mark.slow
@pytest.mark.parametrize("d,num_heads", SHAPES)
def test_mimetic_qk_is_rank_dh_truncation(d, num_heads):
    key = jax.random.key(7 * d + num_heads)
    w_q, w_k = init.mimetic_qk(key, d, num_heads, alpha=2.0, beta=0.6)
    chex.assert_shape([w_q, w_k], (d, d))
    assert_qk_truncation(key, w_q, w_k, num_heads, 2.0, 0.6)


def test_qk_checker_rejects_untruncated_or_wrong_key():
    key = jax.random.key(3)
    w_q, w_k = init.mimetic_qk(key, 64, 4, alpha=1.8, beta=1.0)
    with pytest.raises(AssertionError):  # another key's Z
        assert_qk_truncation(jax.random.key(4), w_q, w_k, 4, 1.8, 1.0)
    with pytest.raises(AssertionError):  # S instead of √S on both factors
        w_q_bad, w_k_bad = init.mimetic_qk(key, 64, 4, alpha=1.8**2, beta=1.0)
        assert_qk_truncation(key, w_q_bad, w_k_bad, 4, 1.8, 1.0)


def test_single_head_qk_product_is_exact():
    key = jax.random.key(11)
    w_q, w_k = init.mimetic_qk(key, 32, 1, alpha=0.7, beta=0.7)
    target = _np64(init.mimetic_qk_targets(key, 32, 1, 0.7, 0.7)[0])
    np.testing.assert_allclose(_np64(w_q) @ _np64(w_k).T, target, atol=1e-5)


@pytest.mark.slow
def test_mimetic_vo_product():
    key = jax.random.key(5)
    d = 48
    w_v, w_o = init.mimetic_vo(key, d, alpha=0.4, beta=0.4)
    z = _np64(jax.random.normal(key, (d, d), jnp.float32)) / np.sqrt(d)
    np.testing.assert_allclose(_np64(w_v) @ _np64(w_o), 0.4 * z - 0.4 * np.eye(d), atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96), (48, 200), (200, 48)])
def test_scaled_uniform_orthogonal_spectrum(shape):
    w = init.scaled_uniform_orthogonal(jax.random.key(sum(shape)), shape, jnp.float32)
    chex.assert_shape(w, shape)
    chex.assert_type(w, jnp.float32)
    assert_mlp_kernel_spectrum(w)


def test_mlp_checker_rejects_max_over_min_scale():
    key = jax.random.key(1)
    assert_mlp_kernel_spectrum(max_over_min_mlp_kernel(key, (64, 256)))  # d→4d: same ×2
    with pytest.raises(AssertionError):  # 4d→d: ×2 where ×1 is right
        assert_mlp_kernel_spectrum(max_over_min_mlp_kernel(key, (256, 64)))


def test_scaled_uniform_orthogonal_as_flax_kernel_init():
    dense = nn.Dense(128, kernel_init=init.scaled_uniform_orthogonal)
    params = dense.init(jax.random.key(0), jnp.zeros((1, 32)))
    np.testing.assert_allclose(_singular_values(params["params"]["kernel"]), 2.0, rtol=1e-5)
    w = init.scaled_uniform_orthogonal(jax.random.key(0), (4, 8, 16), jnp.bfloat16)
    chex.assert_shape(w, (4, 8, 16))
    chex.assert_type(w, jnp.bfloat16)


@pytest.mark.parametrize("shape", [(80, 20), (20, 80), (32, 32)])
def test_haar_orthogonality(shape):
    q = _np64(init.haar_orthogonal(jax.random.key(2), shape))
    gram = q.T @ q if shape[0] >= shape[1] else q @ q.T
    np.testing.assert_allclose(gram, np.eye(min(shape)), atol=1e-5)


def _haar_mean(sign_fix: bool, n: int = 4000) -> np.ndarray:
    def one(k):
        q, r = jnp.linalg.qr(jax.random.normal(k, (3, 3)))
        return q * jnp.sign(jnp.diagonal(r))[None, :] if sign_fix else q
    return np.asarray(jax.vmap(one)(jax.random.split(jax.random.key(0), n))).mean(0)


def test_haar_sign_fix_gives_zero_mean_entries():
    # Haar matrices have E[Q_ij] = 0; standard error here is ≈ 1/√(3·4000) ≈ 0.009.
    keys = jax.random.split(jax.random.key(0), 4000)
    mean = np.asarray(jax.vmap(lambda k: init.haar_orthogonal(k, (3, 3)))(keys)).mean(0)
    assert np.abs(mean).max() < 0.05
    assert np.abs(_haar_mean(sign_fix=True)).max() < 0.05
    assert np.abs(_haar_mean(sign_fix=False)).max() > 0.3  # plain QR is not Haar


@pytest.mark.parametrize("method", ["skipless", "mimetic"])
def test_attention_kernels(method):
    key = jax.random.key(9)
    k = init.attention_kernels(key, method, 64, 4, alpha=2.0, beta=0.6, c=3.0)
    assert set(k) == {"query", "key", "value", "out"}
    chex.assert_shape(list(k.values()), (64, 64))
    k_qk, k_vo = jax.random.split(key)
    assert_qk_truncation(k_qk, k["query"], k["key"], 4, 2.0, 0.6)
    if method == "skipless":
        assert_vo_isometry(k["value"], k["out"], 3.0)
    else:
        z = _np64(jax.random.normal(k_vo, (64, 64), jnp.float32)) / 8.0
        np.testing.assert_allclose(_np64(k["value"]) @ _np64(k["out"]),
                                   0.4 * z - 0.4 * np.eye(64), atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="skipless", alpha=0.0), "init_alpha"),
    (dict(method="mimetic", alpha=-1.0), "init_alpha"),
    (dict(method="skipless", c=0.0), "init_c"),
    (dict(method="skipless", c=-3.0), "init_c"),
    (dict(method="skipless", beta=-0.1), "init_beta"),
    (dict(method="skipless", num_heads=5), "num_heads=5 must be a positive int dividing width d=64"),
    (dict(method="glorot"), "'glorot' is unknown; allowed: "),
])
def test_bad_input_errors(kwargs, match):
    args = dict(method="skipless", d=64, num_heads=4, alpha=2.0, beta=0.6, c=3.0) | kwargs
    with pytest.raises(ValueError, match=match):
        init.attention_kernels(jax.random.key(0), **args)
    cfg = ml_collections.ConfigDict(dict(
        init=args["method"], width=args["d"], num_heads=args["num_heads"],
        init_alpha=args["alpha"], init_beta=args["beta"], init_c=args["c"]))
    with pytest.raises(ValueError, match=match):
        init.validate_init_config(cfg)


def test_validate_init_config_accepts_good_configs():
    for method in init.INIT_METHODS:
        init.validate_init_config(ml_collections.ConfigDict(dict(
            init=method, width=192, num_heads=3, init_alpha=2.0, init_beta=0.6, init_c=3.0)))
    # 'default' ignores the constants; width unset (variant fills it) skips the heads check.
    init.validate_init_config(ml_collections.ConfigDict(dict(
        init="default", width=None, num_heads=None, init_alpha=0.0, init_beta=-1.0, init_c=0.0)))


def test_low_level_errors():
    with pytest.raises(ValueError, match="c must be a finite number > 0"):
        init.scaled_orthogonal_vo(jax.random.key(0), 8, 0.0)
    with pytest.raises(ValueError, match="num_heads=3 must be a positive int dividing width d=8"):
        init.mimetic_qk(jax.random.key(0), 8, 3, 1.0, 1.0)
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        init.mimetic_vo(jax.random.key(0), 8, 0.0, 0.4)
    with pytest.raises(ValueError, match=">= 2 axes"):
        init.scaled_uniform_orthogonal(jax.random.key(0), (8,))


# ---------------------------------------------------------------- self-attention share (docs/method/papers.md §3)


def _np_kernel_share(x: np.ndarray, w_q: np.ndarray, w_k: np.ndarray, num_heads: int) -> float:
    """Mean over samples, tokens and heads of diag softmax(X Wᵠ_h (X Wᴷ_h)ᵀ/√d_h), float64;
    x (S, n, d), kernels (d, h·d_h) with heads as column groups."""
    s, n, _ = x.shape
    dh = w_q.shape[1] // num_heads
    q, k = ((x @ _np64(w)).reshape(s, n, num_heads, dh) for w in (w_q, w_k))
    logits = np.einsum("sqhe,skhe->shqk", q, k) / np.sqrt(dh)
    a = np.exp(logits - logits.max(-1, keepdims=True))
    return float(np.diagonal(a / a.sum(-1, keepdims=True), axis1=-2, axis2=-1).mean())


def _np_share(model: dict, num_tokens: int, num_samples: int, seed: int = 0) -> float:
    """float64 numpy reading of the share: the same random draws (jax's, by the documented keys),
    then M_h = αZ_h + βI, its SVD, the rank-d_h factors and the softmax rebuilt here."""
    d, h, depth = model["width"], model["num_heads"], model["depth"]
    alpha, beta, dh = model["init_alpha"], model["init_beta"], model["width"] // model["num_heads"]
    keys = jax.random.split(jax.random.PRNGKey(seed), depth + 1)
    x = _np64(jax.random.normal(keys[0], (num_samples, num_tokens, d), jnp.float32))
    shares = []
    for layer in range(depth):
        qk_key = jax.random.split(keys[1 + layer])[0]  # attention_kernels' Q/K half
        for head_key in jax.random.split(qk_key, h):
            z = _np64(jax.random.normal(head_key, (d, d), jnp.float32)) / np.sqrt(d)
            u, s, vt = np.linalg.svd(alpha * z + beta * np.eye(d))
            shares.append(_np_kernel_share(x, u[:, :dh] * np.sqrt(s[:dh]), vt[:dh].T * np.sqrt(s[:dh]), 1))
    return float(np.mean(shares))


def _model_config(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    from util import load_config

    return load_config(name, arg).model


@pytest.mark.slow
@pytest.mark.parametrize("name,num_tokens,sizes", [
    ("quickstart", 16, {}),  # d 64, 4 heads, 4 blocks, α 2, β 0.6
    # ViT-B/16's blocks (d 768, 12 heads, α 2, β 0.6) at 197 tokens; one block keeps the float64
    # reference's 12 SVDs of 768×768 to seconds (the function averages 12 such blocks).
    ("vitb_skipless", 197, dict(variant=None, width=768, num_heads=12, depth=1, patch_size=16)),
])
def test_self_attention_share_matches_float64_numpy(name, num_tokens, sizes):
    model = _model_config(name)
    model.update(sizes)
    samples = 8 if sizes else 64
    got = init.self_attention_share(model, num_tokens, num_samples=samples)
    want = _np_share(model.to_dict(), num_tokens, samples)
    assert abs(got - want) < 1e-5, (got, want)
    assert got > 3 / num_tokens  # far above uniform attention
    if not sizes:  # and a wrong β is seen
        model.init_beta = 0.3
        assert abs(init.self_attention_share(model, num_tokens, num_samples=samples) - want) > 0.02


def test_self_attention_share_of_the_other_inits_is_near_uniform():
    """The default (Xavier) and reference (timm) inits attend almost uniformly at init: the
    skipless init's identity term is what raises a token's attention on itself."""
    shares = {}
    for method in ("default", "timm", "skipless"):
        model = _model_config("quickstart", f"init={method}")
        shares[method] = init.self_attention_share(model, 16, num_samples=16)
    assert abs(shares["default"] - 1 / 16) < 0.01 and abs(shares["timm"] - 1 / 16) < 0.005
    assert shares["skipless"] > 0.3


@pytest.mark.slow
@pytest.mark.parametrize("arg,num_tokens,target", [("", 16, 0.8), ("depth=8,tokens=64", 64, 0.76)])
def test_init_self_share_reaches_its_target(arg, num_tokens, target):
    """β from `init_self_share` gives the target share: with the search's own draws, with other
    draws (seed 1), and in the kernels of the model the trainer builds (its own init keys)."""
    from skipless_jax import models
    from skipless_jax.data import inputs

    from util import load_config

    config = load_config("quickstart", f"{arg},self_share={target}".strip(","))
    image_size = inputs.image_size(config)
    assert models.num_tokens(config.model, image_size) == num_tokens
    given = config.model.init_beta
    model_config, beta = models.apply_init_self_share(config.model, image_size)
    assert model_config.init_beta == beta != given and config.model.init_beta == given  # the given config unchanged
    assert abs(init.self_attention_share(model_config, num_tokens) - target) < 1e-3
    assert abs(init.self_attention_share(model_config, num_tokens, seed=1) - target) < 0.01

    model = models.build(model_config, 10)
    params = model.init(jax.random.PRNGKey(3), jnp.zeros((1, image_size, image_size, 1)), train=False)["params"]
    x = _np64(jax.random.normal(jax.random.PRNGKey(4), (32, num_tokens, 64), jnp.float32))
    shares = [_np_kernel_share(x, kernels["query"], kernels["key"], config.model.num_heads)
              for kernels in (params[f"block_{layer}"]["MultiHeadAttention_0"] for layer in range(config.model.depth))]
    assert abs(np.mean(shares) - target) < 0.01, np.mean(shares)


def test_init_self_share_errors_are_one_line():
    from skipless_jax import models, validate

    from util import load_config

    model = _model_config("quickstart")
    for bad in (0.0, 1.0, 1.5, -0.2, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match=r"init_self_share=.* must be a number in \(0, 1\)"):
            init.self_share_beta(model, 16, bad)
    at_zero = ml_collections.ConfigDict({**model.to_dict(), "init_beta": 0.0})
    assert init.self_attention_share(at_zero, 16) > 0.02  # so 0.02 is below every β's share
    with pytest.raises(ValueError, match=r"init_self_share=0.02 is not reachable at 16 tokens: β in \[0, 1024\] "
                                         r"gives shares from 0\.\d{4} to 0\.\d{4}$"):
        init.self_share_beta(model, 16, 0.02)
    with pytest.raises(ValueError, match=r"sets the β of init='skipless' or 'mimetic'; config.model.init='default'"):
        init.self_share_beta(_model_config("quickstart", "init=default"), 16, 0.5)
    config = load_config("quickstart", "init=default,self_share=0.5")
    with pytest.raises(ValueError, match=r"config.model.init='default' has none"):
        validate.validate_config(config)
    config = load_config("quickstart", "self_share=0.5")
    config.trainer = "dino"
    with pytest.raises(ValueError, match=r"applied by the supervised trainer only; config.trainer='dino'"):
        validate.validate_config(config)
    swin = ml_collections.ConfigDict(dict(name="swin", init="skipless", init_self_share=0.5))
    with pytest.raises(ValueError, match=r"defined for the 'vit' family; config.model.name='swin'"):
        models.check_config(swin, 8)
    with pytest.raises(ValueError, match=r"num_tokens=0 must be a positive int"):
        init.self_attention_share(model, 0)
