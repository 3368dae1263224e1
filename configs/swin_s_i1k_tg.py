r"""ImageNet-1k Swin-S with Token Graying: the Swin row of "Always Skip Attention" (docs/method/families.md §10).

    python -m skipless_jax.main --config=configs/swin_s_i1k_tg.py:tg=dct \
        --workdir=gs://BUCKET/swin_s_dct --config.dataset.data_dir=gs://BUCKET/tfds

Token Graying acts on the stem's raw 4×4×3 patch matrix (3136×48 per image) before the patch
projection (the Swin stem is a plain patch projection), identically at train and eval. Args:
tg=dct|svd|svd_fast|none, eps ∈ (0, 1], skip_sab, skip_ffn (the two residuals of every Swin
block),
init=timm|default|skipless (timm: Swin's own init, docs/method/families.md §24),
opt=adamw|soap, seed, epochs, variant=T|S|B.

Hardware: sized for one 8-GPU node (A100/H100) or a TPU v4-32 slice (global batch 1024,
bfloat16 compute); the augmentation needs ≈ 47 worker processes (`input.num_workers`) per
6,150 images/s (docs/data.md).
Wall-clock: not measured (300 epochs ≈ 372k steps of train[:99%]).
Data: imagenet2012 prepared by tensorflow-datasets (docs/data.md); the run fails at start, in
one line, if it is absent.

Expected ImageNet-1k top-1, the paper's numbers (Always Skip Attention, Swin-S; its baseline
81.3 equals Swin-T's published number), not measured here:
    :tg=none                                 81.3   (baseline)
    (no args)                                81.6   (+ DCT-TG, ε = 0.95)

Schedule (Swin's ImageNet-1k recipe): 300 epochs, batch 1024, lr 1e-3, weight decay 0.05 (not on
biases, norms; docs/method/recipes.md §14), 20 warm-up epochs, cosine to 1e-5, gradient clipping 5.0,
label smoothing 0.1, RandAugment m9, mixup 0.8 / cutmix 1.0, random erasing 0.25, AdamW b1 0.9,
b2 0.999, drop-path 0.3 with skips and 0 without; 224×224 images; whole batches per epoch, no
repeated augmentation, no model EMA (Swin's data/build.py and config.py; docs/recipes.md).
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, tg="dct", eps=0.95, skip_sab=True, skip_ffn=True, init="timm", opt="adamw", seed=0,
                          epochs=300, variant="S")
    model = config_blocks.family_model("swin", a, 0.3, variant=a["variant"])
    return config_blocks.imagenet_recipe(a, model, warmup_epochs=20, grad_clip=5.0)
