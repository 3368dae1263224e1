"""DINO multi-crop augmentation on the host (numpy + PIL), docs/method/ssl.md §6.

Per image: 2 global crops (size G, scale 0.4–1) and N local crops (size L, scale 0.05–0.4),
each: random resized crop (bicubic) → flip p 0.5 → colour jitter (0.4, 0.4, 0.2, 0.1) p 0.8 in
random order → grayscale p 0.2 → Gaussian blur (p 1.0 / 0.1 / 0.5 for global 1 / global 2 /
local, σ ~ U(0.1, 2)) → solarize p 0.2 (second global crop only) → normalize.

Every random choice comes from the generator the pipeline passes in, which it derives from
(seed, global example position) = (seed, step, example), so a batch depends only on
(seed, step). The crops of one example travel packed in one float32 vector (the shared
pipeline stacks one array per example); `MultiCrop.unpack` splits a batch into
{'global': (B, 2, G, G, C), 'local': (B, N, L, L, C)}.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from skipless_jax.checks import is_finite
from skipless_jax.data import inputs, pipeline, sources, transforms

# DINO's iterations per epoch (`inputs.steps_per_epoch` arguments): whole batches, as its loader
# drops the last partial one, and at least one, whatever config.input's repeats or drop_last say.
EPOCH_STEPS = dict(repeated_augmentation=1, last_batch="drop", at_least_one=True)

_BICUBIC = Image.Resampling.BICUBIC


def _to_pil(image: np.ndarray) -> Image.Image:
    if image.shape[-1] == 1:
        return Image.fromarray(np.ascontiguousarray(image[..., 0]), "L")
    return Image.fromarray(np.ascontiguousarray(image), "RGB")


def _from_pil(img: Image.Image, channels: int) -> np.ndarray:
    x = np.asarray(img, np.uint8)
    return x[..., None] if channels == 1 else x


def adjust_hue(img: Image.Image, shift: float) -> Image.Image:
    """Rotates the hue by `shift` ∈ [−0.5, 0.5] turns (torchvision's PIL adjust_hue); L images unchanged."""
    if img.mode != "RGB":
        return img
    h, s, v = img.convert("HSV").split()
    h = (np.asarray(h, np.int32) + int(round(shift * 255))) % 256
    return Image.merge("HSV", (Image.fromarray(h.astype(np.uint8), "L"), s, v)).convert("RGB")


def color_jitter(
    img: Image.Image, rng: np.random.Generator, brightness: float, contrast: float, saturation: float, hue: float
) -> Image.Image:
    """torchvision ColorJitter: the four ops in a random order, factors ~ U(1 ± x), hue ~ U(±h).

    All five draws happen for every image (also grayscale ones, where saturation and hue are
    no-ops), so the generator's stream does not depend on the number of channels.
    """
    order = rng.permutation(4)
    b = rng.uniform(1 - brightness, 1 + brightness)
    c = rng.uniform(1 - contrast, 1 + contrast)
    s = rng.uniform(1 - saturation, 1 + saturation)
    h = rng.uniform(-hue, hue)
    for op in order:
        if op == 0:
            img = ImageEnhance.Brightness(img).enhance(b)
        elif op == 1:
            img = ImageEnhance.Contrast(img).enhance(c)
        elif op == 2 and img.mode == "RGB":
            img = ImageEnhance.Color(img).enhance(s)
        elif op == 3:
            img = adjust_hue(img, h)
    return img


@dataclasses.dataclass(frozen=True)
class MultiCrop:
    """(uint8 (H, W, C) image, rng) -> packed float32 crops (uint8 ones with `uint8`); a frozen
    dataclass so workers can pickle it."""

    global_size: int
    local_size: int
    num_local: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int = 3
    global_scale: tuple[float, float] = (0.4, 1.0)
    local_scale: tuple[float, float] = (0.05, 0.4)
    flip_prob: float = 0.5
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.2, 0.1)
    jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    blur_prob: tuple[float, float, float] = (1.0, 0.1, 0.5)  # global 1, global 2, local
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    solarize_prob: float = 0.2  # second global crop only
    uint8: bool = False  # uint8 crops, normalized on device (data/device_images.py)

    def view(
        self,
        image: np.ndarray,
        rng: np.random.Generator,
        size: int,
        scale: tuple[float, float],
        blur_p: float,
        solarize_p: float,
    ) -> np.ndarray:
        """One augmented crop, float32 (size, size, C), normalized."""
        top, left, h, w = transforms.random_resized_crop_box(image.shape[0], image.shape[1], rng, scale)
        # Crop first, then resize: the filter must not read pixels outside the box.
        img = _to_pil(image[top : top + h, left : left + w]).resize((size, size), _BICUBIC)
        if rng.random() < self.flip_prob:
            img = ImageOps.mirror(img)
        if rng.random() < self.jitter_prob:
            img = color_jitter(img, rng, *self.jitter)
        if rng.random() < self.grayscale_prob and img.mode == "RGB":
            img = img.convert("L").convert("RGB")
        if rng.random() < blur_p:
            img = img.filter(ImageFilter.GaussianBlur(radius=rng.uniform(*self.blur_sigma)))
        if rng.random() < solarize_p:
            img = ImageOps.solarize(img, threshold=128)
        crop = _from_pil(img, image.shape[-1])
        return crop if self.uint8 else pipeline.normalize(crop, self.mean, self.std)

    def crops(self, image: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """[global 1, global 2, local 1, …, local N], drawn in that order from `rng`."""
        g1, g2, gl = self.blur_prob
        views = [
            self.view(image, rng, self.global_size, self.global_scale, g1, 0.0),
            self.view(image, rng, self.global_size, self.global_scale, g2, self.solarize_prob),
        ]
        views += [self.view(image, rng, self.local_size, self.local_scale, gl, 0.0) for _ in range(self.num_local)]
        return views

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return np.concatenate([v.reshape(-1) for v in self.crops(image, rng)])

    @property
    def packed_size(self) -> int:
        return (2 * self.global_size**2 + self.num_local * self.local_size**2) * self.channels

    def unpack(self, batch: dict[str, np.ndarray], rng: Any = None) -> dict[str, np.ndarray]:
        """{'image': (B, packed)} -> {'global': (B, 2, G, G, C), 'local': (B, N, L, L, C)} (+ other keys)."""
        del rng  # a batch_transform signature; unpacking is deterministic
        packed = batch.pop("image")
        b, c = packed.shape[0], self.channels
        cut = 2 * self.global_size**2 * c
        batch["global"] = packed[:, :cut].reshape(b, 2, self.global_size, self.global_size, c)
        batch["local"] = packed[:, cut:].reshape(b, self.num_local, self.local_size, self.local_size, c)
        return batch


# ----------------------------------------------------------------------------------------
# Config: validation and iterators.

_PROBS = ("flip_prob", "jitter_prob", "grayscale_prob", "solarize_prob")


def _bad(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config.input.multicrop.{field}={value!r} is invalid; allowed: {allowed}")


def _pair(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(map(is_finite, value))


def validate_multicrop_config(mc: Any, patch_size: int) -> None:
    """One-line ValueError for the first bad field of `config.input.multicrop`."""
    size, n = mc.get("local_size"), mc.get("num_local")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise _bad("local_size", size, "a positive integer")
    if size % patch_size:
        raise ValueError(
            f"config.input.multicrop.local_size={size} is not divisible by the patch size {patch_size}; "
            f"allowed: multiples of {patch_size}"
        )
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise _bad("num_local", n, "an integer >= 0")
    for field in ("global_scale", "local_scale"):
        v = mc.get(field)
        if not _pair(v) or not 0 < v[0] <= v[1] <= 1:
            raise _bad(field, v, "(lo, hi) with 0 < lo <= hi <= 1")
    for field in _PROBS:
        v = mc.get(field)
        if not is_finite(v) or not 0 <= v <= 1:
            raise _bad(field, v, "a probability in [0, 1]")
    blur = mc.get("blur_prob")
    if not isinstance(blur, (tuple, list)) or len(blur) != 3 or not all(is_finite(p) and 0 <= p <= 1 for p in blur):
        raise _bad("blur_prob", blur, "three probabilities (global 1, global 2, local) in [0, 1]")
    sigma = mc.get("blur_sigma")
    if not _pair(sigma) or not 0 < sigma[0] <= sigma[1]:
        raise _bad("blur_sigma", sigma, "(lo, hi) with 0 < lo <= hi")
    jitter = mc.get("jitter")
    if not isinstance(jitter, (tuple, list)) or len(jitter) != 4 or not all(is_finite(j) and j >= 0 for j in jitter):
        raise _bad("jitter", jitter, "(brightness, contrast, saturation, hue) >= 0")
    if not (jitter[0] <= 1 and jitter[1] <= 1 and jitter[2] <= 1 and jitter[3] <= 0.5):
        raise _bad("jitter", jitter, "brightness, contrast, saturation <= 1 and hue <= 0.5")


def from_config(config: Any) -> MultiCrop:
    info = sources.dataset_info(config.dataset.name)
    mc = config.input.multicrop
    return MultiCrop(
        global_size=inputs.image_size(config),
        local_size=int(mc.local_size),
        num_local=int(mc.num_local),
        mean=tuple(map(float, info.mean)),
        std=tuple(map(float, info.std)),
        channels=info.image_shape[-1],
        global_scale=tuple(map(float, mc.global_scale)),
        local_scale=tuple(map(float, mc.local_scale)),
        flip_prob=float(mc.flip_prob),
        jitter=tuple(map(float, mc.jitter)),
        jitter_prob=float(mc.jitter_prob),
        grayscale_prob=float(mc.grayscale_prob),
        blur_prob=tuple(map(float, mc.blur_prob)),
        blur_sigma=tuple(map(float, mc.blur_sigma)),
        solarize_prob=float(mc.solarize_prob),
    )


def _transforms(config: Any, on_device: bool) -> dict[str, Any]:
    """The pipeline's per-example transform (the packed crops) and batch transform (`unpack`)."""
    mc = dataclasses.replace(from_config(config), uint8=on_device)
    return dict(transform=mc, batch_transform=mc.unpack)


def train_iterator(
    config: Any, start_step: int, process_index: int, process_count: int, on_device: bool = False, shards: int = 1
) -> Iterator[dict[str, np.ndarray]]:
    """Process-local multi-crop batches {'global', 'local', 'label'} from `start_step` on;
    `on_device`: uint8 crops, to be normalized in the step (`device_images.prepare`); `shards` as
    `inputs.train_iterator`'s."""
    return inputs.train_iterator(config, start_step, process_index, process_count, shards=shards,
                                 **_transforms(config, on_device))


def train_batch_spec(config: Any, on_device: bool = False) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The global batch of `train_iterator` as {name: (shape, dtype)}, no data read (`inputs.train_batch_spec`)."""
    return inputs.train_batch_spec(config, **_transforms(config, on_device))


def split_views(batch_global: Any, batch_local: Any) -> tuple[Any, Any]:
    """(B, 2, G, G, C), (B, N, L, L, C) -> crop-major (2B, G, G, C), (NB, L, L, C) (jnp or np)."""
    def crop_major(x: Any) -> Any:
        b, n = x.shape[:2]
        return x.swapaxes(0, 1).reshape((n * b,) + tuple(x.shape[2:]))

    return crop_major(batch_global), crop_major(batch_local)
