"""Model FLOPs of one training example, counted from the config (docs/method/runs.md §25).

    train_flops_per_example(config.model, image_size, num_classes)       # a classifier
    mae_train_flops(config.model, image_size, config.mae)                  # masked autoencoding
    dino_train_flops(config.model, image_size, config.dino, config.input.multicrop)
    lm_train_flops(config.model, vocab_size)                               # a causal LM, per sequence
    tg_flops_per_example(config.model, image_size), dino_tg_flops(...)     # Token Graying

Each trainer's record (trainers/__init__.py) says which of these counts its example.

3 × the forward FLOPs (2 per multiply-add) of every matmul and convolution the model defines,
counted as each family computes them; norms, softmax and elementwise work are not counted. The
count depends on the config only, so it is the same with gradient accumulation, a scanned
encoder, rematerialisation or a fused attention kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from skipless_jax.models import cait, convmixer, pvt_v2, swin, vit
from skipless_jax.models import family as family_of
from skipless_jax.models.swin import window_size_and_shift

BACKWARD = 3  # forward + backward = 3 × forward: two matmuls (input and weight gradients) per forward one


def dense(tokens: int, fan_in: int, fan_out: int) -> float:
    """FLOPs of a dense layer (fan_in → fan_out) on `tokens` tokens."""
    return 2.0 * tokens * fan_in * fan_out


def attention(queries: int, keys: int, width: int) -> float:
    """FLOPs of the logits Q·Kᵀ and of probs·V, queries × keys of `width` (all heads together)."""
    return 4.0 * queries * keys * width


def causal_attention(tokens: int, width: int) -> float:
    """Causal attention of `tokens` queries over themselves: half of `attention` (maxtext's
    `calculate_tflops_training_per_device`, after Megatron-LM; docs/method/lm.md §3)."""
    return attention(tokens, tokens, width) / 2


def encoder_block(tokens: int, width: int, mlp_dim: int) -> float:
    """A ViT block (models/blocks.py): Q, K, V, O, attention over all tokens, the MLP."""
    return 4 * dense(tokens, width, width) + attention(tokens, tokens, width) + 2 * dense(tokens, width, mlp_dim)


def _head(width: int, num_classes: int) -> float:
    return dense(1, width, num_classes) if num_classes else 0.0


def _vit(model_config: Any, image_size: int, num_classes: int, channels: int) -> float:
    s = vit.resolve_sizes(model_config)
    p, d = s["patch_size"], s["width"]
    n = (image_size // p) ** 2
    t = n + int(s.get("pool", "tok") != "gap")
    return dense(n, p * p * channels, d) + s["depth"] * encoder_block(t, d, s["mlp_dim"]) + _head(d, num_classes)


def _convmixer(model_config: Any, image_size: int, num_classes: int, channels: int) -> float:
    f = convmixer.resolve(model_config)
    p, d, k = f["patch_size"], f["width"], f["kernel_size"]
    n = (image_size // p) ** 2
    block = 2.0 * n * k * k * d + dense(n, d, d)  # depthwise k×k (one input channel per output), pointwise
    return dense(n, p * p * channels, d) + f["depth"] * block + _head(d, num_classes)


def _swin(model_config: Any, image_size: int, num_classes: int, channels: int) -> float:
    f = swin.resolve(model_config)
    p, c = f["patch_size"], f["width"]
    g = image_size // p
    total = dense(g * g, p * p * channels, c)
    for stage, depth in enumerate(f["depths"]):
        if stage:
            g //= 2
            total += dense(g * g, 4 * c, 2 * c)  # patch merging
            c *= 2
        n = g * g
        ws, _ = window_size_and_shift((g, g), f["window_size"], 0)
        block = 4 * dense(n, c, c) + attention(n, ws * ws, c) + 2 * dense(n, c, f["mlp_ratio"] * c)
        total += depth * block
    return total + _head(c, num_classes)


def _conv(out_positions: int, kernel: int, fan_in: int, fan_out: int) -> float:
    """A kernel×kernel convolution (groups 1) with `out_positions` output positions."""
    return 2.0 * out_positions * kernel * kernel * fan_in * fan_out


def _pvt_v2(model_config: Any, image_size: int, num_classes: int, channels: int) -> float:
    f = pvt_v2.resolve(model_config)
    t = f["patch_size"]
    total, g, c_in = 0.0, image_size, channels
    for stage, depth in enumerate(f["depths"]):
        stride = t if stage == 0 else 2
        kernel = 2 * stride - 1
        g = pvt_v2.conv_output(g, kernel, stride)
        d, r = f["widths"][stage], f["sr_ratios"][stage]
        n = g * g
        total += _conv(n, kernel, c_in, d)  # the overlapping patch embedding
        m = (g // r) ** 2 if r > 1 else n
        hidden = f["mlp_ratios"][stage] * d
        block = (
            (_conv(m, r, d, d) if r > 1 else 0.0)  # spatial reduction
            + 2 * dense(n, d, d) + 2 * dense(m, d, d)  # Q, O on every token; K, V on the reduced ones
            + attention(n, m, d)
            + 2 * dense(n, d, hidden) + 2.0 * n * 9 * hidden  # fc1, fc2, the depthwise 3×3
        )
        total += depth * block
        c_in = d
    return total + _head(c_in, num_classes)


def _cait(model_config: Any, image_size: int, num_classes: int, channels: int) -> float:
    f = cait.resolve(model_config)
    p, d, h, mlp = f["patch_size"], f["width"], f["num_heads"], f["mlp_dim"]
    n = (image_size // p) ** 2
    talking_heads = 2 * 2.0 * n * n * h * h  # the (h, h) mixings of the logits and of the probabilities
    class_block = (2 * dense(1, d, d) + 2 * dense(1 + n, d, d)  # Q, O on the class token; K, V on all
                   + attention(1, 1 + n, d) + 2 * dense(1, d, mlp))
    return (dense(n, p * p * channels, d) + f["depth"] * (encoder_block(n, d, mlp) + talking_heads)
            + f["depth_token_only"] * class_block + _head(d, num_classes))


FAMILIES: dict[str, Callable[[Any, int, int, int], float]] = {
    "vit": _vit, "convmixer": _convmixer, "swin": _swin, "cait": _cait, "pvt_v2": _pvt_v2,
}


def forward_flops_per_example(model_config: Any, image_size: int, num_classes: int, channels: int = 3) -> float:
    """Forward FLOPs of the model `config.model` on one image_size² image of `channels` channels
    (num_classes=0: the backbone without a head)."""
    return FAMILIES[family_of(model_config).FAMILY](model_config, image_size, num_classes, channels)


def _mae_forward(model_config: Any, image_size: int, channels: int, mae: Any) -> float:
    s = vit.resolve_sizes(model_config)
    p, d = s["patch_size"], s["width"]
    n = (image_size // p) ** 2
    kept = int(n * (1 - mae["mask_ratio"]))  # mae.num_kept
    dw = mae["decoder_width"]
    mlp_ratio = mae.get("decoder_mlp_ratio", 4) or 4
    encoder = dense(n, p * p * channels, d) + s["depth"] * encoder_block(kept + 1, d, s["mlp_dim"])
    decoder = (dense(kept + 1, d, dw) + mae["decoder_depth"] * encoder_block(n + 1, dw, mlp_ratio * dw)
               + dense(n + 1, dw, p * p * channels))
    return encoder + decoder


def dino_head_flops(width: int, dino: Any) -> float:
    """Forward FLOPs of DINO's head (models/dino_head.py) on one feature vector of `width`."""
    layers = dino.get("num_layers", 3) or 3
    widths = [width] + [dino["hidden_dim"]] * (layers - 1) + [dino["bottleneck_dim"]]
    return sum(dense(1, a, b) for a, b in zip(widths, widths[1:])) + dense(1, dino["bottleneck_dim"], dino["out_dim"])


