r"""ImageNet-1k Swin-S with Token Graying: the Swin row of "Always Skip Attention" (docs/method.md §10).

    python -m skipless_jax.main --config=configs/swin_s_i1k_tg.py:tg=dct \
        --workdir=gs://BUCKET/swin_s_dct --config.dataset.data_dir=gs://BUCKET/tfds

Token Graying acts on the stem's raw 4×4×3 patch matrix (3136×48 per image) before the patch
projection (the Swin stem is a plain patch projection), identically at train and eval. Args:
tg=dct|svd|svd_fast|none, eps ∈ (0, 1], skip_sab, skip_ffn (the two residuals of every Swin
block), init=default|skipless, opt=adamw|soap, seed, epochs, variant=T|S|B.

Hardware: sized for one 8-GPU node (A100/H100) or a TPU v4-32 slice (global batch 1024,
bfloat16 compute); the augmentation needs ≈ 47 worker processes (`input.num_workers`) per
6,150 images/s (estimate from the measured 134 images per worker CPU second, docs/data.md).
Wall-clock: not measured (300 epochs ≈ 375k steps).
Data: imagenet2012 prepared by tensorflow-datasets (docs/data.md); the run fails at start, in
one line, if it is absent.

Expected ImageNet-1k top-1, the paper's numbers (Always Skip Attention, Swin-S; its baseline
81.3 equals Swin-T's published number), not measured here:
    :tg=none                                 81.3   (baseline)
    (no args)                                81.6   (+ DCT-TG, ε = 0.95)

Schedule (Swin's ImageNet-1k recipe): 300 epochs, batch 1024, lr 1e-3, weight decay 0.05 (not on
biases, norms; docs/method.md §14), 20 warm-up epochs, cosine to 1e-5, gradient clipping 5.0,
label smoothing 0.1, RandAugment m9, mixup 0.8 / cutmix 1.0, random erasing 0.25, AdamW b1 0.9,
b2 0.999, drop-path 0.3 with skips and 0 without; 224×224 images.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks


def family_model(name: str, a: dict, drop_path: float, **fields) -> ml_collections.ConfigDict:
    """`config.model` of a family other than the ViT: switches, init and TG from the args `a`,
    drop-path only with both skips (docs/method.md §1); `fields` (variant, sizes) are added."""
    skip_sab, skip_ffn = a.get("skip_sab", True), a.get("skip_ffn", True)
    init = a.get("init", "default")
    constants = config_blocks.VITB_SUPERVISED_INIT if init != "default" else dict(init_alpha=1.0, init_beta=1.0,
                                                                                   init_c=1.0)
    tg = a.get("tg", "none")
    return ml_collections.ConfigDict(dict(
        name=name, skip_sab=skip_sab, skip_ffn=skip_ffn, drop_path=drop_path if skip_sab and skip_ffn else 0.0,
        init=init, **constants, token_graying=placeholder(str) if tg == "none" else tg, tg_eps=a.get("eps", 0.95),
        dtype="float32", **fields,
    ))


def imagenet_recipe(a: dict, model: ml_collections.ConfigDict, *, warmup_epochs: int, grad_clip: float,
                    lr: float = 1e-3, weight_decay: float = 0.05) -> ml_collections.ConfigDict:
    """The DeiT-style ImageNet-1k recipe these family configs share (batch 1024, 224×224)."""
    c = ml_collections.ConfigDict()
    c.trainer = "supervised"
    c.seed = a["seed"]
    c.dataset = ml_collections.ConfigDict(
        dict(name="imagenet2012", train_split="train", eval_split="validation", data_dir=placeholder(str)))
    c.input = ml_collections.ConfigDict(dict(batch_size=1024, eval_batch_size=1024, image_size=224, crop_pct=0.875,
                                             num_workers=32, aug=config_blocks.deit_aug()))
    model.dtype = "bfloat16"
    c.model = model
    c.optimizer = config_blocks.optimizer(a["opt"], lr=lr, weight_decay=weight_decay)
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=warmup_epochs, end_lr=1e-5))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = grad_clip
    c.label_smoothing = 0.1
    c.skip_nonfinite_steps = False
    config_blocks.runtime(c, eval_every=5000, checkpoint_every=2000)
    return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, tg="dct", eps=0.95, skip_sab=True, skip_ffn=True, init="default", opt="adamw", seed=0,
                          epochs=300, variant="S")
    return imagenet_recipe(a, family_model("swin", a, 0.3, variant=a["variant"]), warmup_epochs=20, grad_clip=5.0)
