"""RandAugment on host images (timm's 'rand-…' semantics, as DeiT used it): the 15 PIL ops,
their magnitude-to-argument maps, the config string grammar (`parse_randaug`) and the op chain
(`rand_augment`).

numpy + PIL; ops take and return PIL RGB images; every draw comes from the generator passed in.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from skipless_jax.data.transforms import check_uint8_image

_BICUBIC = Image.Resampling.BICUBIC

_LEVEL_DENOM = 10.0  # magnitude m maps to the fraction m / 10 of each op's range


def auto_contrast(img: Image.Image) -> Image.Image:
    """Per-channel stretch of [min, max] to [0, 255]."""
    return ImageOps.autocontrast(img)


def equalize(img: Image.Image) -> Image.Image:
    """Per-channel histogram equalization."""
    return ImageOps.equalize(img)


def invert(img: Image.Image) -> Image.Image:
    """255 − x."""
    return ImageOps.invert(img)


def posterize(img: Image.Image, bits: int) -> Image.Image:
    """Keeps the `bits` most significant bits (0 bits gives a black image, as in timm)."""
    if bits >= 8:
        return img
    # A lookup table, not ImageOps.posterize: recent Pillow rejects bits=0.
    mask = 0xFF & ~(2 ** (8 - bits) - 1)
    return img.point([i & mask for i in range(256)] * len(img.getbands()))


def solarize(img: Image.Image, threshold: int) -> Image.Image:
    """Inverts pixels >= threshold."""
    return ImageOps.solarize(img, threshold)


def solarize_add(img: Image.Image, add: int, threshold: int = 128) -> Image.Image:
    """Adds `add` (clipped at 255) to pixels below `threshold`."""
    lut = [min(255, i + add) if i < threshold else i for i in range(256)]
    return img.point(lut * len(img.getbands()))


def color(img: Image.Image, factor: float) -> Image.Image:
    """Saturation: blend with the grayscale image (factor 1 = identity)."""
    return ImageEnhance.Color(img).enhance(factor)


def contrast(img: Image.Image, factor: float) -> Image.Image:
    """Blend with the mean gray level (factor 1 = identity)."""
    return ImageEnhance.Contrast(img).enhance(factor)


def brightness(img: Image.Image, factor: float) -> Image.Image:
    """Blend with black (factor 1 = identity)."""
    return ImageEnhance.Brightness(img).enhance(factor)


def sharpness(img: Image.Image, factor: float) -> Image.Image:
    """Blend with the 3x3 smoothed image (factor 1 = identity)."""
    return ImageEnhance.Sharpness(img).enhance(factor)


def _affine(img: Image.Image, matrix: tuple[float, ...], fill: tuple[int, ...],
            resample: Image.Resampling) -> Image.Image:
    # PIL maps each output pixel (x, y) to the input (a x + b y + c, d x + e y + f).
    return img.transform(img.size, Image.Transform.AFFINE, matrix, resample=resample, fillcolor=fill)


def rotate(img: Image.Image, degrees: float, fill: tuple[int, ...],
           resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """Counter-clockwise rotation about the centre; uncovered corners get `fill`."""
    return img.rotate(degrees, resample=resample, fillcolor=fill)


def shear_x(img: Image.Image, factor: float, fill: tuple[int, ...],
            resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """out(x, y) = in(x + factor·y, y)."""
    return _affine(img, (1, factor, 0, 0, 1, 0), fill, resample)


def shear_y(img: Image.Image, factor: float, fill: tuple[int, ...],
            resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """out(x, y) = in(x, factor·x + y)."""
    return _affine(img, (1, 0, 0, factor, 1, 0), fill, resample)


def translate_x(img: Image.Image, pixels: float, fill: tuple[int, ...],
                resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """out(x, y) = in(x + pixels, y): content moves left for pixels > 0."""
    return _affine(img, (1, 0, pixels, 0, 1, 0), fill, resample)


def translate_y(img: Image.Image, pixels: float, fill: tuple[int, ...],
                resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """out(x, y) = in(x, y + pixels): content moves up for pixels > 0."""
    return _affine(img, (1, 0, 0, 0, 1, pixels), fill, resample)


@dataclasses.dataclass(frozen=True)
class OpContext:
    """What the geometric ops share: fill colour, resampling filter, translate range."""

    fill: tuple[int, int, int]
    resample: Image.Resampling
    translate_pct: float


def _negate_half(value: float, rng: np.random.Generator) -> float:
    # timm's _randomly_negate: the sign is one more draw after the magnitude.
    return -value if rng.random() > 0.5 else value


def _enhance_increasing(m: float, rng: np.random.Generator) -> float:
    return max(0.1, 1.0 + _negate_half(m / _LEVEL_DENOM * 0.9, rng))


# name -> (magnitude, rng, ctx) -> the op's argument (None for ops without one).
LEVEL_TO_ARG: dict[str, Callable[[float, np.random.Generator, OpContext], Any] | None] = {
    "AutoContrast": None,
    "Equalize": None,
    "Invert": None,
    "Rotate": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * 30.0, rng),
    "Posterize": lambda m, rng, ctx: int(m / _LEVEL_DENOM * 4),
    "PosterizeIncreasing": lambda m, rng, ctx: 4 - int(m / _LEVEL_DENOM * 4),
    "Solarize": lambda m, rng, ctx: int(m / _LEVEL_DENOM * 256),
    "SolarizeIncreasing": lambda m, rng, ctx: 256 - int(m / _LEVEL_DENOM * 256),
    "SolarizeAdd": lambda m, rng, ctx: int(m / _LEVEL_DENOM * 110),
    "Color": lambda m, rng, ctx: m / _LEVEL_DENOM * 1.8 + 0.1,
    "ColorIncreasing": lambda m, rng, ctx: _enhance_increasing(m, rng),
    "Contrast": lambda m, rng, ctx: m / _LEVEL_DENOM * 1.8 + 0.1,
    "ContrastIncreasing": lambda m, rng, ctx: _enhance_increasing(m, rng),
    "Brightness": lambda m, rng, ctx: m / _LEVEL_DENOM * 1.8 + 0.1,
    "BrightnessIncreasing": lambda m, rng, ctx: _enhance_increasing(m, rng),
    "Sharpness": lambda m, rng, ctx: m / _LEVEL_DENOM * 1.8 + 0.1,
    "SharpnessIncreasing": lambda m, rng, ctx: _enhance_increasing(m, rng),
    "ShearX": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * 0.3, rng),
    "ShearY": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * 0.3, rng),
    "TranslateXRel": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * ctx.translate_pct, rng),
    "TranslateYRel": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * ctx.translate_pct, rng),
}

# name -> (img, arg, ctx) -> img.
APPLY_OP: dict[str, Callable[[Image.Image, Any, OpContext], Image.Image]] = {
    "AutoContrast": lambda img, _, ctx: auto_contrast(img),
    "Equalize": lambda img, _, ctx: equalize(img),
    "Invert": lambda img, _, ctx: invert(img),
    "Rotate": lambda img, a, ctx: rotate(img, a, ctx.fill, ctx.resample),
    "Posterize": lambda img, a, ctx: posterize(img, a),
    "Solarize": lambda img, a, ctx: solarize(img, a),
    "SolarizeAdd": lambda img, a, ctx: solarize_add(img, a),
    "Color": lambda img, a, ctx: color(img, a),
    "Contrast": lambda img, a, ctx: contrast(img, a),
    "Brightness": lambda img, a, ctx: brightness(img, a),
    "Sharpness": lambda img, a, ctx: sharpness(img, a),
    "ShearX": lambda img, a, ctx: shear_x(img, a, ctx.fill, ctx.resample),
    "ShearY": lambda img, a, ctx: shear_y(img, a, ctx.fill, ctx.resample),
    "TranslateXRel": lambda img, a, ctx: translate_x(img, a * img.size[0], ctx.fill, ctx.resample),
    "TranslateYRel": lambda img, a, ctx: translate_y(img, a * img.size[1], ctx.fill, ctx.resample),
}
# An "...Increasing" op applies its plain op; only its level -> argument differs (LEVEL_TO_ARG).
APPLY_OP.update({name: APPLY_OP[name.removesuffix("Increasing")]
                 for name in LEVEL_TO_ARG if name.endswith("Increasing")})

# timm's _RAND_TRANSFORMS and _RAND_INCREASING_TRANSFORMS (Cutout is random erasing instead).
RAND_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
    "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel",
    "TranslateYRel",
)
RAND_INCREASING_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
    "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
    "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)


@dataclasses.dataclass(frozen=True)
class RandAugmentSpec:
    """Parsed 'rand-m9-mstd0.5-inc1'-style string (timm's config grammar)."""

    num_layers: int = 2
    magnitude: float = 10.0
    magnitude_std: float = 0.0
    magnitude_max: float = _LEVEL_DENOM
    increasing: bool = False


# key -> (RandAugmentSpec field, value regex, converter); the grammar of timm's rand_augment_transform.
_RANDAUG_KEYS: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "m": ("magnitude", r"\d+", float),
    "n": ("num_layers", r"\d+", int),
    "mstd": ("magnitude_std", r"\d+(\.\d*)?", lambda v: math.inf if float(v) > 100 else float(v)),
    "mmax": ("magnitude_max", r"\d+", float),
    "inc": ("increasing", r"[01]", lambda v: v == "1"),
}


