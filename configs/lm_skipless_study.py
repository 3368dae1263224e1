r"""Deep skipless language models, the field's methods side by side (pre-registered).

    python -m skipless_jax.main --config=configs/lm_skipless_study.py:attention_shape=sas,opt=muon \
        --workdir=/tmp/lm_sas_muon

One run: a causal decoder of width 128, 4 heads, MLP 512, context 128 byte tokens, tied head, on
the embedded `stdlib` corpus (data/text.py), batch 8 windows (1,024 tokens), 2,000 steps (2.0M
tokens), warm-up 100 steps then cosine to 1e-05, gradient clipping 1.0, weight decay 0.1 on the
≥ 2-D parameters (config_blocks.lm_optimizer; the gains are 1-D); validation every 100 steps on
128 windows (16,384 bytes), each with the excess kurtosis of every block, the logit lens and the
int8 / int4 weight-quantized bits per byte (docs/method/lm_measures.md).

Args: depth (8 | 12 | 16), attention_shape (softmax | value_skip | sas | sas_p;
docs/method/skipless_lm.md §1-§3), skips (True: both skips, the Pre-LN baseline, softmax only;
False: the arm's own, none but SAS's MLP skip), init (default: GPT-2's | skipless | orthogonal),
opt (adamw | soap | shampoo_ec | muon: Muon on the hidden matrices, AdamW at 0.1× its lr on the
rest, docs/method/skipless_lm.md §6), lr (0: the optimizer's middle grid value, LRS), seed,
steps, batch (windows per step), val (True: train on `train_less_tune`, validate on `tune`, the
split every learning rate is chosen on; False: train on `train`, validate on `validation`, where
the claims are judged).

The study, pre-registered before any of its runs, sized to the issue's 40 CPU-hours:
1. Screening, `GRIDS['screen']`: at depth 8, val=True, seeds 0-1, each cell at the 3 values of
   its optimizer's lr grid (LRS), 7 cells, 42 runs. The cells: the with-skips Pre-LN baseline
   (GPT-2 init, AdamW) and each skipless method with its source's optimizer: the paper's init
   with SOAP and with shampoo_ec (the text's and the authors' optimizer), orthogonal init with
   Muon (the 2026 paper's spectral optimizer), Value-SkipInit, SAS and SAS-P with AdamW (their
   papers' optimizer). Each cell's lr is the grid value of lowest mean tune bits per byte; a best
   value at an edge of its grid has the grid extended by one value on that side (2 seeds) before
   anything is chosen.
2. Confirmation, written into GRIDS after the screening and before its runs: the 7 cells at their
   chosen lr, val=False, seeds 10-14, at depths 8 and 12 (depth 12 at depth 8's lr); 10 seeds
   where a cell's trained count is bimodal (some seeds below the trained threshold, some not).
   The claims read those runs only (`val=False`).

Claims (`CLAIMS`, judged on the confirmation's runs, per depth; docs/method/verdicts.md §8), A the
baseline and B each skipless cell unless said:
- `noninferior`: B ≤ A + 0.05 validation bits per byte; the best arm's row decides "the best
  skipless arm is within 0.05 of the skips".
- `steps_5x`, `steps_2x`: B's steps to the target are under 5× and under 2× A's (geometric means;
  kind='steps'). The target is A's mean validation bits per byte at step 400, a fifth of the run,
  so that 5× A's steps fits in the 2,000 steps (the baseline's final value would need 10,000).
- `int4_loss`, `int8_loss`: B loses fewer bits per byte than A under int4 / int8 weights
  (val_int<b>_bits_per_byte − val_bits_per_byte, H1 A > B).
- `kurtosis`: B's largest per-block activation excess kurtosis is below A's.
- `head_to_head`: the paper's init with SOAP and with shampoo_ec ≤ SAS with AdamW + 0.05.
Each claim's rows are one Holm family.

Departures from the issue, to fit its 40 CPU-hours on this CPU: batch 8 windows (the issue does
not fix it); each skipless method screened with its source's optimizer, not every optimizer;
screening at 2 seeds, not 3; validation on 128 windows; the steps target at step 400, not the
baseline's final value (above).

Hardware: any CPU (one process per run) or one accelerator. Expected validation bits per byte: not
measured yet (docs/results/lm_skipless.md); the baseline's should fall well below the corpus's
unigram entropy of 4.68 bits per byte (configs/lm_quickstart.py).

Cost, measured with `benchmarks/lm_step_cost.py` (the trainer's compiled step, batch 8): at depth
8, 0.32 CPU-seconds a step with AdamW and 0.49 with SOAP; at depth 12, 0.73 with SOAP. A depth-8
run with its 20 validations is then about 16 CPU-minutes, a depth-12 run about 24. Screening: 42
runs, about 11 CPU-hours; confirmation: 70 runs, about 23; about 6 left for grid extensions and
bimodal seeds.

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
BASELINE = "skips=True attention_shape=softmax init=default opt=adamw"
ARMS = {
    "init_soap": "skips=False attention_shape=softmax init=skipless opt=soap",
    "init_shampoo_ec": "skips=False attention_shape=softmax init=skipless opt=shampoo_ec",
    "orthogonal_muon": "skips=False attention_shape=softmax init=orthogonal opt=muon",
    "value_skip_adamw": "skips=False attention_shape=value_skip init=default opt=adamw",
    "sas_adamw": "skips=False attention_shape=sas init=default opt=adamw",
    "sas_p_adamw": "skips=False attention_shape=sas_p init=default opt=adamw",
}
_SCREEN = "depth=8 val=True seed=0,1"


def _lrs(args: str) -> str:
    return "lr=" + ",".join(LRS[args.rpartition("opt=")[2].split()[0]])


GRIDS = {
    # 7 cells × 3 lrs × 2 seeds = 42 runs.
    "screen": [f"{args} {_lrs(args)} {_SCREEN}" for args in (BASELINE, *ARMS.values())],
}


def _cell(args: str) -> dict[str, str]:
    """A cell's args as a claim's filter over the confirmation's runs (val=False)."""
    return {**dict(item.split("=") for item in args.split()), "val": "False"}


