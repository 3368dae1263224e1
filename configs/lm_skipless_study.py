r"""Deep skipless language models, the field's methods side by side (pre-registered).

    python -m skipless_jax.main --config=configs/lm_skipless_study.py:attention_shape=sas,opt=muon \
        --workdir=/tmp/lm_sas_muon

One run: a causal decoder of width 128, 4 heads, MLP 512, context 128 byte tokens, tied head, on
the embedded `stdlib` corpus (data/text.py), batch 32 windows (4,096 tokens), 2,000 steps (8.2M
tokens), warm-up 100 steps then cosine to 1e-05, gradient clipping 1.0, weight decay 0.1 on the
≥ 2-D parameters (config_blocks.lm_optimizer; the gains are 1-D); validation every 100 steps on
256 windows (32,768 bytes), each with the excess kurtosis of every block, the logit lens and the
int8 / int4 weight-quantized bits per byte (docs/method/lm_measures.md).

Args: depth (8 | 12 | 16), attention_shape (softmax | value_skip | sas | sas_p;
docs/method/skipless_lm.md §1-§3), skips (True: both skips, the Pre-LN baseline, softmax only;
False: the arm's own, none but SAS's MLP skip), init (default: GPT-2's | skipless | orthogonal),
opt (adamw | soap | shampoo_ec | muon: Muon on the hidden matrices, AdamW at 0.1× its lr on the
rest, docs/method/skipless_lm.md §6), lr (0: the optimizer's middle grid value, LRS), seed,
steps, val (True: train on `train_less_tune`, validate on `tune`, the split every learning rate
and optimizer is chosen on; False: train on `train`, validate on `validation`, where the claims
are judged).

The study, pre-registered before any of its runs:
1. Screening, `GRIDS['screen']`: at depth 8, val=True, seeds 0-2, every cell at each of the 3
   values of its optimizer's lr grid (LRS): the with-skips Pre-LN baseline (GPT-2 init, AdamW)
   and each skipless arm (the paper's init `init=skipless`, `init=orthogonal`, Value-SkipInit,
   SAS, SAS-P) under each optimizer (AdamW, SOAP, shampoo_ec, Muon): 21 cells, 189 runs. Each
   cell's lr is the grid value of lowest mean tune bits per byte; a best value at an edge of its
   grid has the grid extended by one value on that side (3 seeds) before anything is chosen.
2. Kept: per skipless arm, the optimizer of lowest mean tune bits per byte at its chosen lr; also
   the cells of the head-to-head claim (init=skipless with SOAP and with shampoo_ec, SAS with
   AdamW) and the baseline.
3. Confirmation, written into GRIDS after the screening and before its runs: the kept cells at
   their chosen lr, val=False, seeds 10-14, at depths 8 and 12 (16 if the budget allows; 12 and
   16 at depth 8's lr); 10 seeds where a cell's trained count is bimodal (some seeds below the
   trained threshold, some not). The claims read those runs only (`val=False`).

Claims (`CLAIMS`, judged on the confirmation's runs, validation bits per byte): each kept arm
within 0.05 bits per byte of the baseline at depth 8 and at depth 12 (non-inferiority, one Holm
family; the best arm's row decides "the best skipless arm"), and the paper's init with SOAP and
with shampoo_ec within 0.05 of SAS with AdamW (its own Holm family). The issue's other claims
are not expressible as a `claims.Claim` (one metric's means compared between two cells with an
additive margin, or trained counts): steps to target at most 5× and at most 2× the baseline's (a
ratio, of a first-crossing step read from each run's validation history, with runs that never
reach the target censored), "loses less bits per byte under int4 / int8" (a per-run difference,
val_int4_bits_per_byte − val_bits_per_byte, compared between cells), "a lower maximum activation
kurtosis" (a maximum over a run's per-layer val_kurtosis_layer_<l>); the runs record what they
need (validation every 100 steps with the measures), and they are to be judged by a claim kind
that reads them, added to skipless_jax/claims.py before the confirmation.

Hardware: any CPU (one process per run, on every core it finds) or one accelerator; sized by the
cost below. Expected validation bits per byte: not measured yet (the study measures them, to be
reported in docs/results.md); the baseline's should fall well below the corpus's unigram entropy
of 4.68 bits per byte (configs/lm_quickstart.py).

Cost, measured: one training step of the depth-8 model (batch 32 × 128; the trainer's compiled
step, 10 steps after warm-up, `benchmarks/lm_step_cost.py --config=configs/lm_skipless_study.py
--args=...`) took 1.4-1.8 CPU-seconds (user + system; SAS and the Pre-LN baseline with AdamW
1.4-1.8, SAS with Muon 1.5-1.7, the init with SOAP 1.6) and 4-6 s of wall-clock on this
project's 2-core CPU, shared with other jobs (load average 10-15). A 2,000-step run is
then about 50 CPU-minutes, about 55 with its 20 validations (each 4 batches of 64 windows, three
forward passes of each: float, int8, int4); depth 12 about 1.5× that. The screening's 189 runs
need about 175 CPU-hours and a confirmation of 9 cells × 5 seeds at depths 8 and 12 about 100
more: about 7× the issue's 40 CPU-hour budget, which holds about 43 depth-8 runs. The grids are
for an accelerator (the runs are small: each is one process; docs/results.md is to say which
hardware ran which runs); on CPU alone the study does not fit its budget as pre-registered.

    python -m skipless_jax.sweep --config=configs/lm_skipless_study.py --grid=screen --root=/tmp/lm_skipless
    python -m skipless_jax.report /tmp/lm_skipless --config=configs/lm_skipless_study.py --grid=screen
"""