def _crops(image_size: int, multicrop: Any) -> tuple[int, int, int]:
    """(global size, local size, local crops) of DINO's multi-crop: 2 global crops of `image_size`."""
    return image_size, int(multicrop["local_size"]), int(multicrop["num_local"])


def _gpt_forward(model_config: Any, vocab_size: int) -> float:
    """The causal LM (models/gpt.py) on one sequence of T = seq_len tokens (docs/method/lm.md §3):
    per block Q, K, V, O, the causal half of the attention and the MLP; the output head 2·T·d·V;
    the token and position lookups are no matmuls."""
    d = family_of(model_config).describe(model_config).width
    t, mlp = int(model_config.seq_len), model_config.mlp_dim
    block = 4 * dense(t, d, d) + causal_attention(t, d) + 2 * dense(t, d, mlp)
    return model_config.depth * block + dense(t, d, vocab_size)


def _require(objective: str, **needed: Any) -> None:
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ValueError(f"{objective} needs {missing[0]}= (its config section) to count its FLOPs")


def train_flops_per_example(model_config: Any, image_size: int, num_classes: int, *, channels: int = 3) -> float:
    """Model FLOPs of one training example of a classifier (docs/method/runs.md §25): 3 × forward."""
    return BACKWARD * forward_flops_per_example(model_config, image_size, num_classes, channels)


