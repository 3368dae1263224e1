"""The ViT size variants ('Ti', 'S', 'M', 'B', 'L', 'H' with a patch size, e.g. 'B/16') and the
resolution of `config.model` against them. A module of its own, below models/vit.py and
models/init.py, so that both read the sizes (init's self-attention share) and neither imports
the other upward."""

from __future__ import annotations

import re
from typing import Any

VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "M": (512, 12, 2048, 8),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "H": (1280, 32, 5120, 16),
}


def decode_variant(variant: str) -> dict[str, int]:
    """'B/16' -> dict(width=768, depth=12, mlp_dim=3072, num_heads=12, patch_size=16)."""
    match = re.fullmatch(r"(\w+)/(\d+)", variant or "")
    if match is None or match.group(1) not in VARIANTS:
        raise ValueError(
            f"config.model.variant={variant!r} is not a ViT variant; allowed: "
            f"'<size>/<patch>' with size in {sorted(VARIANTS)}, e.g. 'B/16'"
        )
    width, depth, mlp_dim, num_heads = VARIANTS[match.group(1)]
    return dict(width=width, depth=depth, mlp_dim=mlp_dim, num_heads=num_heads, patch_size=int(match.group(2)))


def resolve_sizes(model_config: Any) -> dict[str, Any]:
    """`config.model` as a dict with the variant's sizes filled in.

    A size set explicitly (not None) that differs from the variant's is an error: the variant
    used to override it silently.
    """
    cfg = dict(model_config)
    variant = cfg.pop("variant", None)
    if variant:
        sizes = decode_variant(variant)
        conflicts = [
            f"{k}={cfg[k]!r} (the variant's: {v})" for k, v in sizes.items() if cfg.get(k) is not None and cfg[k] != v
        ]
        if conflicts:
            raise ValueError(
                f"config.model.variant={variant!r} conflicts with config.model.{', '.join(conflicts)}; "
                "set either the variant or explicit sizes"
            )
        cfg.update(sizes)
    return cfg