import math

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks

OPTS = ("adamw", "soap", "shampoo_ec", "muon")
SHAPES = ("softmax", "value_skip", "sas", "sas_p")
INITS = ("default", "skipless", "orthogonal")
# (skip_sab, skip_ffn) of skips=False: SAS keeps its MLP skip (docs/method/skipless_lm.md §2).
OWN_SKIPS = {"softmax": (False, False), "value_skip": (False, False), "sas": (False, True), "sas_p": (False, False)}
# Each optimizer's lr grid (steps of about 3×): AdamW's around the quickstart's 1e-3, the second-order
# ones' around its 3e-3 for SOAP, Muon's around its authors' 0.02 (its AdamW part at 0.1×).
LRS = {"adamw": ("3e-4", "1e-3", "3e-3"), "soap": ("1e-3", "3e-3", "1e-2"), "shampoo_ec": ("1e-3", "3e-3", "1e-2"),
       "muon": ("3e-3", "1e-2", "3e-2")}
MUON_ADAM_LR_RATIO = 0.1

# The arms: name -> their args (the axes of a run's folder, in this order: skips, attention_shape,
# init, opt, depth, lr, val, seed).
BASELINE = "skips=True attention_shape=softmax init=default"
ARMS = {
    "init": "skips=False attention_shape=softmax init=skipless",
    "orthogonal": "skips=False attention_shape=softmax init=orthogonal",
    "value_skip": "skips=False attention_shape=value_skip init=default",
    "sas": "skips=False attention_shape=sas init=default",
    "sas_p": "skips=False attention_shape=sas_p init=default",
}
_SCREEN = "depth=8 val=True seed=0,1,2"
GRIDS = {
    # 1 + 5 × 4 cells × 3 lrs × 3 seeds = 189 runs.
    "screen": [f"{BASELINE} opt=adamw lr={','.join(LRS['adamw'])} {_SCREEN}"]
    + [f"{arm} opt={opt} lr={','.join(LRS[opt])} {_SCREEN}" for arm in ARMS.values() for opt in OPTS],
}


def _cell(args: str, **more: str) -> dict[str, str]:
    """An arm's args as a claim's filter over the confirmation's runs (val=False)."""
    return {**dict(item.split("=") for item in args.split()), **more, "val": "False"}


# The claims, judged by `python -m skipless_jax.report ROOT --config=configs/lm_skipless_study.py
# --claims=configs/lm_skipless_study.py` on the confirmation's runs, per depth, on validation bits per
# byte (lower is better). A run trained when its final train loss is below half a uniform guess's.
# A cell the screening did not keep has no runs: its rows are untested and outside the Holm count.
MARGIN_BITS = 0.05  # bits per byte: "within 0.05 of the skips"
_JUDGED = dict(metric="val_bits_per_byte", alternative="greater", margin=MARGIN_BITS, per=("depth",),
               trained_metric="train_loss", trained_below=0.5 * math.log(256))
