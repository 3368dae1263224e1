"""TokenCut (docs/method/dense.md §7) against an independent transcription of the official code."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
from scipy import ndimage

from skipless_jax.data import dense_sources
from skipless_jax.evaluators import tokencut as tc

# ---------------------------------------------------------------------------------------------
# Reference: a direct float64 transcription of the official TokenCut `ncut` + `detect_box` +
# `bbox_iou`, with a dense generalized eigh of (D − A, D).
# ---------------------------------------------------------------------------------------------


def ref_ncut(feats, dims, patch_size, image_hw, tau=0.2, eps=1e-5):
    feats = np.asarray(feats, np.float64)
    feats = feats / np.maximum(np.linalg.norm(feats, axis=1, keepdims=True), 1e-12)
    A = feats @ feats.T
    A = A > tau  # noqa: SIM300 (A is the affinity matrix, not a constant; the official TokenCut line)
    A = np.where(A.astype(float) == 0, eps, A)
    d_i = np.sum(A, axis=1)
    D = np.diag(d_i)
    eigenvalues, eigenvectors = scipy.linalg.eigh(D - A, D, subset_by_index=[1, 2])
    eigenvec = np.copy(eigenvectors[:, 0])
    second_smallest_vec = eigenvectors[:, 0]
    avg = np.sum(second_smallest_vec) / len(second_smallest_vec)
    bipartition = second_smallest_vec > avg
    seed = np.argmax(np.abs(second_smallest_vec))
    if bipartition[seed] != 1:
        eigenvec = eigenvec * -1
        bipartition = np.logical_not(bipartition)
    bipartition = bipartition.reshape(dims).astype(float)
    objects, _ = ndimage.label(bipartition)
    cc = objects[np.unravel_index(seed, dims)]
    mask = np.where(objects == cc)
    ymin, ymax = min(mask[0]), max(mask[0]) + 1
    xmin, xmax = min(mask[1]), max(mask[1]) + 1
    pred = [patch_size * xmin, patch_size * ymin, patch_size * xmax, patch_size * ymax]
    pred[2] = min(pred[2], image_hw[1])
    pred[3] = min(pred[3], image_hw[0])
    comp = np.zeros(dims, bool)
    comp[mask] = True
    return eigenvec, comp, int(seed), tuple(int(v) for v in pred), eigenvalues, D


def ref_iou(b1, b2):
    inter = max(min(b1[2], b2[2]) - max(b1[0], b2[0]), 0) * max(min(b1[3], b2[3]) - max(b1[1], b2[1]), 0)
    union = (b1[2] - b1[0]) * (b1[3] - b1[1]) + (b2[2] - b2[0]) * (b2[3] - b2[1]) - inter
    return inter / union


def _check_against_reference(keys, dims, patch_size, image_hw):
    ey, emask, eseed, ebox, evals, D = ref_ncut(keys, dims, patch_size, image_hw)
    y, mask, seed = tc.ncut(keys, dims)
    assert evals[1] - evals[0] > 1e-6, "degenerate test input: the eigenvector is not unique"
    # Both D-normalized (yᵀDy = 1) and sign-fixed by the seed rule.
    np.testing.assert_allclose(y @ D @ y, 1.0, rtol=1e-9)
    cos = abs(y @ D @ ey) / np.sqrt((y @ D @ y) * (ey @ D @ ey))
    assert cos == pytest.approx(1.0, abs=1e-9)
    np.testing.assert_allclose(y, ey, atol=1e-7)
    near = np.flatnonzero(np.abs(ey) >= np.abs(ey).max() - 1e-9)
    if len(near) == 1:
        assert seed == eseed
    else:  # |y| tied in exact arithmetic (equivalent tokens): rounding picks among them
        assert seed in near and eseed in near
    np.testing.assert_array_equal(mask, emask)
    assert tc.box(mask, seed, patch_size, image_hw) == ebox
    return y, mask, seed


def _two_clusters(h, w, rows, cols, d=8, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    e = np.eye(d)
    keys = np.tile(e[1], (h * w, 1))
    for r in rows:
        for c in cols:
            keys[r * w + c] = e[0]
    return keys + noise * rng.normal(size=keys.shape)


# ---------------------------------------------------------------------------------------------


def test_two_clusters_object_found():
    h, w, p = 6, 8, 16
    keys = _two_clusters(h, w, rows=range(1, 4), cols=range(2, 6), noise=0.02)
    y, mask, seed = _check_against_reference(keys, (h, w), p, (h * p, w * p))
    expect = np.zeros((h, w), bool)
    expect[1:4, 2:6] = True
    np.testing.assert_array_equal(mask, expect)
    assert mask.reshape(-1)[seed]
    assert y[seed] > y.mean()
    assert tc.box(mask, seed, p, (h * p, w * p)) == (2 * p, 1 * p, 6 * p, 4 * p)


def test_large_object_still_seeded_in_smaller_side_and_sign_fixed():
    # The object covers most of the grid: the seed (largest |y|) is in the smaller set, the
    # foreground is flipped to hold it; the reference agrees on everything.
    h, w, p = 5, 6, 8
    keys = _two_clusters(h, w, rows=range(5), cols=range(5), noise=0.01, seed=3)
    _, mask, _ = _check_against_reference(keys, (h, w), p, (h * p, w * p))
    assert mask[:, 5].all() and not mask[:, :5].any()


def test_strict_tau_binarization():
    sim = np.array([[1.0, 0.2, 0.2 + 1e-12], [0.2, 1.0, 0.19999], [0.2 + 1e-12, 0.19999, 1.0]])
    a = tc.binarize(sim, 0.2, 1e-5)
    np.testing.assert_array_equal(a, [[1, 1e-5, 1], [1e-5, 1, 1e-5], [1, 1e-5, 1]])
    # End to end: (1, 0, 0, 0) and (1, 2, 2, 4)/5 have cosine exactly 0.2 in float64.
    keys = np.array([[1.0, 0, 0, 0], [1.0, 2.0, 2.0, 4.0], [3.0, 0, 0, 0]])
    f = tc.normalize_tokens(keys)
    assert f[0] @ f[1] == 0.2  # the premise: exactly τ
    a = tc.affinity(keys)
    assert a[0, 1] == 1e-5 and a[1, 0] == 1e-5 and a[1, 2] == 1e-5
    assert a[0, 2] == 1.0 and np.all(np.diag(a) == 1.0)
    # The reference applies the same strict rule.
    ref = np.where((f @ f.T > 0.2).astype(float) == 0, 1e-5, f @ f.T > 0.2)
    np.testing.assert_array_equal(a, ref)


def test_zero_token_diagonal_binarized_like_any_entry():
    keys = np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 0.1]])
    a = tc.affinity(keys)
    assert a[1, 1] == 1e-5 and a[0, 0] == 1.0


def test_seed_ties_first_index_and_flip():
    y = np.array([0.5, -1.0, 1.0, 0.2])  # |y| ties at 1 and 2 → seed 1
    yf, fg, seed = tc.bipartition(y)
    assert seed == 1
    np.testing.assert_array_equal(yf, -y)  # seed was below the mean: sign flipped
    np.testing.assert_array_equal(fg, [False, True, False, False])  # complement of y > mean
    yf, fg, seed = tc.bipartition(-y)  # now seed 1 is already foreground
    assert seed == 1
    np.testing.assert_array_equal(yf, -y)
    np.testing.assert_array_equal(fg, [False, True, False, False])
    y2 = np.array([1.0, 0.0, 0.0, 1.0])
    assert tc.bipartition(y2)[2] == 0


def test_four_connectivity_not_eight():
    # Box of the seed's 4-component: diagonal neighbours are separate components.
    mask = np.eye(3, dtype=bool)
    assert tc.box(mask, 0, 4, (12, 12)) == (0, 0, 4, 4)
    assert tc.box(mask, 8, 4, (12, 12)) == (8, 8, 12, 12)
    assert tc.seed_component(mask, 4).sum() == 1
    # ncut end to end: a 2×2 object block plus a diagonal-only neighbour in the foreground.
    h, w, p = 5, 5, 8
    e = np.eye(4)
    keys = np.tile(e[1], (h * w, 1))
    block = [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r, c in block:
        keys[r * w + c] = e[0]
    keys[3 * w + 3] = e[0] + 0.3 * e[1]  # foreground, touching the block only diagonally
    ey, emask, _, ebox, _, _ = ref_ncut(keys, (h, w), p, (h * p, w * p))
    y, mask, seed = tc.ncut(keys, (h, w))
    _, fg, _ = tc.bipartition(y)
    assert fg.reshape(h, w)[3, 3], "premise: the diagonal token is foreground"
    assert ndimage.label(fg.reshape(h, w), structure=np.ones((3, 3)))[1] == 1  # one 8-component
    assert seed in {r * w + c for r, c in block}  # tied tokens: any of the block
    expect = np.zeros((h, w), bool)
    for r, c in block:
        expect[r, c] = True
    np.testing.assert_array_equal(mask, expect)
    np.testing.assert_array_equal(emask, expect)
    assert tc.box(fg.reshape(h, w), seed, p, (h * p, w * p)) == ebox == (p, p, 3 * p, 3 * p)
    np.testing.assert_allclose(np.abs(y), np.abs(ey), atol=1e-7)


def test_box_selects_component_from_raw_bipartition():
    mask = np.zeros((4, 6), bool)
    mask[0:2, 0:2] = True
    mask[2:4, 3:6] = True
    assert tc.box(mask, 0, 10, (40, 60)) == (0, 0, 20, 20)
    assert tc.box(mask, 2 * 6 + 4, 10, (40, 60)) == (30, 20, 60, 40)
    with pytest.raises(ValueError, match="not in the mask"):
        tc.box(mask, 3, 10, (40, 60))


def test_padding_and_clipping():
    img = np.arange(17 * 30 * 3, dtype=np.float32).reshape(17, 30, 3) + 1
    pad = tc.pad_to_patch_multiple(img, 8)
    assert pad.shape == (24, 32, 3) and pad.dtype == img.dtype
    np.testing.assert_array_equal(pad[:17, :30], img)
    assert not pad[17:].any() and not pad[:, 30:].any()
    assert tc.pad_to_patch_multiple(img[:16, :24], 8).shape == (16, 24, 3)
    assert tc.pad_to_patch_multiple(img[..., 0], 16).shape == (32, 32)
    # Grid 3×4 of the padded 24×32 image; an object in the bottom-right corner gets clipped
    # to the unpadded 17×30.
    h, w, p = 3, 4, 8
    keys = _two_clusters(h, w, rows=[1, 2], cols=[2, 3], noise=0.01, seed=1)
    _, mask, seed = _check_against_reference(keys, (h, w), p, (17, 30))
    assert tc.box(mask, seed, p, (17, 30)) == (16, 8, 30, 17)
    assert tc.box(mask, seed, p, (24, 32)) == (16, 8, 32, 24)


def test_ncut_shape_errors():
    with pytest.raises(ValueError, match="patch grid"):
        tc.ncut(np.ones((10, 4)), (3, 4))
    with pytest.raises(ValueError, match="must be"):
        tc.ncut(np.ones((12,)), (3, 4))


def test_iou_and_corloc():
    assert tc.box_iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert tc.box_iou((0, 0, 10, 10), (0, 0, 10, 20)) == 0.5
    assert tc.box_iou((0, 0, 10, 10), (10, 0, 20, 10)) == 0.0  # touching: no +1
    assert tc.box_iou((0, 0, 10, 10), (5, 5, 15, 15)) == pytest.approx(25 / 175)
    assert tc.box_iou((3, 3, 3, 3), (3, 3, 3, 3)) == 0.0
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = np.sort(rng.integers(0, 50, (2, 2)), axis=0).T.reshape(-1)[[0, 2, 1, 3]] + [0, 0, 1, 1]
        b = np.sort(rng.integers(0, 50, (2, 2)), axis=0).T.reshape(-1)[[0, 2, 1, 3]] + [0, 0, 1, 1]
        assert tc.box_iou(a, b) == pytest.approx(ref_iou(a, b), abs=1e-12)
    preds = np.array([[0, 0, 10, 10]] * 5)
    gts = [
        np.array([[50, 50, 60, 60], [1, 0, 10, 10]]),  # hit (second box, IoU 0.9)
        np.array([[50, 50, 60, 60]]),  # miss
        np.zeros((0, 4)),  # no ground truth: miss
        np.array([[0, 0, 10, 20]]),  # IoU exactly 0.5: hit
        np.array([[0, 0, 10, 21]]),  # IoU < 0.5: miss
    ]
    assert tc.corloc(preds, gts) == pytest.approx(2 / 5)
    assert tc.corloc([(0, 0, 10, 10)], [[]]) == 0.0
    with pytest.raises(ValueError, match="images"):
        tc.corloc(preds, gts[:2])


def test_voc_gt_box():
    assert dense_sources.voc_gt_box(1, 1, 500, 375) == (0, 0, 500, 375)
    assert dense_sources.voc_gt_box(48, 240, 195, 371) == (47, 239, 195, 371)


@pytest.mark.parametrize("seed", range(8))
def test_random_inputs_match_reference(seed):
    rng = np.random.default_rng(seed)
    h, w = (int(v) for v in rng.integers(3, 10, 2))
    d = int(rng.integers(8, 33))
    p = int(rng.choice([8, 14, 16]))
    image_hw = (h * p - int(rng.integers(0, p)), w * p - int(rng.integers(0, p)))
    if seed % 2 == 0:
        keys = rng.normal(size=(h * w, d))  # unstructured
    else:  # a random blob of object tokens in a noisy background
        bg, obj = rng.normal(size=(2, d))
        keys = np.tile(bg, (h * w, 1))
        r0, c0 = rng.integers(0, h), rng.integers(0, w)
        rr, cc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blob = ((rr - r0) ** 2 + (cc - c0) ** 2 <= rng.integers(1, 6)).reshape(-1)
        keys[blob] = obj
        keys = keys + 0.7 * rng.normal(size=keys.shape)
    _check_against_reference(keys.astype(np.float32), (h, w), p, image_hw)


# ---------------------------------------------------------------------------------------------
# Canonical grids (docs/method/dense.md §7): a few programs whatever the image sizes, the keys of each
# image equal to the image alone.
# ---------------------------------------------------------------------------------------------

# VOC07-like sizes (H, W): VOC's long side is 500 for nearly every image, the short side varies.
VOC07_LIKE = [(375, 500), (500, 375), (333, 500), (500, 333), (334, 500), (332, 500), (366, 500), (500, 400),
              (281, 500), (500, 500), (360, 480), (353, 500), (374, 500), (500, 335), (357, 500), (338, 500),
              (500, 341), (500, 496), (377, 500), (313, 500), (400, 500), (500, 319), (240, 320), (442, 500)]
VOC07_WEIGHTS = [30, 10, 12, 5, 4, 4, 3, 3, 2, 3, 1, 2, 3, 2, 2, 2, 1, 1, 2, 1, 2, 1, 1, 1]


def voc07_like_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    p = np.asarray(VOC07_WEIGHTS, np.float64)
    return [VOC07_LIKE[i] for i in rng.choice(len(VOC07_LIKE), n, p=p / p.sum())]


def test_candidate_grids_and_canonical_sizes_on_voc07_like_images():
    assert tc.candidate_grids((16, 8), 8) == tuple((h, w) for h in range(9, 17) for w in range(1, 9))
    grids = {tuple(-(-g // 8) * 8 for g in tc.dense_patch_grid(hw, 16)) for hw in voc07_like_sizes(5000)}
    assert len(grids) <= 8, grids  # every size VOC07 draws, patch 16, bucket 8 tokens (128 px)


@pytest.mark.slow
def test_canonical_grids_equal_per_image_keys_and_boxes_with_few_programs():
    """A patch-16 tiny ViT (learned table resized bicubically) on 12 random images of VOC07-like
    sizes (8 shapes, 3 canonical grids): canonical grids (masked attention, the real grid's
    table) give each image's keys and box as the image alone (bucket=0, one program per padded
    shape), in ≤ 8 programs."""
    import jax
    import jax.numpy as jnp

    from skipless_jax import evaluators, models, sharding

    from util import tiny_config

    config = tiny_config()
    config.dataset.name = "voc07_boxes"
    config.model.update(dict(patch_size=16, pool="tok"))
    model = models.build(config.model, 0, image_size=64)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 64, 64, 3)))["params"]
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1}, jax.devices()[:1])  # the programs, not their sharding
    ctx = evaluators.Context(config, mesh, 20, outputs=lambda p, x: model.apply({"params": p}, x)[1])
    params = jax.device_put(params, sharding.replicated(mesh))
    rng = np.random.default_rng(0)
    records = [{"image": rng.integers(0, 256, (*hw, 3), dtype=np.uint8), "boxes": np.array([[0, 0, 50, 50.0]])}
               for hw in voc07_like_sizes(12)]

    class Source:
        def __len__(self):
            return len(records)

        def __getitem__(self, i):
            return dict(records[i])

    results = {}
    for bucket in (8, 0):
        ev = tc.TokenCut("tc", "tc", None, "x", ctx, dataset="voc07_boxes", bucket=bucket, chunk=24)
        ev.records = Source
        results[bucket] = ev.boxes(params)[0]
        if bucket:
            programs = ev._bucket_keys._cache_size()
        else:
            shapes = ev._keys._cache_size()
    np.testing.assert_array_equal(results[8], results[0])
    assert 1 < programs <= 8 and programs < shapes, (programs, shapes)
    # The keys themselves: one image alone vs on its canonical grid with another size beside it.
    ev = tc.TokenCut("tc", "tc", None, "x", ctx, dataset="voc07_boxes")
    info = ev.info
    from skipless_jax.data import pipeline

    a, b = records[0]["image"], records[1]["image"]
    xa = tc.pad_to_patch_multiple(pipeline.normalize(a, info.mean, info.std), 16)
    alone = np.asarray(ev._keys(params, {"image": jnp.asarray(xa[None])}))[0, 1:]
    key = ev.canonical(a.shape[:2])
    cands = tc.candidate_grids(key, 8)
    canvas = np.zeros((8, key[0] * 16, key[1] * 16, 3), np.float32)
    canvas[0, : xa.shape[0], : xa.shape[1]] = xa
    grid = np.zeros((8,), np.int32)
    grid[0] = cands.index(tc.dense_patch_grid(a.shape[:2], 16))
    if ev.canonical(b.shape[:2]) == key:
        xb = tc.pad_to_patch_multiple(pipeline.normalize(b, info.mean, info.std), 16)
        canvas[1, : xb.shape[0], : xb.shape[1]] = xb
        grid[1] = cands.index(tc.dense_patch_grid(b.shape[:2], 16))
    keys = np.asarray(ev._bucket_keys(params, jnp.asarray(canvas), jnp.asarray(grid), cands, key))[0, 1:]
    gh, gw = tc.dense_patch_grid(a.shape[:2], 16)
    np.testing.assert_allclose(keys.reshape(*key, -1)[:gh, :gw].reshape(gh * gw, -1), alone, rtol=1e-5, atol=1e-5)


def test_attention_key_mask_equals_attention_over_the_kept_tokens_alone():
    """MultiHeadAttention(key_mask): the kept tokens' outputs and attention maps equal the module
    run on the kept tokens alone, masked keys get weight 0, the keys themselves are unchanged; the
    mask differs per batch row, and without it the outputs differ (the test can fail)."""
    import jax
    import jax.numpy as jnp

    from skipless_jax.models.attention import MultiHeadAttention

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 7, 8)).astype(np.float32)
    keep = np.ones((2, 7), bool)
    keep[0, [2, 5]] = False
    keep[1, 6] = False
    module = MultiHeadAttention(num_heads=2, capture_attention=True)
    params = module.init(jax.random.PRNGKey(0), jnp.asarray(x))
    masked, masked_details = module.apply(params, jnp.asarray(x), key_mask=jnp.asarray(keep))
    for b in range(2):
        alone, details = module.apply(params, jnp.asarray(x[b : b + 1, keep[b]]))
        np.testing.assert_allclose(np.asarray(masked)[b, keep[b]], np.asarray(alone)[0], rtol=1e-5, atol=1e-6)
        maps = np.asarray(masked_details["attention"])[b]
        assert np.all(maps[:, :, ~keep[b]] == 0)  # no query reads a masked key
        np.testing.assert_allclose(maps[:, keep[b]][:, :, keep[b]], np.asarray(details["attention"])[0], atol=1e-6)
    np.testing.assert_array_equal(masked_details["keys"], module.apply(params, jnp.asarray(x))[1]["keys"])
    unmasked, _ = module.apply(params, jnp.asarray(x))
    assert not np.allclose(np.asarray(unmasked)[0, keep[0]], np.asarray(masked)[0, keep[0]], atol=1e-3)
