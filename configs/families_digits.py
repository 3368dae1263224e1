r"""A small model of each family on scikit-learn's bundled digits (no download), selected by `family=`.

    python -m skipless_jax.main --config=configs/families_digits.py:family=swin --workdir=/tmp/fam_swin

Families (docs/families.md): convmixer (width 64, depth 4, kernel 3, patch 1), swin (width 32,
depths 2+2, heads 2+4, window 2, patch 2: stage 1 on the 4×4 grid in shifted 2×2 windows, stage
2 one 2×2 window), cait (width 64, depth 4 + 2 class-attention blocks,
4 heads, MLP 128, patch 2), pvt_v2 (widths 32+64, depths 2+2, heads 1+2, SR 2+1, MLP ratio 4,
stem stride 2). Args: family, skip_sab, skip_ffn (ConvMixer has no FFN residual: ignored there),
init=default|skipless, opt=adamw|soap, tg=dct|svd|svd_fast|none, eps, seed, epochs, depth (ConvMixer and
CaiT: the number of blocks instead of the size above).

Hardware: any CPU (2 cores: about 2–3 minutes a run).
Data: 1,437 train / 360 test 8×8 images (the fixed split of skipless_jax/data/sources.py).
Expected: test accuracy 96.9-99.4 % for each family at its default size (15 epochs, AdamW,
default init, seeds 0-2; docs/results/families_digits.md).
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks

# Named grids for `python -m skipless_jax.sweep --config=configs/families_digits.py --grid=NAME`:
# "families" is the table of docs/results/families_digits.md (15 epochs, AdamW, default init).
GRIDS = {
    "families": [
        "family=convmixer skip_sab=True,False depth=4,8 epochs=15 seed=0,1,2",
        "family=swin,pvt_v2 tg=none,dct epochs=15 seed=0,1,2",
    ],
}

SIZES = {
    "convmixer": dict(width=64, depth=4, kernel_size=3, patch_size=1),
    "swin": dict(width=32, depths=(2, 2), num_heads=(2, 4), window_size=2, patch_size=2),
    "cait": dict(width=64, depth=4, num_heads=4, mlp_dim=128, patch_size=2, depth_token_only=2),
    "pvt_v2": dict(widths=(32, 64), depths=(2, 2), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=(4, 4),
                   patch_size=2),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(arg, family="swin", skip_sab=True, skip_ffn=True, init="default", opt="adamw", tg="none",
                          eps=0.95, seed=0, epochs=15, depth=0)
    if a["family"] not in SIZES:
        raise ValueError(f"config arg family={a['family']!r} is unknown; allowed: {', '.join(SIZES)}")
    sizes = dict(SIZES[a["family"]])
    if a["depth"]:
        if "depth" not in sizes:
            raise ValueError(f"config arg depth={a['depth']!r}: family={a['family']!r} sets depths per stage; "
                             "allowed for: " + ", ".join(f for f in SIZES if "depth" in SIZES[f]))
        sizes["depth"] = a["depth"]
    c = ml_collections.ConfigDict()
    c.trainer = "supervised"
    c.seed = a["seed"]
    c.dataset = ml_collections.ConfigDict(dict(name="digits", train_split="train", eval_split="test",
                                               data_dir=placeholder(str)))
    c.input = ml_collections.ConfigDict(dict(batch_size=64, eval_batch_size=120, image_size=placeholder(int),
                                             aug=None, num_workers=0))
    args = dict(a, skip_ffn=a["skip_ffn"] and a["family"] != "convmixer")
    c.model = config_blocks.family_model(a["family"], args, 0.0, **sizes)
    c.optimizer = config_blocks.optimizer(a["opt"], lr=3e-3 if a["opt"] == "soap" else 1e-3, weight_decay=0.05)
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=3, end_lr=1e-5))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = 1.0
    c.label_smoothing = 0.0
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=0, checkpoint_every=1000, log_every=50))
    c.keep_checkpoints = 1
    return c
