"""The host image chains the pipeline maps, built from `config.input.aug`, and its one check.

Train (DeiT, timm semantics; docs/method/papers.md §1 recipe): random resized crop (bicubic) or pad +
crop → horizontal flip → RandAugment 'rand-m9-mstd0.5-inc1' (bicubic, fill = the mean colour)
→ normalize → random erasing ('pixel', p 0.25) per example; mixup 0.8 / cutmix 1.0 (switch 0.5)
per global batch runs inside the train step (data/device_mix.py). Eval: resize the shorter side
to floor(size / crop_pct) (bicubic), centre crop, normalize. The steps live one concept a file:
data/transforms.py (crops, flips, resizes, normalize), data/randaugment.py,
data/random_erasing.py. Every random choice comes from the `np.random.Generator` passed in (the
pipeline derives it from (seed, step, example index)).

Images are uint8 (H, W, 3) RGB until normalized, float32 (H, W, 3) after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from skipless_jax.checks import is_number
from skipless_jax.data.randaugment import RandAugmentSpec, mean_fill, parse_randaug, rand_augment
from skipless_jax.data.random_erasing import random_erasing, random_erasing_box
from skipless_jax.data.transforms import (
    DEFAULT_CROP_PCT,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    check_size,
    normalize,
    random_flip,
    random_pad_crop,
    random_resized_crop,
    resize_center_crop,
)

_AUG_FIELDS = ("randaug", "scale", "flip", "reprob", "mixup", "cutmix", "mixup_switch_prob")


def _field(aug_config: Any, name: str) -> Any:
    try:
        return aug_config[name]
    except (KeyError, AttributeError, TypeError):
        raise ValueError(f'aug.{name} is missing; the aug config needs {", ".join(_AUG_FIELDS)}') from None


def _optional(aug_config: Any, name: str, default: Any) -> Any:
    return aug_config.get(name, default) if hasattr(aug_config, "get") else default


CROPS = ("rrc", "pad")


def _check_unit(value: Any, name: str, upper_open: bool = False) -> None:
    upper = "1)" if upper_open else "1]"
    if not is_number(value) or not (0 <= value < 1 if upper_open else 0 <= value <= 1):
        raise ValueError(f"aug.{name}={value!r}; must be a number in [0, {upper}")


def validate_aug_config(aug_config: Any) -> None:
    """Raises a one-line ValueError naming the first out-of-range augmentation field.

    Fields: randaug (None or 'rand-…'), scale (0 < lo <= hi <= 1), flip (bool), reprob [0, 1],
    mixup >= 0, cutmix >= 0, mixup_switch_prob [0, 1]. Optional: ratio
    (0 < lo <= hi; default (3/4, 4/3)), mixup_prob [0, 1] (default 1), crop ('rrc' random
    resized crop, default; 'pad' zero-pad + random crop, CIFAR style), crop_padding (int >= 0,
    default 4), interpolation (the random resized crop's resampling: 'bicubic', timm's, default;
    'bilinear', torchvision RandomResizedCrop's). Mixup/cutmix always mix the global batch in the
    train step (data/device_mix.py): the removed `mix_on` field is refused.
    """
    randaug = _field(aug_config, "randaug")
    if randaug is not None and not isinstance(randaug, str):
        raise ValueError(f"aug.randaug={randaug!r}; must be None or a string like 'rand-m9-mstd0.5-inc1'")
    if randaug:
        try:
            parse_randaug(randaug)
        except ValueError as err:
            raise ValueError(f"aug.{err}") from None
    scale = _field(aug_config, "scale")
    if (not isinstance(scale, (tuple, list)) or len(scale) != 2 or not all(map(is_number, scale))
        or not 0 < scale[0] <= scale[1] <= 1):
        raise ValueError(f"aug.scale={scale!r}; must be (lo, hi) with 0 < lo <= hi <= 1")
    ratio = _optional(aug_config, "ratio", None)
    if ratio is not None and (not isinstance(ratio, (tuple, list)) or len(ratio) != 2
                              or not all(map(is_number, ratio)) or not 0 < ratio[0] <= ratio[1]):
        raise ValueError(f"aug.ratio={ratio!r}; must be (lo, hi) with 0 < lo <= hi")
    flip = _field(aug_config, "flip")
    if not isinstance(flip, (bool, np.bool_)):
        raise ValueError(f"aug.flip={flip!r}; must be True or False")
    _check_unit(_field(aug_config, "reprob"), "reprob")
    for name in ("mixup", "cutmix"):
        value = _field(aug_config, name)
        if not is_number(value) or value < 0:
            raise ValueError(f"aug.{name}={value!r}; must be a Beta alpha >= 0 (0 turns it off)")
    _check_unit(_field(aug_config, "mixup_switch_prob"), "mixup_switch_prob")
    smoothing = _optional(aug_config, "label_smoothing", None)
    if smoothing:  # one smoothing, in the loss: it applies to mixed targets the same way (it is linear)
        raise ValueError(f"aug.label_smoothing={smoothing!r} is not used; set config.label_smoothing instead")
    _check_unit(_optional(aug_config, "mixup_prob", 1.0), "mixup_prob")
    crop = _optional(aug_config, "crop", "rrc")
    if crop not in CROPS:
        raise ValueError(f"aug.crop={crop!r} is unknown; allowed: {list(CROPS)}")
    padding = _optional(aug_config, "crop_padding", 4)
    if not isinstance(padding, (int, np.integer)) or isinstance(padding, bool) or padding < 0:
        raise ValueError(f"aug.crop_padding={padding!r}; must be an int >= 0")
    interpolation = _optional(aug_config, "interpolation", "bicubic")
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"aug.interpolation={interpolation!r} is unknown; allowed: {list(INTERPOLATIONS)}")
    if _optional(aug_config, "mix_on", None) is not None:
        raise ValueError(f"aug.mix_on={aug_config.get('mix_on')!r} is no longer a field: mixup/cutmix always run "
                         "on the device over the global batch (data/device_mix.py); remove it")


@dataclasses.dataclass(frozen=True)
class TrainTransform:
    """Per-example train chain: crop (random resized, or pad + crop) → flip → RandAugment →
    normalize → random erasing.

    A frozen dataclass (not a closure) so grain worker processes can pickle it.
    Call: (uint8 (H, W, 3), rng) → float32 (image_size, image_size, 3).
    """

    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: tuple[float, float]
    ratio: tuple[float, float]
    flip: bool
    randaug: RandAugmentSpec | None
    reprob: float
    crop: str = "rrc"
    crop_padding: int = 4
    interpolation: str = "bicubic"  # of the random resized crop (transforms.INTERPOLATIONS)
    uint8: bool = False  # stop before normalize: {'image': uint8, 'erase': box}, the rest on device

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray | dict[str, np.ndarray]:
        if self.crop == "pad":
            image = random_pad_crop(image, rng, self.image_size, self.crop_padding)
        else:
            image = random_resized_crop(image, rng, self.image_size, self.scale, self.ratio, self.interpolation)
        if self.flip:
            image = random_flip(image, rng)
        if self.randaug is not None:
            ra = self.randaug
            image = rand_augment(
                np.ascontiguousarray(image), rng, num_layers=ra.num_layers, magnitude=ra.magnitude,
                magnitude_std=ra.magnitude_std, increasing=ra.increasing,
                magnitude_max=ra.magnitude_max, fill=mean_fill(self.mean))
        if self.uint8:  # the same draws as random_erasing below, without the noise (drawn on device)
            if self.reprob <= 0:
                return np.ascontiguousarray(image)
            box = None
            if rng.random() <= self.reprob:
                box = random_erasing_box(image.shape[0], image.shape[1], rng)
            return {"image": np.ascontiguousarray(image), "erase": np.array(box or (0, 0, 0, 0), np.int32)}
        image = normalize(image, self.mean, self.std)
        if self.reprob > 0:
            image = random_erasing(image, rng, prob=self.reprob)
        return image


@dataclasses.dataclass(frozen=True)
class EvalTransform:
    """Eval chain: `resize_center_crop` → normalize. Call: (uint8 image, rng=None) → float32."""

    image_size: int
    crop_pct: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    uint8: bool = False  # the uint8 crop; normalized on device (data/device_images.py)

    def __call__(self, image: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        del rng  # deterministic; the argument keeps the train and eval call signatures alike
        crop = resize_center_crop(image, self.image_size, self.crop_pct)
        return crop if self.uint8 else normalize(crop, self.mean, self.std)


def train_transform(
    aug_config: Any, image_size: int, mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> TrainTransform:
    """Builds the per-example train transform from `config.aug` (validated first)."""
    validate_aug_config(aug_config)
    check_size(image_size, "train_transform")
    ratio = _optional(aug_config, "ratio", None)
    randaug = _field(aug_config, "randaug")
    return TrainTransform(
        image_size=int(image_size), mean=tuple(map(float, mean)), std=tuple(map(float, std)),
        scale=tuple(map(float, _field(aug_config, "scale"))),  # type: ignore[arg-type]
        ratio=tuple(map(float, ratio)) if ratio is not None else (3 / 4, 4 / 3),  # type: ignore[arg-type]
        flip=bool(_field(aug_config, "flip")),
        randaug=parse_randaug(randaug) if randaug else None,
        reprob=float(_field(aug_config, "reprob")),
        crop=_optional(aug_config, "crop", "rrc"),
        crop_padding=int(_optional(aug_config, "crop_padding", 4)),
        interpolation=_optional(aug_config, "interpolation", "bicubic"),
    )


def eval_transform(
    image_size: int, crop_pct: float = DEFAULT_CROP_PCT, mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> EvalTransform:
    """Builds the eval transform (resize shorter side to floor(size/crop_pct), centre crop)."""
    check_size(image_size, "eval_transform")
    if not is_number(crop_pct) or not 0 < crop_pct <= 1:
        raise ValueError(f"crop_pct={crop_pct!r}; must be in (0, 1]")
    return EvalTransform(int(image_size), float(crop_pct), tuple(map(float, mean)),
                         tuple(map(float, std)))
