r"""GPT-2-small-sized skipless causal decoder on C4 (English) byte tokens, one pass, for an accelerator host.

    python -m skipless_jax.main --config=configs/lm_gpt2s.py --workdir=/tmp/lm_gpt2s

The model: width 768, depth 12, 12 heads, MLP 3072, context 1024 byte tokens, tied head (85M
parameters in the blocks, GPT-2 small's sizes; the byte vocabulary of 257 symbols replaces
GPT-2's 50,257-token one). No skips, the skipless init (the ViT-B/16 constants of Cutting the
Skip) and SOAP by default; `init=default` is GPT-2's init and `opt=adamw` GPT-2's AdamW (b2 0.95,
weight decay 0.1 on the ≥ 2-D parameters; docs/method/lm.md §4); the args are the quickstart's
(skip_sab, skip_ffn, depth, seed, init, opt, lr, steps). Batch 256 windows of 1024 tokens
(262,144 tokens per step), 20,000 steps: 5.24B tokens, about one pass over the first 2,400,000
documents of TFDS `c4/en` (3.1.0; about 2,270 bytes a document: 828.6 GB for 364,868,892 train
documents, URL and timestamp fields included, so about 5.3B bytes of text); lr 0.0006, warm-up
2000 steps, cosine to 6e-05, gradient clipping 1.0, bf16 compute, remat of each block's dots;
validation on 1024 windows (1M tokens) spread over the C4 validation split (364,608 documents)
every 1000 steps. The data: `c4/en` prepared in TFDS's array_record format (random access;
docs/data.md), read into host memory at the start (about 11 GB of uint16 tokens, about 30 GB at
the peak of packing).
Hardware: one 8-H100 host (or one H100). Its time, computed, not measured: `models.flops`
counts 5.81e11 FLOPs per sequence (3 ×
forward, causal attention halved; docs/method/lm.md §3), 1.49e14 per step; at 40% MFU of the
H100's dense bf16 peak (989 TFLOP/s, trainers/devices.py) that is 0.047 s per step on one 8-H100
host (`--config.mesh.fsdp=8` to shard the state), 0.26 hours for the 20,000 steps; 0.38 s per
step and 2.1 hours on one H100. Expected validation bits per byte: not measured yet.
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
        dict(name="c4/en:3.1.0", train_split="train", eval_split="validation", text_key="text",
             max_documents=2_400_000, eval_windows=1024, data_dir=placeholder(str))
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
