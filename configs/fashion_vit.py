r"""Fashion-MNIST: a small ViT (or ConvMixer) on 60,000 real 28×28 images, each residual a switch.

    python -m skipless_jax.main --config=configs/fashion_vit.py --workdir=/tmp/fashion_vit

The default is the standard ViT (both skips, default init, AdamW). Args: skip_sab, skip_ffn,
init (default | skipless), opt (adamw | soap | shampoo_ec, docs/method/shampoo_ec.md), depth,
seed, lr (default 1e-3 with AdamW, 3e-3 with SOAP and shampoo_ec), epochs, val=True (train on
train[:55000], report val_accuracy on train[55000:] beside test_accuracy; the test split is never
used to choose), model (vit | convmixer: ConvMixer-64/8, kernel 5, patch 4, the control of "Always
Skip Attention"; its one skip is skip_sab), aug (none | pad_crop | pad_crop_flip, see AUGS),
pilot=True (with val=True: train on train[:10000] only, the study's pilot), e.g.
    --config=configs/fashion_vit.py:skip_sab=False,skip_ffn=False,init=skipless,opt=soap,val=True

Hardware: any CPU; the default run is 4,688 steps (469 per epoch; 430 with val=True). Measured
on this project's 2-core CPU machine while other jobs shared it (load average 9-14):
    python -m skipless_jax.main --config=configs/fashion_vit.py --workdir=/tmp/fv \
        --config.total_steps=80 --config.schedule.warmup_steps=3 --config.log_every_steps=20
prints progress lines with an ETA and trains (test accuracy 33.4 % after 20 steps, 47.7 % after
80, each a whole cosine schedule). One step
takes 0.75 CPU-seconds (the process CPU time of an 80-step run minus a 20-step run's, both with
compilation and the final evaluation of 10,000 test images): 5.9 CPU-minutes per epoch, 59 for
the default 10 epochs (54 with val=True). Under that load the steps ran at 0.4-0.7 steps/s, i.e.
12-20 minutes of wall-clock per epoch; each run is one process on both cores. SOAP adds its
preconditioner's work, ConvMixer-64/8 is smaller (neither measured).
Data: the four IDX files of the Debian package dataset-fashion-mnist in
/usr/share/datasets/fashion-mnist (`apt-get install -y dataset-fashion-mnist`), or tfds's
`fashion_mnist` prepared in the tfds data dir set as config.dataset.data_dir (docs/data.md); the
run fails at start, in one line naming the file, if they are absent or damaged.

Expected test accuracy: to be measured (docs/results.md §Fashion-MNIST), as mean ± std over
seeds 0-4 of the `table1` and `cutting` grids.

Model: a ViT of width 64, depth 8, 4 heads, MLP 128 on 28×28 images with patch 4 (49 tokens of
16 features, global average pooling), drop-path 0 with skips and 0
without; the skipless init's constants are Cutting the Skip's ViT-B/16 ones (docs/method/papers.md §3).
Schedule: 10 epochs, batch 128, lr 1e-3 (AdamW b2 0.999; SOAP: b1 0.9, b2 0.95,
preconditioning every 10 steps), weight decay 0.05, a warm-up of one epoch then cosine to 1e-5,
gradient clipping 1.0, label smoothing 0, no augmentation (the images as stored, normalized by
the train split's mean 0.2860 and std 0.3530, data/sources.py). The study uses no augmentation
(aug=none, the default) at 10 epochs.

The study (pre-registered before any of its runs): `GRIDS['table1']` ("Always Skip
Attention", Table 1: the four skip settings of the ViT, AdamW, depth 8, and ConvMixer with and
without its skip), `GRIDS['cutting']` ("Cutting the Skip": with skips, skipless + default init,
skipless + skipless init, each under AdamW and SOAP, and shampoo_ec with the init, depth 8)
and `GRIDS['cutting_depth12']` (the same at depth 12, if the budget allows);
every run with val=True, 5 seeds, at each of the 3 values of its cell's lr grid (`LRS`). Each
cell's lr is the grid value of highest mean val_accuracy over its seeds, and its test_accuracy
at that lr is what `CLAIMS` judge (`select='lr'`, docs/method/verdicts.md §5), per depth; a best
value at an edge of its grid (`not interior` in the report) has the grid extended by one ladder
value on that side, 5 seeds, before the claims are judged. `GRIDS['pilot']` (one seed,
train[:10000], epochs=3, every depth-8 grid widened by one value on each side) may be run first
to check that the grids' ranges hold their best values; it chooses nothing else.
Cost: a run with val=True is 4,297 steps, about 54 CPU-minutes at the 0.75 CPU-seconds per
step measured above (ViT, AdamW, depth 8), so table1 + cutting (165 runs) need about 150
CPU-hours and cutting_depth12 (105 runs, 1.5× deeper) about 140 more, the pilot about 3: beyond
a 40 CPU-hour budget, so the grids are for an accelerator or a longer CPU budget (docs/results.md
says which hardware ran which runs).

    python -m skipless_jax.sweep --config=configs/fashion_vit.py --grid=table1 --root=/tmp/fashion
    python -m skipless_jax.report /tmp/fashion --config=configs/fashion_vit.py --grid=table1 \
        --claims=configs/fashion_vit.py
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

# The study's grids, for `python -m skipless_jax.sweep --config=configs/fashion_vit.py
# --grid=NAME --root=ROOT` (one root holds them all: a run two grids share is one folder, so the
# axes are always in this order: model, skip_sab, skip_ffn, init, opt, depth, lr, val, seed).
# Each cell's lr grid: three neighbours on the ladder LADDER (steps of about 3×) around the lr its
# recipe expects: AdamW lower without skips (the digits study's best lr fell 3× from depth 8 to 12),
# SOAP's, shampoo_ec's and ConvMixer's higher.
_SEEDS = "0,1,2,3,4"
LADDER = ("1e-5", "3e-5", "1e-4", "3e-4", "1e-3", "3e-3", "1e-2", "3e-2", "1e-1")
LRS = {"adamw_skips": "3e-4", "adamw_skipless": "1e-4", "second_order": "1e-3", "convmixer": "1e-3"}  # lowest


def lr_grid(kind: str, widen: int = 0) -> str:
    """The lr axis of a cell: 3 ladder values from LRS[kind], `widen` more on each side (the pilot)."""
    start = LADDER.index(LRS[kind])
    return ",".join(LADDER[max(start - widen, 0):start + 3 + widen])


OPTS = ("adamw", "soap", "shampoo_ec")
_SKIPS = "skip_sab=True skip_ffn=True init=default"
_NO_SKIPS = "skip_sab=False skip_ffn=False"


def _cells(depths: str, widen: int = 0, tail: str = f"val=True seed={_SEEDS}") -> dict[str, list[str]]:
    """The study's cells as grid strings, each at its lr grid: Table 1's at depth 8, Cutting the
    Skip's at `depths`."""
    return {
        "table1": [  # no skips at all: the lr grid of the skipless AdamW cells, as in "cutting"
            f"skip_sab=True skip_ffn=True,False init=default opt=adamw depth=8 lr={lr_grid('adamw_skips', widen)} "
            f"{tail}",
            f"skip_sab=False skip_ffn=True init=default opt=adamw depth=8 lr={lr_grid('adamw_skips', widen)} "
            f"{tail}",
            f"{_NO_SKIPS} init=default opt=adamw depth=8 lr={lr_grid('adamw_skipless', widen)} {tail}",
            f"model=convmixer skip_sab=True,False init=default opt=adamw depth=8 lr={lr_grid('convmixer', widen)} "
            f"{tail}",
        ],
        "cutting": [
            f"{_SKIPS} opt=adamw depth={depths} lr={lr_grid('adamw_skips', widen)} {tail}",
            f"{_SKIPS} opt=soap depth={depths} lr={lr_grid('second_order', widen)} {tail}",
            f"{_NO_SKIPS} init=default,skipless opt=adamw depth={depths} lr={lr_grid('adamw_skipless', widen)} {tail}",
            f"{_NO_SKIPS} init=default opt=soap depth={depths} lr={lr_grid('second_order', widen)} {tail}",
            f"{_NO_SKIPS} init=skipless opt=soap,shampoo_ec depth={depths} lr={lr_grid('second_order', widen)} {tail}",
        ],
    }


