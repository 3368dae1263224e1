"""Mixed precision (config.model.dtype='bfloat16'): float32 parameters, bf16 matmuls, float32
LayerNorm statistics, softmax, logits and loss, and Token Graying factorised in float32 so that
κ(X̃) = κ(X)^ε holds as in float32 (docs/token_graying.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_token_graying import log_kappa, photo_patches

from skipless_jax import models
from skipless_jax.models import vit

from util import init_params

SMALL = dict(num_classes=10, patch_size=4, width=64, depth=2, mlp_dim=128, num_heads=4, head_zero_init=False)


def _images(n=2, size=32):
    patches = photo_patches(4)[:n]  # (n, 64, 48): 32² crops of the bundled photos, 4×4×3 patches
    grid = size // 4
    return jnp.asarray(patches.reshape(n, grid, grid, 4, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(n, size, size, 3))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["svd", "dct"])
def test_token_graying_in_a_bf16_model_keeps_kappa_to_the_eps(method):
    images = _images()
    model = vit.ViT(**SMALL, dtype=jnp.bfloat16, token_graying=method, tg_eps=0.9)
    params = init_params(model, jax.random.PRNGKey(0), images)
    _, out = jax.jit(model.apply)({"params": params}, images)
    assert out["patches"].dtype == jnp.float32  # TG's output: float32 whatever the model computes in
    x = np.asarray(photo_patches(4)[:2], np.float32)
    np.testing.assert_allclose(vit.patchify(images, 4), x, rtol=1e-6)  # the images hold these patches
    lk = log_kappa(x)
    if method == "svd":  # exactly κ^ε, as the float32 tolerance of test_token_graying
        np.testing.assert_allclose(np.exp(log_kappa(np.asarray(out["patches"])) - 0.9 * lk), 1.0, atol=1e-3)
    # Either method: the grayed patches equal the float32 model's bit for bit (same float32 path).
    f32 = vit.ViT(**SMALL, token_graying=method, tg_eps=0.9)
    _, out32 = jax.jit(f32.apply)({"params": params}, images)
    np.testing.assert_array_equal(out["patches"], out32["patches"])


@pytest.mark.slow
def test_bf16_model_keeps_float32_parameters_and_logits_and_is_close_to_float32():
    images = _images(4)
    config = dict(SMALL)
    bf16, f32 = vit.ViT(**config, dtype=jnp.bfloat16), vit.ViT(**config)
    params = init_params(f32, jax.random.PRNGKey(0), images)
    assert {p.dtype for p in jax.tree.leaves(jax.eval_shape(bf16.init, jax.random.PRNGKey(0), images))} == {
        jnp.dtype("float32")}
    logits16, out16 = jax.jit(bf16.apply)({"params": params}, images)  # one program each, not op by op
    logits32, _ = jax.jit(f32.apply)({"params": params}, images)
    assert logits16.dtype == jnp.float32 and out16["encoded"].dtype == jnp.bfloat16
    scale = float(jnp.abs(logits32).max())
    assert float(jnp.abs(logits16 - logits32).max()) < 0.05 * scale  # bf16 rounding, not a different function

    def loss(model, p):
        logits, _ = model.apply({"params": p}, images)
        return jax.nn.logsumexp(logits, -1).mean()

    g16, g32 = jax.jit(jax.grad(lambda p: loss(bf16, p)))(params), jax.jit(jax.grad(lambda p: loss(f32, p)))(params)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))
    cos = sum(float(jnp.vdot(a, b)) for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)))
    cos /= np.sqrt(sum(float(jnp.vdot(a, a)) for a in jax.tree.leaves(g16)) *
                   sum(float(jnp.vdot(b, b)) for b in jax.tree.leaves(g32)))
    assert cos > 0.99


def test_attention_implementation_field_reaches_dot_product_attention():
    images = _images(2)
    base = models.build(dict(name="vit", **{k: v for k, v in SMALL.items() if k != "num_classes"}), 10)
    params = init_params(base, jax.random.PRNGKey(0), images)
    xla = vit.ViT(**SMALL, attention_impl="xla")
    np.testing.assert_allclose(jax.jit(xla.apply)({"params": params}, images)[0],
                               jax.jit(base.apply)({"params": params}, images)[0],
                               rtol=1e-6, atol=1e-6)
    if jax.default_backend() == "cpu":  # cuDNN attention is GPU-only: asking for it elsewhere fails loudly
        with pytest.raises(Exception):  # noqa: B017 (jax's error type for an unavailable kernel varies)
            vit.ViT(**SMALL, dtype=jnp.bfloat16, attention_impl="cudnn").apply({"params": params}, images)