# The claims, judged by `python -m skipless_jax.report ROOT --claims=configs/lm_skipless_study.py` on
# the confirmation's runs, per depth (docs/method/verdicts.md §8). Lower bits per byte is better. A run
# trained when its final train loss is below half a uniform guess's. Each claim's rows: one Holm family.
MARGIN_BITS = 0.05  # bits per byte: "within 0.05 of the skips"
TARGET_STEP = 400  # the steps target: the baseline's mean validation bits per byte at this step
_COMMON = dict(alternative="greater", per=("depth",), trained_metric="train_loss", trained_below=0.5 * math.log(256))
_SKIPS = _cell(BASELINE)
_FAMILIES = {
    # H1: skips + 0.05 > the arm (non-inferiority); the best arm's row decides for "the best arm".
    "noninferior": ("≤ the Pre-LN baseline + 0.05 bits per byte",
                    dict(metric="val_bits_per_byte", margin=MARGIN_BITS)),
    # H1: log2 steps of the skips + log2 r > the arm's: the arm needs under r× the steps.
    "steps_5x": ("reaches the baseline's step-400 level in under 5× its steps",
                 dict(kind="steps", metric="val_bits_per_byte", target_step=TARGET_STEP, margin=math.log2(5))),
    "steps_2x": ("reaches the baseline's step-400 level in under 2× its steps",
                 dict(kind="steps", metric="val_bits_per_byte", target_step=TARGET_STEP, margin=math.log2(2))),
    # H1: the bits per byte quantization adds to the skips > to the arm.
    "int4_loss": ("loses fewer bits per byte than the baseline under int4 weights",
                  dict(metric="val_int4_bits_per_byte", minus="val_bits_per_byte")),
    "int8_loss": ("loses fewer bits per byte than the baseline under int8 weights",
                  dict(metric="val_int8_bits_per_byte", minus="val_bits_per_byte")),
    # H1: the skips' largest per-block excess kurtosis > the arm's.
    "kurtosis": ("has a lower maximum activation excess kurtosis than the baseline",
                 dict(metric="val_kurtosis_layer_*", reduce="max")),
}
CLAIMS = {
    **{f"{arm}_{family}": dict(text=f"{arm}, no skips, {words}", a=_SKIPS, b=_cell(args), family=family,
                               **fields, **_COMMON)
       for family, (words, fields) in _FAMILIES.items() for arm, args in ARMS.items()},
    # The two papers' methods head to head (H1: SAS-AdamW + 0.05 > init-SOAP / init-shampoo_ec).
    **{f"{arm}_matches_sas_adamw": dict(
        text=f"{arm} ≤ SAS with AdamW + {MARGIN_BITS} bits per byte", a=_cell(ARMS["sas_adamw"]),
        b=_cell(ARMS[arm]), family="head_to_head", metric="val_bits_per_byte", margin=MARGIN_BITS, **_COMMON)
       for arm in ("init_soap", "init_shampoo_ec")},
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, depth=8, attention_shape="softmax", skips=False, init="default", opt="adamw", lr=0.0,
                          seed=0, steps=2000, val=False, batch=8)
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
                                               eval_windows=128, data_dir=placeholder(str)))
    c.input = ml_collections.ConfigDict(dict(batch_size=a["batch"], eval_batch_size=64, device_prefetch=2))
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
