"""The language model's measures beside bits per byte (docs/method/lm_measures.md): per-layer
activation excess kurtosis (§1), post-training fake quantization (§2) and the logit lens (§3).

The math is in small pure functions; `make_measures` runs them in one pass over the validation
windows. The lm trainer reads them through `config.lm_evals` (trainers/lm.py), `evaluate
--quantize` and `analyze` on an lm run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from skipless_jax import losses
from skipless_jax.models import roles

FORMATS = {"int8": 8, "int4": 4}  # weight formats of §2: name -> bits
ACTIVATION_BITS = 8
# The matrices a token is not multiplied by (§2): the position table; the token table, unless it is the head.
KEPT_ROLES = (roles.POSITION_TABLE, roles.TOKEN_TABLE)


# ------------------------------------------------------------------ §1 excess kurtosis


def power_sums(x: jax.Array, mask: jax.Array) -> jax.Array:
    """(5,) [N, Σx, Σx², Σx³, Σx⁴] over the entries of `x` (B, T, d) at the positions where
    `mask` (B, T) is 1 (every feature of a counted position)."""
    w = mask.astype(jnp.float32)[..., None] * jnp.ones(x.shape[-1], jnp.float32)
    x = x.astype(jnp.float32)
    return jnp.stack([w.sum()] + [(w * x**k).sum() for k in (1, 2, 3, 4)])


def excess_kurtosis(sums: np.ndarray) -> float:
    """m₄/m₂² − 3 (population moments, §1) from the power sums [N, Σx, Σx², Σx³, Σx⁴], in float64:
    `scipy.stats.kurtosis(x, fisher=True, bias=True)` of the entries summed."""
    n, s1, s2, s3, s4 = np.asarray(sums, np.float64)
    mu = s1 / n
    m2 = s2 / n - mu**2
    m4 = s4 / n - 4 * mu * s3 / n + 6 * mu**2 * s2 / n - 3 * mu**4
    return float(m4 / m2**2 - 3.0)


# ------------------------------------------------------------------ §2 fake quantization


def fake_quantize(w: jax.Array, bits: int, axis: int) -> jax.Array:
    """Symmetric `bits`-bit fake quantization of `w`, one scale per slice along every axis but
    `axis`: s = max|w| over `axis` / q, q = 2^(bits−1) − 1; s·clip(round(w/s), −q, q), 0 where s = 0."""
    q = 2 ** (bits - 1) - 1
    scale = jnp.max(jnp.abs(w), axis=axis, keepdims=True) / q
    safe = jnp.where(scale > 0, scale, 1.0)
    return jnp.where(scale > 0, jnp.clip(jnp.round(w / safe), -q, q) * safe, 0.0).astype(w.dtype)


def quantize_params(params: Any, bits: int, table: roles.Table, tied: bool = True) -> Any:
    """`params` with every matrix (≥ 2-D: a kernel (…, in, out) per output column, the maximum over
    its input axis) fake-quantized to `bits` (§2), and the token table (vocab, d) per row where it
    is the head (`tied`); the position table, an untied model's token table, biases and norms (found
    by the model's role `table`) as they are."""
    from skipless_jax.sharding import path_str

    def one(path: tuple[Any, ...], w: jax.Array) -> jax.Array:
        role = roles.find_role(path_str(path), table)
        if w.ndim < 2 or (role in KEPT_ROLES and not (role == roles.TOKEN_TABLE and tied)):
            return w
        return fake_quantize(w, bits, -1 if role == roles.TOKEN_TABLE else -2)

    return jax.tree_util.tree_map_with_path(one, params)


@contextlib.contextmanager
def int8_activations() -> Iterator[None]:
    """Within it, a flax model's matmul inputs that are module calls (the attention's input, every
    Dense's input, a tied head's `Embed.attend` input) are fake-quantized to int8 per token (§2)."""
    from skipless_jax.models.attention import MultiHeadAttention

    def interceptor(next_fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    context: nn.module.InterceptorContext) -> Any:
        module, method = context.module, context.method_name
        if (isinstance(module, (nn.Dense, MultiHeadAttention)) and method == "__call__") or (
                isinstance(module, nn.Embed) and method == "attend"):
            args = (fake_quantize(args[0], ACTIVATION_BITS, -1), *args[1:])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        yield


