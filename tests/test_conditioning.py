"""Condition numbers (docs/method/papers.md §2) against independent float64 numpy references."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax import conditioning as cond
from skipless_jax.models import init

RNG = np.random.default_rng(0)


def _np_log_kappa(m: np.ndarray) -> np.ndarray:
    s = np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)
    return np.log(s[..., 0] / s[..., -1])


def _np_attention(params, x, num_heads):
    """Loop-over-heads float64 reference: returns (SA(X), [A_h])."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    n, d = x.shape
    dh = d // num_heads
    q, k, v = (x @ p[name] + p.get(f"{name}_bias", 0.0) for name in ("query", "key", "value"))
    out, probs = np.zeros((n, d)), []
    for h in range(num_heads):
        cols = slice(h * dh, (h + 1) * dh)
        logits = q[:, cols] @ k[:, cols].T / np.sqrt(dh)
        a = np.exp(logits - logits.max(1, keepdims=True))
        a /= a.sum(1, keepdims=True)
        probs.append(a)
        out += a @ v[:, cols] @ p["out"][cols, :]
    return out + p.get("out_bias", 0.0), probs


def _default_attention_params(key, d):
    ks = jax.random.split(key, 8)
    p = {n: nn.initializers.xavier_uniform()(k, (d, d)) for n, k in zip(cond.ATTENTION_KERNELS, ks)}
    p.update({f"{n}_bias": 0.1 * jax.random.normal(k, (d,))
              for n, k in zip(cond.ATTENTION_KERNELS, ks[4:])})
    return p


@pytest.mark.parametrize("shape", [(5, 7), (3, 9, 4), (2, 3, 6, 6)])
def test_log_condition_number_matches_numpy(shape):
    m = RNG.standard_normal(shape)
    got = cond.log_condition_number(jnp.asarray(m, jnp.float32))
    chex.assert_shape(got, shape[:-2])
    np.testing.assert_allclose(np.asarray(got), _np_log_kappa(m), rtol=1e-4, atol=1e-4)


def test_log_condition_number_float64_for_huge_kappa():
    u = np.linalg.qr(RNG.standard_normal((8, 8)))[0]
    m = (u * np.exp(-np.linspace(0, 20, 8))) @ u.T  # κ = e^20, beyond float32's reach
    with jax.enable_x64(True):
        assert cond.analysis_dtype() == jnp.float64
        got = float(cond.log_condition_number(jnp.asarray(m)))
    np.testing.assert_allclose(got, 20.0, rtol=1e-6)
    assert cond.analysis_dtype() == jnp.float32  # x64 is off again outside the context
    with pytest.raises(ValueError, match="needs a matrix"):
        cond.log_condition_number(jnp.ones(3))


def test_embedding_log_kappa_matches_numpy_and_jits():
    num_layers, b, n, d = 3, 4, 10, 6
    blocks = [{p: jnp.asarray(RNG.standard_normal((b, n, d)), jnp.float32)
               for p in cond.EMBEDDING_POINTS} for _ in range(num_layers)]
    got = jax.jit(cond.embedding_log_kappa)({"blocks": blocks, "logits": jnp.zeros((b, 2))})
    assert set(got) == set(cond.EMBEDDING_POINTS)
    for point in cond.EMBEDDING_POINTS:
        chex.assert_shape(got[point], (num_layers,))
        want = [_np_log_kappa(np.asarray(blk[point])).mean() for blk in blocks]
        np.testing.assert_allclose(np.asarray(got[point]), want, rtol=1e-4)
    with pytest.raises(ValueError, match="at least one layer"):
        cond.embedding_log_kappa({"blocks": []})


@pytest.mark.parametrize("num_heads", [1, 4])
def test_self_attention_matches_reference(num_heads):
    p = _default_attention_params(jax.random.key(0), 16)
    x = RNG.standard_normal((6, 16))
    want, probs = _np_attention(p, x, num_heads)
    with jax.enable_x64(True):
        got = cond.self_attention(cond.to_float64(p), jnp.asarray(x), num_heads)
        a = cond.attention_probs(cond.to_float64(p), jnp.asarray(x), num_heads)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(a), np.stack(probs), rtol=1e-10, atol=1e-12)


