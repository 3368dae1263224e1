r"""Fashion-MNIST: a small ViT (or ConvMixer) on 60,000 real 28×28 images, each residual a switch.

    python -m skipless_jax.main --config=configs/fashion_vit.py --workdir=/tmp/fashion_vit

The default is the standard ViT (both skips, default init, AdamW). Args: skip_sab, skip_ffn,
init (default | skipless), opt (adamw | soap | shampoo_ec once config_args.CHOICES has it), depth,
seed, lr (default 1e-3 with AdamW, 3e-3 with SOAP and shampoo_ec), epochs, val=True (train on
train[:55000], report val_accuracy on train[55000:] beside test_accuracy; the test split is never
used to choose), model (vit | convmixer: ConvMixer-64/8, kernel 5, patch 4, the control of "Always
Skip Attention"; its one skip is skip_sab), aug (none | pad_crop | pad_crop_flip, see AUGS),
pilot=True (with val=True: train on train[:10000] only, the study's pilot), e.g.
    --config=configs/fashion_vit.py:skip_sab=False,skip_ffn=False,init=skipless,opt=soap,val=True

Hardware: any CPU; the default run is 4,688 steps (469 per epoch; 430 with val=True). Measured
on this project's 2-core CPU machine while other jobs shared it (load average about 9):
    python -m skipless_jax.main --config=configs/fashion_vit.py --workdir=/tmp/fv \
        --config.total_steps=40 --config.schedule.warmup_steps=3 --config.log_every_steps=10
printed progress lines with an ETA, trained to 39.7 % test accuracy in those 40 steps, and ran
steps 10-40 at 0.68 steps/s, about 1.5 s per step: about 11.5 minutes per epoch, 2 hours for the
10 epochs, under that load (an upper bound; issue #53 quotes 0.9 CPU-seconds per step on this
machine, about 7 minutes per epoch, not re-measured here). The process used 69 CPU-seconds in
all (compilation, 40 steps, the final evaluation of 10,000 test images). Each run is one
process on both cores; SOAP adds its preconditioner's work, ConvMixer-64/8 is smaller.
Data: the four IDX files of the Debian package dataset-fashion-mnist in
/usr/share/datasets/fashion-mnist (`apt-get install -y dataset-fashion-mnist`), or tfds's
`fashion_mnist` prepared in the tfds data dir set as config.dataset.data_dir (docs/data.md); the
run fails at start, in one line naming the file, if they are absent or damaged.

Expected test accuracy: to be measured (docs/results.md §Fashion-MNIST), as mean ± std over
seeds 0-4 of the `table1` and `cutting` grids.

Model: a ViT of width 64, depth 8, 4 heads, MLP 128 on 28×28 images with patch 4 (49 tokens of
16 features, global average pooling), drop-path 0 with skips and 0
without; the skipless init's constants are Cutting the Skip's ViT-B/16 ones (docs/method.md §3).
Schedule: 10 epochs, batch 128, lr 1e-3 (AdamW b2 0.999; SOAP: b1 0.9, b2 0.95,
preconditioning every 10 steps), weight decay 0.05, a warm-up of one epoch then cosine to 1e-5,
gradient clipping 1.0, label smoothing 0, no augmentation (the images as stored, normalized by
the train split's mean 0.2860 and std 0.3530, data/sources.py). The study uses no augmentation
(aug=none, the default) at 10 epochs.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks
from skipless_jax.data import idx

VAL_TRAIN, VAL = "train[:55000]", "train[55000:]"  # val=True: the train split's last 5,000 held out
PILOT_TRAIN = "train[:10000]"  # pilot=True: the first 10,000 (val on the same last 5,000)
MODELS = ("vit", "convmixer")
# aug -> config.input.aug (None: images as stored). 28×28 grayscale: a ±2-pixel shift (zero-pad 2,
# random 28×28 crop), optionally a horizontal flip (clothes are roughly mirror-symmetric; digits
# are not); nothing else. Eval images as stored (crop_pct 1).
_PAD_CROP = dict(randaug=None, scale=(0.08, 1.0), flip=False, reprob=0.0, mixup=0.0, cutmix=0.0,
                 mixup_switch_prob=0.5, crop="pad", crop_padding=2)
AUGS = {"none": None, "pad_crop": _PAD_CROP, "pad_crop_flip": dict(_PAD_CROP, flip=True)}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg,
        model="vit",
        skip_sab=True,
        skip_ffn=True,
        init="default",
        opt="adamw",
        depth=8,
        seed=0,
        lr=None,
        epochs=10,
        val=False,
        pilot=False,
        aug="none",
    )
    for key, allowed in (("model", MODELS), ("aug", tuple(AUGS))):
        if a[key] not in allowed:
            raise ValueError(f"config arg {key}={a[key]!r} is not allowed; allowed: {' | '.join(allowed)}")
    if a["pilot"] and not a["val"]:
        raise ValueError("config arg pilot=True needs val=True (the pilot chooses on the validation split)")
    train_split = PILOT_TRAIN if a["pilot"] else VAL_TRAIN if a["val"] else "train"
    c = config_blocks.recipe(a, "supervised", "fashion_mnist", train_split, "test", batch_size=128,
                             eval_batch_size=500, image_size=28, crop_pct=1.0, num_workers=0,
                             aug=AUGS[a["aug"]], repeated_augmentation=1, drop_last=False)
    c.dataset.data_dir = idx.FASHION_MNIST.default_dir  # or a tfds data dir holding fashion_mnist

    if a["model"] == "convmixer":  # its one residual (around the depthwise conv) is skip_sab
        c.model = config_blocks.family_model("convmixer", dict(a, skip_ffn=False), 0.0, variant=placeholder(str),
                                             width=64, depth=a["depth"], kernel_size=5, patch_size=4)
    else:
        c.model = config_blocks.vit_model(a, config_blocks.VITB_SUPERVISED_INIT, variant=placeholder(str), width=64,
                                          depth=a["depth"], num_heads=4, mlp_dim=128, patch_size=4, pool="gap",
                                          drop_path=0.0)

    lr = config_args.optional_number(a, "lr")
    lr = lr if lr is not None else 1e-3 if a["opt"] == "adamw" else 3e-3
    c.optimizer = config_blocks.optimizer(a["opt"], lr=lr, weight_decay=0.05)
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=1, warmup_steps=placeholder(int), end_lr=1e-5))
    c.total_epochs = a["epochs"]
    c.total_steps = placeholder(int)  # set (with schedule.warmup_steps) to override the epochs: a short run
    c.grad_clip_norm = 1.0
    c.label_smoothing = 0.0
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=0, checkpoint_every=500, log_every=50))  # eval at the end only
    c.keep_checkpoints = 2
    if a["val"]:
        c.evals = ml_collections.ConfigDict(dict(test=dict(type="classification"),
                                                 val=dict(type="classification", split=VAL)))
    return c
