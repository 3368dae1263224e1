"""TokenCut object discovery (docs/method/dense.md §7), with the official TokenCut code's semantics.

numpy/scipy only, all on the host in float64. For one image:

1. keys: the chosen block's key projection of LN1(x), heads concatenated, CLS dropped:
   (n, d) with n = h·w patch tokens in row-major order of the (h, w) patch grid;
2. `affinity`: F = keys L2-normalized per token, A = F Fᵀ, binarized A_ij > τ → 1 (strict),
   else ε; the diagonal is binarized like every other entry (it is 1 for any non-zero token);
3. `second_smallest_eigenvector`: the second-smallest generalized eigenvector of
   (D − A) y = λ D y, D = diag(A·1), D-normalized (yᵀ D y = 1);
4. `bipartition`: foreground = y > mean(y); seed = argmax |y| (first index on ties); when the
   seed is not foreground, the partition is complemented and y's sign flipped;
5. `seed_component` / `box`: the 4-connected component of the foreground on the (h, w) grid
   that holds the seed, and its box [x0·p, y0·p, (x1+1)·p, (y1+1)·p] clipped to the unpadded
   image (W, H);
6. `corloc`: images whose box has IoU ≥ 0.5 with any ground-truth box ÷ images evaluated.

Images are zero-padded at the bottom/right to a multiple of the patch size after
normalization (`pad_to_patch_multiple`), so boxes can reach past the image and get clipped.
Boxes are (x0, y0, x1, y1) in pixels, x1/y1 exclusive (area (x1 − x0)·(y1 − y0)); VOC's
1-based inclusive annotations convert with `data/dense_sources.voc_gt_box`.

The functions above are numpy/scipy only; `TokenCut` at the end is the evaluator
(`config.evals.<name> = dict(type='tokencut', ...)`): it computes the keys on the device mesh
and runs the cut on the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from skipless_jax.checks import is_finite

METHOD_REF = "docs/method/dense.md §7"
TAU = 0.2
EPS = 1e-5
CORLOC_IOU = 0.5

Box = tuple[int, int, int, int]


def pad_to_patch_multiple(image: np.ndarray, patch_size: int) -> np.ndarray:
    """Zero-pad an (H, W, C) (or (H, W)) image at the bottom/right to multiples of `patch_size`.

    Apply it after normalization (the padding is zeros of the normalized image, as in the
    official code). Returns (⌈H/p⌉·p, ⌈W/p⌉·p, C) of the input's dtype; the unpadded (H, W)
    is what `box` clips to. docs/method/dense.md §7.
    """
    image = np.asarray(image)
    if image.ndim not in (2, 3):
        raise ValueError(f"pad_to_patch_multiple: image must be (H, W) or (H, W, C), got shape {image.shape}")
    if patch_size < 1:
        raise ValueError(f"pad_to_patch_multiple: patch_size={patch_size} must be >= 1")
    h, w = image.shape[:2]
    ph, pw = -(-h // patch_size) * patch_size, -(-w // patch_size) * patch_size
    pad = [(0, ph - h), (0, pw - w)] + [(0, 0)] * (image.ndim - 2)
    return np.pad(image, pad, mode="constant", constant_values=0)


def normalize_tokens(keys: np.ndarray) -> np.ndarray:
    """(n, d) → (n, d) float64, each row divided by max(‖row‖₂, 1e-12) (torch F.normalize)."""
    keys = np.asarray(keys, dtype=np.float64)
    if keys.ndim != 2:
        raise ValueError(f"tokencut: keys must be (n, d) patch tokens (CLS dropped), got shape {keys.shape}")
    norms = np.linalg.norm(keys, axis=1, keepdims=True)
    return keys / np.maximum(norms, 1e-12)


def binarize(similarity: np.ndarray, tau: float = TAU, eps: float = EPS) -> np.ndarray:
    """(n, n) cosine similarities → (n, n) float64 graph: 1 where > tau (strict), else eps.

    The official `A = A > tau; A = np.where(A.astype(float) == 0, eps, A)`: every entry, the
    diagonal included, goes through the same rule. docs/method/dense.md §7.
    """
    similarity = np.asarray(similarity, dtype=np.float64)
    return np.where(similarity > tau, 1.0, eps)


def affinity(keys: np.ndarray, tau: float = TAU, eps: float = EPS) -> np.ndarray:
    """(n, d) keys → (n, n) binarized affinity A of normalized tokens (float64). docs/method/dense.md §7."""
    f = normalize_tokens(keys)
    return binarize(f @ f.T, tau, eps)


def second_smallest_eigenvector(a: np.ndarray) -> np.ndarray:
    """(n, n) symmetric affinity → (n,) second-smallest generalized eigenvector of (D − A, D).

    Solved in the symmetric form: with D = diag(A·1), u is the eigenvector of the second-
    smallest eigenvalue of I − D^{-½} A D^{-½} and y = D^{-½} u, so yᵀ D y = 1, the scale
    `scipy.linalg.eigh(D − A, D)` returns. The sign is arbitrary (`bipartition` fixes it).
    docs/method/dense.md §7.
    """
    a = np.asarray(a, dtype=np.float64)
    n = a.shape[0]
    if a.ndim != 2 or a.shape[1] != n or n < 2:
        raise ValueError(f"tokencut: affinity must be (n, n) with n >= 2, got shape {a.shape}")
    d = a.sum(axis=1)
    if np.any(d <= 0):
        raise ValueError("tokencut: the affinity has a token of zero degree")
    s = 1.0 / np.sqrt(d)
    lsym = np.eye(n) - s[:, None] * a * s[None, :]
    lsym = 0.5 * (lsym + lsym.T)
    import scipy.linalg  # here, not at import: every command imports the evaluators, few run TokenCut

    _, u = scipy.linalg.eigh(lsym, subset_by_index=[1, 1])
    return s * u[:, 0]


def bipartition(eigenvector: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(n,) eigenvector y → (y with fixed sign (n,), foreground (n,) bool, seed int).

    foreground = y > mean(y); seed = argmax |y| (first index on ties); if the seed is not in
    the foreground, foreground := its complement and y := −y (the official code), so the
    returned y has y[seed] above its mean. docs/method/dense.md §7.
    """
    y = np.asarray(eigenvector, dtype=np.float64).copy()
    avg = np.sum(y) / len(y)
    fg = y > avg
    seed = int(np.argmax(np.abs(y)))
    if not fg[seed]:
        y = -y
        fg = np.logical_not(fg)
    return y, fg, seed


