r"""ViT-Tiny on CIFAR-100 with each residual a switch: the CIFAR-10 ablation on 100 classes.

    python -m skipless_jax.main --config=configs/cifar100_vit_tiny.py:skip_sab=False \
        --workdir=/tmp/cifar100_vit_tiny_nosab

Hardware: one GPU or TPU chip and ≥ 8 host cores for the augmentation (≈ 0.5 ms per image
per core, docs/results/performance.md). Wall-clock: not measured (200 epochs ≈ 78k steps; the host
augmentation, not the chip, is expected to set the pace).
Data: cifar100 from tensorflow-datasets (docs/data.md, a few minutes to prepare); the run fails
at start, in one line, if it is absent.

Expected CIFAR-100 test accuracy: the papers quote no CIFAR-100 number, so the ≈ 70% below is
this project's estimate for the CIFAR-10 recipe unchanged, not a published figure; what to check
is the ordering of the CIFAR-10 cells (both skips > no FFN skip >> no SAB skip):
    :skip_sab=True,skip_ffn=True      ≈ 70   (both skips; the defaults)
    :skip_ffn=False                   below the above
    :skip_sab=False                   far below (no SAB skip)

Model: ViT-Ti (width 192, depth 12, 3 heads, MLP 768) on 32×32 images with patch 4, i.e. 64
tokens plus the class token. Schedule (as configs/cifar10_vit_tiny.py): 200 epochs, batch 128,
lr 1e-3, weight decay 0.05 (not on biases, norms, position embedding or class token;
docs/method/recipes.md §14), 10 warm-up epochs, cosine to 1e-5, gradient clipping 1.0, label smoothing
0.1, RandAugment m9, mixup 0.8 / cutmix 1.0, random erasing 0.25, zero-pad 4 + random crop and
flip, drop-path 0.1 with skips and 0 without. Eval at 32×32, no resize.
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
        epochs=200,
    )
    # The CIFAR-10 recipe (configs/cifar10_vit_tiny.py) on CIFAR-100.
    c = config_blocks.cifar_vit_tiny(a)
    c.dataset.name = "cifar100"
    return c
