r"""ImageNet-1k ViT-B/16 with both skips, AdamW, 300 epochs: the baseline of both papers.

    python -m skipless_jax.main --config=configs/vitb_i1k_300ep.py \
        --workdir=gs://BUCKET/vitb_i1k_300ep --config.dataset.data_dir=gs://BUCKET/tfds

Hardware: sized for one 8-GPU node (A100/H100) or a TPU v4-32 slice (global batch 1024,
bfloat16 compute); the augmentation needs ≈ 47 worker processes (`input.num_workers`) per
6,150 images/s (estimate from the measured 134 images per worker CPU second, docs/data.md).
Wall-clock: not measured (300 epochs ≈ 372k steps of train[:99%]); Always Skip Attention
reports 0.723 days for its ViT-B baseline (the paper's figure, docs/method/papers.md §4).
Data: imagenet2012 prepared by tensorflow-datasets (docs/data.md); the run fails at start, in
one line, if it is absent.

Expected ImageNet-1k top-1 (Cutting the Skip, 300 epochs), one cell per args:
    (no args)                                                   80.3   (standard ViT-B, AdamW)
    :opt=soap                                                   80.1
    :skip_sab=False,skip_ffn=False                              61.4   (skipless, default init)
    :skip_sab=False,skip_ffn=False,opt=soap                     77.0
    :skip_sab=False,skip_ffn=False,init=skipless                78.1   (skipless + skipless init)
    :skip_sab=False,skip_ffn=False,init=skipless,opt=soap       80.8   (= configs/vitb_skipless.py)

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
        skip_sab=True,
        skip_ffn=True,
        init="default",
        opt="adamw",
        seed=0,
        tg="none",
        eps=0.95,
        variant="B/16",
        epochs=300,
    )
    # The one ImageNet ViT recipe (config_blocks.imagenet_vit, as vitb_skipless.py); this file sets the
    # baseline's args.
    return config_blocks.imagenet_vit(a)
