r"""Quickstart: a tiny ViT on scikit-learn's bundled handwritten digits (no download).

    python -m skipless_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart

The default is the "Cutting the Skip" recipe in miniature: no skips, skipless init, SOAP.
Hardware: any CPU (2 cores: about 1.5 minutes including compilation). Data: 1,437 train / 360
test 8×8 images (the fixed split of skipless_jax/data/sources.py). Expected test accuracy at
depth 4 (seed 0, docs/results.md):
    (no args)                                               95.3   (skipless + init + SOAP)
    :init=default,opt=adamw                                 92.8   (skipless, default init)
    :opt=adamw                                              91.7   (skipless + init, AdamW)
    :skip_sab=True,skip_ffn=True,init=default,opt=adamw     96.1   (standard ViT, 3 seeds)

Args (same names in every config): skip_sab, skip_ffn, depth, seed, init, opt, tg, eps, e.g.
    --config=configs/quickstart.py:skip_sab=False,depth=8,seed=1
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args


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
    )
    c = ml_collections.ConfigDict()
    c.trainer = "supervised"
    c.seed = a["seed"]

    c.dataset = ml_collections.ConfigDict(dict(name="digits", train_split="train", eval_split="test", data_dir=placeholder(str)))
    c.input = ml_collections.ConfigDict(dict(batch_size=64, eval_batch_size=128, image_size=placeholder(int), aug=None, num_workers=0))

    c.model = ml_collections.ConfigDict(
        dict(
            variant=placeholder(str),
            width=64,
            depth=a["depth"],
            num_heads=4,
            mlp_dim=128,
            patch_size=2,  # 16 tokens of 2×2 pixels
            skip_sab=a["skip_sab"],
            skip_ffn=a["skip_ffn"],
            pool="gap",
            posemb="learn",
            dropout=0.0,
            drop_path=0.0,
            dtype="float32",
            init=a["init"],
            init_alpha=2.0,  # the ViT-B/16 constants of Cutting the Skip (METHOD.md §3)
            init_beta=0.6,
            init_c=3.0,
            token_graying=placeholder(str) if a["tg"] == "none" else a["tg"],
            tg_eps=a["eps"],
        )
    )

    c.optimizer = ml_collections.ConfigDict(dict(name=a["opt"], lr=1e-3, b1=0.9, b2=0.999, weight_decay=0.05))
    if a["opt"] == "soap":  # Cutting the Skip's SOAP settings
        c.optimizer.update(dict(lr=3e-3, b1=0.9, b2=0.95, precondition_frequency=10))
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=5, end_lr=1e-5))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = 1.0
    c.label_smoothing = 0.0
    c.skip_nonfinite_steps = False

    c.mesh = [("data", -1), ("fsdp", 1)]
    c.sharding_rules = [(".*", "fsdp")]

    c.log_every_steps = 50
    c.eval_every_steps = 0  # evaluate at the end only
    c.checkpoint_every_steps = 500
    c.keep_checkpoints = 2
    c.analysis = ml_collections.ConfigDict(dict(every_steps=0, probe_size=32))
    return c