def lm_train_flops(model_config: Any, vocab_size: int) -> float:
    """Model FLOPs of one training sequence of `model_config.seq_len` tokens of a causal LM."""
    return BACKWARD * _gpt_forward(model_config, vocab_size)


def mae_train_flops(model_config: Any, image_size: int, mae: Any, *, channels: int = 3) -> float:
    """Model FLOPs of one MAE training example (`mae`: `config.mae`): 3 × forward."""
    _require("mae_train_flops", mae=mae)
    return BACKWARD * _mae_forward(model_config, image_size, channels, mae)


def dino_train_flops(model_config: Any, image_size: int, dino: Any, multicrop: Any, *, channels: int = 3) -> float:
    """Model FLOPs of one DINO training example (`dino`, `multicrop`: `config.dino`,
    `config.input.multicrop`; `image_size`: the global crops'): 3 × the student's forward on
    every crop + the teacher's forward (1×) on the 2 global crops."""
    _require("dino_train_flops", dino=dino, multicrop=multicrop)
    width = family_of(model_config).describe(model_config).width

    def crop(size: int) -> float:
        return forward_flops_per_example(model_config, size, 0, channels) + dino_head_flops(width, dino)

    global_size, local_size, num_local = _crops(image_size, multicrop)
    student = 2 * crop(global_size) + num_local * crop(local_size)
    return BACKWARD * student + 2 * crop(global_size)


def tg_matrix_flops(method: str | None, rows: int, cols: int) -> float:
    """Token Graying's FLOPs (docs/method/runs.md §25, textbook counts) on one rows × cols patch matrix."""
    if method is None:
        return 0.0
    a, b = max(rows, cols), min(rows, cols)
    if method == "svd":
        return 6.0 * a * b * b + 20.0 * b**3 + 2.0 * a * b * b
    if method == "svd_fast":
        r_factor = a >= 2 * b
        r = b if r_factor else a
        qr = 2.0 * a * b * b - 2.0 * b**3 / 3 if r_factor else 0.0
        return qr + 3 * (4.0 * r * b * b + 9.0 * b**3 + 2.0 * b**3) + 2.0 * a * b * b + 2.0 * b**3
    if method == "dct":
        return 5.0 * a * b * math.log2(a * b) if a * b > 1 else 0.0
    raise ValueError(f"model.token_graying={method!r} is unknown; allowed: None, 'svd', 'svd_fast', 'dct'")


def _tg_image(model_config: Any, image_size: int, channels: int) -> float:
    p = family_of(model_config).describe(model_config).patch_size
    return tg_matrix_flops(model_config.get("token_graying"), (image_size // p) ** 2, p * p * channels)


def tg_flops_per_example(model_config: Any, image_size: int, *, channels: int = 3) -> float:
    """Token Graying's FLOPs per training example, forward only (no gradient reaches it): once on the image."""
    return _tg_image(model_config, image_size, channels)


def dino_tg_flops(model_config: Any, image_size: int, multicrop: Any, *, channels: int = 3) -> float:
    """Token Graying's FLOPs per DINO example: on every crop of the student and again on the
    teacher's 2 global crops."""
    _require("dino_tg_flops", multicrop=multicrop)
    global_size, local_size, num_local = _crops(image_size, multicrop)
    return 4 * _tg_image(model_config, global_size, channels) + num_local * _tg_image(
        model_config, local_size, channels)
