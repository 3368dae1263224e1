r"""ViT-Tiny on Tiny-ImageNet-200 (64×64, 200 classes) with each residual a switch.

    python -m skipless_jax.main --config=configs/tiny_imagenet_vit.py:skip_sab=False \
        --workdir=/tmp/tiny_imagenet_nosab --config.dataset.data_dir=/data/tiny-imagenet-200

Hardware: one GPU or TPU chip and ≥ 8 host cores for the augmentation (≈ 1 ms per image per
core, docs/results/performance.md). Wall-clock: not measured (100 epochs ≈ 39k steps; the host augmentation,
not the chip, is expected to set the pace).
Data: the unpacked tiny-imagenet-200 folder (docs/data.md); config.dataset.data_dir must point
at it, and the run fails at start, in one line, if it does not. Evaluation is on the 10,000
validation images (the test labels are not public).

Expected Tiny-ImageNet top-1: the papers quote no number for this recipe, so the ≈ 55% below is
this project's estimate for a ViT-Tiny trained from scratch at 64×64, not a published figure;
what to check is the ordering of the CIFAR-10 cells (both skips > no FFN skip >> no SAB skip):
    :skip_sab=True,skip_ffn=True      ≈ 55   (both skips; the defaults)
    :skip_ffn=False                   below the above
    :skip_sab=False                   far below (no SAB skip)

Model: ViT-Ti (width 192, depth 12, 3 heads, MLP 768) on 64×64 images with patch 8, i.e. 64
tokens plus the class token. Schedule (this project's DeiT-style recipe for 64×64 images): 100
epochs, batch 256, lr 1e-3, weight decay 0.05 (not on biases, norms, position embedding or
class token; docs/method/recipes.md §14), 10 warm-up epochs, cosine to 1e-5, gradient clipping 1.0,
label smoothing 0.1, RandAugment m9, mixup 0.8 / cutmix 1.0, random erasing 0.25, zero-pad 8 +
random crop and flip, drop-path 0.1 with skips and 0 without. Eval at 64×64, no resize;
normalized with the ImageNet mean and std (its source).
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg,
        skip_sab=True,
        skip_ffn=True,
        depth=12,
        init="default",
        opt="adamw",
        seed=0,
        tg="none",
        eps=0.95,
        epochs=100,
    )
    # The CIFAR recipe (configs/cifar10_vit_tiny.py) at 64×64 with patch 8: 64 tokens again.
    c = config_blocks.cifar_vit_tiny(a)
    c.dataset.update(dict(name="tiny_imagenet", eval_split="val"))
    c.input.update(dict(batch_size=256, image_size=64))
    c.input.aug.crop_padding = 8
    c.model.patch_size = 8
    steps_per_10_epochs = 3907  # 390.6 steps per epoch
    c.eval_every_steps = c.checkpoint_every_steps = steps_per_10_epochs
    return c
