r"""ImageNet-1k ViT-B/16, 300 epochs: the "Cutting the Skip" recipe (no skips, skipless init,
SOAP) by default, and with args every cell of the paper's ViT-B table, the standard ViT-B
baseline of both papers included.

    python -m skipless_jax.main --config=configs/vitb_skipless.py \
        --workdir=gs://BUCKET/vitb_skipless --config.dataset.data_dir=gs://BUCKET/tfds
    python -m skipless_jax.main \
        --config=configs/vitb_skipless.py:skip_sab=True,skip_ffn=True,init=default,opt=adamw \
        --workdir=gs://BUCKET/vitb_baseline --config.dataset.data_dir=gs://BUCKET/tfds

Args: skip_sab, skip_ffn, init, opt, seed, tg, eps, variant, epochs (docs/recipes.md).
Hardware: sized for a TPU v4-64 pod slice or 4× 8-GPU H100 nodes (global batch 1024, bfloat16
compute); the augmentation needs ≈ 47 worker processes (`input.num_workers`) per 6,150 images/s
(docs/data.md). Wall-clock: not measured (300 epochs ≈ 372k steps of train[:99%]); Always Skip
Attention reports 0.723 days for its ViT-B baseline (docs/method/papers.md §4).
Data: imagenet2012 prepared by tensorflow-datasets (docs/data.md); the run fails at start,
in one line, if it is absent.

Expected ImageNet-1k top-1, the paper's (Cutting the Skip, 300 epochs; docs/method/papers.md §1),
one cell per args:
    :skip_sab=True,skip_ffn=True,init=default,opt=adamw     80.3   (standard ViT-B)
    :skip_sab=True,skip_ffn=True,init=default,opt=soap      80.1
    :init=default,opt=adamw                                 61.4   (skipless, default init)
    :init=default,opt=soap                                  77.0
    :opt=adamw                                              78.1   (skipless + skipless init)
    (no args)                                               80.8   (skipless + init + SOAP)

Schedule (ViT-B 300 epochs): batch 1024, lr 1e-3, weight decay 0.3 (the ViT/big_vision AdamW
value; DeiT uses 0.05), not on biases, norms, position embedding or class token (docs/method/recipes.md
§14), 5 warm-up epochs, cosine to 1e-5, gradient clipping 1.0, label smoothing 0.1, DeiT's
augmentation (RandAugment m9, mixup 0.8 / cutmix 1.0, random erasing 0.25), drop-path 0.1 with
skips and 0 without. SOAP: b1 0.9, b2 0.95, preconditioning every 10 steps (Cutting the Skip).
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg,
        skip_sab=False,
        skip_ffn=False,
        init="skipless",
        opt="soap",
        seed=0,
        tg="none",
        eps=0.95,
        variant="B/16",
        epochs=300,
    )
    return config_blocks.imagenet_vit(a)
