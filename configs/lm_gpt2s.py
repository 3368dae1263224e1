r"""GPT-2-small-sized skipless causal decoder on the embedded standard-library corpus, for an accelerator host.

    python -m skipless_jax.main --config=configs/lm_gpt2s.py --workdir=/tmp/lm_gpt2s

The model: width 768, depth 12, 12 heads, MLP 3072, context 1024 byte tokens, tied head (85M
parameters in the blocks, GPT-2 small's sizes; the byte vocabulary of 257 symbols replaces
GPT-2's 50,257-token one). No skips, the skipless init (the ViT-B/16 constants of Cutting the
Skip) and SOAP by default; the args are the quickstart's (skip_sab, skip_ffn, depth, seed, init,
opt, lr, steps). Batch 256 windows of 1024 tokens (262,144 tokens per step), 20,000 steps (5.2B
tokens, about 170 passes over the 30M-token train split), lr 0.0006 for SOAP and AdamW, warm-up
2000 steps, cosine to 6e-05, gradient clipping 1.0, bf16 compute, remat of each block's dots;
validation on the whole held-out split (1.2M tokens) every 1000 steps.
Hardware: one 8-GPU H100 host (data-parallel, `--config.mesh.fsdp=8` to shard the state) or a TPU
v4-32 slice. Expected: an estimate, not measured: about 1.0 s per step on 8 H100s at 40% MFU,
i.e. about 6 hours for the 20,000 steps; validation bits per byte not measured.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg, skip_sab=False, skip_ffn=False, depth=12, seed=0, init="skipless", opt="soap", lr=6e-4, steps=20000,
    )
    c = ml_collections.ConfigDict()
    c.trainer = "lm"
    c.seed = a["seed"]
    c.dataset = ml_collections.ConfigDict(
        dict(name="stdlib", train_split="train", eval_split="validation", eval_windows=placeholder(int),
             data_dir=placeholder(str))
    )
    c.input = ml_collections.ConfigDict(dict(batch_size=256, eval_batch_size=256, device_prefetch=2))
    c.model = ml_collections.ConfigDict(dict(
        name="gpt", skip_sab=a["skip_sab"], skip_ffn=a["skip_ffn"], init=a["init"],
        **config_blocks.VITB_SUPERVISED_INIT,
        width=768, depth=a["depth"], num_heads=12, mlp_dim=3072, seq_len=1024, tied_head=True,
        dropout=0.0, drop_path=0.0, dtype="bfloat16", attention_impl=placeholder(str), remat="dots", scan=False,
    ))
    c.optimizer = config_blocks.lm_optimizer(a["opt"], lr=a["lr"])
    c.schedule = ml_collections.ConfigDict(dict(warmup_steps=2000, end_lr=6e-5))
    c.total_steps = a["steps"]
    c.grad_clip_norm = 1.0
    c.grad_accum_steps = 1
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=1000, checkpoint_every=1000, log_every=100))
    c.analysis.probe_size = 8
    return c
