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

Hardware: any CPU; the default run is 4,688 steps (469 per epoch; 430 with val=True). One step
of the default ViT takes 0.75 CPU-seconds on this project's CPU (docs/results/fashion_mnist.md):
5.9 CPU-minutes per epoch, 59 for the default 10 epochs. Each run is one process on every core.
Data: the four IDX files of the Debian package dataset-fashion-mnist in
/usr/share/datasets/fashion-mnist (`apt-get install -y dataset-fashion-mnist`), or tfds's
`fashion_mnist` prepared in the tfds data dir set as config.dataset.data_dir (docs/data.md); the
run fails at start, in one line naming the file, if they are absent or damaged.

Expected test accuracy: to be measured (docs/results/fashion_mnist.md).

Model: a ViT of width 64, depth 8, 4 heads, MLP 128 on 28×28 images with patch 4 (49 tokens of
16 features, global average pooling), drop-path 0; the skipless init's constants are Cutting the
Skip's ViT-B/16 ones (docs/method/papers.md §3).
Schedule: 10 epochs, batch 128, lr 1e-3 (AdamW b2 0.999; SOAP: b1 0.9, b2 0.95, preconditioning
every 10 steps), weight decay 0.05, a warm-up of one epoch then cosine to 1e-5, gradient clipping
1.0, label smoothing 0, no augmentation (the images as stored, normalized by the train split's
mean 0.2860 and std 0.3530, data/sources.py).

The study, pre-registered before any of its runs, sized to the issue's 40 CPU-hours. Its 11 cells
(`CELLS`), all at depth 8 and without augmentation: Table 1 of "Always Skip Attention" (the four
skip settings of the ViT under AdamW, ConvMixer with and without its skip) and Cutting the Skip's
(with skips, no skips + default init, no skips + skipless init, under AdamW and SOAP, and
shampoo_ec with the init).
1. `GRIDS['pilot']` chooses each cell's lr: the 5 values of its lr grid (`lr_grid(kind, 1)`),
   seeds 0-1, the first 10,000 train images, epochs=3, validated on train[55000:]; 110 runs.
   A cell's lr is the value of highest mean val_accuracy; a best value at an edge of the 5 has the
   grid extended by one ladder value on that side (2 seeds) before anything is chosen.
2. `GRIDS['study']`, written after the pilot and before its runs: each cell at its chosen lr,
   val=True (train[:55000]), epochs=5, seeds 0-4; 55 runs. A cell whose trained count is bimodal
   (some seeds trained, some not) gets seeds 5-9. `CLAIMS` read these runs (pilot=False, epochs=5).
Departures from the issue, to fit the budget: epochs=5 (it suggests 8-10); the lr chosen by the pilot on
10,000 images, not by full-size runs at 3 lrs; depth 12 left out.
Cost at 0.75 CPU-seconds a step (SOAP and shampoo_ec taken at 1.3×): a pilot run about 4
CPU-minutes with its evaluations (110 runs: about 7 CPU-hours), a study run 28-36 (55 runs: about
28), leaving about 5 for grid extensions and bimodal seeds.

    python -m skipless_jax.sweep --config=configs/fashion_vit.py --grid=pilot --root=/tmp/fashion
    python -m skipless_jax.report /tmp/fashion --config=configs/fashion_vit.py --grid=pilot --mean_over=seed \
        --metrics=val_accuracy
    python -m skipless_jax.report /tmp/fashion --claims=configs/fashion_vit.py
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
LADDER = ("1e-5", "3e-5", "1e-4", "3e-4", "1e-3", "3e-3", "1e-2", "3e-2", "1e-1")
LRS = {"adamw_skips": "3e-4", "adamw_skipless": "1e-4", "second_order": "1e-3", "convmixer": "1e-3"}  # lowest
STUDY_EPOCHS = 5  # the study's runs (the pilot's: 3, on train[:10000])


def lr_grid(kind: str, widen: int = 0) -> str:
    """The lr axis of a cell: 3 ladder values from LRS[kind], `widen` more on each side (the pilot's 5)."""
    start = LADDER.index(LRS[kind])
    return ",".join(LADDER[max(start - widen, 0):start + 3 + widen])


