"""Model EMA (timm `ModelEmaV3` semantics, docs/method/recipes.md §22): an exponential moving average of
the parameters (and running statistics) kept in the train state as `state.ema`, updated in
the jitted step after every kept optimizer update and evaluated under its own prefix.

    config.model_ema = dict(decay=0.99996, warmup=False, warmup_gamma=1.0, warmup_power=2/3,
                            evals=None)     # None: every config.evals entry, also as 'ema_<prefix>'

After training, `--params=ema` of evaluate, export, timm_convert --reverse and analyze reads the
EMA in place of the trained weights (`weights`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

FIELDS = ("decay", "warmup", "warmup_gamma", "warmup_power", "evals")
TRACKED = ("params", "batch_stats")  # the state entries averaged (a model's float parameters and buffers)
PREFIX = "ema_"
PARAMS = ("model", "ema")  # --params: the trained weights, or their EMA


def enabled(config: ml_collections.ConfigDict) -> bool:
    """True when `config.model_ema.decay` is set and not 0."""
    ema = config.get("model_ema")
    return bool(ema and ema.get("decay"))


def check_config(config: ml_collections.ConfigDict) -> None:
    """One-line ValueError for a bad `config.model_ema` (before anything compiles)."""
    ema = config.get("model_ema")
    if ema is None:
        return
    unknown = sorted(set(ema.keys()) - set(FIELDS))
    if unknown:
        raise ValueError(f"config.model_ema.{unknown[0]} is unknown; allowed: {list(FIELDS)}")
    decay = ema.get("decay")
    if decay is None or decay == 0:
        return
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
        raise ValueError(f"config.model_ema.decay={decay!r}; allowed: a float in (0, 1), or 0/None for no EMA")
    gamma, power = ema.get("warmup_gamma", 1.0), ema.get("warmup_power", 2 / 3)
    if not (isinstance(gamma, (int, float)) and gamma > 0 and isinstance(power, (int, float)) and power > 0):
        raise ValueError(f"config.model_ema warmup_gamma={gamma!r}, warmup_power={power!r}; allowed: both > 0")
    evals = ema.get("evals")
    names = set((config.get("evals") or {}).keys())
    for name in evals or ():
        if name not in names:
            raise ValueError(
                f"config.model_ema.evals names {name!r}, not a config.evals entry; allowed: {sorted(names)}")


def check_params(params: str, entries: list[str], where: str) -> None:
    """One-line ValueError for a bad `--params`, or `--params=ema` on a checkpoint (at `where`,
    whose top-level state `entries` are given) that keeps no EMA."""
    if params not in PARAMS:
        raise ValueError(f"--params={params!r} is unknown; allowed: {', '.join(PARAMS)}")
    if params == "ema" and "ema" not in entries:
        raise ValueError(f"--params=ema: the checkpoint at {where!r} keeps no model EMA (its run had no "
                         f"config.model_ema.decay; it has {entries}); use --params=model")


def weights(state: Mapping[str, Any], params: str) -> Mapping[str, Any]:
    """A checkpoint's state as `checkpoint.load_raw` reads it (a mapping of its entries), as the
    evaluators read it: as saved (`params='model'`), or with the EMA's entries (params[,
    batch_stats]) in place of the trained ones (`params='ema'`)."""
    return {**state, **state["ema"]} if params == "ema" else state


def init(state: Any) -> dict[str, Any]:
    """The EMA at the start: a copy of the tracked fields of the train state ({'params'[, 'batch_stats']})."""
    return {k: jax.tree.map(jnp.copy, getattr(state, k)) for k in TRACKED if getattr(state, k, None) is not None}


def decay_at(ema: Any, update: jax.Array) -> jax.Array:
    """ModelEmaV3.get_decay for optimizer update `update` = 1, 2, ... (timm passes num_updates
    after incrementing it): s = update − 1; 0 when s ≤ 0 (the first update copies the
    parameters); else `decay`, or with `warmup` min(decay, 1 − (1 + s/γ)^(−power)) clipped at 0."""
    s = jnp.maximum(update - 1, 0).astype(jnp.float32)
    decay = jnp.float32(ema.decay)
    if ema.get("warmup"):
        ramp = 1.0 - (1.0 + s / ema.get("warmup_gamma", 1.0)) ** (-ema.get("warmup_power", 2 / 3))
        decay = jnp.clip(ramp, 0.0, decay)
    return jnp.where(s <= 0, 0.0, decay)


def update(average: Any, new: Any, decay: jax.Array | float) -> Any:
    """The one parameter EMA (the model EMA here, DINO's teacher in trainers/dino.py):
    decay·average + (1 − decay)·new per floating leaf, in the average's dtype (DINO's
    `param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)`; timm's `lerp_` is the same
    average to rounding, docs/method/recipes.md §22); other leaves are copied. decay = 1 leaves the
    average exactly as it was, decay = 0 copies `new` exactly (for finite values)."""
    decay = jnp.asarray(decay)

    def leaf(a: jax.Array, n: jax.Array) -> jax.Array:
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            return n
        return (a * decay.astype(a.dtype) + n.astype(a.dtype) * (1.0 - decay).astype(a.dtype)).astype(a.dtype)

    return jax.tree.map(leaf, average, new)


def after_update(config: ml_collections.ConfigDict, old: Any, new: Any) -> Any:
    """`new` (the state after the guarded update of `old`, which passes the EMA through as it
    was) with its EMA moved toward the new tracked entries, only if the update was kept: a
    rejected (non-finite) update counts one more skipped step, and then the decay is 1 (the EMA
    stays, with no per-leaf select)."""
    kept = new.nonfinite.count == old.nonfinite.count
    decay = jnp.where(kept, decay_at(config.model_ema, new.step), 1.0)
    tracked = {k: getattr(new, k) for k in new.ema}
    return new.replace(ema=update(new.ema, tracked, decay))


def results(config: ml_collections.ConfigDict, evals: list[Any], run_all: Any, ctx: Any, ema_tree: Any,
            step: int | None, total_steps: int | None) -> Iterator[tuple[str, str, float]]:
    """The evaluators named by `config.model_ema.evals` (None: all) run on the EMA, as
    (PREFIX + prefix, metric, value); the plain model's metrics keep their own prefixes."""
    names = config.model_ema.get("evals")
    chosen = [ev for ev in evals if names is None or ev.name in names]
    for prefix, metric, value in run_all(chosen, ctx, ema_tree, step, total_steps):
        yield PREFIX + prefix, metric, value
