"""The residual block whose skips are switches (docs/method.md §1).

    y = SA(LN1(x));   x = x + y  if skip_sab else y        # ① SAB output, ② identity
    z = MLP(LN2(x));  x = x + z  if skip_ffn else z        # ③ FFN output, ④ identity

`residual` is the one line a family writes for each of its skips; it also records the branch
output and the sum in the block's `out` dict (①/①+②, ③/③+④), which the κ analysis reads
(`conditioning.embedding_log_kappa` over `out['blocks']`), whatever the family.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from skipless_jax.models.attention import InitFields, MultiHeadAttention
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
    `InitFields` (the init of docs/method.md §3, the compute dtype). Subclasses add their sizes."""

    skip_sab: bool = True
    skip_ffn: bool = True
    drop_path: float = 0.0


class ModelFields(SwitchFields, kw_only=True):
    """`SwitchFields` + the stem's Token Graying (docs/method.md §4): the fields of every model."""

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

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> tuple[jax.Array, dict[str, jax.Array]]:
        out: dict[str, Any] = {}
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y, details = MultiHeadAttention(
            self.num_heads, self.capture_attention, self.attention_impl, self.causal, self.decode, dtype=self.dtype,
            **self.init_fields,
        )(y)
        out.update(details)
        y = nn.Dropout(self.dropout)(y, deterministic=not train)
        x = residual(x, y, self.skip_sab, self.drop_path, train, out, "sab")  # ② the attention skip

        z = nn.LayerNorm(dtype=self.dtype)(x)
        z = MlpBlock(self.mlp_dim, self.init_scheme, self.dropout, self.gelu_approximate, self.dtype)(z, train)
        z = nn.Dropout(self.dropout)(z, deterministic=not train)
        x = residual(x, z, self.skip_ffn, self.drop_path, train, out, "ffn")  # ④ the MLP skip
        out["output"] = x
        return x, out