def seed_component(mask: np.ndarray, seed: int) -> np.ndarray:
    """(h, w) bool mask, flat seed index → (h, w) bool: the seed's 4-connected component.

    `scipy.ndimage.label` with its default cross structure (4-connectivity); the seed indexes
    the grid in row-major order and must lie in the mask. docs/method/dense.md §7.
    """
    mask = np.asarray(mask, dtype=bool)
    if mask.ndim != 2:
        raise ValueError(f"tokencut: mask must be (h, w), got shape {mask.shape}")
    if not 0 <= seed < mask.size:
        raise ValueError(f"tokencut: seed={seed} is outside the {mask.shape} grid")
    rc = np.unravel_index(seed, mask.shape)
    if not mask[rc]:
        raise ValueError(f"tokencut: seed={seed} (row, col)={tuple(int(v) for v in rc)} is not in the mask")
    from scipy import ndimage

    labels, _ = ndimage.label(mask)
    return labels == labels[rc]


def ncut(
    keys: np.ndarray, grid_hw: tuple[int, int], tau: float = TAU, eps: float = EPS
) -> tuple[np.ndarray, np.ndarray, int]:
    """TokenCut's normalized cut on one image's patch keys. docs/method/dense.md §7.

    keys: (n, d) patch keys (CLS dropped, heads concatenated), n = h·w in row-major order of
    grid_hw = (h, w). Returns (eigenvector (n,) float64, D-normalized, sign fixed so that the
    seed is foreground; mask (h, w) bool: the seed's 4-connected component of the foreground
    — not the whole bipartition; seed: flat index of argmax |eigenvector|).
    """
    h, w = (int(v) for v in grid_hw)
    keys = np.asarray(keys)
    if keys.ndim != 2 or keys.shape[0] != h * w:
        raise ValueError(f"tokencut: keys {keys.shape} do not match the {h}x{w} patch grid (CLS must be dropped)")
    y = second_smallest_eigenvector(affinity(keys, tau, eps))
    y, fg, seed = bipartition(y)
    return y, seed_component(fg.reshape(h, w), seed), seed


