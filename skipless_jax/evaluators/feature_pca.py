"""The PCA picture of the dense features (docs/method/dense.md §8, "Cutting the Skip"'s figure).

    config.evals.pca = dict(type='feature_pca', split='test', images=8)

For the first `images` examples of `split`: the tokens of the model's last grid
(`ctx.outputs(params, images)['encoded']`, through the final norm where the family has one, the
class token dropped; `models.describe` gives the grid), their top 3 principal axes over all
the images' tokens as RGB (`pictures.pca_rgb`). Yields ('explained_variance', share of the
variance the 3 axes explain) and writes images over their PCA colouring to
`<picture_dir>/pictures/<prefix>_step<N>.png` when the context has a picture folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from skipless_jax import pictures, sharding


@dataclasses.dataclass
class FeaturePCA:
    name: str
    prefix: str
    every_steps: int | None
    split: str
    ctx: Any
    images: int = 8

    def __post_init__(self):
        from skipless_jax import models
        from skipless_jax.evaluators.common import patch_tokens

        if self.ctx.outputs is None:
            raise ValueError(
                f"config.evals.{self.name}: type 'feature_pca' needs a trainer whose context has `outputs`")
        model = models.describe(self.ctx.config.model)

        def tokens(params: Any, images: jax.Array) -> jax.Array:
            return patch_tokens(self.ctx.outputs(params, images)["encoded"], images.shape[1:3], model)

        self._tokens = jax.jit(tokens, out_shardings=sharding.replicated(self.ctx.mesh))

    def colours(self, params: Any) -> tuple[np.ndarray, np.ndarray, float]:
        """(images (n, H, W, C) as read, PCA colours (n, h, w, 3), explained share) of the first n."""
        shards = sharding.num_data_shards(self.ctx.mesh) * jax.process_count()
        batches, total = self.ctx.batches(self.split, batch_size=-(-self.images // shards) * shards, workers=False)
        batch = next(batches)
        tokens, images, mask = jax.device_get((self._tokens(params, batch["image"]), batch["image"], batch["mask"]))
        keep = np.flatnonzero(mask > 0)[: min(self.images, total)]
        rgb, share = pictures.pca_rgb(np.asarray(tokens, np.float64)[keep])
        return np.asarray(images)[keep], rgb, share

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        images, rgb, share = self.colours(params)
        path = self.ctx.picture_path(self.prefix, step)
        if path is not None:
            rows = [("image", pictures.for_display(images)),
                    ("PCA 1-3", pictures.upsample_nearest(rgb, images.shape[1:3]))]
            pictures.image_grid(path, rows, f"{self.prefix}: patch features, top 3 principal axes as RGB "
                                f"({100 * share:.0f}% of the variance)")
        yield "explained_variance", share

    @staticmethod
    def check(name: str, entry: Any) -> None:
        n = entry.get("images", 8)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise ValueError(f"config.evals.{name}.images={n!r} must be an integer in [1, 64]")

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Any, **common: Any) -> FeaturePCA:
        cls.check(name, entry)
        return cls(name=name, ctx=ctx, images=int(entry.get("images", 8)), **common)
