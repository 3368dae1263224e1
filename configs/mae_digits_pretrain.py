r"""MAE pre-training on scikit-learn's bundled digits (no download): the MAE recipe in miniature.

    python -m skipless_jax.main --config=configs/mae_digits_pretrain.py --workdir=/tmp/mae_digits
    python -m skipless_jax.main --config=configs/mae_digits_finetune.py:init_from=/tmp/mae_digits \
        --workdir=/tmp/mae_digits_ft

The encoder is the quickstart's ViT (width 64, depth 4, 4 heads, 2×2 patches: 16 tokens); the
mask ratio 0.75 keeps 4 of them; the decoder is 32 wide, 2 blocks, 2 heads. AdamW (0.9, 0.95),
lr 3.75e-4 at batch 64 (MAE's rule base × batch / 256 with the base raised tenfold, 1.5e-3, for
this tiny model), wd 0.05, warm-up 10 % of the 100 epochs, cosine; images as stored
(8×8, no crop: a random-resized crop of an 8-pixel digit destroys it), no flip (digits are not
mirror-symmetric). The reconstruction picture goes to <workdir>/reconstruction.png, and to
<workdir>/reconstructions/step_N.png at every evaluation (every 1,000 steps, with a kNN monitor).
Hardware: any CPU (2 cores: about 3 minutes a run).
Expected: kNN accuracy of the encoder's class token 79.3 ± 0.7 % (seeds 0-2;
docs/results/mae_digits.md).

Args: tg / eps (Token Graying in pre-training), target ('raw' | 'grayed'), skip_sab, skip_ffn,
init, seed, epochs, norm_pix (norm_pix_loss), evals ('default', or 'fewshot_linear': the few-shot
and DINO linear-evaluation protocols added at the last step, config_blocks.eval_set), opt ('adamw':
MAE's recipe and the fork's default | 'shampoo_ec': the fork's `--opt soap` call, eigh every 100 steps).

Init under init='skipless' (config_blocks.MAE_FORK_INIT; docs/method/authors_init.md §3): the authors'
fork's uniform Q/K, V/O c² U V, c = 1 and Xavier MLP; the paper's text's α = 2, β = 0.6.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg, skip_sab=True, skip_ffn=True, init="default", seed=0, tg="none", eps=0.95, target="raw", epochs=100,
        norm_pix=False, evals="default", opt="adamw",
    )
    c = ml_collections.ConfigDict()
    c.trainer = "mae"
    c.seed = a["seed"]
    c.dataset = ml_collections.ConfigDict(
        dict(name="digits", train_split="train", eval_split="test", data_dir=placeholder(str))
    )
    c.input = ml_collections.ConfigDict(
        dict(batch_size=64, eval_batch_size=120, image_size=placeholder(int), aug=None, num_workers=0)
    )
    c.model = config_blocks.vit_model(
        a, config_blocks.MAE_FORK_INIT, variant=placeholder(str), width=64, depth=4, num_heads=4,
        mlp_dim=128, patch_size=2, posemb="sincos2d", drop_path=0.0,
    )
    c.mae = config_blocks.mae(norm_pix_loss=a["norm_pix"], target=a["target"], decoder_width=32, decoder_depth=2,
                              decoder_num_heads=2, picture_images=10)
    c.optimizer = config_blocks.mae_optimizer(1.5e-4 * 10, c.input.batch_size, a["opt"],
                                              weight_decay_rule="mae_pretrain")
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=a["epochs"] / 10, end_lr=0.0))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = placeholder(float)
    c.skip_nonfinite_steps = False
    c.evals = ml_collections.ConfigDict(dict(
        knn=dict(type="knn", k=20, temperature=0.07, split=placeholder(str), train_split=placeholder(str),
                 prefix="test"),
    ))
    c.update(config_blocks.runtime(eval_every=1000, checkpoint_every=500, log_every=100, analysis=False))
    c.keep_checkpoints = 2
    return config_blocks.eval_set(c, a["evals"])