def test_attention_jacobian_matches_finite_differences():
    n, d, h = 5, 8, 2
    p = _default_attention_params(jax.random.key(1), d)
    x = RNG.standard_normal((n, d))
    k = cond.attention_jacobian(p, x, h)
    chex.assert_shape(k, (n * d, n * d))
    eps = 1e-6
    fd = np.zeros((n * d, n * d))
    for j in range(n * d):  # central differences on the float64 reference
        e = np.zeros(n * d)
        e[j] = eps
        plus = _np_attention(p, x + e.reshape(n, d), h)[0]
        minus = _np_attention(p, x - e.reshape(n, d), h)[0]
        fd[:, j] = (plus - minus).ravel() / (2 * eps)
    np.testing.assert_allclose(k, fd, atol=1e-7 * np.abs(fd).max())


def test_kronecker_is_frozen_softmax_jacobian():
    n, d, h = 6, 8, 2
    p = _default_attention_params(jax.random.key(2), d)
    x = RNG.standard_normal((n, d))
    b = cond.attention_kronecker(p, x, h)
    _, probs = _np_attention(p, x, h)
    w_v, w_o, dh = np.asarray(p["value"], np.float64), np.asarray(p["out"], np.float64), d // h
    y = RNG.standard_normal((n, d))  # B·vec(Y) = vec(Σ_h A_h Y Wⱽ_h Wᴼ_h)
    want = sum(probs[i] @ y @ w_v[:, i * dh:(i + 1) * dh] @ w_o[i * dh:(i + 1) * dh] for i in range(h))
    np.testing.assert_allclose(b @ y.ravel(), want.ravel(), rtol=1e-10, atol=1e-12)
    # One head: κ(B) = κ(A) κ(WⱽWᴼ), the Kronecker identity.
    b1 = cond.attention_kronecker(p, x, 1)
    _, (a1,) = _np_attention(p, x, 1)
    np.testing.assert_allclose(cond.matrix_log_kappa(b1),
                               _np_log_kappa(a1) + _np_log_kappa(w_v @ w_o), rtol=1e-8)


def test_jacobian_equals_kronecker_when_softmax_is_constant():
    d, h = 8, 2
    p = dict(_default_attention_params(jax.random.key(3), d))
    p["key"] = jnp.zeros((d, d))  # logits constant along each row, so A is frozen
    res = cond.compare_attention_jacobian(p, RNG.standard_normal((5, d)), h)
    assert res["rel_diff_K_B"] < 1e-12
    # Uniform attention is rank one, so both are singular: the rank collapse of plain SA.
    assert min(res["log_kappa_K"], res["log_kappa_B"]) > 20.0


@pytest.mark.slow
def test_skipless_attention_init_is_better_conditioned_than_default():
    """Cutting the Skip's direction at a LayerNorm-scaled input, several seeds (docs/method/papers.md §2)."""
    d, n, h = 32, 16, 2
    gaps = []
    for seed in range(3):
        key = jax.random.key(seed)
        x = RNG.standard_normal((n, d))
        x = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)
        skipless = init.attention_kernels(key, "skipless", d, h, alpha=0.7, beta=0.7, c=1.0)
        default = {k: v for k, v in _default_attention_params(key, d).items() if "bias" not in k}
        r_s = cond.compare_attention_jacobian(skipless, x, h)
        r_d = cond.compare_attention_jacobian(default, x, h)
        assert r_s["log_kappa_WvWo"] < 1e-5  # κ(WⱽWᴼ) = 1
        gaps.append(r_d["log_kappa_K"] - r_s["log_kappa_K"])
    assert min(gaps) > 3.0, gaps  # at least e³ better on every seed


# ------------------------------------------------------------------ Prop. 4.1


@pytest.mark.parametrize("log_kappa", [0.5, 1.5, 3.0])
def test_cube_bound_holds(log_kappa):
    n, d = 12, 6
    for seed in range(5):
        ks = jax.random.split(jax.random.key(seed), 6)
        x = cond.matrix_with_log_kappa(ks[0], n, d, log_kappa)
        np.testing.assert_allclose(_np_log_kappa(x), log_kappa, rtol=1e-10)
        w = [np.asarray(jax.random.normal(k, s), np.float64) for k, s in
             zip(ks[1:], [(d, d), (d, d), (d, d), (d, 4 * d), (4 * d, d)])]
        r = cond.cube_bound_check(x, *w)
        assert r["attn"] <= r["attn_bound"] + 1e-9
        assert r["ffn"] <= r["ffn_bound"] + 1e-9