# ------------------------------------------------------------------ §3 logit lens


def lens_logits(params: Any, normed: jax.Array, tied: bool) -> jax.Array:
    """(B, T, vocab) float32 logits of a block's output through the final norm (`normed`, from
    `out['blocks'][l]['normed']`) and the model's head: normed · Eᵀ (tied) or the `head` Dense."""
    if tied:
        table = params["token_embedding"]["embedding"]
        return jnp.dot(normed, table.astype(normed.dtype).T).astype(jnp.float32)
    kernel, bias = params["head"]["kernel"].astype(normed.dtype), params["head"]["bias"].astype(normed.dtype)
    return (jnp.dot(normed, kernel) + bias).astype(jnp.float32)


# ------------------------------------------------------------------ one pass over the windows


def make_measures(model: Any, batches: Sequence[dict[str, jax.Array]], table: roles.Table, tied: bool,
                  kurtosis: bool = False, logit_lens: bool = False, quantize: Sequence[str] = (),
                  activations: bool = False) -> Callable[[Any], dict[str, float]]:
    """params -> {'loss': the model's mean next-token loss (nats), 'kurtosis_layer_<l>': §1,
    'logit_lens_loss_layer_<l>': §3's mean loss, '<format>_loss': §2's mean loss (activations int8
    too where `activations`)} over the global `batches` {'tokens': (B, T + 1), 'mask': (B, T)[,
    'segments', 'positions': (B, T), packed documents]}."""

    @jax.jit
    def sums(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        tokens, mask = batch["tokens"], batch["mask"]
        packed = {k: batch[k] for k in ("segments", "positions") if k in batch}  # documents packing
        logits, out = model.apply({"params": params}, tokens[:, :-1], train=False, **packed)
        total, count = losses.next_token_loss(logits, tokens, mask)
        s = {"loss": total, "count": count}
        if kurtosis:
            s["kurtosis"] = jnp.stack([power_sums(b["output"], mask) for b in out["blocks"]])
        if logit_lens:
            s["logit_lens_loss"] = jnp.stack([
                losses.next_token_loss(lens_logits(params, b["normed"], tied), tokens, mask)[0] for b in out["blocks"]])
        for name in quantize:
            quantized = quantize_params(params, FORMATS[name], table, tied)
            with int8_activations() if activations else contextlib.nullcontext():
                q_logits, _ = model.apply({"params": quantized}, tokens[:, :-1], train=False, **packed)
            s[f"{name}_loss"] = losses.next_token_loss(q_logits, tokens, mask)[0]
        return s

    def measures(params: Any) -> dict[str, float]:
        acc: dict[str, np.ndarray] = {}
        for batch in batches:
            for k, v in jax.device_get(sums(params, batch)).items():
                acc[k] = acc.get(k, 0.0) + np.asarray(v, np.float64)
        count = float(acc.pop("count"))
        result = {"loss": float(acc.pop("loss")) / count}
        for layer, row in enumerate(acc.pop("kurtosis", [])):
            result[f"kurtosis_layer_{layer}"] = excess_kurtosis(row)
        for layer, total in enumerate(acc.pop("logit_lens_loss", [])):
            result[f"logit_lens_loss_layer_{layer}"] = float(total) / count
        result.update({k: float(v) / count for k, v in acc.items()})
        return result

    return measures


def bits_per_byte_of(measures: dict[str, float], loss: float, bits_per_byte: float) -> dict[str, float]:
    """The measures with each mean loss (`*_loss*`) also as bits per byte: `bits_per_byte` × its loss
    / `loss` (the model's, on the same targets, so the same bytes; docs/method/lm_measures.md)."""
    out = {}
    for name, value in measures.items():
        if name == "loss":
            continue
        out[name] = value
        if "_loss" in name:
            out[name.replace("_loss", "_bits_per_byte")] = bits_per_byte * value / loss if loss > 0 else math.nan
    return out
