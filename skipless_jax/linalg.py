"""Matrix factorizations over leading batch axes that are safe on XLA:CPU with several devices.

jaxlib's batched CPU LAPACK kernels can deadlock when several host devices run one program at
once (jax 0.10.2, 8 host devices: a jitted, replicated program with two batched SVDs hangs on its
first call, every worker thread idle). On CPU `map_matrices` therefore loops over the batch with
`lax.map`, one matrix per kernel call (jaxlib's batched CPU kernels loop over the batch too, so
this costs little); on GPU and TPU it calls the batched kernel. The branch is chosen when the
program is lowered for its platform (`lax.platform_dependent`). `svd`, `eigh` and `qr` are
jnp.linalg's through it.

Limit: on CPU the loop runs over the whole (global) batch, so a batch sharded over several CPU
devices (e.g. Token Graying inside a data-parallel step on fake CPU devices) is gathered and
factorized on every device; correct, but not faster with more devices. Accelerators are
unaffected. Meshes with explicit axis types reject the loop; the trainer's mesh uses Auto axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def map_matrices(fn: Callable[..., Any], *xs: jax.Array) -> Any:
    """fn(*xs) where fn takes single matrices (m, n) and the xs share leading batch axes.

    Every output leaf gets the batch axes in front. Without batch axes, and on accelerators,
    this is fn(*xs) itself (fn must then broadcast over batch axes, as jnp.linalg does).
    """
    batch = xs[0].shape[:-2]
    if any(x.shape[:-2] != batch for x in xs):
        raise ValueError(f"map_matrices needs equal batch axes, got shapes {[x.shape for x in xs]}")
    if not batch:
        return fn(*xs)

    def looped(*xs):
        flat = tuple(x.reshape((-1,) + x.shape[-2:]) for x in xs)
        out = jax.lax.map(lambda args: fn(*args), flat)
        return jax.tree.map(lambda o: o.reshape(batch + o.shape[1:]), out)

    return jax.lax.platform_dependent(*xs, cpu=looped, default=fn)


def svd(x: jax.Array, full_matrices: bool = False, compute_uv: bool = True) -> Any:
    """jnp.linalg.svd over leading batch axes (see the module docstring)."""
    return map_matrices(lambda a: jnp.linalg.svd(a, full_matrices=full_matrices, compute_uv=compute_uv), x)


def eigh(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """jnp.linalg.eigh (ascending eigenvalues, eigenvectors as columns) over batch axes."""
    return map_matrices(jnp.linalg.eigh, x)


def qr(x: jax.Array, mode: str = "reduced") -> Any:
    """jnp.linalg.qr over leading batch axes."""
    return map_matrices(lambda a: jnp.linalg.qr(a, mode=mode), x)
