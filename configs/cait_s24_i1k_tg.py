r"""ImageNet-1k CaiT-S24 with Token Graying: the CaiT row of "Always Skip Attention" (docs/method/families.md §10).

    python -m skipless_jax.main --config=configs/cait_s24_i1k_tg.py:tg=dct \
        --workdir=gs://BUCKET/cait_s24_dct --config.dataset.data_dir=gs://BUCKET/tfds

Token Graying acts on the raw 16×16×3 patch matrix (196×768 per image) before the patch
projection. Args: tg=dct|svd|svd_fast|none, eps ∈ (0, 1], skip_sab, skip_ffn (the residuals of
the self-attention blocks; with one off its LayerScale γ starts at 1, docs/method/families.md §10),
init=timm|default|skipless (timm: CaiT's own init, docs/method/families.md §24),
opt=adamw|soap, seed, epochs, variant=XXS24|S24. The class-attention
blocks keep their skips (`config.model.skip_class_sab`, `skip_class_ffn` switch them).

Hardware: sized for one 8-GPU node (A100/H100) or a TPU v4-32 slice (global batch 1024,
bfloat16 compute); the augmentation needs ≈ 47 worker processes (`input.num_workers`) per
6,150 images/s (docs/data.md).
Wall-clock: not measured (400 epochs ≈ 495k steps of train[:99%]).
Data: imagenet2012 prepared by tensorflow-datasets (docs/data.md); the run fails at start, in
one line, if it is absent.

Expected ImageNet-1k top-1, the paper's numbers (Always Skip Attention, CaiT-S), not measured here:
    :tg=none                                 82.6   (baseline)
    (no args)                                82.7   (+ DCT-TG, ε = 0.95)

Schedule (CaiT's recipe without distillation): 400 epochs, batch 1024, lr 1e-3, weight decay
0.05 (not on biases, norms, position embedding or class token; docs/method/recipes.md §14), 5 warm-up
epochs, cosine to 1e-5, no gradient clipping, label smoothing 0.1, RandAugment m9, mixup 0.8 /
cutmix 1.0, random erasing 0.25, AdamW b1 0.9, b2 0.999, drop-path 0.1 with skips and 0 without,
LayerScale γ initialized at 1e-5; 224×224 images; repeated augmentation 3 (epochs of
⌊N/256⌋·256 samples, whole batches) and model EMA 0.99996, reported as ema_<prefix> (DeiT's
main.py defaults; docs/recipes.md).
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, tg="dct", eps=0.95, skip_sab=True, skip_ffn=True, init="timm", opt="adamw", seed=0,
                          epochs=400, variant="S24")
    model = config_blocks.family_model("cait", a, 0.1, variant=a["variant"])
    # DeiT's main.py (CaiT's training code): repeated augmentation 3, model EMA 0.99996, no clipping.
    return config_blocks.imagenet_recipe(a, model, warmup_epochs=5, grad_clip=None, repeated_augmentation=3,
                                         ema_decay=0.99996)
