"""Linear probe on frozen features: multinomial logistic regression, full-batch L-BFGS.

Features are standardized with the train mean and standard deviation; then (W, b) minimizes

    J(W, b) = mean_i CE(softmax(x_i W + b), y_i) + (l2 / 2)·‖W‖²_F      (b not penalized)

by optax's L-BFGS with zoom line search until ‖∇J‖ < tol or `max_steps`. This is the
evaluation on frozen CLS features without augmentation (DINO trains its linear layer with
SGD on augmented images; a convex fit is deterministic and cheap enough to run periodically).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skipless_jax import sharding
from skipless_jax.evaluators import per_layer
from skipless_jax.evaluators.common import FeatureFitEvaluator

_HIGHEST = jax.lax.Precision.HIGHEST


def validate_linear_probe(l2: float, max_steps: int, where: str = "config.evals.linear") -> None:
    """One-line ValueError for a bad l2 or step count; `where` names the config entry."""
    if not isinstance(l2, (int, float)) or isinstance(l2, bool) or not math.isfinite(l2) or l2 < 0:
        raise ValueError(f"{where}.l2={l2!r} must be a finite number >= 0")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise ValueError(f"{where}.steps={max_steps!r} must be a positive integer")


def objective(params: dict[str, jax.Array], x: jax.Array, y: jax.Array, l2: float,
              weights: jax.Array | None = None) -> jax.Array:
    """J(W, b) above; x (n, d) standardized, y (n,) int labels; `weights` (n,) 1 for a real row,
    0 for padding (the mean is over the real rows)."""
    logits = jnp.matmul(x, params["w"], precision=_HIGHEST) + params["b"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    ce = ce.mean() if weights is None else jnp.sum(weights * ce) / jnp.sum(weights)
    return ce + 0.5 * l2 * jnp.sum(jnp.square(params["w"]))


@functools.partial(jax.jit, static_argnames=("num_classes", "max_steps"))
def _fit(x: jax.Array, y: jax.Array, weights: jax.Array, num_classes: int, l2: float, max_steps: int,
         tol: float) -> dict[str, jax.Array]:
    fun = functools.partial(objective, x=x, y=y, l2=l2, weights=weights)
    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(fun)

    def step(carry):
        params, state = carry
        value, grad = value_and_grad(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=fun)
        return optax.apply_updates(params, updates), state

    def running(carry):
        _, state = carry
        count = optax.tree.get(state, "count")
        return (count == 0) | ((count < max_steps) & (optax.tree.norm(optax.tree.get(state, "grad")) >= tol))

    params = {"w": jnp.zeros((x.shape[1], num_classes), jnp.float32), "b": jnp.zeros((num_classes,), jnp.float32)}
    params, _ = jax.lax.while_loop(running, step, (params, opt.init(params)))
    return params


def fit(
    train_x: np.ndarray | jax.Array,
    train_y: np.ndarray | jax.Array,
    num_classes: int,
    l2: float = 1e-4,
    max_steps: int = 500,
    tol: float = 1e-5,
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, Any]:
    """Standardization statistics and (W, b) fitted on (n, d) features and (n,) int labels.
    With a `mesh` the rows are split over its data axes (padded with weight-0 rows), so the fit's
    matmuls and sums run on every device; (W, b) stay replicated."""
    validate_linear_probe(l2, max_steps)
    if sharding.on_mesh(train_x):
        return _fit_rows(train_x, train_y, num_classes, l2, max_steps, tol)
    x = np.asarray(train_x, np.float64)
    mean, std = x.mean(0), x.std(0) + 1e-6
    xs, ys = ((x - mean) / std).astype(np.float32), np.asarray(train_y, np.int32)
    weights = np.ones(len(ys), np.float32)
    if mesh is not None and sharding.num_data_shards(mesh) > 1:
        pad = -len(ys) % sharding.num_data_shards(mesh)
        xs = np.concatenate([xs, np.zeros((pad, xs.shape[1]), np.float32)])
        ys = np.concatenate([ys, np.zeros(pad, np.int32)])
        weights = np.concatenate([weights, np.zeros(pad, np.float32)])
        xs, ys, weights = sharding.host_rows(mesh, xs, ys, weights)
    params = _fit(xs, ys, weights, int(num_classes), float(l2), int(max_steps), float(tol))
    return {"mean": mean, "std": std, "w": np.asarray(params["w"]), "b": np.asarray(params["b"])}


def _fit_rows(x: jax.Array, y: jax.Array, num_classes: int, l2: float, max_steps: int, tol: float) -> dict[str, Any]:
    """`fit` on global arrays whose rows are split over the mesh (`Context.extract_rows`; label
    −1 marks padding rows, weight 0): statistics and fit on the devices, no host copy of the rows."""

    @jax.jit
    def standardize(x, y):
        w = (y >= 0).astype(jnp.float32)
        n = jnp.sum(w)
        mean = jnp.sum(w[:, None] * x, 0) / n
        std = jnp.sqrt(jnp.sum(w[:, None] * jnp.square(x - mean), 0) / n) + 1e-6
        return (x - mean) / std * w[:, None], jnp.maximum(y, 0), w, mean, std

    xs, ys, w, mean, std = standardize(x, y)
    params = _fit(xs, ys, w, int(num_classes), float(l2), int(max_steps), float(tol))
    mean, std = jax.device_get((mean, std))
    return {"mean": np.asarray(mean, np.float64), "std": np.asarray(std, np.float64),
            "w": np.asarray(params["w"]), "b": np.asarray(params["b"])}


def predict_logits(probe: dict[str, Any], x: np.ndarray) -> np.ndarray:
    xs = (np.asarray(x, np.float64) - probe["mean"]) / probe["std"]
    return xs @ probe["w"].astype(np.float64) + probe["b"].astype(np.float64)


def linear_probe_accuracy(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    l2: float = 1e-4,
    max_steps: int = 500,
    mesh: jax.sharding.Mesh | None = None,
) -> float:
    """Top-1 test accuracy of the probe fitted on the train features (on `mesh`, if given)."""
    probe = fit(train_x, train_y, num_classes, l2, max_steps, mesh=mesh)
    return float(np.mean(predict_logits(probe, test_x).argmax(-1) == np.asarray(test_y)))


@dataclasses.dataclass
class LinearProbe(FeatureFitEvaluator):
    """config.evals entry `type='linear_probe'`: yields ('linear_accuracy', top-1) of the probe
    fitted on the features of `train_split`; with `layers` ('all' or block indices)
    ('layer_<i>/linear_accuracy', ·) per block and ('best_layer', ·) (docs/method/per_layer_eval.md)."""

    l2: float = 1e-4
    max_steps: int = 500

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        yield from self.scores(params, self.score)  # fitted on the devices

    def score(self, train_x: Any, train_y: Any, n: int, test_x: np.ndarray, test_y: np.ndarray) -> tuple[str, float]:
        return "linear_accuracy", linear_probe_accuracy(
            train_x, train_y, test_x, test_y, self.ctx.num_classes, self.l2, self.max_steps, mesh=self.ctx.mesh
        )

    @staticmethod
    def check(name: str, entry: Any) -> None:
        validate_linear_probe(entry.get("l2", 1e-4), entry.get("steps", 500), where=f"config.evals.{name}")
        per_layer.check(f"config.evals.{name}", entry.get("layers"))

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Any, **common: Any) -> LinearProbe:
        cls.check(name, entry)
        l2, steps = entry.get("l2", 1e-4), entry.get("steps", 500)
        return cls(name=name, ctx=ctx, train_split=cls.train_split_of(entry, ctx), l2=l2, max_steps=steps,
                   layers=cls.layers_of(name, entry, ctx), **common)
