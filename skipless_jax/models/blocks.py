"""The residual block whose skips are switches (docs/method/papers.md §1).

    y = SA(LN1(x));   x = x + y  if skip_sab else y        # ① SAB output, ② identity
    z = MLP(LN2(x));  x = x + z  if skip_ffn else z        # ③ FFN output, ④ identity

`residual` is the one line a family writes for each of its skips; it also records the branch
output and the sum in the block's `out` dict (①/①+②, ③/③+④), which the κ analysis reads
(`conditioning.embedding_log_kappa` over `out['blocks']`), whatever the family. Shaped attention's
blocks (SAS, SAS-P: docs/method/skipless_lm.md §2-§3) replace both lines by their trainable gains
(`EncoderBlock._shaped`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax.models.attention import SHAPED, InitFields, MultiHeadAttention
from skipless_jax.models.common import DropPath, MlpBlock


def residual(
    x: jax.Array, branch: jax.Array, skip: bool, drop_path: float, train: bool, out: dict[str, Any], name: str
) -> jax.Array:
    """x + DropPath(branch) if `skip` else branch; records out[name] = branch, out[name_skip] = x + branch.

    Drop-path only ever drops a branch beside a skip; without the skip it is off.
    """
    out[name], out[f"{name}_skip"] = branch, x + branch
    dropped = DropPath(drop_path if skip else 0.0)(branch, train)
    return x + dropped if skip else branch


class SwitchFields(InitFields, kw_only=True):
    """The fields of every block and model, keyword-only (after a subclass's own fields): the two
    skip switches (② and ④; a model hands them to each of its blocks), the drop-path rate, and
    `InitFields` (the init of docs/method/papers.md §3, the compute dtype). Subclasses add their sizes."""

    skip_sab: bool = True
    skip_ffn: bool = True
    drop_path: float = 0.0


class ModelFields(SwitchFields, kw_only=True):
    """`SwitchFields` + the stem's Token Graying (docs/method/papers.md §4): the fields of every model."""

    token_graying: str | None = None
    tg_eps: float = 0.95


class EncoderBlock(SwitchFields):
    """Pre-LN transformer block; its two residuals are the lines marked ② and ④."""

    mlp_dim: int
    num_heads: int
    dropout: float = 0.0
    gelu_approximate: bool = True
    capture_attention: bool = False
    attention_impl: str | None = None
    causal: bool = False  # query t attends to keys 0 … t (models/gpt.py)
    decode: bool = False  # causal, with the attention's KV cache (generation)
    attention_shape: str = "softmax"  # attention.ATTENTION_SHAPES (docs/method/skipless_lm.md §1-§3)
    mlp_branch_gain: float = 0.1  # SAS / SAS-P: the MLP branch's initial gain g_M

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, layer: Any = None,
                 key_mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`layer`: this block's index (an int, traced under scan), read by shaped attention;
        `key_mask`: the attention's (B, 1, n, n) keys of each query (packed documents)."""
        out: dict[str, Any] = {}
        y = nn.LayerNorm(dtype=self.dtype)(x)
        attention = MultiHeadAttention(
            self.num_heads, self.capture_attention, self.attention_impl, self.causal, self.decode, dtype=self.dtype,
            attention_shape=self.attention_shape, **self.init_fields,
        )
        if self.attention_shape in SHAPED:
            return self._shaped(x, y, attention, train, layer, key_mask, out)
        y, details = attention(y, key_mask=key_mask)
        out.update(details)
        y = nn.Dropout(self.dropout)(y, deterministic=not train)
        x = residual(x, y, self.skip_sab, self.drop_path, train, out, "sab")  # ② the attention skip

        z = nn.LayerNorm(dtype=self.dtype)(x)
        z = MlpBlock(self.mlp_dim, self.init_scheme, self.dropout, self.gelu_approximate, self.dtype,
                     init_mlp=self.init_mlp)(z, train)
        z = nn.Dropout(self.dropout)(z, deterministic=not train)
        x = residual(x, z, self.skip_ffn, self.drop_path, train, out, "ffn")  # ④ the MLP skip
        out["output"] = x
        return x, out

    def _shaped(self, x: jax.Array, y: jax.Array, attention: nn.Module, train: bool, layer: Any,
                key_mask: jax.Array | None, out: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
        """SAS (sequential) or SAS-P (parallel) block of docs/method/skipless_lm.md §2-§3 on x and
        y = N₁(x): no attention skip; SAS keeps the MLP skip with a trainable gain s_M."""
        def gain(name: str, value: float) -> jax.Array:
            return self.param(name, nn.initializers.constant(value), (1,), jnp.float32).astype(self.dtype)

        def mlp(inputs: jax.Array) -> jax.Array:
            z = MlpBlock(self.mlp_dim, self.init_scheme, self.dropout, self.gelu_approximate, self.dtype,
                         init_mlp=self.init_mlp)(inputs, train)
            return nn.Dropout(self.dropout)(z, deterministic=not train)

        a, details = attention(y, key_mask=key_mask, layer=layer)
        out.update(details)
        a = gain("attn_branch_gain", 1.0) * nn.Dropout(self.dropout)(a, deterministic=not train)
        out["sab"], out["sab_skip"] = a, x + a
        if self.attention_shape == "sas_p":  # g_M·MLP(N₁(x)) + g_A·SA(N₁(x)): no skip, one norm
            z = gain("mlp_branch_gain", self.mlp_branch_gain) * mlp(y)
            h = a
        else:  # g_M·MLP(N₂(h)) + s_M·h, h = g_A·SA(N₁(x))
            z = gain("mlp_branch_gain", self.mlp_branch_gain) * mlp(nn.LayerNorm(dtype=self.dtype)(a))
            h = gain("mlp_skip_gain", 1.0) * a
        out["ffn"], out["ffn_skip"] = z, h + z
        out["output"] = h + z
        return out["output"], out
