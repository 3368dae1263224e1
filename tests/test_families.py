"""The ConvMixer, Swin, CaiT and PVTv2 families (docs/method/families.md §10): shapes, timm's parameter
counts, the skip switches, `out['blocks']` for the κ analysis, Token Graying on the stems, the
skipless init per family, CaiT's LayerScale rule, and Swin's shifted-window attention against a
float64 numpy reading.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax import conditioning, models
from skipless_jax.models import cait, common, convmixer, family_parts, pvt_v2, stem, swin
from skipless_jax.models.attention import MultiHeadAttention

from util import init_params, tiny_model

FAMILIES = {m.FAMILY: m for m in (convmixer, swin, cait, pvt_v2)}
SIZE = 8

# timm's published parameter counts (ConvMixer-256/8 on CIFAR-10: 10 classes).
TIMM_COUNTS = [
    ("convmixer", "256/8", 10, 32, 594_186),
    ("convmixer", "768/32", 1000, 224, 21_110_248),
    ("convmixer", "1536/20", 1000, 224, 51_625_960),
    ("swin", "T", 1000, 224, 28_288_354),
    ("swin", "S", 1000, 224, 49_606_258),
    ("swin", "B", 1000, 224, 87_768_224),
    ("cait", "XXS24", 1000, 224, 11_956_264),
    ("cait", "S24", 1000, 224, 46_916_200),
    ("pvt_v2", "b0", 1000, 224, 3_666_760),
    ("pvt_v2", "b1", 1000, 224, 14_009_000),
    ("pvt_v2", "b2", 1000, 224, 25_362_856),
    ("pvt_v2", "b3", 1000, 224, 45_238_696),
]


def _cfg(family: str, **fields):
    base = tiny_model({"name": family}, SIZE)
    if family == "swin":  # two blocks in stage 0: the second is shifted (grid 4, window 2)
        base.update(depths=(2, 1))
    if family == "convmixer":
        base.update(depth=2)
    if family == "cait":
        base.update(depth=2)
    if family == "pvt_v2":
        base.update(depths=(2, 1))
    base.update(fields)
    return base


def _images(n: int = 2, size: int = SIZE, channels: int = 1, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (n, size, size, channels))


_CACHE: dict = {}


def _run(family: str, images=None, params=None, **fields):
    """(logits, out, params) of the tiny model; params initialized once per config."""
    cfg = _cfg(family, **fields)
    models.check_config(cfg, SIZE)
    model = models.build(cfg, 10)
    images = _images() if images is None else images
    if params is None:
        key = (family, tuple(sorted((k, str(v)) for k, v in fields.items())))
        if key not in _CACHE:
            _CACHE[key] = init_params(model, {"params": jax.random.PRNGKey(1)}, images, train=False)
        params = _CACHE[key]
    logits, out = jax.jit(lambda p, x: model.apply({"params": p}, x, train=False))(params, images)
    return logits, out, params


@pytest.mark.slow
@pytest.mark.parametrize("family, variant, classes, size, count", TIMM_COUNTS)
def test_parameter_counts_equal_timms(family, variant, classes, size, count):
    cfg = {"name": family, "variant": variant}
    models.check_config(cfg, size)
    model = models.build(cfg, classes)
    shapes = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0)}, jnp.zeros((1, size, size, 3)),
                                               train=False))["params"]
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == count


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shapes_and_blocks_for_the_kappa_analysis(family):
    logits, out, _ = _run(family)
    assert logits.shape == (2, 10) and logits.dtype == jnp.float32
    assert out["pre_logits"].ndim == 2 and np.all(np.isfinite(out["pre_logits"]))
    assert out["blocks"], family
    for block in out["blocks"]:
        assert set(conditioning.EMBEDDING_POINTS) <= set(block)
        shapes = {block[p].shape for p in conditioning.EMBEDDING_POINTS}
        assert len(shapes) == 1 and len(shapes.pop()) == 3
    # What conditioning.embedding_log_kappa computes, over the layers of the first stage (one shape).
    first = [b for b in out["blocks"] if b["sab"].shape == out["blocks"][0]["sab"].shape]
    if family != "swin":  # one family is enough (the SVDs compile slowly on XLA:CPU)
        first = []
    kappa = conditioning.embedding_log_kappa({"blocks": first}) if first else {}
    assert all(v.shape == (len(first),) and np.all(np.isfinite(v)) for v in kappa.values())
    backbone = models.build(_cfg(family), 0)
    params = {k: v for k, v in _run(family)[2].items() if k != "head"}
    features, _ = jax.jit(lambda p, x: backbone.apply({"params": p}, x, train=False))(params, _images())
    np.testing.assert_allclose(features, out["pre_logits"], rtol=1e-4, atol=1e-6)


def _stream_after_sab(block):
    """The residual stream after ② as the block saw it (③+④ − ③ = the FFN's input)."""
    return np.asarray(block["ffn_skip"] - block["ffn"])


def _block_input(block):
    return np.asarray(block["sab_skip"] - block["sab"])


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_skip_switch_removes_its_residual(family):
    on = _run(family)[1]["blocks"]
    off_sab = _run(family, skip_sab=False)[1]["blocks"]
    for blocks, with_skip in ((on, True), (off_sab, False)):
        want = blocks[0]["sab_skip"] if with_skip else blocks[0]["sab"]
        np.testing.assert_allclose(_stream_after_sab(blocks[0]), want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(on[0]["sab"], on[0]["sab_skip"], atol=1e-3)  # the two readings differ
    if family == "convmixer":  # the pointwise part has no residual: the next block reads ③ alone
        np.testing.assert_allclose(_block_input(on[1]), on[0]["ffn"], rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match=r"config.model.skip_ffn=True: ConvMixer has no residual"):
            models.check_config(_cfg(family, skip_ffn=True), SIZE)
        return
    off_ffn = _run(family, skip_ffn=False)[1]["blocks"]
    np.testing.assert_allclose(_block_input(on[1]), on[0]["ffn_skip"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_block_input(off_ffn[1]), off_ffn[0]["ffn"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_cait_class_attention_switches_and_layerscale_rule():
    _, out, params = _run("cait")
    np.testing.assert_allclose(params["block_0"]["gamma_1"], 1e-5)
    np.testing.assert_allclose(params["class_block_0"]["gamma_2"], 1e-5)
    assert out["class_blocks"][0]["sab"].shape == (2, 1, 16)
    _, off, p_off = _run("cait", skip_sab=False, skip_class_ffn=False)
    np.testing.assert_allclose(p_off["block_0"]["gamma_1"], 1.0)  # no skip beside it: γ starts at 1
    np.testing.assert_allclose(p_off["block_0"]["gamma_2"], 1e-5)
    np.testing.assert_allclose(p_off["class_block_0"]["gamma_1"], 1e-5)
    np.testing.assert_allclose(p_off["class_block_0"]["gamma_2"], 1.0)
    cb = off["class_blocks"][0]
    np.testing.assert_allclose(_stream_after_sab(cb), cb["sab_skip"], rtol=1e-4, atol=1e-6)  # class ② on
    # class ④ off: the encoded class token is LN(③) alone
    ln = family_parts.layer_norm(cait.LN_EPS, jnp.float32)
    want = ln.apply({"params": p_off["encoder_norm"]}, cb["ffn"][:, 0])
    np.testing.assert_allclose(off["encoded"][:, 0], want, rtol=1e-4, atol=1e-5)
    # Without its skip the branch is O(1), not O(1e-5): the signal is not scaled away.
    assert float(np.abs(off["blocks"][0]["sab"]).mean()) > 1e-2 > float(np.abs(out["blocks"][0]["sab"]).mean())


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_token_graying_acts_on_the_stem_stride_patch_matrix(family):
    images = _images(seed=3)
    p = _cfg(family)["patch_size"]
    _, plain, params = _run(family, images=images)
    _, grayed, _ = _run(family, images=images, params=params, token_graying="dct", tg_eps=0.6)
    want = stem.token_gray_patches(common.patchify(images, p), "dct", 0.6)
    np.testing.assert_allclose(grayed["patches"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(plain["patches"], common.patchify(images, p), rtol=1e-6)
    assert not np.allclose(grayed["pre_logits"], plain["pre_logits"], atol=1e-4)
    # TG then the model's own stem = the model without TG on the grayed image.
    regrayed = stem.token_gray_images(images, p, "dct", 0.6)
    _, again, _ = _run(family, images=regrayed, params=params)
    np.testing.assert_allclose(again["pre_logits"], grayed["pre_logits"], rtol=1e-4, atol=1e-5)


def _svals(m) -> np.ndarray:
    return np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)


SKIPLESS = dict(init="skipless", init_alpha=2.0, init_beta=0.6, init_c=3.0)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_skipless_init_per_family(family):
    _, _, params = _run(family, skip_sab=False, **SKIPLESS)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    values = [k for k in flat if k.endswith("/value")]
    assert len(values) == (0 if family == "convmixer" else len(_run(family)[1]["blocks"]) + (
        _cfg(family).get("depth_token_only", 0) if family == "cait" else 0))
    for name in values:  # W^V W^O = c² U Vᵀ for the whole layer
        np.testing.assert_allclose(_svals(flat[name] @ flat[name[:-len("value")] + "out"]), 9.0, rtol=1e-4)
    mlp_kernels = [k for k in flat if re.search(r"(Dense_[01]|fc[12]|pointwise)/kernel$", k)]
    assert mlp_kernels
    for name in mlp_kernels:
        n_in, n_out = flat[name].shape
        np.testing.assert_allclose(_svals(flat[name]), max(math.sqrt(n_out / n_in), 1.0), rtol=1e-4)
    for name in (k for k in flat if re.search(r"(Dense_[01]|fc[12]|pointwise)/bias$", k)):
        np.testing.assert_array_equal(flat[name], 0.0)
    if family == "swin":
        np.testing.assert_allclose(_svals(flat["stage_1_merge/kernel"]), 1.0, rtol=1e-4)
    if family == "pvt_v2":
        dw = np.asarray(flat["stage_0_block_0/mlp/dwconv/kernel"])
        np.testing.assert_array_equal(dw, np.asarray(family_parts.dirac_init(None, dw.shape)))
        for name in ("stage_0_block_0/sra/sr/kernel", "stage_1_downsample/proj/kernel"):
            k = np.asarray(flat[name])
            np.testing.assert_allclose(_svals(k.reshape(-1, k.shape[-1])), 1.0, rtol=1e-4)
    if family == "cait":  # talking heads start as the identity
        for name in ("proj_l", "proj_w"):
            np.testing.assert_array_equal(flat[f"block_0/attention/{name}"], np.eye(2))
            np.testing.assert_array_equal(flat[f"block_0/attention/{name}_bias"], 0.0)
        np.testing.assert_allclose(flat["block_0/gamma_1"], 1.0)


@pytest.mark.slow
def test_cait_identity_talking_heads_is_plain_attention():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 8))
    plain = MultiHeadAttention(2, init_scheme="skipless", init_c=1.0)
    talking = MultiHeadAttention(2, init_scheme="skipless", init_c=1.0, talking_heads=True)
    params = talking.init({"params": jax.random.PRNGKey(2)}, x)["params"]
    inner = {k: v for k, v in params.items() if not k.startswith("proj_")}
    np.testing.assert_allclose(talking.apply({"params": params}, x)[0], plain.apply({"params": inner}, x)[0], rtol=1e-5)
    mixed = dict(params, proj_l=params["proj_l"][::-1])
    assert not np.allclose(talking.apply({"params": mixed}, x)[0], plain.apply({"params": inner}, x)[0], atol=1e-4)


# ------------------------------------------------------------------ Swin windows vs numpy


def _np_layer_norm(x, p, eps):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * np.asarray(p["scale"], np.float64) + np.asarray(p["bias"], np.float64)


def _np_shifted_window_attention(x, grid, ws, shift, heads, params):
    """Float64 reading of (S)W-MSA on one image x (H·W, C): per query token, attention over the
    tokens of its window in the rolled map that were neighbours before the roll (same wrap)."""
    h, w = grid
    n, c = x.shape
    dh = c // heads
    att = {k: np.asarray(v, np.float64) for k, v in params["attention"].items()}
    table = np.asarray(params["relative_position_bias"], np.float64)
    rolled = np.roll(x.reshape(h, w, c), (-shift, -shift), axis=(0, 1)).reshape(n, c)
    q = rolled @ att["query"] + att["query_bias"]
    k = rolled @ att["key"] + att["key_bias"]
    v = rolled @ att["value"] + att["value_bias"]
    out = np.zeros((n, c))
    coords = [(i, j) for i in range(h) for j in range(w)]
    for a, (ia, ja) in enumerate(coords):
        mates = []
        for b, (ib, jb) in enumerate(coords):
            same_window = ia // ws == ib // ws and ja // ws == jb // ws
            same_wrap = (ia + shift >= h) == (ib + shift >= h) and (ja + shift >= w) == (jb + shift >= w)
            if same_window and (shift == 0 or same_wrap):
                mates.append(b)
        for head in range(heads):
            cols = slice(head * dh, (head + 1) * dh)
            logits = []
            for b in mates:
                ib, jb = coords[b]
                di, dj = (ia % ws) - (ib % ws), (ja % ws) - (jb % ws)
                bias = table[(di + ws - 1) * (2 * ws - 1) + dj + ws - 1, head]
                logits.append(q[a, cols] @ k[b, cols] / math.sqrt(dh) + bias)
            probs = np.exp(np.array(logits) - max(logits))
            probs /= probs.sum()
            out[a, cols] = probs @ v[mates, cols]
    out = out @ att["out"] + att["out_bias"]
    return np.roll(out.reshape(h, w, c), (shift, shift), axis=(0, 1)).reshape(n, c)


@pytest.mark.slow
def test_swin_shifted_window_attention_matches_numpy():
    cfg = dict(width=8, depths=(2,), num_heads=(2,), window_size=2, patch_size=1)
    images = _images(n=1, size=4, seed=5)
    model = models.build({"name": "swin", **cfg}, 3)
    params = init_params(model, {"params": jax.random.PRNGKey(4)}, images, train=False)
    params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(9), x.shape), params)
    _, out = model.apply({"params": params}, images, train=False)
    assert swin.window_size_and_shift((4, 4), 2, 1) == (2, 1)
    for j, shift in ((0, 0), (1, 1)):
        block, p = out["blocks"][j], params[f"stage_0_block_{j}"]
        x = _np_layer_norm(_block_input(block)[0], p["norm1"], swin.LN_EPS)
        want = _np_shifted_window_attention(x, (4, 4), 2, shift, 2, p["window_attention"])
        np.testing.assert_allclose(np.asarray(block["sab"][0], np.float64), want, rtol=2e-4, atol=2e-5)
    # The mask matters: attention over the whole window (no mask) gives something else.
    x = _np_layer_norm(_block_input(out["blocks"][1])[0], params["stage_0_block_1"]["norm1"], swin.LN_EPS)
    unmasked = _np_shifted_window_attention(x, (4, 4), 2, 0, 2, params["stage_0_block_1"]["window_attention"])
    assert not np.allclose(np.asarray(out["blocks"][1]["sab"][0]), unmasked, atol=1e-3)


def test_swin_helpers_against_their_definitions():
    idx = swin.relative_position_index(3)
    for a in range(9):
        for b in range(9):
            assert idx[a, b] == (a // 3 - b // 3 + 2) * 5 + (a % 3 - b % 3 + 2)
    mask = swin.shift_mask(4, 4, 2, 1)
    assert mask.shape == (4, 1, 4, 4)
    np.testing.assert_array_equal(mask[0], 0.0)  # the top-left window holds one region
    assert (mask[3] == swin.MASK_VALUE).sum() == 12  # the corner window: 4 regions of one token


def test_config_errors_are_one_line():
    cases = [
        ({"name": "swin", "variant": "XL"}, 224, r"config.model.variant='XL' is not a swin variant; allowed"),
        ({"name": "swin", "variant": "S", "width": 64}, 224, r"conflicts with config.model.width=64"),
        ({"name": "cait", "variant": "S24", "mlp_ratio": 4}, 224, r"config.model.mlp_ratio is not a field of the cait"),
        ({"name": "swin", "variant": "T"}, 200, r"needs the image size 200 divisible by 32"),
        ({"name": "pvt_v2", **dict(pvt_v2.VARIANTS["b0"], num_heads=(1, 2))}, 224, r"num_heads=\(1, 2\) has 2 entries"),
        ({"name": "convmixer", **dict(convmixer.VARIANTS["256/8"], activation="tanh")}, 32,
         r"activation='tanh' is unknown"),
        ({"name": "cait", "variant": "XXS24", "layerscale_init": 0.0}, 224, r"layerscale_init=0.0 must be in \(0, 1\]"),
        ({"name": "swin", "variant": "T", "token_graying": "fft"}, 224, r"fft"),
    ]
    for cfg, size, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            models.check_config(cfg, size)
        assert "\n" not in str(err.value)

