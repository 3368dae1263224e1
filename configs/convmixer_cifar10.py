r"""ConvMixer-256/8 on CIFAR-10 with and without its skip: the control of "Always Skip Attention".

    python -m skipless_jax.main --config=configs/convmixer_cifar10.py:skip_sab=False \
        --workdir=/tmp/convmixer_cifar10_noskip

ConvMixer has one residual per block, around depthwise conv → GELU → BatchNorm (`skip_sab`);
the pointwise conv has none (docs/method/families.md §10). Args: skip_sab,
init=timm|default|skipless (timm: the reference's torch defaults, docs/method/families.md §24),
opt=adamw|soap, tg=dct|svd|svd_fast|none, eps, seed, epochs.

Hardware: one GPU or TPU chip and ≥ 8 host cores for the augmentation (docs/data.md).
Wall-clock: not measured (25 epochs ≈ 2k steps).
Data: cifar10 from tensorflow-datasets (docs/data.md); the run fails at start, in one line, if
it is absent.

Expected CIFAR-10 test accuracy, from the sources, not measured here (one cell per args):
    (no args)                         92.5 (with its skip; the reference README's 25-epoch command)
    :skip_sab=False                   92.5 (without: Always Skip Attention reports < ±0.2% change)
(The reference's 94% is its 100-epoch command, with colour jitter and erasing 0.2.)

Model: ConvMixer-256/8, kernel 5, patch 2 (594,186 parameters), on 32×32 images. Schedule (the
ConvMixer CIFAR-10 reference recipe): 25 epochs, batch 512, AdamW lr 0.05, weight decay 0.005
on every parameter (torch AdamW over `model.parameters()`: `weight_decay_rule='all'`, docs/method/recipes.md
§14), no gradient clipping (the README command has no `--clip-norm`), label smoothing 0.0,
2 RandAugment ops of torchvision's magnitude 12 (of 30), i.e. RandAugment m4 on this
project's (timm's) scale of 10, flip, mixup 0 / cutmix 0, random erasing 0; the reference's triangular lr
(`config.schedule.name='triangular'`, docs/method/recipes.md §14: 0 → 0.05 at 2/5 of training → 0.0025
at 4/5 → 0, per step). Its colour jitter is 0 in that command (an identity). ConvMixer's BatchNorm keeps running
statistics (the `batch_stats` state entry), evaluated with them, as in torch's eval mode.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, skip_sab=True, init="timm", opt="adamw", tg="none", eps=0.95, seed=0, epochs=25)
    c = ml_collections.ConfigDict()
    c.trainer = "supervised"
    c.seed = a["seed"]
    c.dataset = ml_collections.ConfigDict(
        dict(name="cifar10", train_split="train", eval_split="test", data_dir=placeholder(str)))
    aug = dict(randaug="rand-m4-n2", crop="pad", crop_padding=0, flip=True, reprob=0.0, mixup=0.0, cutmix=0.0,
               mixup_switch_prob=0.5, scale=(1.0, 1.0))
    c.input = ml_collections.ConfigDict(dict(batch_size=512, eval_batch_size=1000, image_size=32, crop_pct=1.0,
                                             num_workers=8, aug=aug))
    c.model = config_blocks.family_model("convmixer", dict(a, skip_ffn=False), 0.0, variant="256/8")
    c.optimizer = config_blocks.optimizer(a["opt"], lr=0.05, weight_decay=0.005, weight_decay_rule="all")
    c.schedule = ml_collections.ConfigDict(dict(name="triangular", peak_at=0.4, fall_at=0.8, fall_to=0.05,
                                                warmup_epochs=0))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = placeholder(float)  # the reference's README command does not clip
    c.label_smoothing = 0.0
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=490, checkpoint_every=490))
    return c
