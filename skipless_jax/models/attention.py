"""Multi-head attention with (d, d) kernels (docs/method/papers.md §1, §3): the one attention module of
every family.

SA(X) = softmax(Q Kᵀ/√d_h) V Wᴼ, Q = X Wᵠ, K = X Wᴷ, V = X Wⱽ (heads = column groups). The
four kernels are (d, d) params `query`, `key`, `value`, `out`, so that the skipless
initialization (models/init.py) can set the full WⱽWᴼ product of the layer at once. The
module also returns the keys (TokenCut's features, docs/method/dense.md §7) and, with
`capture_attention`, the attention maps. The families' variants are arguments of the same
module: keys/values from other tokens, an additive logit bias, talking heads (CaiT).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax.models import init as init_lib

ATTENTION_KERNELS = ("query", "key", "value", "out")


class InitFields(nn.Module, kw_only=True):
    """The init of docs/method/papers.md §3 and the compute dtype, keyword-only (after a subclass's own
    fields): what `kernel_params` reads of an attention module, and what every block and model
    hands to its attention (`blocks.SwitchFields` adds the switches). Subclasses add their sizes."""

    init_scheme: str = "default"
    init_alpha: float = 1.0
    init_beta: float = 1.0
    init_c: float = 1.0
    # The text's draws or the authors' fork's (docs/method/authors_init.md §2).
    init_qk_dist: str = "normal"
    init_vo: str = "polar"
    init_mlp: str = "suo"
    dtype: Any = jnp.float32

    @property
    def init_fields(self) -> dict[str, Any]:
        """The init arguments (docs/method/papers.md §3), as keywords of an `InitFields` module (attention)."""
        return dict(init_scheme=self.init_scheme, init_alpha=self.init_alpha, init_beta=self.init_beta,
                    init_c=self.init_c, init_qk_dist=self.init_qk_dist, init_vo=self.init_vo,
                    init_mlp=self.init_mlp)


def kernel_params(module: InitFields, d: int, names: tuple[str, ...] = ATTENTION_KERNELS) -> dict[str, jax.Array]:
    """The (d, d) float32 params `names` (of `query`, `key`, `value`, `out`) of an attention `module`
    (its `InitFields` and num_heads; called in its compact method):
    Xavier uniform each under the default init; Haar orthogonal each under init='orthogonal'
    (docs/method/skipless_lm.md §4); one joint draw of the four (models/init.py,
    docs/method/papers.md §3) under the skipless and mimetic inits."""
    if module.init_scheme in init_lib.PLAIN_SCHEMES:
        xavier = nn.initializers.xavier_uniform()
        return {n: module.param(n, xavier, (d, d), jnp.float32) for n in names}
    if module.init_scheme == "orthogonal":
        return {n: module.param(n, init_lib.scaled_uniform_orthogonal, (d, d), jnp.float32) for n in names}
    joint = None
    if module.is_initializing():
        joint = init_lib.attention_kernels(
            module.make_rng("params"), module.init_scheme, d, module.num_heads,
            module.init_alpha, module.init_beta, module.init_c, module.init_qk_dist, module.init_vo,
        )
    # Flax evaluates an initializer's shape on apply too; outside init it is a placeholder.
    return {
        n: module.param(
            n,
            lambda _, n=n: jnp.zeros((d, d), jnp.float32) if joint is None else jnp.asarray(joint[n], jnp.float32),
        )
        for n in names
    }


# config.model.attention_shape (docs/method/skipless_lm.md §1-§3): the softmax, Value-SkipInit's
# αI + βA, shaped attention βA + αI − γC (SAS, and SAS-P's parallel block).
ATTENTION_SHAPES = ("softmax", "value_skip", "sas", "sas_p")
SHAPED = ("sas", "sas_p")  # centred, zero queries, identity value (block 0: r·W + s·I) and output
SHAPED_KEY_STD = 0.02  # MyConv1D's normal init of the keys (the queries start at zero)


def running_mean_rows(v: jax.Array, start: Any, n: int, mask: jax.Array | None = None) -> jax.Array:
    """(C V) of docs/method/skipless_lm.md §2 at rows start … start + n − 1: (B, L, h, d_h) values
    -> (B, n, h, d_h) float32, row i the mean of v_0 … v_i (C_ij = 1/(i + 1) for j ≤ i). With a
    (B, 1, n, n) or (B, 1, 1, n) key `mask` (start 0; packed documents), row i averages the keys
    j ≤ i that the mask allows (the uniform attention under the same mask)."""
    if mask is not None:
        allowed = jnp.logical_and(mask[:, 0], jnp.tril(jnp.ones((n, n), bool))).astype(jnp.float32)  # (B, n, n)
        return jnp.einsum("bqk,bkhd->bqhd", allowed / allowed.sum(-1, keepdims=True), v.astype(jnp.float32))
    total = jax.lax.dynamic_slice_in_dim(jnp.cumsum(v.astype(jnp.float32), axis=1), start, n, axis=1)
    return total / (start + jnp.arange(n) + 1).astype(jnp.float32)[None, :, None, None]


class MultiHeadAttention(InitFields):
    """Multi-head attention of every family: (B…, n_q, d) queries over (B…, n_kv, d) keys/values
    -> ((B…, n_q, d), {'keys': (B…, n_kv, d) with bias, heads concatenated[, 'attention': (B…, h, n_q, n_kv)]}).

    `kv` (default: `x`, self-attention): the tokens keys and values come from (CaiT's class
    attention, PVTv2's spatial-reduction attention). `bias` broadcasts against the logits
    (B…, h, n_q, n_kv) (Swin's relative position bias and shift mask). `talking_heads` (CaiT):
    logits ← Σ_h logits_h·proj_l[h, g] + b_l[g] before the softmax and probs ← Σ_h
    probs_h·proj_w[h, g] + b_w[g] after it; under the skipless/mimetic init the mixings start as
    the identity with zero biases, so the layer starts as plain attention. `key_mask` (B, n) bool,
    optional: keys where it is False take no part in any query's softmax (TokenCut's padded token
    grids, docs/method/dense.md §7), or (B, 1, n, n) on plain self-attention: the keys of each query
    (packed documents, docs/method/lm.md §5). `causal`: query t attends to keys 0 … t only (models/gpt.py).
    `decode`: causal with a KV cache (collection `cache`: the keys and values so far and their
    count); the call with the full (B, max_len) shape creates the cache, each later call writes its
    n new keys and values at the cache's index and attends over the cache (skipless_jax/generate.py).

    Plain self-attention on (B, n, d) (no `kv`, `bias` or talking heads) runs
    `jax.nn.dot_product_attention` (`implementation`); the others form the logits explicitly,
    in float32."""

    num_heads: int
    capture_attention: bool = False
    # jax.nn.dot_product_attention's implementation: None (XLA's choice), 'xla' or 'cudnn' (flash
    # attention on NVIDIA GPUs, bf16/fp16 only); softmax in float32 either way.
    implementation: str | None = None
    causal: bool = False
    decode: bool = False
    talking_heads: bool = False
    attention_shape: str = "softmax"  # ATTENTION_SHAPES (docs/method/skipless_lm.md §1-§3)

    @nn.compact
    def __call__(self, x: jax.Array, kv: jax.Array | None = None, bias: jax.Array | None = None,
                 key_mask: jax.Array | None = None, layer: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`layer`: the block's index (an int, traced under scan); shaped attention's block 0 has its own value."""
        d = x.shape[-1]
        shaped = self.attention_shape in SHAPED
        if shaped:  # the source's Q/K draws; no value or output kernel (docs/method/skipless_lm.md §2)
            kernels = {"query": self.param("query", nn.initializers.zeros, (d, d), jnp.float32),
                       "key": self.param("key", nn.initializers.normal(SHAPED_KEY_STD), (d, d), jnp.float32)}
        else:
            kernels = kernel_params(self, d)
        biases = {
            name: self.param(f"{name}_bias", nn.initializers.zeros, (d,), jnp.float32)
            for name in kernels
        }

        def project(inputs: jax.Array, name: str) -> jax.Array:
            if name not in kernels:  # shaped attention's identity output
                return inputs.astype(self.dtype)
            k = kernels[name].astype(self.dtype)
            return inputs.astype(self.dtype) @ k + biases[name].astype(self.dtype)

        tokens = x if kv is None else kv
        keys = project(tokens, "key")
        details = {"keys": keys}
        q = project(x, "query")
        v = self._shaped_value(tokens, layer) if shaped else project(tokens, "value")
        if kv is None and bias is None and not self.talking_heads and x.ndim == 3:
            merged = self._fused(q, keys, v, key_mask, details)
        else:
            merged = self._explicit(q, keys, v, bias, key_mask, details)
        return project(merged, "out"), details

    def _shaped_value(self, tokens: jax.Array, layer: Any) -> jax.Array:
        """SAS's value (docs/method/skipless_lm.md §2 item 3): X (r W + s I) in block 0, X elsewhere;
        every block holds W (zero), r and s (one), so that the blocks stack under scan."""
        if layer is None:
            raise ValueError(f"attention_shape={self.attention_shape!r} needs the block's layer index")
        d = tokens.shape[-1]
        w = self.param("value", nn.initializers.zeros, (d, d), jnp.float32)
        r = self.param("value_resid_gain", nn.initializers.ones, (1,), jnp.float32)
        s = self.param("value_skip_gain", nn.initializers.ones, (1,), jnp.float32)
        eye = jnp.eye(d, dtype=jnp.float32)
        return tokens.astype(self.dtype) @ jnp.where(layer == 0, r * w + s * eye, eye).astype(self.dtype)

    def _shape(self, heads: jax.Array, v_self: jax.Array, v_keys: jax.Array, start: Any,
               mask: jax.Array | None = None) -> jax.Array:
        """(B, n, h, d_h) softmax heads A V -> β_h A V + α_h V_self [− γ_h (C V) rows start …, C
        under the key `mask`] for Value-SkipInit [SAS, SAS-P] (docs/method/skipless_lm.md §1-§2);
        float32 gains per head."""
        h = self.num_heads
        alpha = self.param("attn_skip_gain", nn.initializers.ones, (h,), jnp.float32)[:, None]
        beta = self.param("attn_resid_gain", nn.initializers.ones, (h,), jnp.float32)[:, None]
        out = beta * heads + alpha * v_self
        if self.attention_shape in SHAPED:
            gamma = self.param("centre_gain", nn.initializers.ones, (h,), jnp.float32)[:, None]
            out = out - gamma * running_mean_rows(v_keys, start, heads.shape[1], mask)
        return out.astype(self.dtype)

    def _fused(self, q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None,
               details: dict[str, jax.Array]) -> jax.Array:
        """(B, n, d) projections -> (B, n, d) heads merged, by `jax.nn.dot_product_attention`."""
        b, n, d = q.shape
        h = self.num_heads
        q, k, v = (t.reshape(b, t.shape[1], h, d // h) for t in (q, k, v))
        if key_mask is not None and key_mask.ndim == 2:
            key_mask = key_mask[:, None, None, :]  # (B, 1, 1, n): every head and query
        mask = key_mask  # or (B, 1, n, n): each query's own keys (packed documents, models/gpt.py)
        causal = self.causal or self.decode
        if self.attention_shape in SHAPED and not causal:
            raise ValueError(f"attention_shape={self.attention_shape!r} is causal only")
        v_self, start = v, 0
        if self.decode:
            q, k, v, cache_mask, start = self._cached(q, k, v)
            if cache_mask is not None:  # the queries at the cache index over the cache (the creating call: causal)
                mask, causal = cache_mask, False
        heads = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                             implementation=self.implementation)  # scale 1/√d_h
        if self.attention_shape != "softmax":  # the cache's mask is the causal one over its rows
            heads = self._shape(heads, v_self, v, start, None if self.decode else mask)
        if self.capture_attention:
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(d // h, q.dtype))
            if mask is not None:
                logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
            if causal:  # the maps the causal softmax used: query t over keys 0 … t
                logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, jnp.finfo(logits.dtype).min)
            details["attention"] = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        return heads.reshape(b, n, d)

    def _explicit(self, q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
                  key_mask: jax.Array | None, details: dict[str, jax.Array]) -> jax.Array:
        """(B…, n_q, d) queries, (B…, n_kv, d) keys and values -> (B…, n_q, d): float32 logits
        (+ bias, talking heads, the key mask), softmax, heads merged."""
        if self.causal or self.decode or self.attention_shape != "softmax":
            raise ValueError("causal or shaped attention is self-attention on (B, n, d) without bias or talking heads")
        d = q.shape[-1]
        h = self.num_heads

        def heads(t: jax.Array) -> jax.Array:  # (..., n, d) -> (..., h, n, d_h)
            return jnp.swapaxes(t.reshape(*t.shape[:-1], h, d // h), -2, -3)

        q, k, v = heads(q), heads(k), heads(v)
        logits = (q @ jnp.swapaxes(k, -1, -2)).astype(jnp.float32) / math.sqrt(d // h)
        if bias is not None:
            logits = logits + bias
        if self.talking_heads:
            w_l, b_l = self._mixing("proj_l", h)
            logits = jnp.einsum("...hqk,hg->...gqk", logits, w_l) + b_l[:, None, None]
        if key_mask is not None:  # (B, n_kv) over (B, h, n_q, n_kv)
            logits = jnp.where(key_mask[:, None, None, :], logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        if self.talking_heads:
            w_w, b_w = self._mixing("proj_w", h)
            probs = jnp.einsum("...hqk,hg->...gqk", probs, w_w) + b_w[:, None, None]
        if self.capture_attention:
            details["attention"] = probs
        merged = jnp.swapaxes(probs.astype(self.dtype) @ v, -2, -3)  # (..., n_q, h, d_h)
        return merged.reshape(*merged.shape[:-2], d)

    def _mixing(self, name: str, h: int) -> tuple[jax.Array, jax.Array]:
        """A talking-heads (h, h) mixing and its bias: Xavier under the plain inits, else the identity."""
        if self.init_scheme in init_lib.PLAIN_SCHEMES:
            kernel = self.param(name, nn.initializers.xavier_uniform(), (h, h), jnp.float32)
        else:
            kernel = self.param(name, lambda _: jnp.eye(h, dtype=jnp.float32))
        return kernel, self.param(f"{name}_bias", nn.initializers.zeros, (h,), jnp.float32)

    def _cached(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Any, Any]:
        """(q, cache keys, cache values, mask (1, 1, n, L), the index written at) after writing k, v
        at the cache index; the first call (no cache yet) creates a zero cache of k's shape and
        returns k, v, None, 0."""
        created = not self.has_variable("cache", "keys")
        keys = self.variable("cache", "keys", jnp.zeros, k.shape, k.dtype)
        values = self.variable("cache", "values", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        if created:
            return q, k, v, None, 0
        n, length = q.shape[1], keys.value.shape[1]
        at = index.value
        keys.value = jax.lax.dynamic_update_slice(keys.value, k.astype(keys.value.dtype), (0, at, 0, 0))
        values.value = jax.lax.dynamic_update_slice(values.value, v.astype(values.value.dtype), (0, at, 0, 0))
        index.value = at + n
        mask = jnp.arange(length)[None, :] <= at + jnp.arange(n)[:, None]  # query at + i sees keys 0 … at + i
        return q, keys.value.astype(q.dtype), values.value.astype(q.dtype), mask[None, None], at
