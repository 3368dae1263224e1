"""The training losses, as plain functions of outputs and targets (no model inside): the
classifier's cross-entropy, DINO's, MAE's reconstruction and the causal LM's next-token loss.
The trainers (and the evaluators and models that report the same quantity) import them from here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from skipless_jax.models.common import patchify


def cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float = 0.0) -> jax.Array:
    """Per-example softmax cross-entropy against (soft) labels smoothed by `smoothing`."""
    labels = labels * (1.0 - smoothing) + smoothing / labels.shape[-1]
    return optax.softmax_cross_entropy(logits, labels)


def dino_loss(
    student_out: jax.Array,
    teacher_out: jax.Array,
    center: jax.Array,
    student_temp: float,
    teacher_temp: jax.Array | float,
) -> jax.Array:
    """docs/method/ssl.md §6: mean over pairs (teacher global view t, student view v ≠ t) of
    mean_b −Σ_k softmax((t_tb − c)/τ_t)_k · log_softmax(s_vb/τ_s)_k.

    student_out (V, B, K), views 0 and 1 the global ones; teacher_out (2, B, K); center (1, K).
    """
    q = jax.nn.softmax((teacher_out - center) / teacher_temp, axis=-1)
    q = jax.lax.stop_gradient(q)
    logp = jax.nn.log_softmax(student_out / student_temp, axis=-1)
    ce = -jnp.einsum("tbk,vbk->tv", q, logp, precision=jax.lax.Precision.HIGHEST) / student_out.shape[1]  # (2, V)
    pairs = 1.0 - jnp.eye(teacher_out.shape[0], student_out.shape[0])  # drop t == v
    return jnp.sum(ce * pairs) / jnp.sum(pairs)


def reconstruction_loss(
    images: jax.Array, prediction: jax.Array, mask: jax.Array, patch_size: int, norm_pix_loss: bool
) -> jax.Array:
    """MAE's `forward_loss`: mean squared error per patch, averaged over the removed patches."""
    return patch_loss(patchify(images.astype(jnp.float32), patch_size), prediction, mask, norm_pix_loss)


def normalized_target(target: jax.Array, norm_pix_loss: bool) -> jax.Array:
    """The (B, L, p²C) target of the loss: the patches, or per patch (t − mean)/√(var + 1e-6)."""
    target = target.astype(jnp.float32)
    if norm_pix_loss:
        mean = target.mean(axis=-1, keepdims=True)
        var = target.var(axis=-1, keepdims=True, ddof=1)  # unbiased, torch's default
        target = (target - mean) / jnp.sqrt(var + 1e-6)
    return target


def patch_loss(target: jax.Array, prediction: jax.Array, mask: jax.Array, norm_pix_loss: bool) -> jax.Array:
    """`reconstruction_loss` on a (B, L, p²C) target patch matrix (the raw or the grayed patches)."""
    target = normalized_target(target, norm_pix_loss)
    loss = jnp.mean((prediction.astype(jnp.float32) - target) ** 2, axis=-1)  # (B, L)
    mask = mask.astype(jnp.float32)
    return jnp.sum(loss * mask) / jnp.sum(mask)


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """(B, T, V) logits, (B, T) targets -> (B, T) −log softmax(logits)[target] in float32 (§26)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def next_token_loss(logits: jax.Array, tokens: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(sum of the target losses, number of targets) of windows `tokens` (B, T + 1) whose inputs
    tokens[:, :T] gave `logits`; `mask` (B, T): which targets count (None: all)."""
    losses = token_losses(logits, tokens[:, 1:])
    mask = jnp.ones_like(losses) if mask is None else mask.astype(jnp.float32)
    return (losses * mask).sum(), mask.sum()
