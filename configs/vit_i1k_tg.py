r"""ImageNet-1k ViT-S/16 and ViT-B/16 with Token Graying: the TG rows of "Always Skip Attention".

    python -m skipless_jax.main --config=configs/vit_i1k_tg.py:variant=S/16,tg=dct \
        --workdir=gs://BUCKET/vits_dct --config.dataset.data_dir=gs://BUCKET/tfds

Token Graying (docs/method/papers.md §4, skipless_jax/token_graying.py) is applied inside the jitted step
to each image's raw patch matrix (196×768, float32), before the patch embedding, identically
at train and eval. Args: variant=S/16|B/16, tg=dct|svd|svd_fast|none, eps ∈ (0, 1].

Hardware: sized for one 8-GPU node (A100/H100) or a TPU v4-32 slice (global batch 1024,
bfloat16 compute); the augmentation needs ≈ 47 worker processes (`input.num_workers`) per
6,150 images/s (docs/data.md).
Wall-clock: not measured (300 epochs ≈ 372k steps of train[:99%]). The paper's figures for
ViT-B (Always Skip Attention): 0.723 days for the baseline, 0.732 with DCT-TG (+1.2%), 4.552
with SVD-TG (6.3×); benchmarks/token_graying.py measures the TG cost itself (DCT, SVD and the
fast SVD-TG) on the machine at hand (docs/results/performance.md).
Data: imagenet2012 prepared by tensorflow-datasets (docs/data.md); the run fails at start, in
one line, if it is absent.

Expected ImageNet-1k top-1 (Always Skip Attention, 300 epochs), one cell per args:
    :variant=S/16,tg=none                    80.2   (ViT-S/16 baseline)
    :variant=S/16,tg=dct                     80.4   (ViT-S/16 + DCT-TG, ε = 0.95)
    :variant=B/16,tg=none                    81.0   (ViT-B/16 baseline)
    (no args)                                81.3   (ViT-B/16 + DCT-TG, ε = 0.95)
The ε ablation (ViT-B/16, SVD-TG; top-1, then log κ_in of the token matrix after TG):
    :tg=none                                 81.0   log κ_in 6.72
    :tg=svd,eps=0.9                          81.2   log κ_in 6.64
    :tg=svd,eps=0.7                          81.4   log κ_in 6.15
    :tg=svd,eps=0.6                          81.4   log κ_in 5.73
    :tg=svd,eps=0.5                          81.0   log κ_in 5.29
`tg=svd_fast` computes the same function as `tg=svd` (to ≤ 3e-5 relative on photo patches)
from symmetric eigendecompositions instead of an SVD.

Schedule (ViT-B 300 epochs, as configs/vitb_skipless.py): batch 1024, lr 1e-3, weight decay
0.3 (the ViT/big_vision AdamW value; DeiT uses 0.05), not on biases, norms, position embedding
or class token (docs/method/recipes.md §14), 5 warm-up epochs, cosine to 1e-5, gradient clipping 1.0,
label smoothing 0.1, DeiT's augmentation (RandAugment m9, mixup 0.8 / cutmix 1.0, random
erasing 0.25), drop-path 0.1, AdamW b1 0.9, b2 0.999; images 224×224 with patch 16.
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg,
        variant="B/16",
        tg="dct",
        eps=0.95,
        seed=0,
        epochs=300,
    )
    # The ImageNet ViT recipe of vitb_skipless.py with both skips, default init and AdamW.
    standard = dict(skip_sab=True, skip_ffn=True, init="default", opt="adamw")
    return config_blocks.imagenet_vit({**standard, **a})
