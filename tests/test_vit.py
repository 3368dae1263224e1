"""The ViT: published parameter counts, the skip switches, patchify + Dense == strided conv."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax import lax

from skipless_jax.models import vit


def count_params(variant: str, **kwargs) -> int:
    model = vit.ViT(num_classes=1000, **{**vit.decode_variant(variant), **kwargs})
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3))))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


@pytest.mark.parametrize(
    "variant, expected",
    # timm / "How to train your ViT" counts (class token, learned 1+196 position table).
    [("Ti/16", 5_717_416), ("S/16", 22_050_664), ("B/16", 86_567_656)],
)
def test_published_parameter_counts(variant, expected):
    assert count_params(variant) == expected


def test_decode_variant_and_bad_variant():
    assert vit.decode_variant("B/16") == dict(width=768, depth=12, mlp_dim=3072, num_heads=12, patch_size=16)
    assert vit.decode_variant("S/8")["patch_size"] == 8
    with pytest.raises(ValueError, match=r"config.model.variant='X/16'.*allowed"):
        vit.decode_variant("X/16")


def test_patchify_dense_equals_strided_conv():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 12, 12, 3)).astype(np.float32)
    p, d = 4, 5
    kernel = rng.normal(size=(p, p, 3, d)).astype(np.float32)
    conv = lax.conv_general_dilated(images, kernel, (p, p), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    dense = vit.patchify(jnp.asarray(images), p) @ kernel.reshape(-1, d)
    np.testing.assert_allclose(dense, conv.reshape(2, -1, d), rtol=1e-5, atol=1e-5)


def _block(skip_sab, skip_ffn, gelu_approximate=True):
    block = vit.EncoderBlock(mlp_dim=16, num_heads=2, skip_sab=skip_sab, skip_ffn=skip_ffn, drop_path=0.5,
                             gelu_approximate=gelu_approximate)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8))
    params = block.init(jax.random.PRNGKey(0), x, train=False)["params"]
    return block, params, x


def _hand_composed(params, x, skip_sab, skip_ffn, exact_gelu=False):
    """The block written out from docs/method/papers.md §1 in numpy, independently of the module."""
    x = np.asarray(x, np.float64)

    def ln(v, p):
        mu = v.mean(-1, keepdims=True)
        var = v.var(-1, keepdims=True)
        return (v - mu) / np.sqrt(var + 1e-6) * np.asarray(p["scale"]) + np.asarray(p["bias"])

    def attention(v, p, heads=2):
        w = {k: np.asarray(p[k], np.float64) for k in p}
        q, k, val = (v @ w[n] + w[f"{n}_bias"] for n in ("query", "key", "value"))
        b, n, d = v.shape
        split = lambda t: t.reshape(b, n, heads, d // heads).transpose(0, 2, 1, 3)
        q, k, val = split(q), split(k), split(val)
        logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads)
        a = np.exp(logits - logits.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = (a @ val).transpose(0, 2, 1, 3).reshape(b, n, d)
        return o @ w["out"] + w["out_bias"]

    def gelu(v):  # tanh approximation, flax's default; or the exact erf form (DINO, timm)
        if exact_gelu:
            return 0.5 * v * (1 + scipy.special.erf(v / np.sqrt(2)))
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))

    def mlp(v, p):
        h = gelu(v @ np.asarray(p["Dense_0"]["kernel"]) + np.asarray(p["Dense_0"]["bias"]))
        return h @ np.asarray(p["Dense_1"]["kernel"]) + np.asarray(p["Dense_1"]["bias"])

    y = attention(ln(x, params["LayerNorm_0"]), params["MultiHeadAttention_0"])
    x = x + y if skip_sab else y
    z = mlp(ln(x, params["LayerNorm_1"]), params["MlpBlock_0"])
    return x + z if skip_ffn else z


@pytest.mark.parametrize("skip_sab, skip_ffn", [(True, True), (False, True), (True, False), (False, False)])
def test_block_equals_hand_composed_function(skip_sab, skip_ffn):
    block, params, x = _block(skip_sab, skip_ffn)
    out, inter = block.apply({"params": params}, x, train=False)
    np.testing.assert_allclose(out, _hand_composed(params, x, skip_sab, skip_ffn), rtol=2e-4, atol=2e-5)
    # The intermediates of docs/method/papers.md §1 are consistent with the output.
    np.testing.assert_allclose(inter["sab_skip"], x + inter["sab"], rtol=1e-6)
    expected = inter["ffn_skip"] if skip_ffn else inter["ffn"]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_exact_gelu_block_equals_hand_composed_function():
    block, params, x = _block(False, True, gelu_approximate=False)
    out, _ = block.apply({"params": params}, x, train=False)
    np.testing.assert_allclose(out, _hand_composed(params, x, False, True, exact_gelu=True), rtol=2e-4, atol=2e-5)
    tanh = _hand_composed(params, x, False, True, exact_gelu=False)
    assert np.abs(np.asarray(out) - tanh).max() > 1e-6  # the two forms differ here


def test_gelu_field_and_variant_conflicts_in_the_config():
    from skipless_jax import models

    cfg = {"name": "vit", "variant": "Ti/4", "gelu": "exact", "width": None, "depth": None}
    model = models.build(cfg, 10)
    assert (model.width, model.depth, model.patch_size, model.gelu_approximate) == (192, 12, 4, False)
    with pytest.raises(
        ValueError, match=r"config\.model\.variant='Ti/4' conflicts with config\.model\.width=64 \(the variant's: 192\)"
    ):
        models.build({**cfg, "width": 64}, 10)
    models.build({**cfg, "width": 192}, 10)  # the variant's own value is no conflict
    with pytest.raises(ValueError, match=r"config\.model\.gelu='erf' is unknown; allowed: \['tanh', 'exact'\]"):
        models.check_config({**cfg, "gelu": "erf"}, 32)
    with pytest.raises(ValueError, match=r"config\.model\.name='resnet' is unknown; allowed: \['cait', 'convmixer', "
                       r"'gpt', 'pvt_v2', 'swin', 'vit'\]"):
        models.build({"name": "resnet"}, 10)


def test_local_crop_position_table_resize_follows_the_antialias_field():
    """DINO resizes position tables bicubically without antialiasing; downsampling with it differs."""
    images = jnp.zeros((1, 4, 4, 1))  # zero pixels and a zero stem bias: block 0's input is cls + table
    inputs = {}
    for antialias in (True, False):
        model = vit.ViT(num_classes=0, patch_size=1, width=8, depth=1, mlp_dim=8, num_heads=2, image_size=8,
                        posemb_antialias=antialias)
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
        block = model.apply({"params": params}, images)[1]["blocks"][0]
        inputs[antialias] = np.asarray(block["sab_skip"] - block["sab"])[:, 1:]
    grid = params["pos_embedding"][:, 1:].reshape(1, 8, 8, 8)
    for antialias in (True, False):
        want = jax.image.resize(grid, (1, 4, 4, 8), "bicubic", antialias=antialias).reshape(1, 16, 8)
        np.testing.assert_allclose(inputs[antialias], want, rtol=1e-5, atol=1e-6)
    assert np.abs(inputs[True] - inputs[False]).max() > 1e-3


def test_drop_path_is_off_without_the_skip():
    # With both skips off, train=True with drop_path=0.5 must equal eval (nothing is dropped).
    block, params, x = _block(False, False)
    train_out, _ = block.apply({"params": params}, x, train=True, rngs={"dropout": jax.random.PRNGKey(3)})
    eval_out, _ = block.apply({"params": params}, x, train=False)
    np.testing.assert_allclose(train_out, eval_out, rtol=1e-6)
    # ... and with the skips on it does drop something.
    block, params, x = _block(True, True)
    train_out, _ = block.apply({"params": params}, x, train=True, rngs={"dropout": jax.random.PRNGKey(3)})
    eval_out, _ = block.apply({"params": params}, x, train=False)
    assert not np.allclose(train_out, eval_out)


@pytest.mark.slow
@pytest.mark.parametrize("pool, posemb", [("tok", "learn"), ("gap", "sincos2d"), ("gap", "learn")])
def test_vit_outputs_and_intermediates(pool, posemb):
    model = vit.ViT(
        num_classes=7, patch_size=2, width=16, depth=3, mlp_dim=32, num_heads=2, pool=pool, posemb=posemb,
        head_zero_init=False,
    )
    images = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 8, 1))
    params = model.init(jax.random.PRNGKey(1), images)["params"]
    logits, out = model.apply({"params": params}, images)
    assert logits.shape == (4, 7) and logits.dtype == jnp.float32
    assert out["patches"].shape == (4, 16, 4)
    assert out["embedding"].shape == (4, 16, 16)
    assert len(out["blocks"]) == 3
    tokens = 16 + (pool == "tok")
    for block in out["blocks"]:
        # keys: TokenCut's features; output / normed (through the final norm): the dense probes'
        # pre_logits: the pooled feature of the model cut after this block (per-layer evaluation)
        assert set(block) == {"sab", "sab_skip", "ffn", "ffn_skip", "keys", "output", "normed", "pre_logits"}
        assert all(v.shape == (4, tokens, 16) for k, v in block.items() if k != "pre_logits")
        assert block["pre_logits"].shape == (4, 16)


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params():
    model = vit.ViT(num_classes=3, patch_size=2, width=16, depth=1, mlp_dim=32, num_heads=2, dtype=jnp.bfloat16)
    images = jnp.ones((2, 8, 8, 1))
    params = model.init(jax.random.PRNGKey(0), images)["params"]
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    _, out = model.apply({"params": params}, images)
    assert out["blocks"][0]["sab"].dtype == jnp.bfloat16


@pytest.mark.slow
def test_position_embedding_resizes_for_other_resolutions():
    model = vit.ViT(num_classes=3, patch_size=2, width=16, depth=1, mlp_dim=32, num_heads=2, image_size=8)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 1)))["params"]
    logits, out = model.apply({"params": params}, jnp.ones((2, 4, 4, 1)))
    assert out["blocks"][0]["sab"].shape == (2, 5, 16)


@pytest.mark.parametrize("scheme", ["skipless", "mimetic"])
def test_joint_attention_init_applies_and_sets_vo_product(scheme):
    model = vit.ViT(num_classes=3, patch_size=2, width=16, depth=2, mlp_dim=32, num_heads=2,
                    skip_sab=False, skip_ffn=False, init_scheme=scheme, init_alpha=2.0, init_beta=0.6, init_c=3.0)
    images = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 1))
    params = model.init(jax.random.PRNGKey(1), images)["params"]
    logits, _ = model.apply({"params": params}, images)  # apply after a joint init
    assert np.isfinite(np.asarray(logits)).all()
    attn = params["block_0"]["MultiHeadAttention_0"]
    s = np.linalg.svd(np.asarray(attn["value"]) @ np.asarray(attn["out"]), compute_uv=False)
    if scheme == "skipless":  # W^V W^O = c² U Vᵀ: every singular value is c² = 9
        np.testing.assert_allclose(s, 9.0, rtol=1e-4)
    # The two layers draw different kernels.
    assert not np.allclose(attn["query"], params["block_1"]["MultiHeadAttention_0"]["query"])


def test_num_classes_zero_is_a_backbone_without_head():
    kw = dict(width=32, depth=1, num_heads=2, mlp_dim=64, patch_size=4)
    images = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    backbone = vit.ViT(num_classes=0, **kw)
    params = backbone.init(jax.random.key(1), images)["params"]
    assert "head" not in params
    features, out = backbone.apply({"params": params}, images)
    assert features.shape == (2, 32)
    np.testing.assert_array_equal(features, out["pre_logits"])
    # The same weights under a classifier give the same features.
    classifier = vit.ViT(num_classes=5, **kw)
    head = classifier.init(jax.random.key(1), images)["params"]["head"]
    _, out5 = classifier.apply({"params": {**params, "head": head}}, images)
    np.testing.assert_array_equal(out5["pre_logits"], features)