def parse_randaug(spec: str) -> RandAugmentSpec:
    """Parses timm's RandAugment string: "rand" then "-"-separated m, n, mstd, mmax, inc.

    mstd above 100 means a uniform magnitude in [0, m] (timm). "inc0" turns the increasing
    op set off (timm reads any inc value as on; only "inc1" occurs in the recipes).
    """
    example = "e.g. 'rand-m9-mstd0.5-inc1'"
    if not isinstance(spec, str) or spec.split("-")[0] != "rand":
        raise ValueError(f"randaug={spec!r}: must be a string starting with 'rand', {example}")
    fields: dict[str, Any] = {}
    for section in spec.split("-")[1:]:
        match = re.fullmatch(r"([a-z]*)(\d.*)?", section)  # letters, then a value from the first digit
        key, value = (match.group(1), match.group(2) or "") if match else (section, "")
        if key not in _RANDAUG_KEYS:
            raise ValueError(f"randaug={spec!r}: unknown section {section!r}; "
                             f"allowed keys {sorted(_RANDAUG_KEYS)}, {example}")
        name, pattern, convert = _RANDAUG_KEYS[key]
        if not re.fullmatch(pattern, value):
            raise ValueError(f"randaug={spec!r}: bad value {value!r} in section {section!r}, {example}")
        fields[name] = convert(value)
    parsed = RandAugmentSpec(**fields)
    if not 0 <= parsed.magnitude <= parsed.magnitude_max:
        raise ValueError(f"randaug={spec!r}: m={parsed.magnitude:g} must be in "
                         f"[0, {parsed.magnitude_max:g}] (set mmax to allow more)")
    return parsed