OPTS = ("adamw", "soap", "shampoo_ec")
_SKIPS = "skip_sab=True skip_ffn=True init=default"
_NO_SKIPS = "skip_sab=False skip_ffn=False"
# The study's 11 cells at depth 8 (each: its args, its lr grid's kind): Table 1's six (the four skip
# settings of the ViT under AdamW, ConvMixer with and without its skip) and Cutting the Skip's five
# more (with skips + SOAP, no skips + default init + SOAP, no skips + skipless init with AdamW, SOAP
# and shampoo_ec; its with-skips and default-init AdamW cells are Table 1's).
CELLS = (
    ("skip_sab=True skip_ffn=True init=default opt=adamw", "adamw_skips"),
    ("skip_sab=True skip_ffn=False init=default opt=adamw", "adamw_skips"),
    ("skip_sab=False skip_ffn=True init=default opt=adamw", "adamw_skips"),
    (f"{_NO_SKIPS} init=default opt=adamw", "adamw_skipless"),
    ("model=convmixer skip_sab=True init=default opt=adamw", "convmixer"),
    ("model=convmixer skip_sab=False init=default opt=adamw", "convmixer"),
    (f"{_SKIPS} opt=soap", "second_order"),
    (f"{_NO_SKIPS} init=default opt=soap", "second_order"),
    (f"{_NO_SKIPS} init=skipless opt=adamw", "adamw_skipless"),
    (f"{_NO_SKIPS} init=skipless opt=soap", "second_order"),
    (f"{_NO_SKIPS} init=skipless opt=shampoo_ec", "second_order"),
)


def _grid(args: str, tail: str) -> str:
    """A cell's grid string, its axes in the root's order: model, skip_sab, skip_ffn, init, opt, depth, lr, ..."""
    head, _, rest = args.partition(" ") if args.startswith("model=") else ("", "", args)
    return " ".join(x for x in (head, rest, "depth=8", tail) if x)


GRIDS = {
    # The pilot, which chooses each cell's lr: every cell at depth 8 at the 5 values of its lr grid,
    # seeds 0-1, the first 10,000 train images, 3 epochs, validated on train[55000:]: 110 runs.
    "pilot": [_grid(args, f"lr={lr_grid(kind, widen=1)} val=True pilot=True epochs=3 seed=0,1")
              for args, kind in CELLS],
    # "study": each cell at the lr the pilot chose, val=True, epochs=5, seeds 0-4 (55 runs), written
    # here after the pilot and before its runs.
}


# The claims the study judges (`report --claims=configs/fashion_vit.py`; docs/method/reports.md §19)
# on the runs of GRIDS['study'] (pilot=False, epochs=5), each cell at the lr the pilot chose, per
# depth. ViT cells: model=vit, the arg's default, which `report` gives the runs whose folders leave
# it out.
_STUDY_RUNS = {"pilot": "False", "epochs": str(STUDY_EPOCHS)}
_VIT_NO_SKIPS = {"model": "vit", "skip_sab": "False", "skip_ffn": "False", **_STUDY_RUNS}
_VIT_SKIPS = {"model": "vit", "skip_sab": "True", "skip_ffn": "True", "init": "default", **_STUDY_RUNS}
_CHOSEN = dict(per=("depth",))
CLAIMS = {
    # Study item 1: Always Skip Attention, Table 1 (the paper: about 22 against 2 points on CIFAR-10).
    "sab_skip_matters_more": dict(
        text="Always Skip Attention: without the FFN skip > without the SAB skip (ViT, default init, AdamW)",
        a={"model": "vit", "skip_sab": "True", "skip_ffn": "False", "init": "default", "opt": "adamw", **_STUDY_RUNS},
        b={"model": "vit", "skip_sab": "False", "skip_ffn": "True", "init": "default", "opt": "adamw", **_STUDY_RUNS},
        **_CHOSEN,
    ),
    "convmixer_skip_costs_little": dict(
        text="Always Skip Attention: ConvMixer without its skip ≥ with it, within 1 point",
        a={"model": "convmixer", "skip_sab": "False", "opt": "adamw", **_STUDY_RUNS},
        b={"model": "convmixer", "skip_sab": "True", "opt": "adamw", **_STUDY_RUNS},
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
