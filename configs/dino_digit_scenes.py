r"""DINO on the digit scenes (32×32 canvases of 1-3 bundled digits; no download), evaluated
densely: the `lin` segmentation probe, TokenCut object discovery and the PCA picture of the
patch features (docs/method/dense.md §7-8), the miniature of "Cutting the Skip"'s dense results.

    python -m skipless_jax.main --config=configs/dino_digit_scenes.py --workdir=/tmp/dino_scenes
    python -m skipless_jax.main --config=configs/dino_digit_scenes.py:skip_sab=False,skip_ffn=False,init=skipless \
        --workdir=/tmp/dino_scenes_skipless
    python -m skipless_jax.evaluate --workdir=/tmp/dino_scenes   # again, on the saved teacher

Hardware: any CPU (2 cores: ≈ 11 min of CPU time for the 20-epoch AdamW run; evaluation 20-30 s).
Data: 2,874 train / 720 test scenes (skipless_jax/data/digit_scenes.py); per-pixel classes
(background + 10 digits) and boxes are used only by the evaluation.
Expected: `lin` mIoU 12.6 ± 0.6 % with skips, 10.4 ± 1.0 % skipless + skipless init (AdamW, 20
epochs, 3 seeds; docs/results/dense.md).

The DINO recipe of configs/dino_digits.py on 32×32 images: 2 global 32×32 crops (scale 0.4–1)
and 4 local 16×16 crops (scale 0.1–0.4), 4×4 patches (64 tokens), no flips, head 256–256–32 →
256, batch 32, teacher temperature 0.025, AdamW (or SOAP) 1e-3 after 3 warm-up epochs, weight decay 0.04
rising to 0.4, 20 epochs.
Evaluations at the end on the teacher: weighted kNN on the class of each scene's largest digit
(k 20, T 0.07), the `lin` probe (300 steps of 16 crops, 30 warm-up steps; DINOv2's `lin`
protocol at the scenes' 32 px: resize by U(0.5, 2), 32×32 crops, photometric distortion, no
flips — a mirrored digit is another shape; test at 32 px, one window), TokenCut on the last
block's keys (τ 0.2), and the PCA picture of 8 test scenes; pictures in `<workdir>/pictures/`.

Args: skip_sab, skip_ffn, depth, seed, init ('default' | 'skipless' | 'mimetic'), opt
('adamw' | 'soap'), epochs, evals ('all', or 'knn': the kNN evaluation only, the dense ones
left to `python -m skipless_jax.evaluate` on the kept checkpoint, as experiments/dino_digit_scenes.py does).
"""

import ml_collections

from skipless_jax import config_args, config_blocks

EVALS = ("all", "knn")  # arg evals=: every evaluator below, or the kNN one only


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    # The digits recipe (config_blocks.dino_digits, as configs/dino_digits.py) with 20 epochs.
    a = config_args.parse(arg, skip_sab=True, skip_ffn=True, depth=4, seed=0, init="default", opt="adamw", epochs=20,
                          evals="all")
    if a["evals"] not in EVALS:
        raise ValueError(f"config arg evals={a['evals']!r} is not allowed; allowed: {' | '.join(EVALS)}")
    c = config_blocks.dino_digits(a)
    c.schedule.warmup_epochs = 3
    c.dataset.name = "digit_scenes"
    c.input.image_size = 32
    c.input.eval_batch_size = 240
    c.input.multicrop.update(dict(global_scale=(0.4, 1.0), local_size=16, local_scale=(0.1, 0.4), num_local=4))
    c.evals = ml_collections.ConfigDict(dict(
        knn=dict(type="knn", k=20, temperature=0.07, prefix="test"),
        seg=dict(type="linear_segmentation", protocol="lin", steps=300, batch_size=16, warmup=30, flip=False,
                 prefix="test"),
        objects=dict(type="tokencut", block=-1, tau=0.2, prefix="test", picture_images=8),
        pca=dict(type="feature_pca", images=8, prefix="test_pca"),
    ))
    if a["evals"] == "knn":
        c.evals = ml_collections.ConfigDict(dict(knn=c.evals.knn))
    c.eval_at_start = False
    c.eval_every_steps = 0  # at the end only
    return c
