r"""DINO on scikit-learn's bundled 8×8 digits (no download): the quick path of the DINO recipe.

    python -m skipless_jax.main --config=configs/dino_digits.py --workdir=/tmp/dino_digits
    python -m skipless_jax.main --config=configs/dino_digits.py:skip_sab=False,skip_ffn=False,init=skipless \
        --workdir=/tmp/dino_digits_skipless

Hardware: any CPU (2 cores: 70–180 s a run of 2,640 steps, compilation and evaluations included).
Labels are used only by the evaluation: weighted kNN (k = 20, T = 0.07) and a linear probe on
the teacher's CLS features, at initialization and at the end (docs/method/evals.md §11).
Expected: teacher kNN 90.5 ± 1.0 % with both skips, 79.1 ± 0.6 % without skips with the
skipless init (seeds 0-2; docs/dino.md).

The DINO recipe (docs/method/ssl.md §6) with 8×8 crops: 2 global 8×8 crops (scale 0.5–1) and 2 local
4×4 crops (scale 0.3–0.6), 4×4 patches (4 tokens; 1 for a local crop), no flips (digits are
not mirror images of each other), brightness/contrast jitter, blur σ ∈ [0.1, 0.6] px and
solarize as in DINO. Head 256–256–32 → 256, teacher momentum 0.996 → 1, AdamW at a fixed
1e-3 peak (not batch-scaled), weight decay 0.04 rising to 0.4. Changed from DINO for this
size: the teacher temperature is a constant 0.025 (with 0.04, or 0.04 → 0.07, the 8×8 views
agree too little at initialization and the head drifts to uniform outputs, entropy ≈ log 256)
and drop-path is 0.

Args: skip_sab, skip_ffn, depth, seed, init ('default' | 'skipless' | 'mimetic'), opt
('adamw' | 'soap'), epochs, evals ('default', or 'fewshot_linear': the few-shot and DINO
linear-evaluation protocols added at the last step, config_blocks.eval_set).
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, skip_sab=True, skip_ffn=True, depth=4, seed=0, init="default", opt="adamw", epochs=60,
                          evals="default")
    return config_blocks.eval_set(config_blocks.dino_digits(a), a["evals"])