_SKIPS_ADAMW = _cell(BASELINE, opt="adamw")
CLAIMS = {
    # The best skipless arm is within 0.05 bits per byte of the skips (non-inferiority; H1: skips +
    # 0.05 > the arm), at depth 8 and at depth 12: one row per kept arm × depth, one Holm family;
    # the claim holds for the best arm where its row holds.
    **{f"{arm}_{opt}_within_margin_of_skips": dict(
        text=f"{arm} with {opt}, no skips, ≤ the Pre-LN baseline (AdamW) + {MARGIN_BITS} bits per byte",
        a=_SKIPS_ADAMW, b=_cell(args, opt=opt), family="noninferior", **_JUDGED)
       for arm, args in ARMS.items() for opt in OPTS},
    # The two papers' methods head to head: the paper's init with a second-order optimizer trains
    # at least as well as shaped attention with AdamW (H1: SAS-AdamW + 0.05 > init-SOAP / init-shampoo_ec).
    **{f"init_{opt}_matches_sas_adamw": dict(
        text=f"init=skipless with {opt} ≤ SAS with AdamW + {MARGIN_BITS} bits per byte",
        a=_cell(ARMS["sas"], opt="adamw"), b=_cell(ARMS["init"], opt=opt), family="head_to_head", **_JUDGED)
       for opt in ("soap", "shampoo_ec")},
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, depth=8, attention_shape="softmax", skips=False, init="default", opt="adamw", lr=0.0,
                          seed=0, steps=2000, val=False)
    for key, allowed in (("attention_shape", SHAPES), ("init", INITS), ("opt", OPTS)):
        if a[key] not in allowed:
            raise ValueError(f"config arg {key}={a[key]!r} is not allowed; allowed: {' | '.join(allowed)}")
    if a["skips"] and a["attention_shape"] != "softmax":
        raise ValueError(f"config arg skips=True is the Pre-LN baseline (attention_shape=softmax); got "
                         f"attention_shape={a['attention_shape']!r}")
    skip_sab, skip_ffn = (True, True) if a["skips"] else OWN_SKIPS[a["attention_shape"]]
    c = ml_collections.ConfigDict()
    c.trainer = "lm"
    c.seed = a["seed"]
    train_split, eval_split = ("train_less_tune", "tune") if a["val"] else ("train", "validation")
    c.dataset = ml_collections.ConfigDict(dict(name="stdlib", train_split=train_split, eval_split=eval_split,
                                               eval_windows=256, data_dir=placeholder(str)))
    c.input = ml_collections.ConfigDict(dict(batch_size=32, eval_batch_size=64, device_prefetch=2))
    c.model = ml_collections.ConfigDict(dict(
        name="gpt", skip_sab=skip_sab, skip_ffn=skip_ffn, init=a["init"], **config_blocks.VITB_SUPERVISED_INIT,
        attention_shape=a["attention_shape"], mlp_branch_gain=0.1, width=128, depth=a["depth"], num_heads=4,
        mlp_dim=512, seq_len=128, tied_head=True, dropout=0.0, drop_path=0.0, dtype="float32",
        attention_impl=placeholder(str), remat=placeholder(str), scan=False))
    c.optimizer = config_blocks.lm_optimizer(a["opt"], lr=a["lr"] or float(LRS[a["opt"]][1]))
    if a["opt"] == "muon":
        c.optimizer.update(adam_lr_ratio=MUON_ADAM_LR_RATIO, momentum=0.95)
    c.schedule = ml_collections.ConfigDict(dict(warmup_steps=100, end_lr=1e-5))
    c.total_steps = a["steps"]
    c.grad_clip_norm = 1.0
    c.grad_accum_steps = 1
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=100, checkpoint_every=500, log_every=100))
    c.analysis.probe_size = 8
    c.lm_evals = ml_collections.ConfigDict(dict(kurtosis=True, logit_lens=True, quantize="int8,int4",
                                                quantize_activations=False))
    c.keep_checkpoints = 2
    return c
