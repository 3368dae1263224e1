r"""LM quickstart: a tiny skipless causal decoder on the Python standard library's source (no download).

    python -m skipless_jax.main --config=configs/lm_quickstart.py --workdir=/tmp/lm_quickstart

The default is the "Cutting the Skip" recipe applied to language: no skips, skipless init, SOAP,
on byte-level tokens of the embedded `stdlib` corpus (the `.py` files of the running Python's
standard library, one file in 20 held out for validation; data/text.py). The model: width 128,
depth 4, 4 heads, MLP 512, context 128 tokens, tied head. Batch 32 windows of 128 tokens, 200
steps (0.8M tokens), lr 0.003 for SOAP (0.001 for AdamW), b1 0.9, b2 0.95, weight decay 0.1 on
the parameters of ≥ 2 dims (GPT-2's, docs/method/lm.md §4), warm-up 20 steps, cosine to 1e-05,
gradient clipping 1.0 (`init=default` is GPT-2's init); validation on 256 windows (32,768
bytes) spread over the validation split, at the end.
Hardware: any CPU (about 3 minutes of CPU time a run).
Expected: validation bits per byte (`val_bits_per_byte`, lower is better) 3.75 ± 0.09 over
seeds 0-4, well below the 4.68 of the targets' unigram entropy (docs/results/lm.md).

Args (same names as the vision quickstart): skip_sab, skip_ffn, depth, seed, init, opt, lr, steps,
e.g. --config=configs/lm_quickstart.py:skip_sab=True,skip_ffn=True,init=default,opt=adamw
"""

import math

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks

_SKIPLESS = "skip_sab=False skip_ffn=False"
_SEEDS = "0,1,2,3,4"
# Named grids for `python -m skipless_jax.sweep --config=configs/lm_quickstart.py --grid=NAME`.
GRIDS = {
    # The claims below: no skips × {default, skipless init} × {AdamW, SOAP}, and with skips under
    # AdamW, at depths 4 and 8, 5 seeds.
    "claims": [
        f"{_SKIPLESS} init=default,skipless opt=adamw,soap depth=4,8 seed={_SEEDS}",
        f"skip_sab=True skip_ffn=True init=default opt=adamw depth=4,8 seed={_SEEDS}",
    ],
    # The default run (no skips, skipless init, SOAP, depth 4) over 5 seeds: a cell of `claims`.
    "default": f"{_SKIPLESS} init=skipless opt=soap depth=4 seed={_SEEDS}",
}

# The papers' claims carried to language, judged by `python -m skipless_jax.report SRC
# --claims=configs/lm_quickstart.py` on validation bits per byte (lower is better). A run trained
# when its final train loss is below half the loss of a uniform guess over the 256 byte values.
_NO_SKIPS = {"skip_sab": "False", "skip_ffn": "False"}
_WITH_SKIPS = {"skip_sab": "True", "skip_ffn": "True", "init": "default"}
_JUDGED = dict(metric="val_bits_per_byte", alternative="less", per=("depth",), trained_metric="train_loss",
               trained_below=0.5 * math.log(256))
MARGIN_BITS = 0.05  # bits per byte: "as good as with skips" allows this much worse
CLAIMS = {
    "init_beats_default_adamw": dict(
        text="the skipless init < the default init in validation bits per byte under AdamW, no skips",
        a={**_NO_SKIPS, "init": "skipless", "opt": "adamw"},
        b={**_NO_SKIPS, "init": "default", "opt": "adamw"},
        **_JUDGED,
    ),
    "init_soap_matches_skips": dict(
        text=f"no skips + skipless init + SOAP ≤ with skips under AdamW + {MARGIN_BITS} bits per byte "
             "(H1: with skips + margin > the skipless run, in bits per byte)",
        a={**_WITH_SKIPS, "opt": "adamw"},
        b={**_NO_SKIPS, "init": "skipless", "opt": "soap"},
        **{**_JUDGED, "alternative": "greater"},
        margin=MARGIN_BITS,
    ),
    "soap_beats_adamw_init": dict(
        text="SOAP < AdamW in validation bits per byte, no skips, skipless init",
        a={**_NO_SKIPS, "init": "skipless", "opt": "soap"},
        b={**_NO_SKIPS, "init": "skipless", "opt": "adamw"},
        **_JUDGED,
    ),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg,
        skip_sab=False,
        skip_ffn=False,
        depth=4,
        seed=0,
        init="skipless",
        opt="soap",
        lr=0.0,  # 0: the optimizer's default below
        steps=200,
    )
    c = ml_collections.ConfigDict()
    c.trainer = "lm"
    c.seed = a["seed"]
    c.dataset = ml_collections.ConfigDict(
        dict(name="stdlib", train_split="train", eval_split="validation", eval_windows=256, data_dir=placeholder(str))
    )
    c.input = ml_collections.ConfigDict(dict(batch_size=32, eval_batch_size=64, device_prefetch=2))
    c.model = ml_collections.ConfigDict(dict(
        name="gpt",
        skip_sab=a["skip_sab"],
        skip_ffn=a["skip_ffn"],
        init=a["init"],
        **config_blocks.VITB_SUPERVISED_INIT,
        width=128,
        depth=a["depth"],
        num_heads=4,
        mlp_dim=512,
        seq_len=128,
        tied_head=True,
        dropout=0.0,
        drop_path=0.0,
        dtype="float32",
        attention_impl=placeholder(str),
        remat=placeholder(str),
        scan=False,
    ))
    default_lr = 3e-3 if a["opt"] == "soap" else 1e-3
    c.optimizer = config_blocks.lm_optimizer(a["opt"], lr=a["lr"] or default_lr)
    c.schedule = ml_collections.ConfigDict(dict(warmup_steps=20, end_lr=1e-5))
    c.total_steps = a["steps"]
    c.grad_clip_norm = 1.0
    c.grad_accum_steps = 1
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=0, checkpoint_every=100, log_every=25))  # eval at the end only
    c.analysis.probe_size = 8
    # Measures added to each validation (docs/method/lm_measures.md), off: e.g. --config.lm_evals.kurtosis=True,
    # --config.lm_evals.quantize=int8,int4.
    c.lm_evals = ml_collections.ConfigDict(
        dict(kurtosis=False, logit_lens=False, quantize="", quantize_activations=False))
    c.keep_checkpoints = 2
    return c
