r"""Fine-tuning on digits after configs/mae_digits_pretrain.py (or, without `init_from`, the same
recipe from scratch): the MAE fine-tuning recipe in miniature.

    python -m skipless_jax.main --config=configs/mae_digits_finetune.py:init_from=/tmp/mae_digits \
        --workdir=/tmp/mae_digits_ft

The encoder is the pre-training's (its skips must match: pass the same skip_sab / skip_ffn);
global average pooling → fc_norm → head (std 2e-5), the fixed position table as the initial
learned one, layer-wise lr decay 0.75 over the 4 blocks (docs/method/ssl.md §9), AdamW (0.9, 0.999)
lr 1e-3, wd 0.05, 5 warm-up epochs, cosine to 1e-5, 40 epochs, images as stored (no
augmentation, as the quickstart).
Hardware: any CPU (2 cores: about 1.5 minutes a run).
Expected: test accuracy 95.6 ± 0.7 % after configs/mae_digits_pretrain.py, 93.8 ± 0.9 % from
scratch (seeds 0-2; docs/results/mae_digits.md).

Args: init_from (an MAE workdir; none: from scratch), tg / eps (Token Graying in fine-tuning),
skip_sab, skip_ffn, init, seed, epochs, layer_decay.

Init under init='skipless' (config_blocks.MAE_FORK_INIT; docs/method/authors_init.md §3): the authors'
fork's uniform Q/K, V/O c² U V, c = 1 and Xavier MLP; the paper's text's α = 2, β = 0.6.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg, init_from=None, skip_sab=True, skip_ffn=True, init="default", seed=0, tg="none", eps=0.95, epochs=40,
        layer_decay=0.75,
    )
    c = ml_collections.ConfigDict()
    c.trainer = "supervised"
    c.seed = a["seed"]
    c.init_from = a["init_from"] if a["init_from"] else placeholder(str)
    c.dataset = ml_collections.ConfigDict(
        dict(name="digits", train_split="train", eval_split="test", data_dir=placeholder(str))
    )
    c.input = ml_collections.ConfigDict(
        dict(batch_size=64, eval_batch_size=120, image_size=placeholder(int), aug=None, num_workers=0)
    )
    c.model = config_blocks.vit_model(
        a, config_blocks.MAE_FORK_INIT, variant=placeholder(str), width=64, depth=4, num_heads=4,
        mlp_dim=128, patch_size=2, pool="gap_fc_norm", posemb="learn", drop_path=0.0, head_init_std=2e-5,
    )
    c.optimizer = config_blocks.mae_optimizer(1e-3 * 256 / 64, c.input.batch_size, b2=0.999,
                                              layer_decay=a["layer_decay"])
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=5, end_lr=1e-5))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = placeholder(float)
    c.label_smoothing = 0.0
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=0, checkpoint_every=500, log_every=100))
    c.keep_checkpoints = 2
    return c
