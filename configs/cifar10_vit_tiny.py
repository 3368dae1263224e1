r"""ViT-Tiny on CIFAR-10 with each residual a switch: the Always Skip Attention ablation.

    python -m skipless_jax.main --config=configs/cifar10_vit_tiny.py:skip_sab=False \
        --workdir=/tmp/cifar10_vit_tiny_nosab

Hardware: one GPU or TPU chip and ≥ 8 host cores for the augmentation (≈ 0.5 ms per image
per core, docs/results/performance.md). Wall-clock: not measured (200 epochs ≈ 78k steps; the host
augmentation, not the chip, is expected to set the pace).
Data: cifar10 from tensorflow-datasets (docs/data.md, a few minutes to prepare); the run fails
at start, in one line, if it is absent.

Expected CIFAR-10 test accuracy (Always Skip Attention, ViT-Tiny), one cell per args:
    :skip_sab=True,skip_ffn=True      92   (both skips; the defaults)
    :skip_ffn=False                   90   (no FFN skip: a small loss)
    :skip_sab=False                   70   (no SAB skip: diverges after ~30 epochs)

Model: ViT-Ti (width 192, depth 12, 3 heads, MLP 768) on 32×32 images with patch 4, i.e. 64
tokens plus the class token. Schedule (this project's DeiT-style recipe for 32×32 images; the
paper's exact one is not restated here): 200 epochs, batch 128, lr 1e-3, weight decay 0.05 (not
on biases, norms, position embedding or class token; docs/method/recipes.md §14), 10 warm-up epochs,
cosine to 1e-5, gradient clipping 1.0, label smoothing 0.1, RandAugment m9, mixup 0.8 / cutmix
1.0, random erasing 0.25, zero-pad 4 + random crop and flip, drop-path 0.1 with skips and 0
without. Eval at 32×32, no resize.
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
    return config_blocks.cifar_vit_tiny(a)
