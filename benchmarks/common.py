"""What the benchmarks share: the classifier train step they time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax


def classifier_step(model: Any, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, images, int labels) -> (params, opt_state, loss): one step of softmax
    cross-entropy with `tx`, unjitted (the benchmark jits and donates as it needs)."""

    def step(params, opt_state, images, labels):
        def loss_fn(p):
            logits, _ = model.apply({"params": p}, images, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