def test_cube_bound_is_tight_with_identity_weights():
    n, d = 10, 5
    x = cond.matrix_with_log_kappa(jax.random.key(0), n, d, 2.0)
    eye = np.eye(d)
    r = cond.cube_bound_check(x, eye, eye, eye, np.eye(d, 4 * d), np.eye(4 * d, d))
    np.testing.assert_allclose([r["attn"], r["ffn"]], [6.0, 2.0], rtol=1e-9)  # κ³ vs κ
    with pytest.raises(ValueError, match="n >= d"):
        cond.cube_bound_check(x.T, eye, eye, eye, eye, eye)


# ------------------------------------------------------------------ whole block


def _block(skip_sab: bool, skip_ffn: bool, scheme: str = "default", n: int = 4, d: int = 8):
    from skipless_jax.models import vit

    block = vit.EncoderBlock(mlp_dim=2 * d, num_heads=2, skip_sab=skip_sab, skip_ffn=skip_ffn,
                             init_scheme=scheme, init_alpha=2.0, init_beta=0.6, init_c=3.0)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((1, n, d)), jnp.float32)
    params = block.init({"params": jax.random.key(0)}, x, train=False)["params"]
    return params, np.asarray(x[0], np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("skip_sab,skip_ffn", [(False, False), (True, True), (False, True)])
def test_encoder_block_matches_the_model(skip_sab, skip_ffn):
    from skipless_jax.models import vit

    params, x = _block(skip_sab, skip_ffn, scheme="skipless")
    block = vit.EncoderBlock(mlp_dim=16, num_heads=2, skip_sab=skip_sab, skip_ffn=skip_ffn)
    want = block.apply({"params": params}, jnp.asarray(x, jnp.float32)[None], train=False)[0][0]
    got = cond.encoder_block(params, jnp.asarray(x, jnp.float32), 2, skip_sab, skip_ffn)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("skip_sab,skip_ffn", [(False, False), (True, True), (False, True)])
def test_block_jacobian_matches_finite_differences(skip_sab, skip_ffn):
    params, x = _block(skip_sab, skip_ffn)
    n, d = x.shape
    jac = cond.block_jacobian(params, x, num_heads=2, skip_sab=skip_sab, skip_ffn=skip_ffn)
    eps = 1e-6
    fd = np.zeros((n * d, n * d))
    with jax.enable_x64(True):
        p64 = cond.to_float64(params)
        f = jax.jit(lambda y: cond.encoder_block(p64, y, 2, skip_sab, skip_ffn))
        for j in range(n * d):
            e = np.zeros(n * d)
            e[j] = eps
            fd[:, j] = np.asarray(f(x + e.reshape(n, d)) - f(x - e.reshape(n, d))).ravel() / (2 * eps)
    np.testing.assert_allclose(jac, fd, atol=1e-7 * np.abs(fd).max())

    # LayerNorm at the block input: exactly 2n zero singular values unless ② adds the identity.
    s = np.linalg.svd(jac, compute_uv=False)
    null = cond.block_null_dim(n, skip_sab)
    assert null == (0 if skip_sab else 2 * n)
    if null:  # the mean direction is exactly null, the scale direction up to LayerNorm's eps
        assert s[-null:].max() < 1e-7 * s[0]
        assert s[n * d - null - 1] > 1e3 * s[-null:].max()  # a clear gap after the 2n
        assert cond.matrix_log_kappa(jac) > 16.0 > cond.matrix_log_kappa(jac, null)
    else:
        assert s[-1] > 1e-3 * s[0]


@pytest.mark.slow
def test_skipless_vit_attention_jacobian_below_default():
    """A small skipless ViT at init (d=32, h=2, n=16, L=2) with the quickstart constants
    α=2, β=0.6, c=3: per seed, mean-over-layers log κ(K_ℓ) at least e³ below the default init's."""
    from skipless_jax import analyze
    from skipless_jax.models import vit

    def mean_log_kappa_k(scheme: str, seed: int) -> float:
        model = vit.ViT(num_classes=10, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=2,
                        skip_sab=False, skip_ffn=False, pool="gap", init_scheme=scheme,
                        init_alpha=2.0, init_beta=0.6, init_c=3.0)
        images = np.asarray(jax.random.normal(jax.random.key(1000 + seed), (1, 16, 16, 3)))
        params = model.init({"params": jax.random.key(seed)}, jnp.zeros((1, 16, 16, 3)))["params"]
        rows = analyze.jacobian_rows(model, params, images)
        assert len(rows) == 2 and all(np.isfinite(r["log_kappa_block"]) for r in rows)
        return float(np.mean([r["log_kappa_K"] for r in rows]))

    for seed in (0, 1):
        assert mean_log_kappa_k("default", seed) - mean_log_kappa_k("skipless", seed) > 3.0