def box(mask: np.ndarray, seed: int, patch_size: int, image_hw: tuple[int, int]) -> Box:
    """Pixel box (x0, y0, x1, y1) of the seed's 4-connected component of `mask`. docs/method/dense.md §7.

    mask: (h, w) bool patch grid (a raw bipartition or `ncut`'s component; the component is
    selected here either way); seed: flat row-major index; image_hw: the unpadded (H, W).
    Returns [x0·p, y0·p, (x1+1)·p, (y1+1)·p] with x1 ≤ W and y1 ≤ H after clipping.
    """
    comp = seed_component(mask, seed)
    rows, cols = np.nonzero(comp)
    p = int(patch_size)
    hh, ww = (int(v) for v in image_hw)
    x0, y0 = int(cols.min()) * p, int(rows.min()) * p
    x1, y1 = (int(cols.max()) + 1) * p, (int(rows.max()) + 1) * p
    return x0, y0, min(x1, ww), min(y1, hh)


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two (x0, y0, x1, y1) boxes, areas (x1 − x0)·(y1 − y0) (no +1). docs/method/dense.md §7.

    The official `bbox_iou` semantics without its 1e-7 guard terms (which vanish in its
    float32 arithmetic), so an IoU of exactly 0.5 is 0.5; an empty union gives 0.
    """
    ax0, ay0, ax1, ay1 = (float(v) for v in a)
    bx0, by0, bx1, by1 = (float(v) for v in b)
    inter = max(min(ax1, bx1) - max(ax0, bx0), 0.0) * max(min(ay1, by1) - max(ay0, by0), 0.0)
    union = (ax1 - ax0) * (ay1 - ay0) + (bx1 - bx0) * (by1 - by0) - inter
    return inter / union if union > 0 else 0.0


def corloc(
    pred_boxes: Sequence[Sequence[float]] | np.ndarray,
    gt_boxes_per_image: Sequence[np.ndarray],
    iou: float = CORLOC_IOU,
) -> float:
    """CorLoc: fraction of images whose box has IoU ≥ `iou` (0.5) with any ground-truth box. docs/method/dense.md §7.

    pred_boxes: (N, 4), one box per image; gt_boxes_per_image: N arrays (k_i, 4) (k_i = 0: the
    image counts as a miss). Returns hits / N (N = 0 raises).
    """
    preds = np.asarray(pred_boxes, dtype=np.float64).reshape(-1, 4)
    if len(preds) != len(gt_boxes_per_image):
        raise ValueError(f"corloc: {len(preds)} predicted boxes for {len(gt_boxes_per_image)} images")
    if len(preds) == 0:
        raise ValueError("corloc: no images to evaluate")
    hits = 0
    for pred, gts in zip(preds, gt_boxes_per_image):
        gts = np.asarray(gts, dtype=np.float64).reshape(-1, 4)
        if any(box_iou(pred, g) >= iou for g in gts):
            hits += 1
    return hits / len(preds)


# ---------------------------------------------------------------------------------------------
# The evaluator.
# ---------------------------------------------------------------------------------------------


def validate_tokencut(block: Any, tau: Any, eps: Any, iou: Any, where: str = "config.evals.tokencut") -> None:
    """One-line ValueError for a bad block, tau, eps or iou (before anything compiles)."""
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool):
        raise ValueError(f"{where}.block={block!r} must be an integer block index (-1: the last block)")
    if not is_finite(tau) or not -1.0 <= tau < 1.0:
        raise ValueError(f"{where}.tau={tau!r} must be a number in [-1, 1) (a cosine-similarity threshold)")
    if not is_finite(eps) or not 0.0 < eps <= 1.0:
        raise ValueError(f"{where}.eps={eps!r} must be a number in (0, 1] (the weight of non-edges)")
    if not is_finite(iou) or not 0.0 < iou <= 1.0:
        raise ValueError(f"{where}.iou={iou!r} must be a number in (0, 1]")


def dense_patch_grid(hw: tuple[int, int], p: int) -> tuple[int, int]:
    """The token grid of an (H, W) image padded to a multiple of p: (⌈H/p⌉, ⌈W/p⌉)."""
    return -(-hw[0] // p), -(-hw[1] // p)


def sharding_shards(mesh: Any) -> int:
    from skipless_jax import sharding

    return sharding.num_data_shards(mesh)


def candidate_grids(canonical: tuple[int, int], bucket: int) -> tuple[tuple[int, int], ...]:
    """Every real token grid (gh, gw) that pads to the canonical grid: Gh − bucket < gh ≤ Gh (and w)."""
    gh, gw = canonical
    return tuple((h, w) for h in range(max(gh - bucket + 1, 1), gh + 1) for w in range(max(gw - bucket + 1, 1), gw + 1))


def bucket_keys(outputs: Any, block: int, params: Any, images: jax.Array, grid: jax.Array,
                candidates: tuple[tuple[int, int], ...], canonical: tuple[int, int]) -> jax.Array:
    """Keys (B, extra + Gh·Gw, d) of block `block` for images (B, Gh·p, Gw·p, C) zero-padded to the
    canonical grid (Gh, Gw), image b's real grid candidates[grid[b]]: the ViT's position table
    is the real grid's (`_position_embedding` at (gh, gw), laid on the canonical grid, 0 on the
    padding), and every attention masks the padding's keys, so the real tokens' keys are those of
    the image alone (docs/method/dense.md §7)."""
    import flax.linen as nn

    from skipless_jax.models.attention import MultiHeadAttention
    from skipless_jax.models.common import resize_posemb

    gh_c, gw_c = canonical
    masks = np.stack([np.pad(np.ones(c, bool), ((0, gh_c - c[0]), (0, gw_c - c[1]))).reshape(-1) for c in candidates])
    valid = jnp.asarray(masks)[grid]  # (B, Gh·Gw)

    def intercept(next_fun, args, kwargs, context):
        if context.method_name == "_position_embedding":  # (grid_h, grid_w, d) of the canonical grid
            d, vit = args[2], context.module
            if vit.posemb != "sincos2d":  # the learned table, read once, resized as the ViT does
                native = (vit.image_size // vit.patch_size,) * 2
                table = next_fun(*native, d)
            tables = []
            for h, w in candidates:
                if vit.posemb == "sincos2d":
                    pe = next_fun(h, w, d)
                else:
                    pe = table if (h, w) == native else resize_posemb(
                        table, h, w, antialias=vit.posemb_antialias, extra=int(vit.pool != "gap"))
                extra = pe.shape[1] - h * w
                laid = jnp.pad(pe[:, extra:].reshape(1, h, w, d), ((0, 0), (0, gh_c - h), (0, gw_c - w), (0, 0)))
                tables.append(jnp.concatenate([pe[:, :extra], laid.reshape(1, gh_c * gw_c, d)], axis=1))
            return jnp.concatenate(tables, axis=0)[grid]  # (B, extra + Gh·Gw, d)
        if isinstance(context.module, MultiHeadAttention) and context.method_name == "__call__":
            extra = args[0].shape[1] - gh_c * gw_c
            keep = jnp.concatenate([jnp.ones((valid.shape[0], extra), bool), valid], axis=1)
            return next_fun(*args, **{**kwargs, "key_mask": keep})  # the block passes key_mask=None
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(intercept):
        out = outputs(params, images)
    return out["blocks"][block]["keys"].astype(jnp.float32)


@dataclasses.dataclass
class TokenCut:
    """config.evals entry `type='tokencut'`: yields ('corloc', CorLoc) of TokenCut's boxes on
    `split` of `dataset` (default the run's) (docs/method/dense.md §7).

    Every record of the split exactly once, at its own resolution: normalized with the
    dataset's mean/std, zero-padded at the bottom/right to a multiple of the patch size; the
    keys of block `block` (default −1, the last) from `ctx.outputs`, jitted over the images
    of one canonical grid (`bucket`, ViT family: `bucket_keys`, few programs whatever the sizes)
    or one padded shape at a time (`chunk` consecutive records grouped, the rows split over the
    mesh's data axes), on the model's token grid (`models.describe(config.model).token_stride`
    pixels a token), CLS dropped (prefix = tokens − h·w); `ncut` with (tau, eps) on the host in
    float64 — process p reads, decodes and cuts records p, p + P, … alone and the boxes are
    gathered — `box` clipped to the unpadded image, then CorLoc at `iou` against the record's
    `boxes` (none: a miss).
    """

    name: str
    prefix: str
    every_steps: int | None
    split: str
    ctx: Any
    dataset: str = ""
    data_dir: str | None = None
    block: int = -1
    tau: float = TAU
    eps: float = EPS
    iou: float = CORLOC_IOU
    picture_images: int = 8
    chunk: int = 64
    bucket: int = 8  # canonical grids: multiples of `bucket` tokens (ViT family; 0: one program per padded shape)
    rows: int = 16  # images per call of a canonical grid (rounded up to the data shards)

    def __post_init__(self):
        if self.ctx.outputs is None:
            raise ValueError(
                f"config.evals.{self.name}: type 'tokencut' needs a trainer whose context has `outputs` (the keys)"
            )
        from skipless_jax import models, sharding
        from skipless_jax.data import sources

        self.patch_size = models.describe(self.ctx.config.model).token_stride  # pixels a token of the grid
        self.info = sources.dataset_info(self.dataset or self.ctx.config.dataset.name)
        block = self.block

        def keys(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
            return self.ctx.outputs(params, batch["image"])["blocks"][block]["keys"].astype(jnp.float32)

        self._keys = jax.jit(keys, out_shardings=sharding.replicated(self.ctx.mesh))  # every host reads all rows
        self.family = models.describe(self.ctx.config.model).family
        self._bucket_keys = jax.jit(functools.partial(bucket_keys, self.ctx.outputs, block), static_argnums=(3, 4))

    def records(self) -> Any:
        from skipless_jax.data import sources

        return sources.get_source(self.dataset or self.ctx.config.dataset.name, self.split, self.data_dir)

    def _cut(self, keys: np.ndarray, image_hw: tuple[int, int]) -> Box:
        grid = (-(-image_hw[0] // self.patch_size), -(-image_hw[1] // self.patch_size))
        tokens = keys[keys.shape[0] - grid[0] * grid[1] :]
        _, mask, seed = ncut(tokens, grid, self.tau, self.eps)
        return box(mask, seed, self.patch_size, image_hw)

    def canonical(self, image_hw: tuple[int, int]) -> tuple[int, int] | None:
        """The canonical token grid an image is padded to: its grid (⌈H/p⌉, ⌈W/p⌉) rounded up to
        multiples of `bucket` (None: the image's own padded shape: no bucket, another family than
        ViT's, or a dataset stored at one size, whose one shape needs none)."""
        if not self.bucket or self.family != "vit" or self.info.fixed_size:
            return None
        grid = dense_patch_grid(image_hw, self.patch_size)
        return tuple(-(-g // self.bucket) * self.bucket for g in grid)

    def boxes(self, params: Any) -> tuple[np.ndarray, list[np.ndarray]]:
        """(predicted boxes (n, 4), n ground-truth arrays (k_i, 4)) over every record of the split;
        the first `picture_images` images of this process are kept in `self.shown` for the picture.

        Image i is read, decoded and cut by process i mod P alone (on its own devices); the boxes
        and ground truths are gathered. With canonical grids (`bucket`, the ViT family) the images
        of one canonical grid go `rows` at a time through one program: zero-padded at the
        bottom/right to the canonical grid after their own padding to a multiple of p, the
        padded tokens masked out of every attention and given no position embedding, the real
        grid's position table placed on it; the keys are cropped back to the real grid (equal
        to the image alone, docs/method/dense.md §7). Else one program per padded shape (as the
        official code: the image alone)."""
        from skipless_jax.data import dense, pipeline
        from skipless_jax.evaluators.common import global_rows
        from skipless_jax.evaluators.segmentation import process_local

        source = self.records()
        n, rank, procs = len(source), jax.process_index(), jax.process_count()
        mesh = self.ctx.mesh
        if procs > 1:
            mesh, (params,) = process_local(params)
        preds = np.zeros((n, 4), np.float64)
        gts: dict[int, np.ndarray] = {}
        self.shown, self.shown_rows = [], []
        mine = list(range(rank, n, procs))
        shards = -(-self.rows // sharding_shards(mesh)) * sharding_shards(mesh)
        for start in range(0, len(mine), self.chunk):
            index = mine[start : start + self.chunk]
            records = [source[i] for i in index]
            normalized = [pipeline.normalize(r["image"], self.info.mean, self.info.std) for r in records]
            groups: dict[Any, list[int]] = {}
            for j, r in enumerate(records):
                gts[index[j]] = np.asarray(r.get("boxes", np.zeros((0, 4))), np.float64).reshape(-1, 4)
                hw = r["image"].shape[:2]
                groups.setdefault(self.canonical(hw) or dense.patch_multiple(hw, self.patch_size), []).append(j)
                if len(self.shown) < self.picture_images:
                    self.shown.append(normalized[j])
                    self.shown_rows.append(index[j])
            for key, members in groups.items():
                if self.canonical(records[members[0]]["image"].shape[:2]) is None:
                    images = np.stack([pad_to_patch_multiple(normalized[j], self.patch_size) for j in members])
                    keys = np.asarray(jax.device_get(self._keys(params, global_rows(mesh, {"image": images},
                                                                                    bucket=True))))
                    for row, j in enumerate(members):
                        preds[index[j]] = self._cut(keys[row], records[j]["image"].shape[:2])
                    continue
                canvas = (key[0] * self.patch_size, key[1] * self.patch_size)
                cands = candidate_grids(key, self.bucket)
                for c in range(0, len(members), shards):
                    part = members[c : c + shards]
                    images = np.zeros((shards, *canvas, normalized[part[0]].shape[-1]), np.float32)
                    which = np.zeros((shards,), np.int32)
                    for row, j in enumerate(part):
                        x = pad_to_patch_multiple(normalized[j], self.patch_size)
                        images[row, : x.shape[0], : x.shape[1]] = x
                        which[row] = cands.index(dense_patch_grid(x.shape[:2], self.patch_size))
                    batch = global_rows(mesh, {"image": images, "grid": which})
                    keys = np.asarray(jax.device_get(self._bucket_keys(params, batch["image"], batch["grid"],
                                                                       cands, key)))
                    for row, j in enumerate(part):
                        hw = records[j]["image"].shape[:2]
                        grid = dense_patch_grid(hw, self.patch_size)
                        extra = keys.shape[1] - key[0] * key[1]
                        real = keys[row, extra:].reshape(*key, -1)[: grid[0], : grid[1]].reshape(-1, keys.shape[-1])
                        preds[index[j]] = self._cut(real, hw)
            for r in records:
                r.clear()  # the image, once cut
        if procs > 1:  # each process cut its rows; the others are zeros there
            from jax.experimental import multihost_utils

            gathered = np.asarray(multihost_utils.process_allgather(preds))
            preds = gathered[np.arange(n) % procs, np.arange(n)]
            k = int(np.max(multihost_utils.process_allgather(np.int64(max([len(g) for g in gts.values()] + [0])))))
            padded = np.full((n, k, 4), np.nan)
            for i, g in gts.items():
                padded[i, : len(g)] = g
            gathered = np.asarray(multihost_utils.process_allgather(padded))[np.arange(n) % procs, np.arange(n)]
            gts = {i: g[~np.isnan(g[:, 0])] for i, g in enumerate(gathered)}
        if len(gts) != n:  # every record exactly once
            raise AssertionError(f"TokenCut counted {len(gts)} of {n} examples of {self.split!r}")
        return preds, [gts[i] for i in range(n)]

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        preds, gts = self.boxes(params)
        score = corloc(preds, gts, self.iou)
        path = self.ctx.picture_path(self.prefix, step)
        if path is not None and self.shown:
            from skipless_jax import pictures
            from skipless_jax.data import dense

            hw = tuple(max(x.shape[i] for x in self.shown) for i in (0, 1))  # images of several sizes: padded
            self.shown = [dense.pad_to(x, hw, 0.0) for x in self.shown]
            drawn = [[(tuple(preds[i]), "red")] + [(tuple(g), "lime") for g in gts[i]] for i in self.shown_rows]
            pictures.image_grid(path, [("TokenCut", pictures.for_display(np.stack(self.shown)))],
                                f"{self.prefix}: TokenCut box (red), ground truth (green); CorLoc {100 * score:.1f}%",
                                boxes={0: drawn})
        yield "corloc", score

    @staticmethod
    def check(name: str, entry: Any) -> None:
        validate_tokencut(
            entry.get("block", -1),
            entry.get("tau", TAU),
            entry.get("eps", EPS),
            entry.get("iou", CORLOC_IOU),
            where=f"config.evals.{name}",
        )
        shown = entry.get("picture_images", 8)
        if not isinstance(shown, int) or isinstance(shown, bool) or not 0 <= shown <= 64:
            raise ValueError(f"config.evals.{name}.picture_images={shown!r} must be an integer in [0, 64]")

    @staticmethod
    def check_model(name: str, entry: Any, model: Any) -> None:
        """One-line ValueError unless the model (a `models.ModelDescription`) has the keys to cut."""
        if not model.block_keys:
            raise ValueError(
                f"config.evals.{name}: type 'tokencut' is not available for the {model.family} family: its blocks "
                "record no attention keys on the token grid (out['blocks'][i]['keys'], TokenCut's features)")
        block, depth = int(entry.get("block", -1)), model.depth
        if not -depth <= block < depth:
            raise ValueError(
                f"config.evals.{name}.block={block} is outside the model's {depth} blocks; allowed: {-depth}..{depth-1}"
            )

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Any, **common: Any) -> TokenCut:
        from skipless_jax import models
        from skipless_jax.data import sources
        from skipless_jax.evaluators.common import dense_dataset

        cls.check(name, entry)
        cls.check_model(name, entry, models.describe(ctx.config.model))
        dataset, data_dir = dense_dataset(name, entry, ctx.config)
        sources.check_dense_dataset(name, "tokencut", dataset, "boxes")
        block = int(entry.get("block", -1))
        return cls(
            name=name,
            ctx=ctx,
            block=block,
            tau=float(entry.get("tau", TAU)),
            eps=float(entry.get("eps", EPS)),
            iou=float(entry.get("iou", CORLOC_IOU)),
            picture_images=int(entry.get("picture_images", 8)),
            dataset=dataset,
            data_dir=data_dir,
            **common,
        )
