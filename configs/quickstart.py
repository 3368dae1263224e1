r"""Quickstart: a tiny ViT on scikit-learn's bundled handwritten digits (no download).

    python -m skipless_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart

The default is the "Cutting the Skip" recipe in miniature: no skips, skipless init, SOAP; a
4-layer, width-64 ViT on 2×2-pixel patches, 40 epochs (899 steps, batch 64).
Hardware: any CPU (2 cores: 39 s for the default including compilation). Data: 1,437 train /
360 test 8×8 images (the fixed split of skipless_jax/data/sources.py).
Expected: test accuracy 94.7 ± 1.1 to 95.9 ± 1.4 % over seeds 0-2, by CPU (docs/results/quickstart.md).

Args (same names in every config): skip_sab, skip_ffn, depth, seed, init, opt, tg, eps, e.g.
    --config=configs/quickstart.py:skip_sab=False,depth=8,seed=1
The miniature's own knobs (none given: the recipe above, unchanged): lr (default 3e-3 with SOAP,
1e-3 with AdamW), tokens (16, or 64: the digits upsampled bicubically to 16×16, still in 2×2
patches; see TOKENS), label_smoothing (default 0), self_share (config.model.init_self_share: β
set so that a token's attention on itself at init is that share, docs/method/papers.md §3; this
project's extension, not the paper's), val=True (train on train[:90%], report val_accuracy on
train[90%:] beside test_accuracy), aug (none, or pad_crop: a ±1-pixel pad-and-crop, see AUGS),
repeats (repeated augmentation's r, docs/method/recipes.md §21), ema (the model EMA's decay, 0: off;
docs/method/recipes.md §22),
init_source (paper: the text's skipless-init settings, as without it; fork: config_blocks.MAE_FORK_INIT),
pf (precondition_frequency of opt=soap or shampoo_ec; unset: the optimizer's own, 10 or 100).
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks

# tokens -> the input size the digits are resized to (None: their own 8×8). 64 tokens: 2×2 patches
# of the digits upsampled bicubically to 16×16, not 1×1 patches of the 8×8 ones, so that a token
# keeps the 4 features of the 16-token default (a local intensity and its gradients; Token Graying
# and the patch projection act on the same 4-feature patches) where a 1-pixel token would carry one
# number and a rank-1 patch matrix; only the number of tokens changes.
TOKENS = {16: None, 64: 16}
VAL_TRAIN, VAL = "train[:90%]", "train[90%:]"  # val=True: the train split's last 10 % held out
# init_source -> the skipless init's settings: the paper's text (Q/K Gaussian, V/O polar with c = 3,
# SUO MLP) or the authors' MAE fork (Q/K uniform, V/O U Vᵀ with c = 1, default MLP;
# docs/method/authors_init.md §3); α = 2, β = 0.6 in both.
INIT_SOURCES = {"paper": config_blocks.VITB_SUPERVISED_INIT, "fork": config_blocks.MAE_FORK_INIT}
# aug -> config.input.aug (None: images as stored). The digits are 8×8 single-channel: pad_crop
# shifts by up to one pixel (pad 1, random 8×8 crop), no flip (digits are not mirror-symmetric),
# nothing else; eval images as stored (crop_pct 1).
AUGS = {
    "none": None,
    "pad_crop": dict(randaug=None, scale=(0.08, 1.0), flip=False, reprob=0.0, mixup=0.0, cutmix=0.0,
                     mixup_switch_prob=0.5, crop="pad", crop_padding=1),
}

# Named grids for `python -m skipless_jax.sweep --config=configs/quickstart.py --grid=NAME`
# (docs/results.md shows each as a table via `python -m skipless_jax.report`). A list is the
# union of its grids: the variants that are not one product of axes.

_SKIPLESS = "skip_sab=False skip_ffn=False"
_SEEDS = "0,1,2,3,4"
_SEEDS_MORE = "5,6,7,8,9"
_LRS_2ND = "7.5e-4,1.5e-3,3e-3,6e-3"  # the fork_recipe grid's lrs of SOAP and shampoo_ec
# Label smoothing 0.1 on the cells of ordering (ii) (the claims grid's priority 4).
_LABEL_SMOOTHING = [
    f"{_SKIPLESS} init=skipless opt=soap depth=8,12,16 label_smoothing=0.1 seed={_SEEDS}",
    f"skip_sab=True skip_ffn=True init=default opt=adamw depth=8,12,16 label_smoothing=0.1 seed={_SEEDS}",
]

GRIDS = {
    # Table 1 of Cutting the Skip in miniature: {with skips, skipless + default init, skipless +
    # skipless init} × {AdamW, SOAP} × 5 seeds at depth 8.
    "table1": [
        f"skip_sab=True skip_ffn=True init=default opt=adamw,soap depth=8 seed={_SEEDS}",
        f"{_SKIPLESS} init=default,skipless opt=adamw,soap depth=8 seed={_SEEDS}",
    ],
    # The skip ablation: each skip switch, default init and AdamW, depth 4 and 8; and no skips
    # with the skipless init; 5 seeds. The axes are in the order of the other grids, so that a
    # run they share has one folder (one root holds them all, docs/results.md).
    "skip_ablation": [
        f"skip_sab=True,False skip_ffn=True,False init=default opt=adamw depth=4,8 seed={_SEEDS}",
        f"{_SKIPLESS} init=skipless opt=adamw depth=4,8 seed={_SEEDS}",
    ],
    # Token Graying's ε ablation on the standard ViT (ε = 1: no TG), SVD-TG.
    "tg_eps": [
        "skip_sab=True skip_ffn=True init=default opt=adamw tg=none seed=0,1,2",
        "skip_sab=True skip_ffn=True init=default opt=adamw tg=svd eps=0.9,0.7,0.6,0.5 seed=0,1,2",
    ],
    # bf16 against float32 (run once per dtype, --config.model.dtype=bfloat16): the quickstart's
    # default and the standard ViT with AdamW.
    "bf16": ["seed=0,1,2", "skip_sab=True skip_ffn=True init=default opt=adamw seed=0,1,2"],
    # Does the central effect hold in depth? Table 1's four skipless cells at depths 8-24, 5 seeds (report --claims).
    "depth": f"{_SKIPLESS} init=default,skipless opt=adamw,soap depth=8,12,16,24 seed={_SEEDS}",
    # The claims grid's depth axis alone (its runs at the recipe's lr, no knobs): the figure of
    # test accuracy against depth with the skips included (docs/results/claims.md).
    "claims_depth": [
        f"skip_sab=True skip_ffn=True init=default opt=adamw,soap depth=8,12,16 seed={_SEEDS}",
        f"{_SKIPLESS} init=default,skipless opt=adamw,soap depth=8,12,16 seed={_SEEDS}",
    ],
    # The papers' claims in miniature (docs/results/claims.md), 5 seeds; in priority order, each new
    # knob an axis between depth and seed, written only where it is not the default, so that a
    # run another grid has (Table 1's, the depth grid's) is the same folder under one root.
    # 225 runs, 155 of them in no other grid.
    # Repeated augmentation (r = 1, 3) and a model EMA (decay 0.98) without and with the
    # pad-and-crop augmentation, 3 seeds (experiments/ra_ema_digits.py, docs/results/ra_ema.md).
    "ra_ema": "aug=none,pad_crop repeats=1,3 ema=0.98 seed=0,1,2",
    "claims": [
        # The runs of Table 1 and the depth grid at depths 8-16 that the claims compare.
        f"skip_sab=True skip_ffn=True init=default opt=adamw,soap depth=8 seed={_SEEDS}",
        f"{_SKIPLESS} init=default,skipless opt=adamw,soap depth=8,12,16 seed={_SEEDS}",
        # 1. With skips at every depth (ordering (ii): init + SOAP ≥ with skips).
        f"skip_sab=True skip_ffn=True init=default opt=adamw,soap depth=12,16 seed={_SEEDS}",
        # 2. AdamW's learning rate: the three AdamW cells at lr 3e-4, 1e-3 (the default, not
        #    written), 2e-3 on train[:90%], chosen on val_accuracy.
        f"skip_sab=True skip_ffn=True init=default opt=adamw depth=8,12 lr=3e-4,2e-3 val=True seed={_SEEDS}",
        f"skip_sab=True skip_ffn=True init=default opt=adamw depth=8,12 val=True seed={_SEEDS}",
        f"{_SKIPLESS} init=default,skipless opt=adamw depth=8,12 lr=3e-4,2e-3 val=True seed={_SEEDS}",
        f"{_SKIPLESS} init=default,skipless opt=adamw depth=8,12 val=True seed={_SEEDS}",
        # 3. 64 tokens, the skipless cells under AdamW: the paper's β, and β matched to ViT-B/16's
        #    share, self_attention_share(ViT-B/16, 197 tokens) = 0.7605 (docs/method/papers.md §3).
        f"{_SKIPLESS} init=default,skipless opt=adamw depth=8 tokens=64 seed={_SEEDS}",
        f"{_SKIPLESS} init=skipless opt=adamw depth=8 tokens=64 self_share=0.76 seed={_SEEDS}",
        # 4. Label smoothing 0.1 on ordering (ii)'s cells.
        *_LABEL_SMOOTHING,
    ],
    # Priority 4 of the claims grid alone, to judge ordering (ii) under label smoothing by itself.
    "claims_label_smoothing": _LABEL_SMOOTHING,
    # Written before its runs: ordering (ii) with the authors' recipe, each cell at the lr it
    # chooses on validation (claims `init_shampoo_ec_matches_skips_pf*`, `init_soap_matches_skips_best_lr`).
    # The second-order cells share a 4-lr grid, 8× wide around SOAP's 3e-3 (AdamW's choices:
    # skipless + init 1e-3 at depth 8 and 3e-4 at 12; with skips 2e-3, the top of its grid, at both):
    # shampoo_ec with the fork's init, refreshing every 100 steps (the fork's) and every 10 (a digits
    # run is 809 steps); SOAP with the paper's init. With skips, AdamW: the claims grid's 3e-4, 1e-3
    # (unwritten) and 2e-3 (30 runs already there), and 4e-3, 8e-3 above them.
    # 170 runs, 140 new: 80 shampoo_ec, 40 SOAP, 20 AdamW. Cost, from 55-70 CPU-s per 899-step run at
    # depth 4 (14-17.5 CPU-s per block) × 809/899 steps, the second-order steps taken as 1-1.2× AdamW's:
    # 101-151 CPU-s per run at depth 8, 151-227 at depth 12; the 140 new runs 4.9-7.2 CPU-hours,
    # 6.0-8.5 with the 30 AdamW runs on a root that lacks them.
    "fork_recipe": [
        f"{_SKIPLESS} init=skipless opt=shampoo_ec depth=8,12 init_source=fork pf=100,10 lr={_LRS_2ND} val=True "
        f"seed={_SEEDS}",
        f"{_SKIPLESS} init=skipless opt=soap depth=8,12 lr={_LRS_2ND} val=True seed={_SEEDS}",
        f"skip_sab=True skip_ffn=True init=default opt=adamw depth=8,12 lr=3e-4,2e-3,4e-3,8e-3 val=True seed={_SEEDS}",
        f"skip_sab=True skip_ffn=True init=default opt=adamw depth=8,12 val=True seed={_SEEDS}",
    ],
    # The fork_recipe cells whose lr chosen on validation is an end of its grid get the next value
    # past that end (lrs in factors of 2), 5 seeds; `report` then chooses again. Depth 12, eigh
    # every 100 steps chose 7.5e-4, the grid's lowest.
    "fork_recipe_wider": [
        f"{_SKIPLESS} init=skipless opt=shampoo_ec depth=12 init_source=fork pf=100 lr=3.75e-4 val=True seed={_SEEDS}",
    ],
    # Seeds 5-9 on each committed cell whose trained count k/n (final train loss below
    # ½ ln 10) is strictly between 0 and n, in the folders of its grid (seeds 0-4 are committed):
    #   no skips, default init, AdamW, depth 8                    4/5  (quickstart_runs.csv)
    #   no skips, skipless init, AdamW, depth 12                  4/5  (quickstart_runs.csv)
    #   no skips, default init, AdamW, depth 12, lr 3e-4, val     3/5  (claims_runs.csv)
    #   no skips, skipless init, AdamW, depth 12, lr 1e-3, val    3/5  (claims_runs.csv)
    #   no skips, default init, AdamW, depth 8, 64 tokens         1/5  (claims_runs.csv)
    #   no skips, default init, SOAP, depth 16                    2/5  (claims_runs.csv)
    # Their partner cells (e.g. the skipless init at 5/5) keep 5 seeds. 30 runs; at 14-17.5 CPU-s
    # per block (×0.9 with val, ×4 at 64 tokens): 1.7-2.2 CPU-hours.
    "bimodal_seeds": [
        f"{_SKIPLESS} init=default opt=adamw depth=8 seed={_SEEDS_MORE}",
        f"{_SKIPLESS} init=skipless opt=adamw depth=12 seed={_SEEDS_MORE}",
        f"{_SKIPLESS} init=default opt=adamw depth=12 lr=3e-4 val=True seed={_SEEDS_MORE}",
        f"{_SKIPLESS} init=skipless opt=adamw depth=12 val=True seed={_SEEDS_MORE}",
        f"{_SKIPLESS} init=default opt=adamw depth=8 tokens=64 seed={_SEEDS_MORE}",
        f"{_SKIPLESS} init=default opt=soap depth=16 seed={_SEEDS_MORE}",
    ],
}

# The papers' claims, judged over seeds by `python -m skipless_jax.report SRC --claims=configs/quickstart.py`
# (docs/method/reports.md §19: Welch and permutation tests; Holm within each claim's `family`, by default
# its own name: docs/method/verdicts.md). Cells are arg filters over the runs' args (the defaults
# of get_config below, the sweep's args, the folder's); each claim is judged separately per depth
# (and per setting of the miniature's other knobs, where a grid varies them).
_NO_SKIPS = {"skip_sab": "False", "skip_ffn": "False"}
_WITH_SKIPS = {"skip_sab": "True", "skip_ffn": "True", "init": "default"}
_PER = ("depth", "lr", "tokens", "label_smoothing", "self_share", "val")
_PER_BEST_LR = tuple(k for k in _PER if k not in ("lr", "val"))


def _matches_skips_best_lr(what: str, a: dict[str, str], family: str) -> dict:
    """Ordering (ii) with validation: skipless-init cell A (no skips, `a`'s optimizer and init
    settings) ≥ with skips under AdamW within 1 point, each cell at the lr it chooses on val."""
    return dict(
        text=f"{what} ≥ with skips under AdamW, within 1 point, each at the lr it chooses on validation",
        a={**_NO_SKIPS, "init": "skipless", **a, "val": "True"},
        b={**_WITH_SKIPS, "opt": "adamw", "val": "True"},
        margin=0.01,
        per=_PER_BEST_LR,
        select="lr",
        select_field="optimizer.lr",
        family=family,
    )


CLAIMS = {
    "init_beats_default_adamw": dict(
        text="Cutting the Skip: the skipless init > the default init under AdamW, no skips",
        a={**_NO_SKIPS, "init": "skipless", "opt": "adamw"},
        b={**_NO_SKIPS, "init": "default", "opt": "adamw"},
        per=_PER,
        family="init_beats_default_adamw",
    ),
    "init_soap_matches_skips": dict(
        text="Cutting the Skip: no skips + skipless init + SOAP ≥ with skips under AdamW, within 1 point",
        a={**_NO_SKIPS, "init": "skipless", "opt": "soap"},
        b={**_WITH_SKIPS, "opt": "adamw"},
        margin=0.01,
        per=_PER,
        family="init_soap_matches_skips",
    ),
    "soap_beats_adamw_init": dict(
        text="Cutting the Skip: SOAP > AdamW, no skips, skipless init",
        a={**_NO_SKIPS, "init": "skipless", "opt": "soap"},
        b={**_NO_SKIPS, "init": "skipless", "opt": "adamw"},
        per=_PER,
        family="soap_beats_adamw_init",
    ),
    "soap_beats_adamw_default": dict(
        text="Cutting the Skip: SOAP > AdamW, no skips, default init",
        a={**_NO_SKIPS, "init": "default", "opt": "soap"},
        b={**_NO_SKIPS, "init": "default", "opt": "adamw"},
        per=_PER,
        family="soap_beats_adamw_default",
    ),
    "sab_skip_matters_more": dict(
        text="Always Skip Attention: without the FFN skip > without the SAB skip (default init, AdamW)",
        a={"skip_sab": "True", "skip_ffn": "False", "init": "default", "opt": "adamw"},
        b={"skip_sab": "False", "skip_ffn": "True", "init": "default", "opt": "adamw"},
        per=_PER,
        family="sab_skip_matters_more",
    ),
    # Written before its runs: the failure rate, not the mean. A run trained when its
    # final train loss is below ½ ln 10 (docs/method/reports.md §19); Fisher's exact test on k/n per cell
    # (docs/method/verdicts.md §3), its own Holm family.
    "init_trains_more_often": dict(
        text="Cutting the Skip: the skipless init trains more often than the default init under AdamW, no skips",
        a={**_NO_SKIPS, "init": "skipless", "opt": "adamw"},
        b={**_NO_SKIPS, "init": "default", "opt": "adamw"},
        per=_PER,
        kind="trained",
        family="init_trains_more_often",
    ),
    # Written after the claims grid's lr runs were seen: the comparison docs/results.md had made
    # by hand, now made by code: each cell takes the lr of its best mean
    # val_accuracy, then test decides; a choice at an end of the lr grid is marked not interior.
    "init_beats_default_adamw_best_lr": dict(
        text="the skipless init > the default init under AdamW, no skips, each at the lr it chooses on validation",
        a={**_NO_SKIPS, "init": "skipless", "opt": "adamw", "val": "True"},
        b={**_NO_SKIPS, "init": "default", "opt": "adamw", "val": "True"},
        per=_PER_BEST_LR,
        select="lr",
        select_field="optimizer.lr",
        family="init_beats_default_adamw_best_lr",
    ),
    # Written before the fork_recipe grid's runs: ordering (ii) with the authors'
    # optimizer and init, one claim per refresh frequency (the with-skips cell has none), the two in
    # one Holm family; and with today's SOAP, both at the lr each cell chooses on validation.
    **{f"init_shampoo_ec_matches_skips_pf{pf}": _matches_skips_best_lr(
        f"no skips + the fork's init + shampoo_ec (eigh every {pf} steps)",
        dict(opt="shampoo_ec", init_source="fork", pf=str(pf)), "init_shampoo_ec_matches_skips",
    ) for pf in (100, 10)},
    "init_soap_matches_skips_best_lr": _matches_skips_best_lr(
        "no skips + skipless init + SOAP", dict(opt="soap", init_source="paper", pf="None"),
        "init_soap_matches_skips_best_lr",
    ),
}


def _refresh_frequency(a: dict) -> int | None:
    """The `pf` arg as an int >= 1 (None: unset); a one-line error for a bad value or an optimizer
    without a preconditioner refresh."""
    pf = config_args.optional_number(a, "pf")
    if pf is None:
        return None
    if a["opt"] not in ("soap", "shampoo_ec"):
        raise ValueError(f"config arg pf={a['pf']!r} applies to opt=soap | shampoo_ec only, not opt={a['opt']!r}")
    if pf != int(pf) or pf < 1:
        raise ValueError(f"config arg pf={a['pf']!r} must be an integer >= 1")
    return int(pf)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg,
        skip_sab=False,
        skip_ffn=False,
        depth=4,
        seed=0,
        init="skipless",
        opt="soap",
        tg="none",
        eps=0.95,
        epochs=40,
        lr=None,
        tokens=16,
        label_smoothing=0.0,
        self_share=None,
        val=False,
        aug="none",
        repeats=1,
        ema=0.0,
        init_source="paper",
        pf=None,
    )
    if a["init_source"] not in INIT_SOURCES:
        raise ValueError(f"config arg init_source={a['init_source']!r} is not allowed; allowed: "
                         f"{' | '.join(INIT_SOURCES)}")
    if a["aug"] not in AUGS:
        raise ValueError(f"config arg aug={a['aug']!r} is not allowed; allowed: {' | '.join(AUGS)}")
    if a["tokens"] not in TOKENS:
        raise ValueError(f"config arg tokens={a['tokens']!r} is not allowed; allowed: {' | '.join(map(str, TOKENS))}")
    c = ml_collections.ConfigDict()
    c.trainer = "supervised"
    c.seed = a["seed"]

    c.dataset = ml_collections.ConfigDict(
        dict(name="digits", train_split=VAL_TRAIN if a["val"] else "train", eval_split="test",
             data_dir=placeholder(str))
    )
    c.input = ml_collections.ConfigDict(
        dict(batch_size=64, eval_batch_size=128, image_size=placeholder(int), aug=None, num_workers=0,
             repeated_augmentation=1, drop_last=False)
    )
    if TOKENS[a["tokens"]]:
        c.input.image_size = TOKENS[a["tokens"]]
        c.input.crop_pct = 1.0  # the whole upsampled digit, no centre crop
    if AUGS[a["aug"]] is not None:
        c.input.aug, c.input.crop_pct = ml_collections.ConfigDict(AUGS[a["aug"]]), 1.0
    c.input.repeated_augmentation = a["repeats"]

    # Skips, init (the ViT-B/16 constants of Cutting the Skip) and Token Graying from the args.
    c.model = config_blocks.vit_model(
        a,
        INIT_SOURCES[a["init_source"]],
        variant=placeholder(str),
        width=64,
        depth=a["depth"],
        num_heads=4,
        mlp_dim=128,
        patch_size=2,  # 16 tokens of 2×2 pixels (64 on the upsampled digits)
        pool="gap",
        drop_path=0.0,
        gelu=placeholder(str),  # None: tanh; `--config.model.gelu=exact --config.model.pool=tok`: timm's ViT
    )
    share = config_args.optional_number(a, "self_share")
    if share is not None:
        c.model.init_self_share = share  # β from this target (trainers/supervised.py)

    # AdamW (b2 0.999) or Cutting the Skip's SOAP (b1 0.9, b2 0.95, frequency 10).
    lr = config_args.optional_number(a, "lr")
    lr = lr if lr is not None else 3e-3 if a["opt"] == "soap" else 1e-3
    c.optimizer = config_blocks.optimizer(a["opt"], lr=lr, weight_decay=0.05)
    pf = _refresh_frequency(a)
    if pf is not None:
        c.optimizer.precondition_frequency = pf
    c.optimizer.update(config_blocks.small_model_shampoo(a["opt"], c.model.width))
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=5, end_lr=1e-5))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = 1.0
    c.label_smoothing = a["label_smoothing"]
    c.skip_nonfinite_steps = False
    c.model_ema = config_blocks.model_ema(decay=a["ema"])  # off by default; docs/results/ra_ema.md measures it on

    c.update(config_blocks.runtime(eval_every=0, checkpoint_every=500, log_every=50))  # eval at the end only
    c.keep_checkpoints = 2
    if a["val"]:
        c.evals = config_blocks.val_evals(VAL)
    return c