_STUDY, _DEEPER = _cells("8"), _cells("12")
GRIDS = {
    # Always Skip Attention, Table 1: both skips / no SAB skip / no FFN skip / no skips under
    # AdamW (default init) at depth 8; ConvMixer with and without its skip. 6 cells × 3 lrs × 5
    # seeds = 90 runs.
    "table1": _STUDY["table1"],
    # Cutting the Skip: with skips (AdamW, SOAP), skipless + default init and skipless + init
    # (AdamW, SOAP; shampoo_ec with the init only) at depth 8: 7 cells × 3 lrs × 5 seeds = 105
    # runs, 30 of them table1's.
    "cutting": _STUDY["cutting"],
    # The same cells at depth 12, if the budget allows: 105 runs.
    "cutting_depth12": _DEEPER["cutting"],
    # Does each cell's lr grid hold its best value? Every cell at depth 8, one seed, the first
    # 10,000 train images, epochs=3, its grid widened by one ladder value on each side: 55 runs
    # of 235 steps; it chooses no lr (the grids above do, on 5 seeds).
    "pilot": [g for gs in _cells("8", widen=1, tail="val=True pilot=True epochs=3 seed=0").values() for g in gs],
}


# The claims the study judges (`report --claims=configs/fashion_vit.py`; docs/method/reports.md §19),
# each cell at its own lr: `select='lr'` keeps, per cell and depth, the runs of the lr of highest
# mean val_accuracy (docs/method/verdicts.md §5). ViT cells: model=vit, the arg's default, which
# `report` gives the runs whose folders leave it out.
_VIT_NO_SKIPS = {"model": "vit", "skip_sab": "False", "skip_ffn": "False"}
_VIT_SKIPS = {"model": "vit", "skip_sab": "True", "skip_ffn": "True", "init": "default"}
_CHOSEN = dict(per=("depth",), select="lr", select_by="val_accuracy")
CLAIMS = {
    # Study item 1: Always Skip Attention, Table 1 (the paper: about 22 against 2 points on CIFAR-10).
    "sab_skip_matters_more": dict(
        text="Always Skip Attention: without the FFN skip > without the SAB skip (ViT, default init, AdamW)",
        a={"model": "vit", "skip_sab": "True", "skip_ffn": "False", "init": "default", "opt": "adamw"},
        b={"model": "vit", "skip_sab": "False", "skip_ffn": "True", "init": "default", "opt": "adamw"},
        **_CHOSEN,
    ),
    "convmixer_skip_costs_little": dict(
        text="Always Skip Attention: ConvMixer without its skip ≥ with it, within 1 point",
        a={"model": "convmixer", "skip_sab": "False", "opt": "adamw"},
        b={"model": "convmixer", "skip_sab": "True", "opt": "adamw"},
        margin=0.01,
        **_CHOSEN,
    ),
    # Study item 2: Cutting the Skip's (i)-(iii), as the digits study states them (configs/quickstart.py).
    "init_beats_default_adamw": dict(
        text="Cutting the Skip (i): the skipless init > the default init under AdamW, no skips",
        a={**_VIT_NO_SKIPS, "init": "skipless", "opt": "adamw"},
        b={**_VIT_NO_SKIPS, "init": "default", "opt": "adamw"},
        **_CHOSEN,
    ),
    "init_soap_matches_skips": dict(
        text="Cutting the Skip (ii): no skips + skipless init + SOAP ≥ with skips under AdamW, within 1 point",
        a={**_VIT_NO_SKIPS, "init": "skipless", "opt": "soap"},
        b={**_VIT_SKIPS, "opt": "adamw"},
        margin=0.01,
        **_CHOSEN,
    ),
    "init_shampoo_ec_matches_skips": dict(
        text="Cutting the Skip (ii): no skips + skipless init + shampoo_ec ≥ with skips under AdamW, within 1 point",
        a={**_VIT_NO_SKIPS, "init": "skipless", "opt": "shampoo_ec"},
        b={**_VIT_SKIPS, "opt": "adamw"},
        margin=0.01,
        **_CHOSEN,
    ),
    "soap_beats_adamw_init": dict(
        text="Cutting the Skip (iii): SOAP > AdamW, no skips, skipless init",
        a={**_VIT_NO_SKIPS, "init": "skipless", "opt": "soap"},
        b={**_VIT_NO_SKIPS, "init": "skipless", "opt": "adamw"},
        **_CHOSEN,
    ),
    "soap_beats_adamw_default": dict(
        text="Cutting the Skip (iii): SOAP > AdamW, no skips, default init",
        a={**_VIT_NO_SKIPS, "init": "default", "opt": "soap"},
        b={**_VIT_NO_SKIPS, "init": "default", "opt": "adamw"},
        **_CHOSEN,
    ),
}


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
    for key, allowed in (("model", MODELS), ("aug", tuple(AUGS)), ("opt", OPTS)):
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
    c.optimizer.update(config_blocks.small_model_shampoo(a["opt"], c.model.width))
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=1, warmup_steps=placeholder(int), end_lr=1e-5))
    c.total_epochs = a["epochs"]
    c.total_steps = placeholder(int)  # set (with schedule.warmup_steps) to override the epochs: a short run
    c.grad_clip_norm = 1.0
    c.label_smoothing = 0.0
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=0, checkpoint_every=500, log_every=50))  # eval at the end only
    c.keep_checkpoints = 2
    if a["val"]:
        c.evals = config_blocks.val_evals(VAL)
    return c
