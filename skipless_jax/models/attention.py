"""Multi-head self-attention with (d, d) kernels (docs/method.md §1, §3).

SA(X) = softmax(Q Kᵀ/√d_h) V Wᴼ, Q = X Wᵠ, K = X Wᴷ, V = X Wⱽ (heads = column groups). The
four kernels are (d, d) params `query`, `key`, `value`, `out`, so that the skipless
initialization (models/init.py) can set the full WⱽWᴼ product of the layer at once. The
module also returns the keys (TokenCut's features, docs/method.md §7) and, with
`capture_attention`, the attention maps.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax.models import init as init_lib

ATTENTION_KERNELS = ("query", "key", "value", "out")


class InitFields(nn.Module, kw_only=True):
    """The init of docs/method.md §3 and the compute dtype, keyword-only (after a subclass's own
    fields): what `kernel_params` reads of an attention module, and what every block and model
    hands to its attention (`blocks.SwitchFields` adds the switches). Subclasses add their sizes."""

    init_scheme: str = "default"
    init_alpha: float = 1.0
    init_beta: float = 1.0
    init_c: float = 1.0
    dtype: Any = jnp.float32

    @property
    def init_fields(self) -> dict[str, Any]:
        """The init arguments (docs/method.md §3), as keywords of an `InitFields` module (attention)."""
        return dict(init_scheme=self.init_scheme, init_alpha=self.init_alpha, init_beta=self.init_beta,
                    init_c=self.init_c)


def kernel_params(module: InitFields, d: int) -> dict[str, jax.Array]:
    """The four (d, d) float32 params `query`, `key`, `value`, `out` of an attention `module` (its
    `InitFields` and num_heads; called in its compact method):
    Xavier uniform each under the default init; one joint draw of the four (models/init.py,
    docs/method.md §3) under the skipless and mimetic inits. Both attention modules (this one and
    `family_parts.Attention`) build their kernels here."""
    if module.init_scheme in init_lib.PLAIN_SCHEMES:
        xavier = nn.initializers.xavier_uniform()
        return {n: module.param(n, xavier, (d, d), jnp.float32) for n in ATTENTION_KERNELS}
    joint = None
    if module.is_initializing():
        joint = init_lib.attention_kernels(
            module.make_rng("params"), module.init_scheme, d, module.num_heads,
            module.init_alpha, module.init_beta, module.init_c,
        )
    # Flax evaluates an initializer's shape on apply too; outside init it is a placeholder.
    return {
        n: module.param(
            n,
            lambda _, n=n: jnp.zeros((d, d), jnp.float32) if joint is None else jnp.asarray(joint[n], jnp.float32),
        )
        for n in ATTENTION_KERNELS
    }


class MultiHeadAttention(InitFields):
    """(B, n, d) -> ((B, n, d), {'keys': (B, n, d) with bias, heads concatenated[, 'attention': (B, h, n, n)]}).

    `key_mask` (B, n) bool, optional: keys where it is False take no part in any query's softmax
    (TokenCut's padded token grids, docs/method.md §7); None: every key. `causal`: query t attends
    to keys 0 … t only (the causal language model, models/gpt.py). `decode`: causal with a KV
    cache (collection `cache`: the keys and values so far and their count); the call with the full
    (B, max_len) shape creates the cache, each later call writes its n new keys and values at the
    cache's index and attends over the cache (generation, skipless_jax/generate.py)."""

    num_heads: int
    capture_attention: bool = False
    # jax.nn.dot_product_attention's implementation: None (XLA's choice), 'xla' or 'cudnn' (flash
    # attention on NVIDIA GPUs, bf16/fp16 only); softmax in float32 either way.
    implementation: str | None = None
    causal: bool = False
    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, key_mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        b, n, d = x.shape
        h = self.num_heads
        kernels = kernel_params(self, d)
        biases = {
            name: self.param(f"{name}_bias", nn.initializers.zeros, (d,), jnp.float32)
            for name in ATTENTION_KERNELS
        }

        def project(inputs: jax.Array, name: str) -> jax.Array:
            k = kernels[name].astype(self.dtype)
            return inputs.astype(self.dtype) @ k + biases[name].astype(self.dtype)

        keys = project(x, "key")
        q, k, v = (t.reshape(b, n, h, d // h) for t in (project(x, "query"), keys, project(x, "value")))
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, n): every head and query
        causal = self.causal or self.decode
        if self.decode:
            q, k, v, cache_mask = self._cached(q, k, v)
            if cache_mask is not None:  # the queries at the cache index over the cache (the creating call: causal)
                mask, causal = cache_mask, False
        heads = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                             implementation=self.implementation)  # scale 1/√d_h
        details = {"keys": keys}
        if self.capture_attention:
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(d // h, q.dtype))
            if mask is not None:
                logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
            if causal:  # the maps the causal softmax used: query t over keys 0 … t
                logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, jnp.finfo(logits.dtype).min)
            details["attention"] = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        return project(heads.reshape(b, n, d), "out"), details

    def _cached(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
        """(q, cache keys, cache values, mask (1, 1, n, L)) after writing k, v at the cache index;
        the first call (no cache yet) creates a zero cache of k's shape and returns k, v, None."""
        created = not self.has_variable("cache", "keys")
        keys = self.variable("cache", "keys", jnp.zeros, k.shape, k.dtype)
        values = self.variable("cache", "values", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        if created:
            return q, k, v, None
        n, length = q.shape[1], keys.value.shape[1]
        at = index.value
        keys.value = jax.lax.dynamic_update_slice(keys.value, k.astype(keys.value.dtype), (0, at, 0, 0))
        values.value = jax.lax.dynamic_update_slice(values.value, v.astype(values.value.dtype), (0, at, 0, 0))
        index.value = at + n
        mask = jnp.arange(length)[None, :] <= at + jnp.arange(n)[:, None]  # query at + i sees keys 0 … at + i
        return q, keys.value.astype(q.dtype), values.value.astype(q.dtype), mask[None, None]
