r"""ImageNet-1k PVTv2-b3 with Token Graying: the PVTv2 row of "Always Skip Attention" (docs/method/families.md §10).

    python -m skipless_jax.main --config=configs/pvtv2_b3_i1k_tg.py:tg=dct \
        --workdir=gs://BUCKET/pvtv2_b3_dct --config.dataset.data_dir=gs://BUCKET/tfds

PVTv2's stem is an overlapping 7×7 convolution of stride 4, not a plain patch projection: Token
Graying acts on the stem-stride 4×4×3 patch matrix (3136×48 per image), mapped back to the
image, then the model's own stem, identically at train and eval. Args: tg=dct|svd|svd_fast|none,
eps ∈ (0, 1], skip_sab, skip_ffn,
init=timm|default|skipless (timm: PVTv2's own init, docs/method/families.md §24),
opt=adamw|soap, seed, epochs,
variant=b0|b1|b2|b3.

Hardware: sized for one 8-GPU node (A100/H100) or a TPU v4-32 slice (global batch 1024,
bfloat16 compute); the augmentation needs ≈ 47 worker processes (`input.num_workers`) per
6,150 images/s (docs/data.md).
Wall-clock: not measured (300 epochs ≈ 372k steps of train[:99%]).
Data: imagenet2012 prepared by tensorflow-datasets (docs/data.md); the run fails at start, in
one line, if it is absent.

Expected ImageNet-1k top-1, the paper's numbers (Always Skip Attention, PVTv2-b3), not measured here:
    :tg=none                                 82.9   (baseline)
    (no args)                                83.0   (+ DCT-TG, ε = 0.95)

Schedule (PVT's DeiT-style recipe): 300 epochs, batch 1024, lr 1e-3, weight decay 0.05 (not on
biases, norms; docs/method/recipes.md §14), 5 warm-up epochs, cosine to 1e-5, gradient clipping 1.0,
label smoothing 0.1, RandAugment m9, mixup 0.8 / cutmix 1.0, random erasing 0.25, AdamW b1 0.9,
b2 0.999, drop-path 0.3 with skips and 0 without (PVT's configs/pvt_v2/pvt_v2_b3.py); 224×224
images; repeated augmentation 3 (epochs of ⌊N/256⌋·256 samples, whole batches), no model EMA
(PVT's main.py; docs/recipes.md).
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, tg="dct", eps=0.95, skip_sab=True, skip_ffn=True, init="timm", opt="adamw", seed=0,
                          epochs=300, variant="b3")
    model = config_blocks.family_model("pvt_v2", a, 0.3, variant=a["variant"])
    # PVT's classification/main.py: repeated augmentation on (3), model EMA commented out;
    # configs/pvt_v2/pvt_v2_b3.py clips at 1.0.
    return config_blocks.imagenet_recipe(a, model, warmup_epochs=5, grad_clip=1.0, repeated_augmentation=3)