def rand_augment(
    image: np.ndarray,
    rng: np.random.Generator,
    num_layers: int = 2,
    magnitude: float = 9.0,
    magnitude_std: float = 0.5,
    increasing: bool = True,
    magnitude_max: float = _LEVEL_DENOM,
    fill: tuple[int, int, int] = (124, 116, 104),
    translate_pct: float = 0.45,
) -> np.ndarray:
    """RandAugment as timm's 'rand-m{magnitude}-mstd{magnitude_std}-inc1' (DeiT's setting).

    `num_layers` ops are drawn uniformly with replacement from the 15-op list; each is applied
    with probability 0.5, at magnitude ~ N(magnitude, magnitude_std) clipped to
    [0, magnitude_max] (uniform in [0, magnitude] for an infinite std), with a random sign for
    signed ops. Geometric ops resample bicubic and fill with `fill` (DeiT: the ImageNet mean
    colour, round(255·mean)).

    Args:
        image: uint8 (H, W, 3).

    Returns:
        uint8 (H, W, 3).
    """
    check_uint8_image(image, "rand_augment")
    names = RAND_INCREASING_OPS if increasing else RAND_OPS
    ctx = OpContext(fill=tuple(int(v) for v in fill), resample=_BICUBIC, translate_pct=translate_pct)
    img = Image.fromarray(image)
    for index in rng.integers(0, len(names), size=num_layers):
        name = names[int(index)]
        if rng.random() > 0.5:  # each chosen op fires with probability 0.5
            continue
        m = magnitude
        if magnitude_std == math.inf:
            m = rng.uniform(0.0, magnitude)
        elif magnitude_std > 0:
            m = rng.normal(magnitude, magnitude_std)
        m = float(min(max(m, 0.0), magnitude_max))
        level_to_arg = LEVEL_TO_ARG[name]
        arg = level_to_arg(m, rng, ctx) if level_to_arg is not None else None
        img = APPLY_OP[name](img, arg, ctx)
    return np.asarray(img)


def mean_fill(mean: Sequence[float]) -> tuple[int, int, int]:
    """timm's RandAugment fill colour for DeiT: round(255 · mean), clipped; mean in [0, 1] units."""
    return tuple(min(255, round(255 * m)) for m in mean)  # type: ignore[return-value]
